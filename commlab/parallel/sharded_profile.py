"""Step time, compute, communication and how much of it hides behind compute, for a
:class:`~commlab.parallel.ShardedDataParallel` model: measured with ``torch.profiler``.

:func:`profile_sharded` runs a few steps under the profiler (all threads, as :mod:`commlab.overlap.profile`)
and reads back the ``sharded::`` ranges that :mod:`commlab.parallel.sharded` and this module open. A
collective's end is gloo's own event on its worker thread, matched to its launch by order (gloo gives no
completion callback for ``reduce_scatter_tensor``, run as a whole-gradient AllReduce in torch 2.13). Per
step, in seconds: ``comm_s`` = |C|, the union of the collectives' [launch, end]; ``exposed_comm_s`` = |M|,
the training thread's launch, wait and AllReduce ranges; ``compute_s`` = step - |M|; ``overlapped_s`` =
|C ∩ (step \\ M)|. The last step is kept as :attr:`ShardedProfile.timeline`
(:func:`commlab.viz.plot_overlap_timeline`); :func:`gathers_issued_ahead` reads which AllGathers were
prefetched.

Book: chapter 12, §12.3.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from commlab import checks
from commlab.overlap.profile import (Interval, all_threads_config, intersection_of_unions, profiler_events,
                                     union_length)
from commlab.parallel.sharded import (RANGE_ALL_GATHER, RANGE_ALL_REDUCE, RANGE_REDUCE_SCATTER, RANGE_WAIT_GATHER,
                                      RANGE_WAIT_REDUCE, ShardedDataParallel)

__all__ = ["ShardedProfile", "profile_sharded", "gathers_issued_ahead", "RANGE_STEP"]

RANGE_STEP = "sharded::step"
RANGE_FORWARD, RANGE_BACKWARD, RANGE_OPTIMIZER = "sharded::forward", "sharded::backward", "sharded::optimizer"
RANGE_UNIT_FORWARD = "sharded::forward::unit"   # + index: a unit's forward compute (hooks added by the profile)


@dataclasses.dataclass(frozen=True)
class ShardedProfile:
    """One rank's measurement of ``steps`` profiled steps (medians over the steps, but the fraction).

    Attributes:
        rank, stage, steps: as run.
        step_s, compute_s, comm_s, overlapped_s, exposed_comm_s: seconds (module docstring).
        overlap_fraction: sum of ``overlapped_s`` over the steps / sum of ``comm_s`` (0 with no communication).
        timeline: the last profiled step's bars (module docstring), seconds from its start.
    """

    rank: int
    stage: int
    steps: int
    step_s: float
    compute_s: float
    comm_s: float
    overlapped_s: float
    exposed_comm_s: float
    overlap_fraction: float
    timeline: tuple[Interval, ...] = ()


def _measure(events: Sequence[tuple[str, int, float, float]]) -> list[dict[str, float]]:
    """Per step: step, compute, comm, overlapped, exposed seconds (module docstring), from profiler events."""
    def named(pattern):
        pat = re.compile(pattern)
        return sorted((s, e) for n, _, s, e in events if pat.match(n))

    steps = named(re.escape(RANGE_STEP) + "$")
    if not steps:
        raise ValueError(f"no '{RANGE_STEP}' ranges in the profile: run steps inside record_function('{RANGE_STEP}')")
    all_reduces = named(re.escape(RANGE_ALL_REDUCE) + r"\d+$")

    def outside_all_reduce(s, e):
        return not any(a <= s and e <= z + 1e-6 for a, z in all_reduces)

    def by_unit(prefix):
        pat = re.compile(re.escape(prefix) + r"(\d+)$")
        return sorted((s, e, int(m.group(1))) for n, _, s, e in events for m in [pat.match(n)] if m)

    comm: list[tuple[float, float]] = list(all_reduces)
    labelled: list[tuple[str, float, float, int]] = [("AR", s, e, i) for s, e, i in by_unit(RANGE_ALL_REDUCE)]
    for tag, launch_name, gloo_name in (("AG", RANGE_ALL_GATHER, "gloo:all_gather"),
                                        ("RS", RANGE_REDUCE_SCATTER, "gloo:all_reduce")):
        launches = by_unit(launch_name)
        done = [(s, e) for s, e in named(re.escape(gloo_name) + "$") if outside_all_reduce(s, e)]
        if done and len(done) != len(launches):
            raise ValueError(f"{len(launches)} '{launch_name}*' launches but {len(done)} '{gloo_name}' events; "
                             "profile ShardedDataParallel steps only, with no other collective on its groups")
        # No gloo events at all: N = 1, nothing travels, and the interval is the launch range alone.
        for k, (s, e, unit) in enumerate(launches):
            end = max(e, done[k][1]) if done else e
            comm.append((s, end))
            labelled.append((tag, s, end, unit))
    waits = [("AG", s, e, i) for s, e, i in by_unit(RANGE_WAIT_GATHER)] + \
        [("RS", s, e, None) for s, e in named(re.escape(RANGE_WAIT_REDUCE) + "$")]
    phases = [(kind, s, e) for kind, name in (("forward", RANGE_FORWARD), ("backward", RANGE_BACKWARD),
                                               ("optimizer", RANGE_OPTIMIZER)) for s, e in named(re.escape(name) + "$")]
    unit_computes = by_unit(RANGE_UNIT_FORWARD)
    training_thread = (named(re.escape(RANGE_ALL_GATHER) + r"\d+$") + named(re.escape(RANGE_REDUCE_SCATTER) + r"\d+$")
                       + named(re.escape(RANGE_WAIT_GATHER) + r"\d+$") + named(re.escape(RANGE_WAIT_REDUCE) + "$")
                       + all_reduces)
    out = []
    for s0, s1 in steps:
        def clip(iv):
            return [(max(s, s0), min(e, s1)) for s, e in iv if min(e, s1) > max(s, s0)]
        c, m = clip(comm), clip(training_thread)
        exposed = union_length(m)
        comm_s = union_length(c)
        overlapped = comm_s - intersection_of_unions(c, m)

        def within(s, e):  # a bar belongs to the step it starts in (a collective may end after the step)
            return s0 <= s < s1 + 1e-9

        bars = [Interval(kind, s - s0, e - s0) for kind, s, e in phases if within(s, e)]
        bars += [Interval("unit", s - s0, e - s0, unit) for s, e, unit in unit_computes if within(s, e)]
        bars += [Interval("wait", s - s0, e - s0, unit, f"{tag}{'' if unit is None else unit}")
                 for tag, s, e, unit in waits if within(s, e)]
        bars += [Interval("comm", s - s0, e - s0, unit, f"{tag}{unit}") for tag, s, e, unit in labelled if within(s, e)]
        out.append({"step": s1 - s0, "compute": (s1 - s0) - exposed, "comm": comm_s, "overlapped": overlapped,
                    "exposed": exposed, "timeline": tuple(sorted(bars, key=lambda b: (b.start_s, b.kind)))})
    return out


def profile_sharded(sdp: ShardedDataParallel, optimizer: torch.optim.Optimizer,
                    loss_fn: Callable[..., torch.Tensor], batch: Sequence[Any], steps: int = 3,
                    warmup: int = 1) -> ShardedProfile:
    """Run ``warmup`` + ``steps`` training steps of ``sdp`` and measure the profiled ones (call on every rank).

    A step is ``loss_fn(sdp(batch[0]), *batch[1:]).backward(); optimizer.step(); optimizer.zero_grad()``.

    Args:
        sdp: the wrapped model. optimizer: over its parameters (the shards), e.g. ``torch.optim.SGD(sdp.parameters())``.
        loss_fn, batch: this rank's inputs and targets. steps, warmup: ints >= 1 and >= 0.

    Returns:
        :class:`ShardedProfile` of this rank.

    Raises:
        ValueError: bad ``steps``/``warmup``; a profile whose launches and gloo events do not match.
    """
    checks.integer("steps", steps)
    checks.integer("warmup", warmup, least=0)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")

    def one_step():
        with record_function(RANGE_FORWARD):
            loss = loss_fn(sdp(batch[0]), *batch[1:])
        with record_function(RANGE_BACKWARD):
            loss.backward()
        with record_function(RANGE_OPTIMIZER):
            optimizer.step()
            optimizer.zero_grad()

    for _ in range(warmup):
        one_step()
    dist.barrier()
    open_ranges: dict[int, Any] = {}

    def enter(index):
        def hook(module, args):
            open_ranges[index] = record_function(f"{RANGE_UNIT_FORWARD}{index}").__enter__()
        return hook

    def leave(index):
        def hook(module, args, output):
            r = open_ranges.pop(index, None)
            if r is not None:
                r.__exit__(None, None, None)
        return hook

    handles = [h for i, m in enumerate(sdp.units)
               for h in (m.register_forward_pre_hook(enter(i)), m.register_forward_hook(leave(i)))]
    try:
        with profile(activities=[ProfilerActivity.CPU], experimental_config=all_threads_config()) as prof:
            for _ in range(steps):
                with record_function(RANGE_STEP):
                    one_step()
    finally:
        for h in handles:
            h.remove()
    per_step = _measure(profiler_events(prof))
    med = statistics.median
    total = sum(s["comm"] for s in per_step)
    return ShardedProfile(rank=dist.get_rank(), stage=sdp.stage, steps=steps,
                          step_s=med(s["step"] for s in per_step), compute_s=med(s["compute"] for s in per_step),
                          comm_s=med(s["comm"] for s in per_step), overlapped_s=med(s["overlapped"] for s in per_step),
                          exposed_comm_s=med(s["exposed"] for s in per_step),
                          overlap_fraction=sum(s["overlapped"] for s in per_step) / total if total > 0 else 0.0,
                          timeline=per_step[-1]["timeline"])


def gathers_issued_ahead(timeline: Sequence[Interval]) -> dict[str, list[int]]:
    """Which units' AllGathers were launched ahead, read from the *order* of one step's bars on the training
    thread (:attr:`ShardedProfile.timeline`), not from their lengths: the answer does not depend on the
    machine's speed or load.

    * forward (units 0, 1, ..., U-1): unit i's AllGather was issued ahead when its launch began before unit
      i-1's forward compute (its ``unit`` bar) ended, so that it travelled while unit i-1 computed;
    * backward (units U-1, ..., 0): unit i's AllGather was issued ahead when its launch began before unit i+1's
      ReduceScatter was launched, which happens once unit i+1's backward has produced its gradients.

    A unit's first AllGather of the step is its forward one, the second its backward one.

    Returns:
        ``{"forward": [units], "backward": [units]}``: the units whose AllGather was issued ahead, sorted.

    Raises:
        ValueError: a timeline without two AllGathers per unit (a stage 2 or an N = 1 profile).
    """
    gathers: dict[int, list[float]] = {}
    computes: dict[int, list[float]] = {}
    reduces: dict[int, float] = {}
    for b in sorted(timeline, key=lambda b: b.start_s):
        label = b.label or ""
        if b.kind == "comm" and label.startswith("AG"):
            gathers.setdefault(b.bucket, []).append(b.start_s)
        elif b.kind == "comm" and label.startswith("RS"):
            reduces.setdefault(b.bucket, b.start_s)
        elif b.kind == "unit":
            computes.setdefault(b.bucket, []).append(b.end_s)
    if not gathers or any(len(v) < 2 for v in gathers.values()):
        raise ValueError("the timeline does not hold two AllGathers per unit (forward and backward): profile a "
                         "ZeRO-3 step (stage=3) on N > 1 ranks with profile_sharded")
    ahead: dict[str, list[int]] = {"forward": [], "backward": []}
    for i in sorted(gathers):
        if i - 1 in computes and gathers[i][0] < computes[i - 1][0]:
            ahead["forward"].append(i)
        if i + 1 in reduces and gathers[i][1] < reduces[i + 1]:
            ahead["backward"].append(i)
    return ahead
