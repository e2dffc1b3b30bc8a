"""The measuring primitives every benchmark shares, run inside a rank.

How many calls a timed round makes, how the slowest rank's time is found (:func:`max_over_ranks`, per round
or per step), and how a result is checked against ``dist.all_reduce`` (nccl-tests' ``#wrong``): one
definition each, so that the nccl-tests table, the algorithm comparison, the calibration and the
step-time tables measure the same way.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist


def calls_per_round(nbytes: int, payload_nbytes: int, most: int) -> int:
    """Calls per timed round: enough to move about ``payload_nbytes`` (small messages need many calls to
    rise above the timer's and the barrier's cost), at least 1, at most ``most``."""
    return int(min(most, max(1, payload_nbytes // max(nbytes, 1))))


def max_over_ranks(values: Sequence[float], device: torch.device | str = "cpu") -> list[float]:
    """Element-wise largest of every rank's ``values`` (one AllReduce MAX of float64 on ``device``, the group's
    device); every rank must call it with as many values, and gets the same list."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def slowest_rank(seconds: float, device: torch.device | str = "cpu") -> float:
    """The largest of every rank's ``seconds``: a collective is as slow as its slowest rank."""
    return max_over_ranks([seconds], device)[0]


def time_calls(fn: Callable[[], object], calls: int, device: torch.device | str = "cpu") -> float:
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls started together after a barrier, for
    the slowest rank (on a GPU, after synchronising, so that the work is timed, not its launch)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return slowest_rank((time.perf_counter() - t0) / calls, device)


def count_wrong(got: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements, summed over all ranks, where ``got`` differs from ``ref`` by more than 1e-5 relative
    (1e-6 absolute): the ``#wrong`` column of nccl-tests."""
    bad = (~torch.isclose(got, ref, rtol=1e-5, atol=1e-6)).sum().reshape(1)
    dist.all_reduce(bad)
    return int(bad)
