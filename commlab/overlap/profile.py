"""How much of the gradient AllReduce hides behind backward: measured with ``torch.profiler``.

:func:`profile_overlap` runs a few :func:`commlab.overlap.train_step` steps under ``torch.profiler`` and
:func:`extract_timeline` reads back the trainer's ``record_function`` ranges (``overlap::step``,
``::forward``, ``::backward``, ``::optimizer``, ``::wait``, and per bucket ``::ready``, ``::launch`` and
``::done``); :func:`overlap_from_step` computes the same from the trainer's own clock, without the profiler.
Per step, in seconds: U = union of the buckets' [launch start, done]; overlap fraction = |U ∩ B| / |U| with
B = [backward start, last gradient's arrival]; exposed = last gradient's arrival to the end of the wait.

Why our own markers: for a gloo ``all_reduce(async_op=True)`` on CPU (torch 2.13), ``c10d::allreduce_``
covers only the enqueue, and ``gloo:all_reduce`` on a worker thread starts when a worker picks the work up
and names no bucket; a range closed on another thread loses its end, and ranges on gloo's threads are
recorded only with ``_ExperimentalConfig(profile_all_threads=True)``, which is used here. The gloo events
stay in the timeline as kind ``"gloo"``. Book: chapter 9, §9.6.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from commlab import checks
from commlab.overlap.bucketed import (RANGE_BACKWARD, RANGE_DONE, RANGE_FORWARD, RANGE_LAUNCH, RANGE_OPTIMIZER,
                                      RANGE_READY, RANGE_WAIT, BucketedDataParallel, train_step)

__all__ = ["Interval", "OverlapProfile", "union_length", "intersection_length", "merged_intervals",
           "intersection_of_unions", "MEASURE_WIDTHS", "make_mlp",
           "random_batch", "profile_overlap", "extract_timeline", "measure_overlap", "overlap_from_step", "RANGE_STEP",
           "all_threads_config", "profiler_events", "TRACE_WIDTHS", "DEVICE_S", "DeviceTime", "with_device_time",
           "trace_dp_step"]

RANGE_STEP = "overlap::step"

# Kineto prints a "profiler_start"/"profiler_stop" line with the process id at every profile; in a notebook that
# makes outputs differ between runs. Level 6 silences it; it must be set before the first profile in a process.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


@dataclasses.dataclass(frozen=True)
class Interval:
    """One bar of a timeline: ``kind`` in forward, backward, wait, optimizer, comm, gloo (and unit, for a
    sharded step's per-unit compute); seconds from the step's start; ``bucket`` for comm bars (the bucket, or
    the unit of a sharded step); ``label``, what the drawing writes on a comm bar (default: the bucket)."""

    kind: str
    start_s: float
    end_s: float
    bucket: int | None = None
    label: str | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclasses.dataclass(frozen=True)
class OverlapProfile:
    """One rank's measurement of ``steps`` profiled steps (medians over the steps unless said otherwise).

    Attributes:
        rank, world_size, bucket_cap_bytes: as run. bucket_nbytes: each bucket's bytes, in launch order.
        steps: profiled steps.
        step_s, forward_s, backward_s (compute: until the last gradient), wait_s (``finish``), optimizer_s,
            comm_s (|U|), exposed_comm_s (last gradient to the end of the wait): seconds.
        overlap_fraction: sum over steps of |U ∩ B| divided by the sum of |U|.
        timeline: the last profiled step's bars (seconds from its start).
    """

    rank: int
    world_size: int
    bucket_cap_bytes: int
    bucket_nbytes: tuple[int, ...]
    steps: int
    step_s: float
    forward_s: float
    backward_s: float
    wait_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    overlap_fraction: float
    timeline: tuple[Interval, ...]

    @property
    def buckets(self) -> int:
        return len(self.bucket_nbytes)


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once); 0 for none.

    Raises:
        ValueError: an interval with end < start.
    """
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if e < s:
            raise ValueError(f"interval ({s}, {e}) ends before it starts")
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def intersection_length(intervals: Sequence[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of (union of ``intervals``) ∩ ``window``."""
    lo, hi = window
    clipped = [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]
    return union_length(clipped)


def merged_intervals(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(start, end)`` intervals merged where they overlap or touch, sorted.

    Raises:
        ValueError: an interval with end < start.
    """
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e < s:
            raise ValueError(f"interval ({s}, {e}) ends before it starts")
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def intersection_of_unions(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """|(∪ a) ∩ (∪ b)| for two lists of ``(start, end)`` intervals; 0 when either is empty.

    Raises:
        ValueError: an interval with end < start.
    """
    a, b = merged_intervals(a), merged_intervals(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


#: The MLP of the chapter's measurements and of ``bench --overlap``: 8.0 M parameters (30.7 MiB of float32
#: gradients) in tensors from 40 B to 16 MiB, so that 64 KiB, 1 MiB, 25 MiB and one bucket give 6, 4, 2 and 1
#: buckets; big enough that gloo's AllReduce of it takes about as long as backward on one core.
MEASURE_WIDTHS = (512, 2048, 2048, 1024, 512, 256, 128, 10)


def make_mlp(widths: Sequence[int] = MEASURE_WIDTHS, seed: int = 0) -> nn.Sequential:
    """``Linear(widths[0], widths[1]), ReLU, ..., Linear(widths[-2], widths[-1])``, built under ``seed`` so
    every rank starts from the same weights. Input ``(batch, widths[0])``, output ``(batch, widths[-1])``.

    Raises:
        ValueError: fewer than two widths, or a width that is not an int >= 1.
    """
    widths = list(widths)
    if len(widths) < 2 or not all(checks.is_int(w) and w >= 1 for w in widths):
        checks.fail("widths", widths, "at least two ints >= 1")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)


def all_threads_config():
    """The profiler option that records ranges on every thread (Kineto records only the threads it was enabled
    on unless told otherwise; the done-callbacks run on gloo's worker threads).

    Raises:
        RuntimeError: this torch's profiler lacks the option (torch < 2.7).
    """
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError as e:  # an older torch without the option
        raise RuntimeError("this torch's profiler cannot record ranges on gloo's worker threads "
                           "(_ExperimentalConfig(profile_all_threads=True) is missing); commlab.overlap.profile "
                           "needs torch >= 2.7") from e


def profiler_events(prof) -> list[tuple[str, int, float, float]]:
    """Every event of a finished ``torch.profiler.profile`` as ``(name, thread, start_s, end_s)``."""
    out = []
    for e in prof.events():
        out.append((e.name, e.thread, e.time_range.start * 1e-6, e.time_range.end * 1e-6))
    return out


def extract_timeline(events: Sequence[tuple[str, int, float, float]]) -> list[dict]:
    """Split profiler events ``(name, thread, start_s, end_s)`` into steps and measure each.

    Steps are the ``overlap::step`` ranges; the i-th launch range and the i-th done marker of bucket *b* (by
    start time) belong to step i, since every synced step launches every bucket once (a done-callback can run
    a moment after the step's wait returned, so containment would misplace it).

    Returns:
        One dict per step: ``step``, ``forward``, ``backward`` (compute), ``wait``, ``optimizer`` as
        ``(start, end)`` absolute seconds, ``comm`` {bucket: (launch start, done)}, ``gloo`` [(start, end)],
        and ``intervals``: the :class:`Interval` list relative to the step's start.

    Raises:
        ValueError: ranges missing or not nested as the trainer opens them (not a trainer's profile).
    """
    def ranges(name):
        return sorted((s, e) for n, _, s, e in events if n == name)

    steps = ranges(RANGE_STEP)
    if not steps:
        raise ValueError(f"no '{RANGE_STEP}' ranges in the profile: run steps inside record_function('{RANGE_STEP}')")
    launch: dict[int, list[tuple[float, float]]] = {}
    done: dict[int, list[float]] = {}
    ready: dict[int, list[float]] = {}
    pats = [(re.compile(re.escape(RANGE_LAUNCH) + r"(\d+)$"), launch, lambda s, e: (s, e)),
            (re.compile(re.escape(RANGE_DONE) + r"(\d+)$"), done, lambda s, e: s),
            (re.compile(re.escape(RANGE_READY) + r"(\d+)$"), ready, lambda s, e: s)]
    for n, _, s, e in events:
        for pat, into, value in pats:
            if (m := pat.match(n)):
                into.setdefault(int(m.group(1)), []).append(value(s, e))
    for b in launch:
        launch[b].sort()
        done.setdefault(b, []).sort()
        ready.setdefault(b, []).sort()
        if not len(launch[b]) == len(done[b]) == len(ready[b]) == len(steps):
            raise ValueError(f"bucket {b}: {len(ready[b])} ready marks, {len(launch[b])} launches and {len(done[b])} "
                             f"completions for {len(steps)} steps; every profiled step must be a synced step")
    gloo = [(s, e) for n, _, s, e in events if n.startswith("gloo:all_reduce")]

    def inside(name, lo, hi):
        found = [(s, e) for s, e in ranges(name) if s >= lo and e <= hi + 1e-6]
        if not found:
            raise ValueError(f"no '{name}' range inside step ({lo}, {hi})")
        return found[0]

    out = []
    for i, (s0, s1) in enumerate(steps):
        fwd = inside(RANGE_FORWARD, s0, s1)
        bwd = inside(RANGE_BACKWARD, s0, s1)
        wait = inside(RANGE_WAIT, s0, s1)
        opt = inside(RANGE_OPTIMIZER, s0, s1)
        # Backward's compute ends with its last gradient (the last bucket's ready mark), before the last launch.
        last_grad = max(ready[b][i] for b in ready) if ready else bwd[1]
        bwd_compute = (bwd[0], min(last_grad, wait[0], bwd[1]))
        comm = {b: (launch[b][i][0], max(done[b][i], launch[b][i][0])) for b in sorted(launch)}
        g = [(s, e) for s, e in gloo if s0 <= s <= s1]
        rel = [Interval("forward", fwd[0] - s0, fwd[1] - s0), Interval("backward", bwd_compute[0] - s0, bwd_compute[1] - s0),
               Interval("wait", wait[0] - s0, wait[1] - s0), Interval("optimizer", opt[0] - s0, opt[1] - s0)]
        rel += [Interval("comm", a - s0, z - s0, b) for b, (a, z) in comm.items()]
        rel += [Interval("gloo", a - s0, z - s0) for a, z in g]
        out.append({"step": (s0, s1), "forward": fwd, "backward": bwd_compute, "wait": wait, "optimizer": opt,
                    "exposed": wait[1] - bwd_compute[1],
                    "comm": comm, "gloo": g, "intervals": rel})
    return out


def profile_overlap(model: nn.Module, bucket_cap_bytes: int, batch: Sequence[torch.Tensor],
                    loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy, steps: int = 3,
                    warmup: int = 1, lr: float = 0.0, hook: tuple | None = None,
                    process_group: dist.ProcessGroup | None = None) -> OverlapProfile:
    """Run ``warmup`` + ``steps`` training steps of ``model`` wrapped in :class:`BucketedDataParallel` and
    measure the profiled ones. Call it on every rank (inside :func:`commlab.launch`).

    Args:
        model: the replica (wrapped here; its parameters are broadcast from rank 0).
        bucket_cap_bytes: the wrapper's bucket cap in bytes.
        batch: ``(inputs, targets, ...)`` of this rank; ``loss_fn(model(inputs), targets, ...)``.
        steps, warmup: profiled and unprofiled steps (ints >= 1 and >= 0).
        lr: SGD learning rate (default 0: the model does not change, so every step does the same work).
        hook: optional ``(state, hook)`` to register as comm hook.

    Returns:
        :class:`OverlapProfile` of this rank.

    Raises:
        ValueError: bad ``steps``/``warmup``, or anything :class:`BucketedDataParallel` raises.
    """
    checks.integer("steps", steps)
    checks.integer("warmup", warmup, least=0)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    wrapped = BucketedDataParallel(model, bucket_cap_bytes=bucket_cap_bytes, process_group=process_group)
    if hook is not None:
        wrapped.register_comm_hook(*hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(warmup):
        train_step(wrapped, opt, loss_fn, *batch)
    dist.barrier(group=process_group)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=all_threads_config()) as prof:
        for _ in range(steps):
            with record_function(RANGE_STEP):
                train_step(wrapped, opt, loss_fn, *batch)
    per_step = extract_timeline(profiler_events(prof))
    hidden = total = 0.0
    step_s, fwd_s, bwd_s, wait_s, opt_s, comm_s, exposed_s = [], [], [], [], [], [], []
    for st in per_step:
        comm = list(st["comm"].values())
        u = union_length(comm)
        hidden += intersection_length(comm, st["backward"])
        total += u
        comm_s.append(u)
        exposed_s.append(st["exposed"])
        for lst, key in ((step_s, "step"), (fwd_s, "forward"), (bwd_s, "backward"), (wait_s, "wait"),
                         (opt_s, "optimizer")):
            lst.append(st[key][1] - st[key][0])
    med = statistics.median
    return OverlapProfile(rank=dist.get_rank(), world_size=dist.get_world_size(process_group),
                          bucket_cap_bytes=bucket_cap_bytes, bucket_nbytes=tuple(b.nbytes for b in wrapped.buckets),
                          steps=steps, step_s=med(step_s), forward_s=med(fwd_s), backward_s=med(bwd_s),
                          wait_s=med(wait_s), optimizer_s=med(opt_s), comm_s=med(comm_s),
                          exposed_comm_s=med(exposed_s),
                          overlap_fraction=hidden / total if total > 0 else 0.0,
                          timeline=tuple(per_step[-1]["intervals"]))


def random_batch(widths: Sequence[int], batch_size: int, seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch: inputs ``(batch_size, widths[0])`` normal, class targets in ``range(widths[-1])``."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(batch_size, widths[0], generator=g),
            torch.randint(0, widths[-1], (batch_size,), generator=g))


#: The traced DP step of chapter 13b, lab 13b and the overlap checker's test: big layers last, so that with overlap on
#: their 24 MiB of gradients leave first and travel under the small layers' backward.
TRACE_WIDTHS = (16, 64, 64, 2048, 2048, 1024)
#: Seconds each layer's backward of the traced step also waits without the CPU (:class:`DeviceTime`).
DEVICE_S = 0.04


class DeviceTime(torch.autograd.Function):
    """Identity forward; a backward that waits ``seconds`` without using the CPU, as a GPU's kernels would leave it
    to gloo. On two loaded cores a CPU-bound backward and gloo's overlapped AllReduce slow each other down, and a
    comparison of overlap on and off would measure the load instead."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _WithDeviceTime(nn.Module):
    def __init__(self, layer: nn.Module, seconds: float):
        super().__init__()
        self.layer, self.seconds = layer, seconds

    def forward(self, x):
        return DeviceTime.apply(self.layer(x), self.seconds)


def with_device_time(model: nn.Sequential, seconds: float) -> nn.Sequential:
    """``model`` with every ``nn.Linear`` wrapped so that its backward also waits ``seconds`` (:class:`DeviceTime`);
    the parameters are the same objects. Raises ValueError for ``seconds`` < 0."""
    checks.number("seconds", seconds, least=0)
    return nn.Sequential(*(_WithDeviceTime(m, seconds) if isinstance(m, nn.Linear) else m for m in model))


def trace_dp_step(directory: str, widths: Sequence[int] = TRACE_WIDTHS, device_s: float = DEVICE_S,
                  batch_size: int = 16) -> dict[str, tuple[str, int]]:
    """Inside a launched rank: one warm-up step, then one profiled step (``RANGE_STEP``, gloo's threads included) of
    :func:`make_mlp` ``(widths)`` under :func:`with_device_time`, with overlap ``"on"`` (buckets of at most 1 MiB,
    launched during backward) and ``"off"`` (one bucket, launched when backward ends).

    Returns:
        ``{"on"|"off": (path of this rank's Chrome trace in directory, number of buckets)}``.
    """
    x, y = random_batch(widths, batch_size, 0, dist.get_rank())
    out = {}
    for overlap, cap in (("on", 2 ** 20), ("off", 10 ** 9)):
        model = with_device_time(make_mlp(widths), device_s)
        dp = BucketedDataParallel(model, bucket_cap_bytes=cap)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        train_step(dp, opt, nn.functional.cross_entropy, x, y)   # warm-up
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], experimental_config=all_threads_config()) as prof:
            dist.barrier()   # the ranks start the step together: a peer's lateness is not measured
            with record_function(RANGE_STEP):
                train_step(dp, opt, nn.functional.cross_entropy, x, y)
        path = os.path.join(directory, f"{overlap}.rank{dist.get_rank()}.json")
        prof.export_chrome_trace(path)
        out[overlap] = (path, len(dp.buckets))
    return out


def _profile_rank(widths, batch_size, caps, steps, warmup, seed):
    batch = random_batch(widths, batch_size, seed, dist.get_rank())
    return [profile_overlap(make_mlp(widths, seed=seed), cap, batch, steps=steps, warmup=warmup) for cap in caps]


def measure_overlap(world_size: int, bucket_caps: Sequence[int], widths: Sequence[int] = MEASURE_WIDTHS,
                    batch_size: int = 64, steps: int = 3, warmup: int = 1, seed: int = 0,
                    timeout: float = 120.0) -> list[list[OverlapProfile]]:
    """Profile :func:`make_mlp` ``(widths)`` on ``world_size`` gloo ranks for each bucket cap in turn.

    Returns:
        ``result[rank][i]``: the :class:`OverlapProfile` of ``bucket_caps[i]`` on that rank.
    """
    from commlab.launch import launch

    return launch(_profile_rank, world_size, tuple(widths), batch_size, list(bucket_caps), steps, warmup, seed,
                  timeout=timeout)


def overlap_from_step(times) -> tuple[float, float, float]:
    """Overlap of one step from the trainer's own clock marks (the host clock on the CPU, CUDA events on a
    GPU), without the profiler.

    Same definitions as the profile: B = [backward() called, last gradient arrived], U = union over buckets
    of [launch, done], exposed = [last gradient, end of the wait]. Used by the benchmark, where the profiler's own cost would distort the step times.

    Args:
        times: a :class:`commlab.overlap.StepTimes` of a synced step.

    Returns:
        ``(overlap_fraction, comm_s, exposed_s)``: |U ∩ B| / |U|, |U|, and the exposed seconds.

    Raises:
        ValueError: the step has no record (not a :class:`BucketedDataParallel` step) or a bucket without times.
    """
    rec = times.record
    if rec is None or rec.wait_start_s is None:
        raise ValueError("this step has no bucket record: it was not a synced BucketedDataParallel step")
    comm = []
    for b in rec.buckets:
        if b.launch_s is None or b.done_s is None:
            raise ValueError(f"bucket {b.index} has no launch/done time")
        comm.append((b.launch_s, max(b.done_s, b.launch_s)))
    u = union_length(comm)
    last_grad = min(max(b.ready_s for b in rec.buckets), rec.wait_start_s)
    hidden = intersection_length(comm, (times.forward_end_s, last_grad))
    return (hidden / u if u > 0 else 0.0), u, rec.wait_end_s - last_grad
