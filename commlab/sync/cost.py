"""The α-β cost of syncing less often: an outer sync, its overlap with inner steps, and when it beats compression.

:func:`outer_sync_seconds` prices one fragment's outer sync (ring AllReduce of dense or linear payloads, AllGather
of the others); :func:`predict_step_seconds` is the mean inner step with the exposed part of the syncs;
:func:`hiding_sync_delay` the smallest tau that hides a sync; :func:`break_even_bandwidth` the link bandwidth at which
syncing every H steps and compressing every step reach a target in the same time. α in s, β in s/byte per direction.

Book: chapter 8b, §8b.4 (the calculator) and §8b.5; checked by hand in tests/test_sync_cost.py.
"""

from __future__ import annotations

import dataclasses
import math

from commlab import checks
from commlab.collectives import ring_all_gather_seconds, ring_all_reduce_seconds, ring_bytes_sent_per_rank

__all__ = ["SYNC_PATHS", "outer_sync_seconds", "sync_messages", "bytes_sent_per_rank_per_step",
           "exposed_seconds", "predict_step_seconds", "hiding_sync_delay", "BreakEven", "break_even_bandwidth"]

#: How a payload is combined: ``"all_reduce"`` (dense, casts: a ring AllReduce), ``"all_gather"`` (Top-K, INT8,
#: sign: every rank's payload gathered, as :func:`commlab.compress.aggregate` does), ``"two_phase"`` (priced as
#: a ring AllReduce of the payload: its owners' recompressed chunks are about the same size).
SYNC_PATHS = ("all_reduce", "all_gather", "two_phase")


def _check(payload_nbytes, n, path, where):
    checks.number("payload_nbytes", payload_nbytes, least=0.0, where=where)
    checks.integer("n", n, where=where, note="ranks in the data-parallel group")
    checks.one_of("path", path, SYNC_PATHS, where=where)


def sync_messages(n: int, path: str = "all_reduce") -> int:
    """Latencies α on the critical path of one sync over ``n`` ring ranks: 2(n-1) (AllReduce, two-phase) or n-1
    (AllGather)."""
    _check(0, n, path, "sync_messages")
    return (n - 1) if path == "all_gather" else 2 * (n - 1)


def bytes_sent_per_rank_per_step(payload_nbytes: float, n: int, every: int = 1, path: str = "all_reduce") -> float:
    """Mean bytes each rank sends per inner step when a payload of ``payload_nbytes`` (one rank's, the whole model)
    is combined once every ``every`` steps: ``2 (n-1)/n × payload / every`` (AllReduce, two-phase) or
    ``(n-1) × payload / every`` (AllGather). Per-step compression is ``every = 1``.

    Raises:
        ValueError: a negative payload, ``n < 1``, ``every < 1``, an unknown path.
    """
    _check(payload_nbytes, n, path, "bytes_sent_per_rank_per_step")
    checks.integer("every", every, where="bytes_sent_per_rank_per_step")
    if path == "all_gather":
        return ring_bytes_sent_per_rank(n * payload_nbytes, n, "all_gather") / every
    return ring_bytes_sent_per_rank(payload_nbytes, n, "all_reduce") / every


def outer_sync_seconds(payload_nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                       path: str = "all_reduce", codec_s: float = 0.0) -> float:
    """α-β seconds of one outer sync of a payload of ``payload_nbytes`` bytes per rank over ``n`` ranks.

    ``"all_reduce"``/``"two_phase"``: ``2(n-1) α + 2(n-1)/n · payload · β``
    (:func:`commlab.collectives.ring_all_reduce_seconds`); ``"all_gather"``: ``(n-1) α + (n-1) · payload · β``;
    plus ``codec_s`` (compress and decompress). For Streaming DiLoCo pass one fragment's payload.

    Raises:
        ValueError: a negative payload, α, β or codec_s; ``n < 1``; an unknown path.
    """
    _check(payload_nbytes, n, path, "outer_sync_seconds")
    checks.seconds("codec_s", codec_s, where="outer_sync_seconds")
    if path == "all_gather":
        return ring_all_gather_seconds(n * payload_nbytes, n, alpha_s, beta_s_per_byte) + codec_s
    return ring_all_reduce_seconds(payload_nbytes, n, alpha_s, beta_s_per_byte) + codec_s


def exposed_seconds(sync_s: float, sync_delay: int, base_step_s: float) -> float:
    """The part of a sync of ``sync_s`` seconds that ``sync_delay`` (tau) inner steps of ``base_step_s`` do not
    cover: ``max(0, sync_s - tau · base_step_s)``; all of it when tau = 0 (DiLoCo, local SGD).

    Raises:
        ValueError: negative seconds or tau.
    """
    checks.seconds("sync_s", sync_s, where="exposed_seconds")
    checks.seconds("base_step_s", base_step_s, where="exposed_seconds")
    checks.integer("sync_delay", sync_delay, least=0, where="exposed_seconds")
    return max(0.0, sync_s - sync_delay * base_step_s)


def predict_step_seconds(base_step_s: float, sync_s: float, *, inner_steps: int, fragments: int = 1,
                         sync_delay: int = 0) -> float:
    """Mean seconds per inner step: ``base_step_s + F · exposed(sync_s) / H``.

    Args:
        base_step_s: one inner step without communication (s).
        sync_s: one fragment's outer sync (s), e.g. :func:`outer_sync_seconds` of the model's payload / F.
        inner_steps, fragments, sync_delay: H, F and tau (each of the F fragments syncs once per H steps).

    Raises:
        ValueError: negative seconds; H, F, tau out of range (as :func:`commlab.sync.schedule.check_schedule`).
    """
    from commlab.sync.schedule import check_schedule

    check_schedule(inner_steps, fragments, sync_delay, where="predict_step_seconds")
    return base_step_s + fragments * exposed_seconds(sync_s, sync_delay, base_step_s) / inner_steps


def hiding_sync_delay(base_step_s: float, sync_s: float) -> int:
    """The smallest tau with ``tau · base_step_s >= sync_s``: ``ceil(sync_s / base_step_s)`` (0 for no sync).
    It is usable only below H/F (:func:`commlab.sync.schedule.check_schedule`); otherwise no tau hides the sync.

    Raises:
        ValueError: ``base_step_s <= 0``, negative ``sync_s``, or a ratio ``sync_s / base_step_s`` that overflows
            a float (a step of 5e-324 s).
    """
    checks.number("base_step_s", base_step_s, above=0.0, where="hiding_sync_delay")
    checks.seconds("sync_s", sync_s, where="hiding_sync_delay")
    ratio = sync_s / base_step_s
    if not math.isfinite(ratio):
        checks.fail("base_step_s", base_step_s, "large enough that sync_s / base_step_s is finite",
                    where="hiding_sync_delay", note=f"sync_s = {sync_s}")
    # An exact multiple (0.3 s / 0.1 s = 2.9999999999999996 or 3.0000000000000004) must not round up a step.
    return math.ceil(ratio * (1 - 1e-12))


@dataclasses.dataclass(frozen=True)
class BreakEven:
    """Where syncing every H steps and compressing every step reach the target in the same time.

    Attributes:
        bytes_per_s: the break-even link bandwidth (per direction), or None when one always or never wins.
        verdict: ``"sync wins below"``, ``"sync wins above"``, ``"sync always wins"``, ``"sync never wins"`` or
            ``"tie"`` (the same time at every bandwidth: one rank, or equal bytes and fixed costs).
    """

    bytes_per_s: float | None
    verdict: str


def break_even_bandwidth(base_step_s: float, n: int, alpha_s: float, *, sync_payload_nbytes: float,
                         inner_steps: int, compressed_payload_nbytes: float, sync_path: str = "all_reduce",
                         compressed_path: str = "all_reduce", sync_steps: int = 1,
                         compressed_steps: int = 1) -> BreakEven:
    """The bandwidth at which a sync every H steps (local SGD, DiLoCo; tau = 0) and a compressed AllReduce every step
    reach a target in the same time.

    A method that needs S steps of ``base_step_s + m α / every + b / bandwidth`` (m latencies and b bytes per rank
    per step, :func:`sync_messages`, :func:`bytes_sent_per_rank_per_step`) takes ``S (fixed + b / bandwidth)``; the
    two times cross at ``bandwidth = (S_s b_s - S_c b_c) / (S_c fixed_c - S_s fixed_s)``. Streaming DiLoCo with tau
    > 0 hides part of its sync and does at least as well.

    Args:
        base_step_s: one step's compute (s), the same for both. n: ranks. alpha_s: α (s).
        sync_payload_nbytes: one rank's payload of a whole outer sync (dense fp32 Delta: 4 bytes per parameter).
        inner_steps: H. compressed_payload_nbytes: one rank's compressed gradient per step.
        sync_path, compressed_path: how each payload is combined (:data:`SYNC_PATHS`).
        sync_steps, compressed_steps: steps each needs to reach the target (measured; 1 and 1 compare per step).

    Raises:
        ValueError: negative sizes or times, counts below 1, unknown paths.
    """
    checks.seconds("base_step_s", base_step_s, where="break_even_bandwidth")
    checks.seconds("alpha_s", alpha_s, where="break_even_bandwidth")
    for name, v in (("sync_steps", sync_steps), ("compressed_steps", compressed_steps)):
        checks.integer(name, v, where="break_even_bandwidth")
    b_s = bytes_sent_per_rank_per_step(sync_payload_nbytes, n, inner_steps, sync_path)
    b_c = bytes_sent_per_rank_per_step(compressed_payload_nbytes, n, 1, compressed_path)
    fixed_s = base_step_s + sync_messages(n, sync_path) * alpha_s / inner_steps
    fixed_c = base_step_s + sync_messages(n, compressed_path) * alpha_s
    saved_bytes = compressed_steps * b_c - sync_steps * b_s   # > 0: the sync moves fewer bytes to the target
    extra_fixed = sync_steps * fixed_s - compressed_steps * fixed_c  # > 0: and spends more on everything else
    if saved_bytes == 0:
        if extra_fixed == 0:
            return BreakEven(None, "tie")
        return BreakEven(None, "sync always wins" if extra_fixed < 0 else "sync never wins")
    if saved_bytes > 0:
        return BreakEven(saved_bytes / extra_fixed, "sync wins below") if extra_fixed > 0 \
            else BreakEven(None, "sync always wins")
    return BreakEven(saved_bytes / extra_fixed, "sync wins above") if extra_fixed < 0 \
        else BreakEven(None, "sync never wins")
