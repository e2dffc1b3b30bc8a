"""Time per step, time to a target quality, and the break-even bandwidth of a compressor.

One data-parallel step costs ``T_step = compute + codec + a·α + b·β`` (seconds; α in s, β in s/byte), with
``(a, b)`` from :func:`comm_coefficients`: the ring collectives of the method's payload over ``n`` ranks
(:mod:`commlab.collectives.ring`): AllReduce ``2(n-1), 2(n-1)/n·P``; AllGather ``n-1, (n-1)·P``; two-phase
as the AllReduce; PowerSGD's two AllReduces ``4(n-1), 2(n-1)/n·P``; ``a`` times the payload tensors. A
method needing ``s`` steps takes ``s·T_step`` (:func:`time_to_target`), and :func:`break_even` gives the
one β* at which compressed and dense take the same time:
``β* = [s_c (C_c + a_c α) - s_d (C_d + a_d α)] / (s_d b_d - s_c b_c)``, ``C = compute + codec``.
Overlap with backward (chapter 9) is left out.

Book: chapter 8, §8.6.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

from commlab import checks
from commlab.experiments.methods import payload_tensors
from commlab.collectives.all_to_all import all_to_all_seconds
from commlab.collectives.ring import ring_all_gather_seconds, ring_all_reduce_seconds
from commlab.topology.links import Link

__all__ = ["StepCosts", "comm_coefficients", "comm_seconds", "step_seconds", "costs_from_record",
           "steps_to_target", "time_to_target", "BreakEven", "break_even"]

PATHS = ("all_reduce", "all_gather", "two_phase", "powersgd")


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What one step of a method costs apart from the link.

    Attributes:
        label: the method's name.
        compute_s: forward + backward seconds; codec_s: encode + decode seconds.
        payload_nbytes: bytes of one rank's payload; path: one of :data:`PATHS`.
        world_size: ranks n (>= 1). collectives: payload tensors, each its own collective (>= 1).

    Raises:
        ValueError: negative seconds or bytes, an unknown path, n < 1.
    """

    label: str
    compute_s: float
    codec_s: float
    payload_nbytes: float
    path: str
    world_size: int
    collectives: int = 1

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")
        for name in ("compute_s", "codec_s", "payload_nbytes"):
            checks.number(name, getattr(self, name), least=0, where=f"StepCosts {self.label!r}")
        for name in ("world_size", "collectives"):
            checks.integer(name, getattr(self, name), where=f"StepCosts {self.label!r}")


def _check_steps(name: str, steps) -> None:
    if steps is not None:
        checks.integer(name, steps, least=0, note="or None: never reached")


def comm_coefficients(costs: StepCosts) -> tuple[float, float]:
    """(a, b): the link time of one step is ``a·α + b·β`` (a messages on the critical path, b bytes)."""
    n, p = costs.world_size, costs.payload_nbytes
    # Read the coefficients off the collectives' cost functions themselves, so the two cannot drift apart.
    if costs.path == "all_gather":
        a, b = ring_all_gather_seconds(0, n, 1.0, 0.0), ring_all_gather_seconds(n * p, n, 0.0, 1.0)
    elif costs.path == "two_phase":  # the workers' chunks all-to-all, then the owners' chunks (P in all) gathered
        a = all_to_all_seconds(0, n, 1.0, 0.0) + ring_all_gather_seconds(0, n, 1.0, 0.0)
        b = all_to_all_seconds(p, n, 0.0, 1.0) + ring_all_gather_seconds(p, n, 0.0, 1.0)
    else:
        a, b = ring_all_reduce_seconds(0, n, 1.0, 0.0), ring_all_reduce_seconds(p, n, 0.0, 1.0)
        if costs.path == "powersgd":
            a *= 2
    return a * costs.collectives, b


def comm_seconds(costs: StepCosts, link: Link) -> float:
    """Seconds of the step's collectives on ``link``: ``a·α + b·β``."""
    a, b = comm_coefficients(costs)
    return a * link.alpha_s + b * link.beta_s_per_byte


def step_seconds(costs: StepCosts, link: Link) -> float:
    """Predicted seconds of one step: compute + codec + collectives."""
    return costs.compute_s + costs.codec_s + comm_seconds(costs, link)


def costs_from_record(record, skip: int = 5, collectives: int | None = None) -> StepCosts:
    """:class:`StepCosts` from a :class:`~commlab.experiments.harness.RunRecord`: medians over its steps.

    ``skip`` first steps (start-up, and dense warm-up steps) are left out. ``collectives`` defaults to the
    method's payload tensors (:func:`commlab.experiments.methods.payload_tensors`).

    Raises:
        ValueError: fewer than ``skip + 1`` steps.
    """
    checks.integer("skip", skip, least=0)
    if collectives is not None:
        checks.integer("collectives", collectives, note="or None: the method's payload tensors")
    start = max(skip, record.config.get("warmup_steps", 0))
    if len(record.compute_s) <= start:
        raise ValueError(f"{record.label}: {len(record.compute_s)} steps, need more than {start}")
    med = lambda xs: statistics.median(xs[start:])  # noqa: E731
    coll = collectives or payload_tensors(record.config["method"])
    return StepCosts(record.label, med(record.compute_s), med(record.codec_s), record.payload_nbytes,
                     record.path, record.config["world_size"], coll)


def steps_to_target(eval_steps: Sequence[int], quality: Sequence[float], target: float,
                    higher_is_better: bool) -> int | None:
    """First evaluated step count at which ``quality`` meets ``target`` (None if it never does).

    Raises:
        ValueError: ``eval_steps`` and ``quality`` of different lengths.
    """
    if len(eval_steps) != len(quality):
        raise ValueError(f"eval_steps has {len(eval_steps)} entries, quality {len(quality)}")
    for s, q in zip(eval_steps, quality):
        if not math.isnan(q) and (q >= target if higher_is_better else q <= target):
            return s
    return None


def time_to_target(costs: StepCosts, steps: int | None, link: Link) -> float:
    """``steps · step_seconds`` (inf when the target is never reached, ``steps=None``).

    Raises:
        ValueError: ``steps`` negative or not an int.
    """
    _check_steps("steps", steps)
    return math.inf if steps is None else steps * step_seconds(costs, link)


@dataclasses.dataclass(frozen=True)
class BreakEven:
    """Where a compressed method and the dense one take equally long to the target.

    Attributes:
        bytes_per_s: the break-even link bandwidth (bytes/s per direction), or None when there is none.
        verdict: ``"pays below"`` (compression is faster on links slower than ``bytes_per_s``),
            ``"pays above"`` (it needs fewer steps but moves more bytes to the target, so it is faster only on
            links faster than ``bytes_per_s``), ``"never pays"`` (slower at every bandwidth), ``"always pays"`` (faster at every bandwidth), or
            ``"never reaches target"``.
    """

    bytes_per_s: float | None
    verdict: str


#: Relative difference below which two byte totals count as equal in :func:`break_even`.
_SAME_BYTES_REL = 1e-9


def break_even(dense: StepCosts, dense_steps: int | None, comp: StepCosts, comp_steps: int | None,
               alpha_s: float) -> BreakEven:
    """The bandwidth at which ``comp`` and ``dense`` reach the target in the same time (book §8.6).

    Args:
        dense, comp: step costs; dense_steps, comp_steps: steps each needs to reach the target (None: never).
        alpha_s: the link latency α in seconds (finite, >= 0).

    Byte totals to the target that differ by less than 1e-9 of the larger are taken as equal: the verdict
    is then "always pays" or "never pays" by the fixed costs alone.

    Raises:
        ValueError: negative or non-integer step counts, or a negative or non-finite α.
    """
    _check_steps("dense_steps", dense_steps)
    _check_steps("comp_steps", comp_steps)
    checks.seconds("alpha_s", alpha_s)
    if comp_steps is None:
        return BreakEven(None, "never reaches target")
    if dense_steps is None:
        return BreakEven(None, "always pays")
    ad, bd = comm_coefficients(dense)
    ac, bc = comm_coefficients(comp)
    fixed = comp_steps * (comp.compute_s + comp.codec_s + ac * alpha_s) - dense_steps * (dense.compute_s + dense.codec_s + ad * alpha_s)
    saved_bytes = dense_steps * bd - comp_steps * bc
    # Byte totals equal up to rounding (a ratio of 1 + 2e-16) do not cross: their "break-even" would be a
    # bandwidth of ~1e-12 bytes/s at which the fixed costs vanish into the rounding of 1e16-second times.
    if abs(saved_bytes) <= _SAME_BYTES_REL * max(dense_steps * bd, comp_steps * bc):
        return BreakEven(None, "always pays" if fixed < 0 else "never pays")
    if saved_bytes < 0:
        # The compressed run moves more bytes to the target (fewer steps, or an AllGather that grows with n):
        # it can only win on fixed costs, and only where bytes are cheap.
        return BreakEven(saved_bytes / fixed, "pays above") if fixed < 0 else BreakEven(None, "never pays")
    if fixed <= 0:
        return BreakEven(None, "always pays")
    return BreakEven(saved_bytes / fixed, "pays below")
