"""Data parallelism inside a DP group: gradient averaging (optionally compressed) and ZeRO-1.

On a 3D mesh (TP x PP x DP) the ranks that hold the *same* parameters are the ones with the same pipeline
stage and tensor-parallel shard: they form one DP group, and a gradient is averaged over that group
only. Every function here takes that group explicitly (DESIGN.md, layer 5); nothing reads a global
process-group manager. Build the groups with :mod:`commlab.parallel.mesh` or ``dist.new_group``.

:func:`sync_gradients` flattens the gradients into buckets, sums each bucket over the DP group and
divides by the group size:

* without a compressor, with commlab's ring AllReduce (:func:`commlab.collectives.ring_all_reduce`):
  ``2 (N-1)/N`` of the gradient's bytes sent per rank;
* with a compressor, with :func:`commlab.compress.aggregate`, which all-reduces linear payloads and
  all-gathers the others, optionally with error feedback. The *compressed* payload is what travels.

The source article's ``Hybrid3DCommunicator.sync_gradients`` (§4.3) computes ``compressed =
compressor.compress(grad)`` and then all-reduces the uncompressed ``grad``: the compression costs time and
saves nothing, and the error-feedback state (if any) records a residual that was never withheld. It also
all-gathers each gradient over the TP group afterwards; a tensor-parallel parameter's gradient is already
the gradient of the local shard, so that step would turn a shard's gradient into a full-size tensor that
no longer matches the shard it belongs to. Here the payload is aggregated, and TP is left alone.

:class:`ZeroOneOptimizer` is ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory optimizations toward
training trillion parameter models", SC'20, §5.1, P_os): each of the N ranks keeps the optimizer state
(Adam's two moments) of 1/N of the parameters only. A step reduce-scatters the gradient (each rank gets
the sum of its shard), updates its shard, and all-gathers the parameters: the bytes of one AllReduce,
``2 (N-1)/N`` of the parameters' bytes, with 1/N of the optimizer memory (ZeRO §7.1 counts the same volume).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from commlab.collectives import (ring_all_gather, ring_all_reduce, ring_bytes_sent_per_rank,
                                 ring_reduce_scatter)
from commlab.collectives._common import group_size_and_rank
from commlab.compress import Compressor, ErrorFeedback, aggregate

__all__ = ["SyncStats", "sync_gradients", "ZeroStepStats", "ZeroOneOptimizer"]


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """Bytes of one :func:`sync_gradients` call, on this rank.

    Attributes:
        group_size: N, ranks in the DP group.
        dense_nbytes: bytes of the flat gradient (all buckets, uncompressed).
        payload_nbytes: bytes this rank put into the collective: ``dense_nbytes`` without a compressor, the
            compressed payloads' bytes with one.
        bytes_sent_per_rank: bytes this rank sends in the collectives (ring model; see
            :func:`commlab.compress.aggregate` for the compressed paths). 0 when N = 1.
        buckets: number of buckets.
        path: ``"all_reduce"`` (dense, or a linear compressor), ``"all_gather"`` (non-linear compressor) or
            ``"none"`` (N = 1: nothing to do).
    """

    group_size: int
    dense_nbytes: int
    payload_nbytes: int
    bytes_sent_per_rank: float
    buckets: int
    path: str


def _grad_params(model_or_params) -> list[nn.Parameter]:
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    params = [p for p in params if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"the parameters have several dtypes {sorted(str(d) for d in dtypes)}; flat buckets need "
                         "one dtype (sync each dtype's parameters in a separate call)")
    return params


def _flat(tensors: list[torch.Tensor], params: list[nn.Parameter], pad_to: int = 0) -> torch.Tensor:
    """Concatenate (a None entry = zeros of its parameter's shape), zero-padded to ``pad_to`` elements."""
    parts = [(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(tensors, params)]
    total = sum(x.numel() for x in parts)
    if pad_to > total:
        parts.append(torch.zeros(pad_to - total, dtype=params[0].dtype, device=params[0].device))
    return torch.cat(parts) if parts else torch.zeros(0)


def _bucket_bounds(numel: int, element_size: int, bucket_nbytes: int | None) -> list[tuple[int, int]]:
    if bucket_nbytes is None or numel == 0:
        return [(0, numel)]
    per = max(1, bucket_nbytes // element_size)
    return [(a, min(a + per, numel)) for a in range(0, numel, per)]


def sync_gradients(model: nn.Module | Iterable[nn.Parameter], dp_group: dist.ProcessGroup | None,
                   compressor: Compressor | None = None, error_feedback: ErrorFeedback | None = None, *,
                   bucket_nbytes: int | None = None, key: str = "dp") -> SyncStats:
    """Replace every gradient by its average over the DP group (and only that group).

    Call after ``backward()`` and before ``optimizer.step()`` on every rank of ``dp_group``, with the same
    model structure on each (the same pipeline stage and TP shard).

    Args:
        model: a module, or an iterable of parameters; parameters with ``requires_grad`` False are skipped,
            a missing ``.grad`` counts as zeros (and is filled in), so every rank sends the same size.
        dp_group: the data-parallel group (None: the default group).
        compressor: optional :class:`commlab.compress.Compressor`; the compressed payload is aggregated with
            :func:`commlab.compress.aggregate` on ``dp_group``.
        error_feedback: optional :class:`commlab.compress.ErrorFeedback` wrapping ``compressor`` (if
            ``compressor`` is None, the wrapped one is used). Residuals are kept per bucket under
            ``f"{key}/{bucket index}"``, so keep the bucket layout fixed between steps.
        bucket_nbytes: split the flat gradient into buckets of at most this many bytes (None: one bucket).
            Smaller buckets cost one latency each; DDP's default is 25 MiB.
        key: prefix of the error-feedback keys (distinct per model when one ErrorFeedback serves several).

    Returns:
        :class:`SyncStats` (bytes of this call). The averaged gradients are written into ``.grad``; every
        rank of the group then holds the same gradients (exactly, for the dense and the all-gather paths).

    Raises:
        ValueError: parameters of several dtypes, ``bucket_nbytes`` < 1, or ``error_feedback`` wrapping a
            different compressor than ``compressor``.
        CollectiveMismatchError: the ranks' gradients differ in size (different models), on every rank.
        RuntimeError: this rank is not in ``dp_group``.
    """
    if bucket_nbytes is not None and bucket_nbytes < 1:
        raise ValueError(f"bucket_nbytes must be >= 1 or None, got {bucket_nbytes!r}")
    if compressor is None and error_feedback is not None:
        compressor = error_feedback.compressor
    n, _ = group_size_and_rank(dp_group)
    params = _grad_params(model)
    flat = _flat([p.grad for p in params], params)
    dense_nbytes = flat.numel() * flat.element_size()
    bounds = _bucket_bounds(flat.numel(), flat.element_size(), bucket_nbytes)
    if n == 1:
        # Nothing to average; the stats say so instead of pretending to communicate.
        return SyncStats(1, dense_nbytes, 0, 0.0, len(bounds), "none")

    payload_nbytes, sent, path = 0, 0.0, "all_reduce"
    averaged = torch.empty_like(flat)
    for i, (a, b) in enumerate(bounds):
        bucket = flat[a:b]
        if compressor is None:
            total = ring_all_reduce(bucket, dp_group)
            payload_nbytes += bucket.numel() * bucket.element_size()
            sent += ring_bytes_sent_per_rank(bucket.numel() * bucket.element_size(), n, "all_reduce")
        else:
            # The payload, not the raw gradient, goes over the wire (the source article's bug, §4.3).
            agg = aggregate(bucket, compressor, dp_group, error_feedback=error_feedback,
                            key=f"{key}/{i}" if error_feedback is not None else None)
            total, path = agg.sum, agg.path
            payload_nbytes += agg.payload_nbytes
            sent += agg.bytes_sent_per_rank
        averaged[a:b] = total / n
    offset = 0
    with torch.no_grad():
        for p in params:
            new = averaged[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = new.clone()
            else:
                p.grad.copy_(new)
            offset += p.numel()
    return SyncStats(n, dense_nbytes, payload_nbytes, sent, len(bounds), path)


@dataclasses.dataclass(frozen=True)
class ZeroStepStats:
    """Bytes of one :meth:`ZeroOneOptimizer.step`, on this rank (ring model, padded sizes).

    Attributes:
        reduce_scatter_nbytes: sent in the gradient ReduceScatter, ``(N-1)/N * padded gradient bytes``.
        all_gather_nbytes: sent in the parameter AllGather, ``(N-1)/N * padded parameter bytes``.
        bytes_sent_per_rank: their sum, the same as one ring AllReduce of the gradient.
    """

    reduce_scatter_nbytes: float
    all_gather_nbytes: float

    @property
    def bytes_sent_per_rank(self) -> float:
        return self.reduce_scatter_nbytes + self.all_gather_nbytes


class ZeroOneOptimizer:
    """ZeRO stage 1: an optimizer whose state is sharded across the DP group.

    The parameters are viewed as one flat vector, zero-padded to a multiple of N and cut into N equal
    shards; group rank r owns shard r. Each rank keeps a float copy of its shard as the inner optimizer's
    only parameter, so the optimizer state (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum) exists
    for 1/N of the model on each rank. :meth:`step`:

    1. flattens the local gradients and ring-ReduceScatters them over ``dp_group``; rank r receives the
       sum of shard r, divided by N (the average, as in :func:`sync_gradients`);
    2. steps the inner optimizer on its shard;
    3. ring-AllGathers the shards and writes the updated values into every parameter.

    Element-wise optimizers (SGD, momentum, Adam, AdamW) then give the same parameters as the unsharded
    optimizer after an AllReduce-average, up to the rounding of the gradient sum (different chunking
    changes the summation order). Anything that needs the whole gradient (global-norm clipping, LAMB's
    per-tensor trust ratio) is not element-wise and is not supported.

    Args:
        params: the model's parameters (``requires_grad`` ones are used; one dtype and device), the same
            structure on every rank of the group and equal values (as after a broadcast).
        dp_group: the data-parallel group (None: the default group).
        optimizer_cls: a ``torch.optim.Optimizer`` class, built as ``optimizer_cls([shard], **kwargs)``.
        **optimizer_kwargs: e.g. ``lr=1e-3``.

    Attributes:
        shard: this rank's master copy of its shard (a 1-D ``nn.Parameter`` of ``padded_numel / N`` elements).
        inner: the inner optimizer over ``shard``.
        numel, padded_numel: parameters in total, and after padding to a multiple of N.
        last_step: :class:`ZeroStepStats` of the latest step (None before the first).

    Raises:
        ValueError: no parameters, or parameters of several dtypes or devices.
        RuntimeError: this rank is not in ``dp_group``.
    """

    def __init__(self, params: Iterable[nn.Parameter], dp_group: dist.ProcessGroup | None,
                 optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam, **optimizer_kwargs):
        self.params = _grad_params(list(params))
        if not self.params:
            raise ValueError("ZeroOneOptimizer needs at least one parameter with requires_grad=True")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"ZeroOneOptimizer needs all parameters on one device, got {sorted(map(str, devices))}")
        self.group = dp_group
        self.n, self.group_rank = group_size_and_rank(dp_group)
        self.numel = sum(p.numel() for p in self.params)
        # Padding to a multiple of N makes every shard the same size, which the ring AllGather requires.
        self.padded_numel = math.ceil(self.numel / self.n) * self.n
        self.shard_numel = self.padded_numel // self.n
        start = self.group_rank * self.shard_numel
        with torch.no_grad():
            flat = _flat([p.detach() for p in self.params], self.params, self.padded_numel)
        self.shard = nn.Parameter(flat[start:start + self.shard_numel].clone())
        self.inner = optimizer_cls([self.shard], **optimizer_kwargs)
        self.last_step: ZeroStepStats | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (the shard's gradient is rebuilt every step)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> ZeroStepStats:
        """ReduceScatter the gradients, update this rank's shard, AllGather the parameters.

        The parameters' ``.grad`` keep this rank's local (not averaged) gradient.

        Returns:
            :class:`ZeroStepStats` (also kept as ``last_step``).
        """
        grad = _flat([p.grad for p in self.params], self.params, self.padded_numel)
        nbytes = grad.numel() * grad.element_size()
        shard_grad = ring_reduce_scatter(grad, self.group) / self.n
        self.shard.grad = shard_grad.to(self.shard.dtype)
        self.inner.step()
        full = ring_all_gather(self.shard.detach(), self.group)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.last_step = ZeroStepStats(ring_bytes_sent_per_rank(nbytes, self.n, "reduce_scatter"),
                                       ring_bytes_sent_per_rank(nbytes, self.n, "all_gather"))
        return self.last_step

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held on this rank (tensors in ``inner.state``), about 1/N of unsharded."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))
