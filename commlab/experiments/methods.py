"""Gradient-averaging methods named by short specs, each timing its encode/decode and its communication.

A spec names a method (:func:`parse_spec`): ``dense``, ``cast:fp16``, ``cast:bf16``, ``int:8``, ``int:4``,
``qsgd:4`` (buckets of 512), ``qsgd:4:all`` (one bucket), ``qsgd:4:D``, ``sign`` (one scale for the bucket),
``sign:tensor`` (one scale per parameter tensor), ``topk:0.01``, ``randomk:0.01`` and ``powersgd:R``;
``aggregation`` (:data:`AGGREGATIONS`) is ``"auto"`` or ``"two_phase"``. :func:`make_method` builds a
:class:`Method`, the comm hook (:func:`method_hook`) of a :class:`commlab.overlap.BucketedDataParallel` that
averages each bucket and records per bucket the payload bytes, the bytes sent per rank, ``codec_s`` and
``comm_s``, timed with a :class:`commlab.launch.Clock`. The experiments put the whole gradient in one bucket;
PowerSGD sees each parameter's gradient, as its DDP hook does. :meth:`Method.average` does the same for a
list of tensors; :func:`compressor_for` gives the compressor of a spec.

Book: chapter 8, §8.2 (the experiment).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives import ring_all_reduce, ring_bytes_sent_per_rank
from commlab.compress.aggregate import aggregate, agree_finite
from commlab.compress.error_feedback import ErrorFeedback
from commlab.compress.hooks import AGGREGATIONS  # how payloads are summed: the hook's choices, one list
from commlab.compress.powersgd import PowerSGDCall, PowerSGDState
from commlab.compress.quantize import QSGD_BUCKET_SIZE
# The specs live in layer 4 (commlab.sync reads them too); re-exported here, where chapter 8 imports them.
from commlab.compress.specs import (METHOD_KINDS, OPTIONAL_ARGUMENT, compressor_for, parse_spec,  # noqa: F401
                                    build_compressor as _compressor, qsgd_settings as _qsgd_settings)
from commlab.launch.device import Clock, Mark
from commlab.overlap.bucketed import Bucket, completed_future
from commlab.topology.emulated import EmulatedTopology

__all__ = ["METHOD_KINDS", "AGGREGATIONS", "TWO_PHASE_KINDS", "SYNC_KINDS", "StepComm", "BucketCost", "parse_spec",
           "parse_sync", "describe_sync",
           "check_aggregation", "describe", "payload_tensors", "make_method", "Method", "method_hook",
           "compressor_for"]

#: The spec kinds whose compressors are not linear: those the two-phase AllReduce applies to.
TWO_PHASE_KINDS = ("int", "qsgd", "sign", "topk")


@dataclasses.dataclass(frozen=True)
class StepComm:
    """What one averaging step cost on this rank: bytes (per rank) and seconds."""

    payload_nbytes: int
    bytes_sent_per_rank: float
    codec_s: float
    comm_s: float
    path: str           # "all_reduce", "all_gather", "two_phase" or "powersgd" (two AllReduces: P, then Q)


@dataclasses.dataclass(frozen=True)
class BucketCost:
    """What averaging one bucket cost on this rank: bytes, and clock marks read only when asked.

    Attributes:
        payload_nbytes, bytes_sent_per_rank, path: as in :class:`StepComm`.
        start, end: marks around the whole averaging call.
        codec: ``(start, end)`` marks of every interval inside the compressor (encode, decode; PowerSGD's
            arithmetic between its collectives).
    """

    payload_nbytes: int
    bytes_sent_per_rank: float
    path: str
    start: Mark
    end: Mark
    codec: tuple[tuple[Mark, Mark], ...]

    def codec_s(self, clock: Clock) -> float:
        return sum(clock.elapsed(a, b) for a, b in self.codec)

    def seconds(self, clock: Clock) -> float:
        return clock.elapsed(self.start, self.end)


#: Sync kinds of a run (:func:`parse_sync`) -> how they are written. ``every`` is synchronous data parallelism
#: (the method averages every step's gradient); the others sync less often (:mod:`commlab.sync`).
SYNC_KINDS = {"every": "every", "local": "local:H", "diloco": "diloco:H",
              "streaming": "streaming:H:F:tau:alpha"}


def parse_sync(sync: str) -> tuple[str, tuple]:
    """Split a sync spec into its kind and its numbers: ``"every"`` -> ``("every", ())``; ``"local:H"`` (local SGD,
    parameters averaged every H steps) and ``"diloco:H"`` -> ``(kind, (H,))``; ``"streaming:H:F:tau:alpha"``
    (Streaming DiLoCo: F fragments, each synced every H steps, its outer AllReduce in flight for tau inner steps,
    then mixed in with alpha) -> ``("streaming", (H, F, tau, alpha))``. H >= 1, F divides H, 0 <= tau < H / F
    (:func:`commlab.sync.schedule.check_schedule`), alpha in [0, 1].

    Raises:
        ValueError: an unknown kind, a wrong count of numbers, a number out of range or not in its one spelling
            (``"diloco:010"`` is refused: resume keys must not depend on the spelling).
    """
    if not isinstance(sync, str):
        raise ValueError(f"a sync spec is a string such as 'diloco:10', got {sync!r}")
    kind, _, rest = sync.partition(":")
    if kind not in SYNC_KINDS:
        raise ValueError(f"unknown sync {sync!r}; write one of {', '.join(SYNC_KINDS.values())}")
    parts = rest.split(":") if rest else []
    want = SYNC_KINDS[kind].count(":")
    if len(parts) != want:
        raise ValueError(f"sync {sync!r} must be written {SYNC_KINDS[kind]}")
    if kind == "every":
        return kind, ()
    try:
        ints = [int(x) for x in parts[:3]]
        alpha = float(parts[3]) if kind == "streaming" else 0.0
    except ValueError:
        raise ValueError(f"sync {sync!r}: H, F and tau are ints and alpha a number ({SYNC_KINDS[kind]})") from None
    if [str(i) for i in ints] != parts[:3] or (kind == "streaming" and parts[3] != f"{alpha:g}"):
        canon = ":".join([kind, *map(str, ints)] + ([f"{alpha:g}"] if kind == "streaming" else []))
        raise ValueError(f"sync {sync!r}: write it {canon!r}")
    h = checks.integer("H (inner steps between syncs)", ints[0], where=f"sync {sync!r}")
    if kind != "streaming":
        return kind, (h,)
    from commlab.sync.schedule import check_schedule  # F divides H, tau below H/F: the schedule's own rule

    f, tau = ints[1], ints[2]
    check_schedule(h, f, tau, where=f"sync {sync!r}")
    checks.share("alpha (mixing)", alpha, where=f"sync {sync!r}")
    return kind, (h, f, tau, alpha)


def describe_sync(sync: str, spec: str = "dense", error_feedback: bool = False) -> str:
    """A label for a sync and the compressor of its outer sync: ``"DiLoCo H=10, INT8 Δ"``, ``"local SGD H=10"``,
    ``"Streaming DiLoCo H=10 F=2 τ=1 α=0.5"`` (dense fp32 Δ is left out of the label)."""
    kind, nums = parse_sync(sync)
    if kind == "every":
        return describe(spec, error_feedback)
    if kind == "local":
        return f"local SGD H={nums[0]}"
    base = (f"DiLoCo H={nums[0]}" if kind == "diloco" else
            f"Streaming DiLoCo H={nums[0]} F={nums[1]} τ={nums[2]} α={nums[3]:g}")
    return base if spec == "dense" else f"{base}, {describe(spec, error_feedback)} Δ"


def check_aggregation(spec: str, aggregation: str) -> None:
    """Raise ``ValueError`` unless ``aggregation`` is one of :data:`AGGREGATIONS` and fits ``spec``: two-phase
    applies to the non-linear compressors (:data:`TWO_PHASE_KINDS`); dense, casts and Random-K (shared
    indices) already ride the ring AllReduce, and PowerSGD has its own two AllReduces."""
    kind, _ = parse_spec(spec)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "two_phase" and spec == "sign:tensor":
        raise ValueError(f"method {spec!r} scales each parameter tensor of a bucket, and the two-phase AllReduce "
                         "compresses chunks that cut across them; use 'sign' for two-phase aggregation")
    if aggregation == "two_phase" and kind not in TWO_PHASE_KINDS:
        why = ("has its own two AllReduces (P, then Q)" if kind == "powersgd" else
               "sends nothing compressed" if kind == "dense" else "is linear: its payloads ride the ring AllReduce")
        raise ValueError(f"method {spec!r} {why}; two-phase aggregation is for "
                         f"{', '.join(k + ':...' if METHOD_KINDS[k] else k for k in TWO_PHASE_KINDS)}")


def payload_tensors(spec: str, warm: bool = False) -> int:
    """Tensors in one rank's payload, each summed by its own collective (1 for dense and PowerSGD's two
    AllReduces each; 2 where a scale, norm or index tensor travels beside the values)."""
    kind, _ = parse_spec(spec)
    return 2 if kind in ("int", "qsgd", "sign", "topk") and not warm else 1


def _qsgd_label(arg: str) -> str:
    bits, bucket_size = _qsgd_settings(arg)
    where = {QSGD_BUCKET_SIZE: "", None: ", one bucket"}.get(bucket_size, f", buckets of {bucket_size}")
    return f"QSGD {bits}-bit{where}"


def describe(spec: str, error_feedback: bool = False, warmup_steps: int = 0, aggregation: str = "auto") -> str:
    """A label for tables: ``"Top-K 1% + EF"``, ``"PowerSGD r=4"``, ``"sign + EF, 30 dense steps"``,
    ``"sign (1-bit) + EF, two-phase"`` (error feedback on workers and chunk owners)."""
    kind, arg = parse_spec(spec)
    sign = "sign (1-bit)" if arg is None else "sign (1-bit, per-tensor scale)"
    base = {"dense": "dense fp32", "sign": sign}.get(kind)
    if base is None:
        base = {"cast": lambda a: a.upper() if a == "fp16" else "BF16",
                "int": lambda a: f"INT{a}",
                "qsgd": _qsgd_label,
                "topk": lambda a: f"Top-K {float(a) * 100:g}%",
                "randomk": lambda a: f"Random-K {float(a) * 100:g}%",
                "powersgd": lambda a: f"PowerSGD r={a}"}[kind](arg)
    if kind == "powersgd" and not error_feedback:
        base += " no EF"
    elif kind != "powersgd" and error_feedback:
        base += " + EF"
    if aggregation == "two_phase":
        base += ", two-phase"
    if warmup_steps:
        base += f", {warmup_steps} dense steps"
    return base


class _TimedCompressor:
    """Forwards to a compressor and keeps clock marks around every compress/decompress in ``intervals``."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.name, self.linear, self.clock = inner, inner.name, inner.linear, clock
        self.intervals: list[tuple[Mark, Mark]] = []

    def _timed(self, fn, arg):
        t0 = self.clock.mark()
        try:
            return fn(arg)
        finally:
            self.intervals.append((t0, self.clock.mark()))

    def compress(self, tensor):
        return self._timed(self.inner.compress, tensor)

    def decompress(self, payload):
        return self._timed(self.inner.decompress, payload)


class Method:
    """One rank's averaging state for a spec (build it with :func:`make_method` inside every rank).

    Register it as the comm hook of a :class:`commlab.overlap.BucketedDataParallel` with
    ``wrapped.register_comm_hook(method, method_hook)``: each bucket is then averaged by :meth:`average_bucket`,
    and :attr:`costs` collects one :class:`BucketCost` per bucket until :meth:`take_costs` hands them over.
    :meth:`average` averages a list of tensors directly (one step). The first ``warmup_steps`` steps average
    densely (commlab's ring AllReduce), as PowerSGD's ``start_iter`` does; a step ends at the last bucket.
    With ``aggregation="two_phase"`` the compressed steps run the two-phase AllReduce, with worker and owner
    error feedback when ``error_feedback``.

    Attributes:
        clock: the :class:`commlab.launch.Clock` of the marks (pass the wrapper's, so that they share its time
            axis). step: steps completed.

    Raises (from averaging):
        FloatingPointError: a NaN/Inf gradient on any rank, raised on every rank before anything is sent.
    """

    def __init__(self, spec: str, error_feedback: bool, warmup_steps: int, seed: int,
                 emulate: EmulatedTopology | None, clock: Clock | None = None, aggregation: str = "auto"):
        self.kind, arg = parse_spec(spec)
        self.spec = spec
        check_aggregation(spec, aggregation)
        self.aggregation = aggregation
        if self.kind == "powersgd" and emulate is not None:
            raise ValueError("PowerSGD runs its AllReduces through dist.all_reduce, which an EmulatedTopology "
                             "cannot delay; measure it without emulate")
        self.warmup_steps, self.emulate, self.step = warmup_steps, emulate, 0
        self.clock = clock if clock is not None else Clock()
        self.compressor = self.ef = self.server_ef = self.powersgd = None
        self.costs: list[BucketCost] = []
        if self.kind == "powersgd":
            # start_iter is handled here (warmup_steps); the state's own counter is used only by the DDP hook.
            self.powersgd = PowerSGDState(rank=int(arg), start_iter=1000, use_error_feedback=error_feedback,
                                          warm_start=True, random_seed=seed)
        elif self.kind != "dense":
            self.compressor = _TimedCompressor(_compressor(self.kind, arg, seed), self.clock)
            self.ef = ErrorFeedback(self.compressor) if error_feedback else None
            if error_feedback and aggregation == "two_phase":
                self.server_ef = ErrorFeedback(self.compressor)

    @property
    def compressing(self) -> bool:
        """Whether the current step compresses (not dense, and past the warm-up)."""
        return self.kind != "dense" and self.step >= self.warmup_steps

    def average(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], StepComm]:
        """Average ``grads`` (this rank's tensors) over the world as one step; returns the averages and the cost.

        Reads the step's times at once (on a GPU that waits for the work); training uses :func:`method_hook`.
        """
        if self.kind == "powersgd" and self.compressing:
            avg, cost = self._powersgd(list(grads), list(range(len(grads))), None)
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._set_segments(grads)
            total, cost = self._flat_sum(flat, "flat")
            avg = (total / dist.get_world_size()).split([g.numel() for g in grads])
            avg = [a.view_as(g) for a, g in zip(avg, grads)]
        self.step += 1
        codec = cost.codec_s(self.clock)
        return avg, StepComm(cost.payload_nbytes, cost.bytes_sent_per_rank, codec,
                             cost.seconds(self.clock) - codec, cost.path)

    def average_bucket(self, bucket: Bucket) -> torch.Tensor:
        """The average over the world of one bucket (a flat tensor of the bucket's length); records its cost."""
        if self.kind == "powersgd" and self.compressing:
            grads = bucket.gradients()
            # Written into the bucket's own views: the future's value is then the bucket's buffer.
            _, cost = self._powersgd(grads, [(bucket.index(), j) for j in range(len(grads))], grads)
            result = bucket.buffer()
        else:
            # One error-feedback residual per bucket (the buckets of a step differ in size).
            key = "flat" if bucket.index() == 0 else f"flat/{bucket.index()}"
            self._set_segments(bucket.gradients())
            total, cost = self._flat_sum(bucket.buffer(), key)
            result = total / dist.get_world_size()
        self.costs.append(cost)
        if bucket.is_last():
            self.step += 1
        return result

    def _set_segments(self, grads: Sequence[torch.Tensor]) -> None:
        """``sign:tensor``: one scale per tensor of the flat buffer about to be compressed."""
        if self.spec == "sign:tensor":
            self.compressor.inner.segments = [g.numel() for g in grads]

    def take_costs(self) -> list[BucketCost]:
        """The :class:`BucketCost` of every bucket averaged since the last call (one step's, in training)."""
        costs, self.costs = self.costs, []
        return costs

    def _flat_sum(self, flat: torch.Tensor, key: str) -> tuple[torch.Tensor, BucketCost]:
        """The sum over ranks of ``flat`` (dense, or through the compressor; ``key`` names its residual), and its
        cost."""
        n = dist.get_world_size()
        t0 = self.clock.mark()
        if not self.compressing:
            agree_finite(flat, None, f"step {self.step}: training diverged (lower the learning rate)")
            total = ring_all_reduce(flat, check=False, emulate=self.emulate)
            nbytes = flat.numel() * flat.element_size()
            return total, BucketCost(nbytes, ring_bytes_sent_per_rank(nbytes, n, "all_reduce"), "all_reduce",
                                     t0, self.clock.mark(), ())
        self.compressor.intervals = []
        out = aggregate(flat, self.compressor, error_feedback=self.ef, key=key if self.ef else None,
                        emulate=self.emulate, path="two_phase" if self.aggregation == "two_phase" else "auto",
                        server_error_feedback=self.server_ef)
        return out.sum, BucketCost(out.payload_nbytes, out.bytes_sent_per_rank, out.path, t0, self.clock.mark(),
                                   tuple(self.compressor.intervals))

    def _powersgd(self, grads: list[torch.Tensor], keys: list[Hashable], out):
        # The three stages of a PowerSGD call, marked apart: what runs between the collectives is encode/decode.
        clock = self.clock
        t0 = clock.mark()
        call = PowerSGDCall(grads, self.powersgd, dist.group.WORLD, keys, out)
        futs = call.start()
        t1 = clock.mark()
        for f in futs:
            f.wait()
        t2 = clock.mark()
        fut = call.middle()
        t3 = clock.mark()
        fut.wait()
        t4 = clock.mark()
        result = call.finish()
        t5 = clock.mark()
        b = self.powersgd.last_nbytes
        n = dist.get_world_size()
        # The collectives were launched inside start()/middle(), so part of their time may count as codec; on
        # gloo the launch returns at once and the work shows up in the waits.
        return result, BucketCost(b.total_nbytes, ring_bytes_sent_per_rank(b.total_nbytes, n, "all_reduce"),
                                  "powersgd", t0, t5, ((t0, t1), (t2, t3), (t4, t5)))


def method_hook(method: Method, bucket: Bucket) -> torch.futures.Future:
    """Comm hook (``BucketedDataParallel.register_comm_hook(method, method_hook)``): average the bucket with
    ``method``, synchronously, on the autograd thread, and return a completed future of the average."""
    return completed_future(method.average_bucket(bucket))


def make_method(spec: str, error_feedback: bool = False, warmup_steps: int = 0, seed: int = 0,
                emulate: EmulatedTopology | None = None, clock: Clock | None = None,
                aggregation: str = "auto") -> Method:
    """A :class:`Method` for ``spec`` (the specs: :func:`parse_spec`).

    Args:
        spec: e.g. ``"topk:0.01"``.
        error_feedback: wrap the compressor in :class:`~commlab.compress.ErrorFeedback` (for PowerSGD: its
            own residuals, ``use_error_feedback``); ignored by ``dense``.
        warmup_steps: dense steps before compression starts (>= 0).
        seed: seeds Random-K's shared indices, QSGD's rounding and PowerSGD's initial Q (same on every rank).
        emulate: an emulated slow link that delays the payloads (not for PowerSGD).
        clock: the clock of the method's time marks (default: the host clock).
        aggregation: ``"auto"`` or ``"two_phase"`` (:func:`check_aggregation`).

    Raises:
        ValueError: a bad spec, a negative ``warmup_steps``, PowerSGD with ``emulate``, or an aggregation that
            does not apply to the spec.
    """
    checks.integer("warmup_steps", warmup_steps, least=0)
    kind, _ = parse_spec(spec)
    return Method(spec, bool(error_feedback) and kind != "dense", warmup_steps, seed, emulate, clock, aggregation)
