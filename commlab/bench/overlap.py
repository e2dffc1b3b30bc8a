"""Bucket size vs step time: our overlapped data parallelism beside ``DistributedDataParallel`` (chapter 9).

``python -m commlab bench --overlap`` runs, for each bucket cap (64 KiB, 1 MiB, 25 MiB = DDP's default, and
one bucket for everything), training steps of the same MLP on the same data with
:class:`commlab.overlap.BucketedDataParallel` and with ``DistributedDataParallel(bucket_cap_mb=same)``,
alternating the two step by step so both see the same machine load, and prints one table: median step
time of each (slowest rank per step), the ratio ours / DDP, and for ours the overlap fraction, the exposed
communication and the communication time, from the trainer's own clock marks (the
profiler's cost would distort the step times; the per-step definitions are those of :mod:`commlab.overlap.profile`,
and the table gives the median over steps of each per-step figure, where ``OverlapProfile`` sums over steps).

The model (:data:`commlab.overlap.profile.MEASURE_WIDTHS`, 8.0 M parameters, 30.7 MiB of float32 gradients)
has tensors from 40 B to 16 MiB, so the four caps give 6, 4, 2 and 1 buckets. Ranks are capped at the
number of cores: ranks that time-share a core would show the scheduler, not the overlap.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Sequence

import torch

from commlab import checks
from commlab.bench.timing import max_over_ranks

__all__ = ["OverlapBenchRow", "DEFAULT_CAPS", "bench_overlap", "print_overlap_bench"]

KiB, MiB = 2 ** 10, 2 ** 20
#: (label, bucket cap in bytes); "one bucket" is a cap larger than any model here.
DEFAULT_CAPS: tuple[tuple[str, int], ...] = (("64 KiB", 64 * KiB), ("1 MiB", MiB), ("25 MiB", 25 * MiB),
                                             ("one bucket", 2 ** 40))


@dataclasses.dataclass(frozen=True)
class OverlapBenchRow:
    """One bucket cap: median seconds per step (slowest rank), ours and DDP's, and our overlap figures
    (medians over the steps, rank 0's; seconds)."""

    label: str
    bucket_cap_bytes: int
    buckets: int
    ours_s: float
    ddp_s: float
    overlap_fraction: float
    exposed_s: float
    comm_s: float

    @property
    def ratio(self) -> float:
        """ours / DDP step time (1.0 = as fast as DDP)."""
        return self.ours_s / self.ddp_s


def _bench_rank(widths, batch_size, caps, steps, warmup, seed):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlab.overlap import BucketedDataParallel, train_step
    from commlab.overlap.profile import make_mlp, overlap_from_step, random_batch

    batch = random_batch(widths, batch_size, seed, dist.get_rank())
    rows = []
    for label, cap in caps:
        runs = {}
        m = make_mlp(widths, seed=seed)
        runs["ours"] = (BucketedDataParallel(m, bucket_cap_bytes=cap), torch.optim.SGD(m.parameters(), lr=0.0))
        m = make_mlp(widths, seed=seed)
        runs["ddp"] = (DDP(m, bucket_cap_mb=cap / MiB), torch.optim.SGD(m.parameters(), lr=0.0))
        times = {"ours": [], "ddp": []}
        fractions, exposed, comm = [], [], []
        # warmup >= 2: DDP rebuilds its buckets after its first step.
        for step in range(warmup + steps):
            for name in (("ours", "ddp") if step % 2 == 0 else ("ddp", "ours")):
                model, opt = runs[name]
                dist.barrier()
                st = train_step(model, opt, F.cross_entropy, *batch)
                if step >= warmup:
                    times[name].append(st.step_s)
                    if name == "ours":
                        f, c, e = overlap_from_step(st)
                        fractions.append(f)
                        comm.append(c)
                        exposed.append(e)
        # each step is as slow as its slowest rank
        slowest = {name: statistics.median(max_over_ranks(ts)) for name, ts in times.items()}
        med = statistics.median
        rows.append(OverlapBenchRow(label, cap, len(runs["ours"][0].buckets), slowest["ours"], slowest["ddp"],
                                    med(fractions), med(exposed), med(comm)))
    return rows


def bench_overlap(world_size: int = 2, caps: Sequence[tuple[str, int]] = DEFAULT_CAPS,
                  widths: Sequence[int] | None = None, batch_size: int = 64, steps: int = 10, warmup: int = 3,
                  seed: int = 0, timeout: float = 300.0) -> list[OverlapBenchRow]:
    """Measure each cap on ``world_size`` gloo ranks; rows from rank 0.

    Raises:
        ValueError: world_size < 2 (nothing to overlap), steps < 1 or warmup < 2.
    """
    from commlab.launch import launch
    from commlab.overlap.profile import MEASURE_WIDTHS

    checks.integer("world_size", world_size, least=2, note="one rank has nothing to all-reduce")
    checks.integer("steps", steps)
    checks.integer("warmup", warmup, least=2, note="DDP rebuilds its buckets after step 1")
    widths = tuple(MEASURE_WIDTHS if widths is None else widths)
    return launch(_bench_rank, world_size, widths, batch_size, list(caps), steps, warmup, seed, timeout=timeout)[0]


def print_overlap_bench(world_size: int = 2, steps: int = 10) -> int:
    """Print the table; return 0 (a shell exit status)."""
    from commlab.overlap.profile import MEASURE_WIDTHS, make_mlp

    cores = os.cpu_count() or 2
    ranks = max(2, min(world_size, cores))
    if world_size < 2:
        print(f"# {world_size} rank requested, 2 used: data parallelism needs at least 2 ranks to communicate")
    elif ranks != world_size:
        print(f"# {world_size} ranks requested, {ranks} used: this machine has {cores} cores, and ranks that "
              "time-share a core measure the scheduler, not the overlap")
    n = sum(p.numel() for p in make_mlp(MEASURE_WIDTHS).parameters())
    print(f"# data-parallel step (forward, backward, AllReduce of the gradients, SGD) of the MLP "
          f"{'-'.join(map(str, MEASURE_WIDTHS))} ({n / 1e6:.1f} M parameters, {n * 4 / MiB:.1f} MiB of float32 "
          f"gradients), batch 64 per rank, {ranks} gloo ranks, one thread per rank")
    print(f"# median of {steps} steps (slowest rank per step), ours and DDP alternating; overlap, exposed and comm "
          "are ours (rank 0)")
    rows = bench_overlap(ranks, steps=steps)
    print(f"#{'bucket cap':>11} {'buckets':>8} {'ours ms':>8} {'DDP ms':>8} {'ours/DDP':>9} {'overlap':>8} "
          f"{'exposed ms':>11} {'comm ms':>8}")
    for r in rows:
        print(f" {r.label:>11} {r.buckets:>8} {r.ours_s * 1e3:>8.1f} {r.ddp_s * 1e3:>8.1f} {r.ratio:>9.2f} "
              f"{r.overlap_fraction:>8.2f} {r.exposed_s * 1e3:>11.1f} {r.comm_s * 1e3:>8.1f}")
    print("# overlap: share of the buckets' communication (launch to done) that falls inside backward's compute; "
          "exposed: last gradient to all buckets averaged")
    return 0
