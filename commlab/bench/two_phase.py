"""The two-phase compressed AllReduce beside the all-gather path and a dense ring AllReduce.

``python -m commlab bench --two-phase`` averages one float32 tensor (default 4 MiB) over N = 2, 4, 8 gloo
ranks for sign, INT8 and Top-K 1 %: commlab's dense ring AllReduce, :func:`commlab.compress.aggregate` with
``path="all_gather"``, and with ``path="two_phase"`` (:mod:`commlab.compress.two_phase`). It prints the bytes
each rank sends (exact, from :class:`commlab.compress.Aggregated`), the time of one averaging call (slowest
rank, median over rounds, variants interleaved), the ratios all-gather / two-phase and dense / two-phase,
and ``#differ`` (ranks whose two-phase result is not bitwise rank 0's; must be 0). No error feedback. On a
laptop the times mostly measure the codecs; the bytes are what a network would carry.

Book: chapter 4, §4.3; chapter 6, §6.7; chapter 8, §8.3.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.bench.timing import time_calls
from commlab.collectives import ring_all_reduce, ring_bytes_sent_per_rank
from commlab.compress.aggregate import aggregate
from commlab.experiments.methods import compressor_for, describe
from commlab.launch import launch

__all__ = ["TwoPhaseRow", "DEFAULT_SPECS", "bench_two_phase", "print_two_phase_bench"]

#: Method specs measured by default (:func:`commlab.experiments.methods.compressor_for`).
DEFAULT_SPECS = ("sign", "int:8", "topk:0.01")
VARIANTS = ("dense ring", "all-gather", "two-phase")


@dataclasses.dataclass(frozen=True)
class TwoPhaseRow:
    """One compressor at one world size: bytes sent per rank and seconds per call of each variant.

    Attributes:
        world_size, spec, label, numel: what was measured (``numel`` float32 elements per rank).
        payload_nbytes: one rank's payload on the all-gather path (the tensor compressed whole).
        sent: variant -> bytes sent per rank. seconds: variant -> median seconds per call (slowest rank).
        differ: ranks whose two-phase result differs from rank 0's (0 when correct).
    """

    world_size: int
    spec: str
    label: str
    numel: int
    payload_nbytes: int
    sent: dict
    seconds: dict
    differ: int


def _differ(result: torch.Tensor) -> int:
    ref = result.clone()
    dist.broadcast(ref, 0)
    bad = torch.tensor([int(not torch.equal(ref, result))])
    dist.all_reduce(bad)
    return int(bad)


def _rank(numel: int, specs: Sequence[str], rounds: int) -> list[dict]:
    n = dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = []
    for spec in specs:
        comp = compressor_for(spec)
        calls = {"dense ring": lambda: ring_all_reduce(x, check=False),
                 "all-gather": lambda: aggregate(x, comp, path="all_gather"),
                 "two-phase": lambda: aggregate(x, comp, path="two_phase")}
        results = {v: fn() for v, fn in calls.items()}  # warm-up, and the byte counts
        times = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for v in VARIANTS:
                times[v].append(time_calls(calls[v], 1))
        dense_nbytes = numel * x.element_size()
        out.append(dict(spec=spec, payload_nbytes=results["all-gather"].payload_nbytes,
                        sent={"dense ring": ring_bytes_sent_per_rank(dense_nbytes, n, "all_reduce"),
                              "all-gather": results["all-gather"].bytes_sent_per_rank,
                              "two-phase": results["two-phase"].bytes_sent_per_rank},
                        seconds={v: statistics.median(t) for v, t in times.items()},
                        differ=_differ(results["two-phase"].sum)))
    return out


def bench_two_phase(world_sizes: Sequence[int] = (2, 4, 8), numel: int = 2 ** 20,
                    specs: Sequence[str] = DEFAULT_SPECS, rounds: int = 5,
                    timeout: float = 600.0) -> list[TwoPhaseRow]:
    """Measure every variant of :data:`VARIANTS` for each spec at each world size (one launch per size).

    Args:
        world_sizes: gloo ranks to launch (each >= 2). numel: float32 elements of the tensor (>= 1; default
        1 Mi = 4 MiB). specs: method specs of non-linear compressors. rounds: timed calls per variant (>= 1).

    Raises:
        ValueError: a world size below 2, ``numel`` or ``rounds`` below 1, or a bad spec.
    """
    if not world_sizes:
        checks.fail("world_sizes", list(world_sizes), "at least one int >= 2")
    for w in world_sizes:
        checks.integer("world size", w, 2, note="a single rank sends nothing")
    checks.integer("numel", numel)
    checks.integer("rounds", rounds)
    for spec in specs:
        if compressor_for(spec) is None:
            raise ValueError(f"{spec!r} is no compressor; give specs such as {', '.join(DEFAULT_SPECS)}")
    rows = []
    for n in world_sizes:
        for d in launch(_rank, n, numel, list(specs), rounds, timeout=timeout, print_output=False)[0]:
            rows.append(TwoPhaseRow(n, d["spec"], describe(d["spec"]), numel, d["payload_nbytes"], d["sent"],
                                    d["seconds"], d["differ"]))
    return rows


def print_two_phase_bench(world_sizes: Sequence[int] = (2, 4, 8), numel: int = 2 ** 20, rounds: int = 5) -> int:
    """Print :func:`bench_two_phase`'s table; return 0, or 1 if any rank's two-phase result differed."""
    print(f"# two-phase compressed AllReduce vs all-gather vs dense ring AllReduce: {numel} float32 "
          f"({numel * 4 / 2 ** 20:.3g} MiB) per rank, gloo, median of {rounds} calls (slowest rank), no error feedback",
          flush=True)
    print(f"#{'':>25} | {'bytes sent per rank (KiB)':^46} | {'time per call (ms)':^46} |")
    print(f"#{'N':>3} {'compressor':>14} {'ratio':>6} | {'dense':>8} {'all-gather':>10} {'two-phase':>10} {'ag/tp':>6} "
          f"{'dense/tp':>8} | {'dense':>8} {'all-gather':>10} {'two-phase':>10} {'ag/tp':>6} {'dense/tp':>8} | "
          f"{'#differ':>7}")
    differ = 0
    for r in (row for n in world_sizes for row in bench_two_phase([n], numel, rounds=rounds)):  # print as measured
        kib = {v: r.sent[v] / 1024 for v in VARIANTS}
        ms = {v: r.seconds[v] * 1e3 for v in VARIANTS}
        print(f" {r.world_size:>3} {r.label:>14} {r.numel * 4 / r.payload_nbytes:>6.1f} | "
              f"{kib['dense ring']:>8.1f} {kib['all-gather']:>10.1f} {kib['two-phase']:>10.1f} "
              f"{r.sent['all-gather'] / r.sent['two-phase']:>6.2f} {r.sent['dense ring'] / r.sent['two-phase']:>8.2f} | "
              f"{ms['dense ring']:>8.2f} {ms['all-gather']:>10.2f} {ms['two-phase']:>10.2f} "
              f"{ms['all-gather'] / ms['two-phase']:>6.2f} {ms['dense ring'] / ms['two-phase']:>8.2f} | {r.differ:>7}",
              flush=True)
        differ += r.differ
    print(f"# ranks whose two-phase result differed from rank 0's: {differ} {'OK' if differ == 0 else 'FAILED'}")
    return 0 if differ == 0 else 1
