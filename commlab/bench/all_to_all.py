"""commlab's pairwise AllToAllV beside ``dist.all_to_all_single`` on the same ranks, sizes and buffers.

The AlltoAll table of nccl-tests (``src/alltoall.cu``): equal blocks, the size S being one rank's whole send
buffer (N blocks), busbw = algbw · (n-1)/n (:data:`commlab.bench.metrics.BUSBW_FACTORS`). Ours is
:func:`commlab.collectives.all_to_all_v` with equal split sizes (the general path, the one expert
parallelism uses), torch's is ``dist.all_to_all_single(out, inp)``.

Method, per size (one launch per size, as :mod:`commlab.bench.allreduce`): correctness first (both on the
same random float32 data; ``#wrong`` counts the elements where ours differs from torch's, summed over
ranks), then one warm-up call of each, then ``rounds`` rounds of back-to-back calls between barriers, the
two alternating and swapping which goes first; a round's time is the slowest rank's, the reported time the
median over rounds.
"""

from __future__ import annotations

import os
import statistics
from typing import Iterable

import torch
import torch.distributed as dist

from commlab.bench.allreduce import DEFAULT_SIZES, BenchRow, table_header, table_row
from commlab.bench.timing import calls_per_round, count_wrong, time_calls
from commlab.collectives.all_to_all import all_to_all_v
from commlab.launch import launch
from commlab.launch.device import group_device

_ITEMSIZE = 4  # float32


def count_per_rank(nbytes: int, world_size: int) -> int:
    """float32 elements of one rank's send buffer for a requested size: ``nbytes`` rounded down to whole
    blocks of one element per rank, as nccl-tests rounds (``(count/nranks)*nranks``), but at least one
    element per rank."""
    return max(1, nbytes // _ITEMSIZE // world_size) * world_size


def _measure_one_size(nbytes: int, rounds: int, check: bool) -> BenchRow:
    rank, n = dist.get_rank(), dist.get_world_size()
    device = group_device()  # the rank's own GPU under NCCL, the CPU under gloo
    count = count_per_rank(nbytes, n)
    splits = [count // n] * n
    data = torch.randn(count, generator=torch.Generator().manual_seed(rank)).to(device)
    ref = torch.empty_like(data)
    dist.all_to_all_single(ref, data)
    wrong = count_wrong(all_to_all_v(data, splits, splits, check=check), ref)  # the function timed is checked

    buf, out = torch.zeros(count, device=device), torch.empty(count, device=device)
    iters = calls_per_round(count * _ITEMSIZE, 8 * 2**20, 200)
    # Both receive into a buffer allocated once (a fresh CPU output costs its page faults on every call).
    algs = {"ours": lambda: all_to_all_v(buf, splits, splits, out=out, check=check),
            "torch": lambda: dist.all_to_all_single(out, buf)}
    for fn in algs.values():
        fn()  # warm-up
    times = {name: [] for name in algs}
    for r in range(rounds):
        for name in (["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]):
            times[name].append(time_calls(algs[name], iters, device))
    return BenchRow(nbytes=count * _ITEMSIZE, count=count, dtype="float32", world_size=n,
                    ours_s=statistics.median(times["ours"]), torch_s=statistics.median(times["torch"]),
                    wrong=wrong, collective="all_to_all")


def bench_all_to_all(world_size: int = 4, sizes: Iterable[int] = DEFAULT_SIZES, rounds: int = 5,
                     check: bool = False, backend: str = "gloo", progress: bool = True,
                     timeout: float = 600.0) -> list[BenchRow]:
    """Time commlab's AllToAllV (equal splits) beside ``dist.all_to_all_single``, one table row per size.

    Args:
        world_size: ranks to launch (>= 1).
        sizes: bytes of one rank's send buffer (S of nccl-tests), each >= 4; rounded as
            :func:`count_per_rank` does.
        rounds: timed rounds per algorithm and size (median reported); >= 1.
        check: time ours with its split-size agreement check (one small all-gather per call); off by
            default, like ``dist.all_to_all_single``, which checks nothing.
        backend: ``"gloo"`` or ``"nccl"`` (one GPU per rank).
        progress: print the heading and each row as soon as its size is measured.
        timeout: seconds allowed per size.

    Returns:
        One :class:`~commlab.bench.allreduce.BenchRow` per size, ``collective="all_to_all"`` (its ``ratio`` is
        busbw ours / busbw torch).

    Raises:
        ValueError: a size below 4 bytes, ``rounds < 1`` or ``world_size < 1``.
    """
    sizes = list(sizes)
    if any(s < 4 for s in sizes):
        raise ValueError(f"every size must be >= 4 bytes (one float32), got {sizes}")
    if rounds < 1 or world_size < 1:
        raise ValueError(f"need rounds >= 1 and world_size >= 1, got rounds={rounds}, world_size={world_size}")
    cores = os.cpu_count() or 1
    if progress and backend == "gloo" and world_size > cores:
        print(f"# note: {world_size} ranks share {cores} CPU cores, so every message also waits for the "
              "scheduler: small-message times measure that more than the algorithm", flush=True)
    if progress:
        print(table_header(world_size, backend, check, collective="all_to_all"), flush=True)
    rows = []
    for nbytes in sizes:
        row = launch(_measure_one_size, world_size, nbytes, rounds, check, backend=backend, timeout=timeout,
                     print_output=True)[0]
        rows.append(row)
        if progress:
            print(table_row(row), flush=True)
    return rows
