"""ZeRO-3 step time: commlab's :class:`~commlab.parallel.ShardedDataParallel` beside torch's FSDP2
(``torch.distributed.fsdp.fully_shard``) on the same model, data and ranks.

``python -m commlab bench --sharded`` builds the MLP of :data:`commlab.overlap.profile.MEASURE_WIDTHS` (8.0 M
float32 parameters) three times: once wrapped by ``ShardedDataParallel(stage=3)`` (one unit per ``Linear``,
prefetching the next unit's AllGather), once with ``fully_shard`` on every ``Linear`` and then on the root
(FSDP2's per-module units; its own prefetch of one unit ahead), and once more by ``ShardedDataParallel`` without
prefetch. The three train with Adam on the same batch, taking turns step by step (in a rotating order) so that
they see the same machine load, and the table gives the median step time (forward, backward, optimizer step;
the slowest rank per step) of ours with and without prefetch, FSDP2's, and the ratio, and, from profiled
steps of ours after the timed ones (:func:`commlab.parallel.sharded_profile.profile_sharded`), the communication
time and the share of it overlapped with compute. Ranks are capped at the number of cores.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from commlab import checks
from commlab.bench.timing import max_over_ranks

__all__ = ["ShardedBenchRow", "bench_sharded", "print_sharded_bench"]


@dataclasses.dataclass(frozen=True)
class ShardedBenchRow:
    """Median seconds per step (slowest rank), ours and FSDP2's, and ours profiled (rank 0, seconds).

    Attributes:
        prefetch: whether ours prefetched. ours_s, fsdp2_s: step times. comm_s, overlap_fraction: ours, profiled.
    """

    prefetch: bool
    ours_s: float
    fsdp2_s: float
    comm_s: float
    overlap_fraction: float

    @property
    def ratio(self) -> float:
        """ours / FSDP2 step time (1.0 = as fast as FSDP2)."""
        return self.ours_s / self.fsdp2_s


def _bench_rank(widths, batch_size, steps, warmup, seed):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from commlab.overlap.profile import make_mlp, random_batch
    from commlab.parallel import ShardedDataParallel
    from commlab.parallel.sharded_profile import profile_sharded

    x, y = random_batch(widths, batch_size, seed, dist.get_rank())
    ref = make_mlp(widths, seed=seed)
    for layer in ref:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(ref)
    runs = {"fsdp2": (ref, torch.optim.Adam(ref.parameters(), lr=1e-4))}
    for prefetch in (True, False):
        sdp = ShardedDataParallel(make_mlp(widths, seed=seed), stage=3, prefetch=prefetch)
        runs[prefetch] = (sdp, sdp.make_optimizer(torch.optim.Adam, lr=1e-4))
    names = list(runs)
    times = {name: [] for name in names}
    # The three take turns, in an order that rotates every step, so that each sees the same machine load.
    for step in range(warmup + steps):
        for name in names[step % 3:] + names[:step % 3]:
            model, opt = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    # each step is as slow as its slowest rank
    slowest = {name: statistics.median(max_over_ranks(ts)) for name, ts in times.items()}
    rows = []
    for prefetch in (True, False):
        sdp, opt = runs[prefetch]
        prof = profile_sharded(sdp, opt, F.cross_entropy, (x, y), steps=3, warmup=0)
        rows.append(ShardedBenchRow(prefetch, slowest[prefetch], slowest["fsdp2"], prof.comm_s, prof.overlap_fraction))
    return rows


def bench_sharded(world_size: int = 2, widths=None, batch_size: int = 64, steps: int = 10, warmup: int = 2,
                  seed: int = 0, timeout: float = 600.0) -> list[ShardedBenchRow]:
    """Measure on ``world_size`` gloo ranks, with and without our prefetch; rows from rank 0.

    Raises:
        ValueError: world_size < 2 (nothing is sharded), steps < 1 or warmup < 1.
    """
    from commlab.launch import launch
    from commlab.overlap.profile import MEASURE_WIDTHS

    checks.integer("world_size", world_size, least=2, note="one rank shards nothing")
    checks.integer("steps", steps)
    checks.integer("warmup", warmup)
    widths = tuple(MEASURE_WIDTHS if widths is None else widths)
    return launch(_bench_rank, world_size, widths, batch_size, steps, warmup, seed, timeout=timeout)[0]


def print_sharded_bench(world_size: int = 2, steps: int = 10) -> int:
    """Print the table; return 0 (a shell exit status)."""
    from commlab.overlap.profile import MEASURE_WIDTHS, make_mlp

    cores = os.cpu_count() or 2
    ranks = max(2, min(world_size, cores))
    if ranks != world_size:
        print(f"# {world_size} rank(s) requested, {ranks} used: ZeRO-3 needs 2 ranks or more, and ranks that "
              f"time-share a core measure the scheduler (this machine has {cores} cores)")
    n = sum(p.numel() for p in make_mlp(MEASURE_WIDTHS).parameters())
    print(f"# ZeRO-3 step (forward, backward, Adam) of the MLP {'-'.join(map(str, MEASURE_WIDTHS))} "
          f"({n / 1e6:.1f} M float32 parameters, one unit per Linear), batch 64 per rank, {ranks} gloo ranks")
    print(f"# median of {steps} steps (slowest rank per step), ours (ShardedDataParallel) with and without prefetch "
          "and FSDP2 (fully_shard) taking turns; comm and overlap: ours, 3 profiled steps, rank 0")
    rows = bench_sharded(ranks, steps=steps)
    print(f"#{'prefetch':>9} {'ours ms':>8} {'FSDP2 ms':>9} {'ours/FSDP2':>11} {'comm ms':>8} {'overlap':>8}")
    for r in rows:
        print(f" {('yes' if r.prefetch else 'no'):>9} {r.ours_s * 1e3:>8.1f} {r.fsdp2_s * 1e3:>9.1f} {r.ratio:>11.2f} "
              f"{r.comm_s * 1e3:>8.1f} {r.overlap_fraction:>8.2f}")
    print("# overlap: share of our collectives' time (launch to gloo's completion) while the training thread computes")
    return 0
