"""The α-β picture of bucket size: how much of a data-parallel AllReduce sticks out of backward.

A model, not a measurement (chapter 9 §9.8 sets it beside the measurement): backward produces the
``grad_nbytes`` gradient bytes at a steady rate over ``backward_s`` seconds; every ``bucket_cap_bytes`` of them
form a bucket (the last one smaller), launched when complete; buckets share one link, so a bucket starts when
it is complete *and* the previous one has finished; each takes the time a cost function gives for its
bytes: a ring AllReduce's ``2(n-1)α + 2(n-1)/n · bytes · β`` (:func:`commlab.collectives.ring_all_reduce_seconds`),
or NCCL's own prediction, the fastest (algorithm, protocol) pair for that size
(:func:`commlab.collectives.nccl_model.best`). Exposed time is what is left after backward ends. Tensors are assumed divisible at any byte (DDP never splits a parameter;
real buckets are coarser).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

__all__ = ["BucketedSchedule", "bucketed_allreduce_schedule"]


@dataclasses.dataclass(frozen=True)
class BucketedSchedule:
    """Result of :func:`bucketed_allreduce_schedule` (seconds from the start of backward).

    Attributes:
        buckets: number of buckets. comm_s: sum of the buckets' AllReduce times. end_s: when the last
        bucket's AllReduce ends. exposed_s: ``max(0, end_s - backward_s)``.
    """

    buckets: int
    comm_s: float
    end_s: float
    exposed_s: float


def bucketed_allreduce_schedule(grad_nbytes: float, backward_s: float, bucket_cap_bytes: float,
                                allreduce_seconds: Callable[[float], float]) -> BucketedSchedule:
    """Schedule the buckets' AllReduces behind a backward pass that produces bytes at a steady rate.

    Args:
        grad_nbytes: gradient bytes per rank (> 0). backward_s: backward's compute time (> 0).
        bucket_cap_bytes: bucket size in bytes (> 0; >= grad_nbytes means one bucket).
        allreduce_seconds: seconds of one AllReduce of a bucket, given its bytes, e.g.
            ``lambda b: ring_all_reduce_seconds(b, n, alpha_s, beta_s_per_byte)``.

    Raises:
        ValueError: a size or time that is not a finite number > 0, a cost function that is not callable,
            or what the cost function rejects.
    """
    for name, v in (("grad_nbytes", grad_nbytes), ("backward_s", backward_s), ("bucket_cap_bytes", bucket_cap_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    if not callable(allreduce_seconds):
        raise ValueError(f"allreduce_seconds must be a function of the bucket's bytes, got {allreduce_seconds!r}")
    buckets = max(1, math.ceil(grad_nbytes / bucket_cap_bytes))
    end, comm, produced = 0.0, 0.0, 0.0
    for _ in range(buckets):
        size = min(bucket_cap_bytes, grad_nbytes - produced)
        produced += size
        ready = backward_s * produced / grad_nbytes
        t = allreduce_seconds(size)
        end = max(end, ready) + t
        comm += t
    return BucketedSchedule(buckets, comm, end, max(0.0, end - backward_s))
