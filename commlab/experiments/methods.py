"""Gradient-averaging methods named by short specs, each timing its encode/decode and its communication.

A *spec* names a method: ``dense`` (commlab's ring AllReduce of the float32 gradient), ``cast:fp16``,
``cast:bf16``, ``int:8``, ``int:4`` (:class:`~commlab.compress.quantize.RoundingQuantizer`), ``qsgd:4``
(QSGD with 4-bit codes), ``sign``, ``topk:0.01``, ``randomk:0.01`` (share kept) and ``powersgd:R`` (rank R).
A method averages one rank's list of gradients over the group and reports, for that step, the payload
bytes, the bytes sent per rank, and two timings:

* ``codec_s``: seconds inside the compressor's ``compress`` and ``decompress`` (for PowerSGD, the matrix
  products, orthogonalisation and error-feedback arithmetic between its two AllReduces),
* ``comm_s``: the rest of the averaging call: the collectives (and, for the compressors that
  :func:`commlab.compress.aggregate` handles, its two small agreement collectives and the error-feedback
  bookkeeping).

The compressors of :func:`commlab.compress.aggregate` see the whole flattened gradient as one tensor
(so Top-K is a global selection, as in chapter 5); PowerSGD sees each parameter's gradient, as its
DDP hook does (matrices compressed, vectors sent whole).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
import torch.distributed as dist

from commlab.collectives import ring_all_reduce, ring_bytes_sent_per_rank
from commlab.compress.aggregate import aggregate, agree_finite
from commlab.compress.cast import CastCompressor
from commlab.compress.error_feedback import ErrorFeedback
from commlab.compress.powersgd import PowerSGDState, _Call
from commlab.compress.quantize import QSGD, RoundingQuantizer
from commlab.compress.sign import SignCompressor
from commlab.compress.sparse import RandomK, TopK
from commlab.topology.emulated import EmulatedTopology

__all__ = ["METHOD_KINDS", "StepComm", "parse_spec", "describe", "payload_tensors", "make_method", "Method"]

#: Spec prefix -> what its argument means.
METHOD_KINDS = {"dense": None, "cast": "fp16 or bf16", "int": "bits (8 or 4)", "qsgd": "bits (2, 4 or 8)",
                "sign": None, "topk": "share kept in (0, 1]", "randomk": "share kept in (0, 1]",
                "powersgd": "rank >= 1"}


@dataclasses.dataclass(frozen=True)
class StepComm:
    """What one averaging step cost on this rank: bytes (per rank) and seconds."""

    payload_nbytes: int
    bytes_sent_per_rank: float
    codec_s: float
    comm_s: float
    path: str           # "all_reduce", "all_gather" or "powersgd" (two AllReduces: P, then Q)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split ``"kind:arg"`` and validate it.

    Raises:
        ValueError: unknown kind, a missing or superfluous argument, or an argument out of range.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a method spec is a string such as 'topk:0.01', got {spec!r}")
    kind, sep, arg = spec.partition(":")
    if sep and not arg:
        raise ValueError(f"method {spec!r} ends with ':' but has no argument")
    if arg != arg.strip():
        raise ValueError(f"method {spec!r}: no spaces around the argument")
    if kind not in METHOD_KINDS:
        raise ValueError(f"unknown method {spec!r}; kinds: {', '.join(f'{k}:<{v}>' if v else k for k, v in METHOD_KINDS.items())}")
    if (METHOD_KINDS[kind] is None) != (arg == ""):
        want = f"{kind}:<{METHOD_KINDS[kind]}>" if METHOD_KINDS[kind] else kind
        raise ValueError(f"method {spec!r} must be written {want}")
    try:
        if kind == "cast" and arg not in ("fp16", "bf16"):
            raise ValueError
        if kind == "int" and arg not in ("8", "4"):
            raise ValueError
        if kind == "qsgd" and arg not in ("2", "4", "8"):
            raise ValueError
        if kind in ("topk", "randomk") and not 0 < float(arg) <= 1:
            raise ValueError
        if kind == "powersgd" and int(arg) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"method {spec!r}: the argument of {kind} must be {METHOD_KINDS[kind]}") from None
    # One spelling per method, so that labels and resume keys do not depend on it ("powersgd:02", "topk:0.010").
    if kind == "powersgd" and arg != str(int(arg)):
        raise ValueError(f"method {spec!r}: write it 'powersgd:{int(arg)}'")
    if kind in ("topk", "randomk") and arg not in (f"{float(arg):g}", repr(float(arg))):
        raise ValueError(f"method {spec!r}: write it '{kind}:{float(arg):g}'")
    return kind, arg or None


def payload_tensors(spec: str, warm: bool = False) -> int:
    """Tensors in one rank's payload, each summed by its own collective (1 for dense and PowerSGD's two
    AllReduces each; 2 where a scale, norm or index tensor travels beside the values)."""
    kind, _ = parse_spec(spec)
    return 2 if kind in ("int", "qsgd", "sign", "topk") and not warm else 1


def describe(spec: str, error_feedback: bool = False, warmup_steps: int = 0) -> str:
    """A label for tables: ``"Top-K 1% + EF"``, ``"PowerSGD r=4"``, ``"sign + EF, 30 dense steps"``."""
    kind, arg = parse_spec(spec)
    base = {"dense": "dense fp32", "sign": "sign (1-bit)"}.get(kind)
    if base is None:
        base = {"cast": lambda a: a.upper() if a == "fp16" else "BF16",
                "int": lambda a: f"INT{a}",
                "qsgd": lambda a: f"QSGD {a}-bit",
                "topk": lambda a: f"Top-K {float(a) * 100:g}%",
                "randomk": lambda a: f"Random-K {float(a) * 100:g}%",
                "powersgd": lambda a: f"PowerSGD r={a}"}[kind](arg)
    if kind == "powersgd" and not error_feedback:
        base += " no EF"
    elif kind != "powersgd" and error_feedback:
        base += " + EF"
    if warmup_steps:
        base += f", {warmup_steps} dense steps"
    return base


class _TimedCompressor:
    """Forwards to a compressor and adds the seconds spent in compress/decompress to ``seconds``."""

    def __init__(self, inner):
        self.inner, self.name, self.linear, self.seconds = inner, inner.name, inner.linear, 0.0

    def _timed(self, fn, arg):
        t0 = time.perf_counter()
        try:
            return fn(arg)
        finally:
            self.seconds += time.perf_counter() - t0

    def compress(self, tensor):
        return self._timed(self.inner.compress, tensor)

    def decompress(self, payload):
        return self._timed(self.inner.decompress, payload)


def _compressor(kind: str, arg: str | None, seed: int):
    if kind == "cast":
        return CastCompressor(torch.float16 if arg == "fp16" else torch.bfloat16)
    if kind == "int":
        return RoundingQuantizer(bits=int(arg))
    if kind == "qsgd":
        return QSGD(bits=int(arg), seed=seed)
    if kind == "sign":
        return SignCompressor()
    if kind == "topk":
        return TopK(ratio=float(arg))
    return RandomK(ratio=float(arg), seed=seed)


class Method:
    """One rank's averaging state for a spec (build it with :func:`make_method` inside every rank).

    :meth:`average` takes the gradients of this rank (a list of tensors, the model's parameter order) and
    returns their average over the group plus a :class:`StepComm`. The first ``warmup_steps`` calls
    average densely (commlab's ring AllReduce), as PowerSGD's ``start_iter`` does.

    Raises (from :meth:`average`):
        FloatingPointError: a NaN/Inf gradient on any rank, raised on every rank before anything is sent.
    """

    def __init__(self, spec: str, error_feedback: bool, warmup_steps: int, seed: int,
                 emulate: EmulatedTopology | None):
        self.kind, arg = parse_spec(spec)
        if self.kind == "powersgd" and emulate is not None:
            raise ValueError("PowerSGD runs its AllReduces through dist.all_reduce, which an EmulatedTopology "
                             "cannot delay; measure it without emulate")
        self.warmup_steps, self.emulate, self.step = warmup_steps, emulate, 0
        self.compressor = self.ef = self.powersgd = None
        if self.kind == "powersgd":
            # start_iter is handled here (warmup_steps); the state's own counter is used only by the DDP hook.
            self.powersgd = PowerSGDState(rank=int(arg), start_iter=1000, use_error_feedback=error_feedback,
                                          warm_start=True, random_seed=seed)
        elif self.kind != "dense":
            self.compressor = _TimedCompressor(_compressor(self.kind, arg, seed))
            self.ef = ErrorFeedback(self.compressor) if error_feedback else None

    def average(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], StepComm]:
        n = dist.get_world_size()
        dense = self.kind == "dense" or self.step < self.warmup_steps
        self.step += 1
        t0 = time.perf_counter()
        if self.kind == "powersgd" and not dense:
            return self._powersgd(grads, n, t0)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dense:
            agree_finite(flat, None, f"step {self.step - 1}: training diverged (lower the learning rate)")
            total = ring_all_reduce(flat, check=False, emulate=self.emulate)
            nbytes = flat.numel() * flat.element_size()
            comm = StepComm(nbytes, ring_bytes_sent_per_rank(nbytes, n, "all_reduce"), 0.0,
                            time.perf_counter() - t0, "all_reduce")
        else:
            self.compressor.seconds = 0.0
            out = aggregate(flat, self.compressor, error_feedback=self.ef, key="flat" if self.ef else None,
                            emulate=self.emulate)
            total, codec = out.sum, self.compressor.seconds
            comm = StepComm(out.payload_nbytes, out.bytes_sent_per_rank, codec,
                            time.perf_counter() - t0 - codec, out.path)
        avg = total / n
        return [a.view_as(g) for a, g in zip(avg.split([g.numel() for g in grads]), grads)], comm

    def _powersgd(self, grads, n, t0):
        # The three stages of a PowerSGD call, timed apart: what runs between the collectives is encode/decode.
        call = _Call(list(grads), self.powersgd, dist.group.WORLD, list(range(len(grads))), None)
        codec = 0.0
        futs = call.start()
        t1 = time.perf_counter()
        codec += t1 - t0
        for f in futs:
            f.wait()
        t2 = time.perf_counter()
        fut = call.middle()
        t3 = time.perf_counter()
        codec += t3 - t2
        fut.wait()
        t4 = time.perf_counter()
        out = call.finish()
        t5 = time.perf_counter()
        codec += t5 - t4
        b = self.powersgd.last_nbytes
        # The collectives were launched inside start()/middle(), so part of their time may count as codec; on
        # gloo the launch returns at once and the work shows up in the waits.
        return out, StepComm(b.total_nbytes, ring_bytes_sent_per_rank(b.total_nbytes, n, "all_reduce"), codec,
                             (t5 - t0) - codec, "powersgd")


def make_method(spec: str, error_feedback: bool = False, warmup_steps: int = 0, seed: int = 0,
                emulate: EmulatedTopology | None = None) -> Method:
    """A :class:`Method` for ``spec`` (see the module docstring).

    Args:
        spec: e.g. ``"topk:0.01"``.
        error_feedback: wrap the compressor in :class:`~commlab.compress.ErrorFeedback` (for PowerSGD: its
            own residuals, ``use_error_feedback``); ignored by ``dense``.
        warmup_steps: dense steps before compression starts (>= 0).
        seed: seeds Random-K's shared indices, QSGD's rounding and PowerSGD's initial Q (same on every rank).
        emulate: an emulated slow link that delays the payloads (not for PowerSGD).

    Raises:
        ValueError: a bad spec, a negative ``warmup_steps``, or PowerSGD with ``emulate``.
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    kind, _ = parse_spec(spec)
    return Method(spec, bool(error_feedback) and kind != "dense", warmup_steps, seed, emulate)
