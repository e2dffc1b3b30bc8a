"""Ring AllReduce (ours) beside ``dist.all_reduce`` on the same ranks, sizes and buffers.

Method, per message size (one launch per size, so each row is printed as soon as it is measured):

* correctness first: both algorithms reduce the same random float32 data; ``#wrong`` counts the
  elements where ours differs from torch's by more than 1e-5 relative (nccl-tests' ``#wrong`` column),
  on every rank, summed;
* timing on a zero-filled buffer, reduced in place by both (repeated in-place sums of random data
  would overflow), after one warm-up call of each;
* ``rounds`` rounds, each timing ``iters`` back-to-back calls of one algorithm between barriers, the two
  algorithms alternating (and swapping which goes first) so that drift in the machine's speed hits both;
  a round's time is the slowest rank's, and the reported time is the median over rounds.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from commlab.bench.metrics import algbw_bytes_per_s, busbw_bytes_per_s
from commlab.bench.timing import calls_per_round, count_wrong, time_calls
from commlab.collectives import ring_all_reduce
from commlab.launch import launch
from commlab.launch.device import group_device

DEFAULT_SIZES = tuple(2**k for k in range(10, 27, 2))  # 1 KiB ... 64 MiB, every factor of 4


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One size of a benchmark, ours beside torch's. Times in seconds, bandwidths in bytes/s; ``nbytes`` is
    nccl-tests' S for ``collective`` (a key of :data:`~commlab.bench.metrics.BUSBW_FACTORS`: for AllReduce
    the buffer, for AlltoAll one rank's whole send buffer), which sets busbw's factor."""

    nbytes: int
    count: int
    dtype: str
    world_size: int
    ours_s: float
    torch_s: float
    wrong: int
    collective: str = "all_reduce"

    @property
    def ours_algbw(self) -> float:
        return algbw_bytes_per_s(self.nbytes, self.ours_s)

    @property
    def ours_busbw(self) -> float:
        return busbw_bytes_per_s(self.nbytes, self.ours_s, self.world_size, self.collective)

    @property
    def torch_algbw(self) -> float:
        return algbw_bytes_per_s(self.nbytes, self.torch_s)

    @property
    def torch_busbw(self) -> float:
        return busbw_bytes_per_s(self.nbytes, self.torch_s, self.world_size, self.collective)

    @property
    def ratio(self) -> float:
        """busbw ours / busbw torch (> 1: ours is faster); computed as torch_s / ours_s, which is the same
        ratio and stays defined for one rank, where busbw is 0."""
        return self.torch_s / self.ours_s


def _measure_one_size(nbytes: int, rounds: int, ours: Callable[[torch.Tensor], object]):
    rank, n = dist.get_rank(), dist.get_world_size()
    device = group_device()  # the rank's own GPU under NCCL, the CPU under gloo
    count = nbytes // 4
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(count, generator=g).to(device)
    ref = data.clone()
    dist.all_reduce(ref)
    got = data.clone()
    ours(got)  # the function that is timed is the function that is checked
    wrong = count_wrong(got, ref)

    buf = torch.zeros(count, device=device)
    # About 8 MiB of payload per timed round, at most 200 calls.
    iters = calls_per_round(nbytes, 8 * 2**20, 200)
    algs = {"ours": lambda: ours(buf), "torch": lambda: dist.all_reduce(buf)}
    for fn in algs.values():
        fn()  # warm-up: first-call costs (buffer allocation, connection set-up) are not the algorithm's
    times = {name: [] for name in algs}
    for r in range(rounds):
        names = ["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]
        for name in names:
            times[name].append(time_calls(algs[name], iters, device))
    return BenchRow(nbytes=count * 4, count=count, dtype="float32", world_size=n,
                    ours_s=statistics.median(times["ours"]), torch_s=statistics.median(times["torch"]),
                    wrong=wrong)


def _ring_inplace(buf: torch.Tensor) -> None:
    ring_all_reduce(buf, inplace=True)


def _ring_inplace_unchecked(buf: torch.Tensor) -> None:
    ring_all_reduce(buf, inplace=True, check=False)


def bench_all_reduce(world_size: int = 4, sizes: Iterable[int] = DEFAULT_SIZES, rounds: int = 5,
                     ours: Callable[[torch.Tensor], object] | None = None, check: bool = False,
                     backend: str = "gloo", progress: bool = True, timeout: float = 600.0) -> list[BenchRow]:
    """Time ``ours`` (default: commlab's ring AllReduce, in place) beside ``dist.all_reduce``.

    Args:
        world_size: ranks to launch.
        sizes: message sizes in bytes (rounded down to whole float32 elements; >= 4).
        rounds: timed rounds per algorithm and size (median reported); >= 1.
        ours: the function to time against torch, called as ``ours(buffer)`` inside each rank; it must
            all-reduce ``buffer`` in place. Default: ``ring_all_reduce(buffer, inplace=True, check=check)``.
        check: with the default ``ours``, whether the ring first checks that all ranks agree on size and
            dtype (one extra small collective per call; see ``ring_all_reduce``). Off by default, so that
            the comparison is like for like: ``dist.all_reduce`` checks nothing.
        backend: ``"gloo"`` or ``"nccl"``.
        progress: print each row of the table as soon as its size is measured.
        timeout: seconds allowed per size.

    Returns:
        One :class:`BenchRow` per size.

    Raises:
        ValueError: a size below 4 bytes or ``rounds < 1``.
    """
    sizes = list(sizes)
    if any(s < 4 for s in sizes):
        raise ValueError(f"every size must be >= 4 bytes (one float32), got {sizes}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if ours is None:
        ours = _ring_inplace if check else _ring_inplace_unchecked
    rows = []
    cores = os.cpu_count() or 1
    if progress and backend == "gloo" and world_size > cores:
        print(f"# note: {world_size} ranks share {cores} CPU cores, so every message also waits for the "
              "scheduler: small-message times measure that more than the algorithm", flush=True)
    if progress:
        print(table_header(world_size, backend, check if ours in (_ring_inplace, _ring_inplace_unchecked) else None),
              flush=True)
    for nbytes in sizes:
        row = launch(_measure_one_size, world_size, nbytes, rounds, ours, backend=backend,
                     timeout=timeout, print_output=True)[0]
        rows.append(row)
        if progress:
            print(table_row(row), flush=True)
            sys.stdout.flush()
    return rows


# collective -> (its name, what "ours" is, what "torch" is), for the table's heading.
TITLES = {"all_reduce": ("AllReduce", "ring", "dist.all_reduce"),
          "all_to_all": ("AlltoAll", "pairwise AllToAllV", "dist.all_to_all_single")}


def table_header(world_size: int, backend: str, check: bool | None = None, collective: str = "all_reduce") -> str:
    """The nccl-tests-style header of a benchmark table: title, column names, units."""
    what = {None: "", True: " with check=True", False: " with check=False"}[check]
    name, ours, theirs = TITLES[collective]
    return "\n".join([
        f"# {name}, {world_size} ranks, backend {backend}: commlab {ours} (ours{what}) vs {theirs} (torch)",
        "#" + " " * 37 + f"ours ({ours})".ljust(37) + f"torch ({theirs})",
        f"#{'size':>11} {'count':>10} {'type':>7}  {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        f"  {'time':>10} {'algbw':>7} {'busbw':>7}  {'busbw ours/torch':>16}",
        f"#{'(B)':>11} {'(elements)':>10} {'':>7}  {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
        f"  {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7}  {'':>16}",
    ])


def table_row(r: BenchRow) -> str:
    """One row of the table :func:`table_header` starts (µs, GB/s = 1e9 bytes/s)."""
    return (f" {r.nbytes:>11} {r.count:>10} {r.dtype:>7}  {r.ours_s * 1e6:>10.1f} {r.ours_algbw / 1e9:>7.3f}"
            f" {r.ours_busbw / 1e9:>7.3f} {r.wrong:>6}  {r.torch_s * 1e6:>10.1f} {r.torch_algbw / 1e9:>7.3f}"
            f" {r.torch_busbw / 1e9:>7.3f}  {r.ratio:>16.2f}")


def format_table(rows: list[BenchRow], backend: str = "gloo") -> str:
    """The nccl-tests-style table for ``rows`` (GB = 1e9 bytes, as nccl-tests prints)."""
    if not rows:
        return "(no rows)"
    return "\n".join([table_header(rows[0].world_size, backend, collective=rows[0].collective)]
                     + [table_row(r) for r in rows])
