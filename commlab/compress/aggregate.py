"""Summing compressed tensors over ranks, the way each compressor allows, with exact byte accounting.

* **Linear** compressors (``compressor.linear``: a cast, Random-K with a shared seed): a sum of payloads is
  the payload of the sum, so each payload tensor rides commlab's ring AllReduce
  (:func:`commlab.collectives.ring_all_reduce`, which adds it hop by hop) and is decompressed once.
  Bytes sent per rank: ``2 (N-1)/N * payload bytes``.
* **Non-linear** ones (Top-K, QSGD, INT8/INT4, sign): payloads cannot be added (different indices,
  different scales), so they are all-gathered and every rank decompresses all N and sums them.
  Bytes sent per rank in a ring AllGather: ``(N-1) * payload bytes``, which grows with N: compression
  that wins at 8 ranks can lose to a dense AllReduce at 512.

The source article passes a dict to ``all_reduce`` and lets Top-K payloads be added inside a ring;
:func:`sparse_ring_fill_in` and :func:`union_support_sizes` put numbers on why that cannot work: every
hop of a ring adds another rank's index set to the partial sum, whose support (and so its sparse size)
grows towards dense.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Sequence

import torch
import torch.distributed as dist

from commlab.collectives import ring_all_gather, ring_all_reduce, ring_bytes_sent_per_rank
from commlab.collectives._common import (SUPPORTED_DTYPES, CollectiveMismatchError, all_gather_single,
                                         group_size_and_rank)
from commlab.compress.base import Compressor, Payload, all_finite
from commlab.compress.error_feedback import ErrorFeedback
from commlab.topology.emulated import EmulatedTopology

__all__ = ["Aggregated", "aggregate", "SparseRingFillIn", "sparse_ring_fill_in", "expected_union_support",
           "union_support_sizes"]


@dataclasses.dataclass(frozen=True)
class Aggregated:
    """Result of :func:`aggregate`.

    Attributes:
        sum: the sum over ranks of each rank's decompressed payload; shape and dtype of the input.
        payload_nbytes: bytes of this rank's payload (equal on every rank; checked).
        bytes_sent_per_rank: bytes each rank sends. ``"all_reduce"``: ``2 (N-1)/N * payload_nbytes`` (the
            ring's figure: exact when N divides every payload tensor's element count, otherwise the mean
            over ranks, since ranks whose own chunk is smaller send slightly more). ``"all_gather"``:
            ``(N-1) * payload_nbytes`` exactly.
        path: ``"all_reduce"`` (linear compressor) or ``"all_gather"``.
    """

    sum: torch.Tensor
    payload_nbytes: int
    bytes_sent_per_rank: float
    path: str


def _describe(payload: Payload, compressor_name: str) -> tuple:
    """What must be identical on every rank for the payloads to be aggregated (picklable, small)."""
    tensors = tuple((name, t.numel(), str(t.dtype).replace("torch.", "")) for name, t in payload.tensors.items())
    meta = tuple(sorted((str(k), repr(v)) for k, v in payload.meta.items()))
    return (compressor_name, tuple(payload.shape), str(payload.dtype).replace("torch.", ""), tensors, meta)


def _agree(payload: Payload, compressor_name: str, group, size: int) -> None:
    """One small all-gather of each rank's payload description; every rank raises the same error on a mismatch."""
    mine = _describe(payload, compressor_name)
    if size == 1:
        return
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) > 1:
        lines = "; ".join(
            f"rank {r}: {d[0]} of shape {list(d[1])} {d[2]}, payload "
            + ", ".join(f"{name}={numel}x{dt}" for name, numel, dt in d[3])
            + (f", meta {{{', '.join(f'{k}: {v}' for k, v in d[4])}}}" if d[4] else "")
            for r, d in enumerate(everyone))
        raise CollectiveMismatchError(
            f"aggregate: the ranks' payloads differ ({lines}). Every rank must compress a tensor of the same "
            "shape and dtype with the same compressor settings (and, for Random-K, call it the same number "
            "of times); payloads whose sizes depend on the data (topk_global) cannot be aggregated this way")


def agree_finite(tensor: torch.Tensor, group, what: str) -> None:
    """Raise the same ``FloatingPointError`` on every rank if any rank's ``tensor`` holds a NaN or an inf.

    One tiny collective before compressing. Without it the rank with the bad gradient raises alone while
    its peers wait in the next collective, or, if the caller skips the step there only, the ranks drift
    one step apart and sum different steps' gradients without any error.
    """
    size, _ = group_size_and_rank(group)
    bad = int(not all_finite(tensor))
    if size == 1:
        flags = [bad]
    else:
        mine = torch.tensor([bad], dtype=torch.int64, device=tensor.device)
        everyone = torch.empty(size, dtype=torch.int64, device=tensor.device)
        all_gather_single(everyone, mine, group=group)
        flags = everyone.tolist()
    if any(flags):
        ranks = [r for r, f in enumerate(flags) if f]
        raise FloatingPointError(f"{what}: rank(s) {ranks} hold NaN or infinite gradient values; nothing was "
                                 "sent. Every rank raises this, so all can skip the step together")


def aggregate(tensor: torch.Tensor, compressor: Compressor, group: dist.ProcessGroup | None = None, *,
              error_feedback: ErrorFeedback | None = None, key: Hashable | None = None,
              emulate: EmulatedTopology | None = None) -> Aggregated:
    """Compress ``tensor`` on every rank and return the sum over ranks of the decompressed tensors.

    Args:
        tensor: this rank's tensor (a gradient); the same shape and dtype on every rank.
        compressor: any :class:`commlab.compress.base.Compressor`; its ``linear`` flag picks the path.
        group: process group (None: the default group).
        error_feedback: an :class:`ErrorFeedback` wrapping ``compressor`` (the same object), to compress
            ``tensor + residual`` and keep the new residual under ``key``.
        key: the residual's name; required with ``error_feedback``.
        emulate: an :class:`~commlab.topology.EmulatedTopology` whose link delays every payload message
            (chapter 8 measures compression on an emulated slow link this way). Both paths then use
            commlab's ring (AllReduce, or AllGather in place of ``dist.all_gather``), whose sends the
            emulation can delay; the small agreement collectives are not delayed.

    Returns:
        :class:`Aggregated` with the sum (input shape and dtype), the payload bytes, the bytes each rank
        sends, and the path taken. The sum of the non-linear path is accumulated in float32 (float64 for
        float64 input) over ranks in rank order, then rounded once to the input dtype, so every rank
        gets the same result.

    Raises:
        ValueError: ``error_feedback`` without ``key``, or wrapping a different compressor.
        CollectiveMismatchError: the ranks' payloads differ in size, dtype or meta (on every rank).
        TypeError: a linear compressor whose payload dtype the ring cannot add.
        FloatingPointError: non-finite input on any rank (the compressors' policy), raised on every rank
            before anything is sent, so that all ranks can skip the step together.
    """
    size, _ = group_size_and_rank(group)
    agree_finite(tensor, group, "aggregate")
    if error_feedback is not None:
        if key is None:
            raise ValueError("aggregate: error_feedback needs a key naming this tensor's residual (e.g. the "
                             "parameter's name)")
        if error_feedback.compressor is not compressor:
            raise ValueError(f"aggregate: error_feedback wraps {error_feedback.name!r}, not the compressor "
                             f"passed ({getattr(compressor, 'name', type(compressor).__name__)!r}); pass "
                             "the same compressor object to both")
        payload = error_feedback.compress(tensor, key)
    else:
        payload = compressor.compress(tensor)
    name = getattr(compressor, "name", type(compressor).__name__)
    _agree(payload, name, group, size)
    nbytes = payload.nbytes

    if compressor.linear:
        summed = {}
        for tname, t in payload.tensors.items():
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"aggregate: payload tensor {tname!r} of {name} has dtype {t.dtype}, which the "
                                "ring cannot add; a linear compressor must send an addable dtype")
            # Agreement was checked above for all payload tensors at once, so the ring skips its own check.
            summed[tname] = ring_all_reduce(t, group, check=False, emulate=emulate)
        result = compressor.decompress(Payload(summed, payload.shape, payload.dtype, payload.meta))
        return Aggregated(result, nbytes, ring_bytes_sent_per_rank(nbytes, size, "all_reduce"), "all_reduce")

    gathered: list[dict[str, torch.Tensor]] = [dict() for _ in range(size)]
    for tname, t in payload.tensors.items():
        if size == 1 or t.numel() == 0:
            parts = [t] * size  # nothing to move (equal sizes were agreed, so every rank skips alike)
        elif emulate is not None:
            parts = list(ring_all_gather(t, group, emulate=emulate).view(size, *t.shape).unbind(0))
        else:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
        for r in range(size):
            gathered[r][tname] = parts[r]
    acc = torch.promote_types(payload.dtype, torch.float32)
    total = torch.zeros(payload.shape, dtype=acc, device=tensor.device)
    for r in range(size):
        total += compressor.decompress(Payload(gathered[r], payload.shape, payload.dtype, payload.meta)).to(acc)
    # A ring AllGather of N payloads: each rank forwards N-1 of them.
    sent = ring_bytes_sent_per_rank(size * nbytes, size, "all_gather")
    return Aggregated(total.to(payload.dtype), nbytes, sent, "all_gather")


# ------------------------------------------------------------------- why Top-K cannot ride a ring

@dataclasses.dataclass(frozen=True)
class SparseRingFillIn:
    """Expected message sizes of a ring AllReduce that keeps its partial sums sparse (see
    :func:`sparse_ring_fill_in`). Supports are in elements, sizes in bytes; hop ``j`` is 1-based.

    Attributes:
        numel, k, n: tensor size, entries per rank, ranks.
        reduce_scatter_support: expected non-zeros of the chunk sent at ReduceScatter hop j = 1..n-1
            (it holds j ranks' contributions): ``(numel/n) * (1 - (1 - k/numel)**j)``.
        all_gather_support: expected non-zeros of each fully reduced chunk forwarded in the AllGather
            (n contributions): ``(numel/n) * (1 - (1 - k/numel)**n)``.
        reduce_scatter_nbytes, all_gather_nbytes: the same as sparse messages (value + index bytes each).
        dense_chunk_nbytes: one chunk sent dense (``numel/n * value_bytes``); a sparse message larger than
            this should have been sent dense.
        sparse_ring_nbytes_per_rank: sum over the 2(n-1) hops of the sparse messages.
        all_gather_nbytes_per_rank: what all-gathering the Top-K payloads costs, ``(n-1) k (value + index)``.
        dense_ring_nbytes_per_rank: a dense ring AllReduce, ``2 (n-1)/n * numel * value_bytes``.
        final_support: expected non-zeros of the full sum, ``numel * (1 - (1 - k/numel)**n)``.
    """

    numel: int
    k: int
    n: int
    value_bytes: int
    index_bytes: int
    reduce_scatter_support: list[float]
    all_gather_support: float
    reduce_scatter_nbytes: list[float]
    all_gather_nbytes: float
    dense_chunk_nbytes: float
    sparse_ring_nbytes_per_rank: float
    all_gather_nbytes_per_rank: float
    dense_ring_nbytes_per_rank: float
    final_support: float


def expected_union_support(numel: int, k: int, m: int) -> float:
    """Expected size of the union of m independent uniformly random k-subsets of ``numel`` positions.

    A position misses one subset with probability ``1 - k/numel`` and all m with ``(1 - k/numel)**m``, so
    ``E|union| = numel * (1 - (1 - k/numel)**m)`` (exact in expectation, not an approximation). It
    starts at k for m = 1, grows by almost k per subset while the union is sparse, and approaches numel.
    """
    if numel == 0:
        return 0.0
    return numel * (1.0 - (1.0 - k / numel) ** m)


def sparse_ring_fill_in(numel: int, k: int, n: int, value_bytes: int = 4, index_bytes: int = 4) -> SparseRingFillIn:
    """Why a Top-K payload cannot simply ride a ring: the partial sums fill in, hop by hop.

    In a ring AllReduce (ReduceScatter, then AllGather; chunks of numel/n elements) the chunk sent at
    ReduceScatter hop j holds the sum of j ranks' contributions. If each rank's k entries sit at
    independent random positions, the support of that sum is the union of j index sets, and a sparse
    message for it (values + indices) grows from about ``k/n`` entries at hop 1 towards dense; the
    AllGather then forwards chunks that hold all n contributions. Adding sparse payloads element-wise
    (as the source article does) is simply wrong, since indices differ; doing it right means growing
    messages, as computed here.

    Random supports are the pessimistic-but-simple model: real Top-K sets of different ranks overlap
    (the large gradient entries are often the same ones), so their unions grow more slowly; measure that
    with :func:`union_support_sizes` on real payloads.

    Args:
        numel: elements of the tensor; k: entries per rank (1..numel); n: ranks (>= 1).
        value_bytes, index_bytes: bytes of one value and one index (4 and 4: float32 and int32).

    Returns:
        :class:`SparseRingFillIn` (expected values; remainders of numel/n ignored).

    Raises:
        ValueError: numel < 1, k outside 1..numel, n < 1, or non-positive byte sizes.
    """
    for label, v in (("numel", numel), ("n", n), ("value_bytes", value_bytes), ("index_bytes", index_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"sparse_ring_fill_in: {label} must be an int >= 1, got {v!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not (1 <= k <= numel):
        raise ValueError(f"sparse_ring_fill_in: k must be an int in 1..numel={numel}, got {k!r}")
    chunk = numel / n
    per_entry = value_bytes + index_bytes
    rs_support = [chunk * (1.0 - (1.0 - k / numel) ** j) for j in range(1, n)]
    ag_support = chunk * (1.0 - (1.0 - k / numel) ** n)
    rs_bytes = [s * per_entry for s in rs_support]
    ag_bytes = ag_support * per_entry
    return SparseRingFillIn(
        numel=numel, k=k, n=n, value_bytes=value_bytes, index_bytes=index_bytes,
        reduce_scatter_support=rs_support, all_gather_support=ag_support if n > 1 else 0.0,
        reduce_scatter_nbytes=rs_bytes, all_gather_nbytes=ag_bytes if n > 1 else 0.0,
        dense_chunk_nbytes=chunk * value_bytes,
        sparse_ring_nbytes_per_rank=sum(rs_bytes) + (n - 1) * ag_bytes,
        all_gather_nbytes_per_rank=float((n - 1) * k * per_entry),
        dense_ring_nbytes_per_rank=2 * (n - 1) / n * numel * value_bytes,
        final_support=expected_union_support(numel, k, n))


def union_support_sizes(payloads: Sequence[Payload]) -> list[int]:
    """Support of the running sum of sparse payloads: ``[|I_1|, |I_1 u I_2|, ..., |I_1 u ... u I_m|]``.

    ``payloads`` are Top-K-format payloads (with ``indices``) of tensors of one shape, e.g. the N ranks'
    Top-K payloads of one gradient; entry j is the number of distinct positions a partial sum of the
    first j+1 payloads occupies, i.e. the size (in entries) of the sparse message a ring would have to
    forward after j hops. Compare with :func:`expected_union_support`.

    Raises:
        ValueError: a payload without ``indices``, or payloads of different shapes.
    """
    sizes: list[int] = []
    seen = None
    shape = None
    for i, p in enumerate(payloads):
        if "indices" not in p.tensors:
            raise ValueError(f"union_support_sizes: payload {i} has no 'indices' tensor (got "
                             f"{sorted(p.tensors)}); it needs Top-K-format payloads")
        if shape is None:
            shape = p.shape
            seen = torch.zeros(math.prod(shape), dtype=torch.bool)
        elif p.shape != shape:
            raise ValueError(f"union_support_sizes: payload {i} is for shape {list(p.shape)}, payload 0 for "
                             f"{list(shape)}; all must be payloads of one tensor's shape")
        seen[p.tensors["indices"].long().cpu()] = True
        sizes.append(int(seen.sum()))
    return sizes
