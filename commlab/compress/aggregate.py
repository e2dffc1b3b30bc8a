"""Summing compressed tensors over ranks, the way each compressor allows, with exact byte accounting.

:func:`aggregate` returns an :class:`Aggregated` (the sum, the payload bytes, the bytes each rank sends) by
one of three paths: ``"all_reduce"`` for linear compressors (payloads ride commlab's ring AllReduce,
``2 (N-1)/N × payload`` bytes per rank); ``"all_gather"`` for the others (``(N-1) × payload``, growing with
N, as torch's prototype ``quantization_pertensor_hook``); ``"two_phase"`` for any
(:mod:`commlab.compress.two_phase`, about ``2 (N-1)/N × payload``). :func:`sparse_ring_fill_in`,
:func:`expected_union_support` and :func:`union_support_sizes` count why Top-K payloads cannot be added
inside a ring, as the source article does: each hop's partial sum covers the union of more index sets.

Book: chapter 4, §4.3 (the three paths) and §4.4 (the sparse ring).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Sequence

import torch
import torch.distributed as dist

from commlab.collectives import ring_all_gather, ring_all_reduce, ring_bytes_sent_per_rank
from commlab.collectives._common import SUPPORTED_DTYPES, group_size_and_rank
from commlab.compress.agreement import agree_finite, agree_payloads
from commlab.compress.base import Compressor, Payload
from commlab.compress.error_feedback import ErrorFeedback
from commlab.compress.two_phase import TwoPhaseCall
from commlab.topology.emulated import EmulatedTopology

__all__ = ["Aggregated", "aggregate", "PATHS", "SparseRingFillIn", "sparse_ring_fill_in", "expected_union_support",
           "union_support_sizes", "agree_finite"]

#: The values of ``aggregate(path=...)``: "auto" is the compressor's own (ring AllReduce if linear, else all-gather).
PATHS = ("auto", "all_reduce", "all_gather", "two_phase")


@dataclasses.dataclass(frozen=True)
class Aggregated:
    """Result of :func:`aggregate`.

    Attributes:
        sum: the sum over ranks of each rank's decompressed payload; shape and dtype of the input.
        payload_nbytes: bytes of this rank's payload (equal on every rank; checked).
        bytes_sent_per_rank: bytes each rank sends. ``"all_reduce"``: ``2 (N-1)/N * payload_nbytes`` (the
            ring's figure: exact when N divides every payload tensor's element count, otherwise the mean
            over ranks, since ranks whose own chunk is smaller send slightly more). ``"all_gather"``:
            ``(N-1) * payload_nbytes`` exactly. ``"two_phase"``: ``(N-1)/N * (payload_nbytes +
            server_payload_nbytes)`` exactly (:func:`commlab.compress.two_phase.two_phase_bytes_sent_per_rank`).
        path: ``"all_reduce"``, ``"all_gather"`` or ``"two_phase"``.
        server_payload_nbytes: ``"two_phase"`` only (else 0): the N chunk owners' payloads together.
            ``payload_nbytes`` is then this rank's payload of its N chunks (padding included, one scale per
            chunk), a little more than the tensor's payload compressed whole.
    """

    sum: torch.Tensor
    payload_nbytes: int
    bytes_sent_per_rank: float
    path: str
    server_payload_nbytes: int = 0


def aggregate(tensor: torch.Tensor, compressor: Compressor, group: dist.ProcessGroup | None = None, *,
              error_feedback: ErrorFeedback | None = None, key: Hashable | None = None,
              emulate: EmulatedTopology | None = None, path: str = "auto",
              server_error_feedback: ErrorFeedback | None = None) -> Aggregated:
    """Compress ``tensor`` on every rank and return the sum over ranks of the decompressed tensors.

    Args:
        tensor: this rank's tensor (a gradient); the same shape and dtype on every rank.
        compressor: any :class:`commlab.compress.base.Compressor`.
        group: process group (None: the default group).
        error_feedback: an :class:`ErrorFeedback` wrapping ``compressor`` (the same object), to compress
            ``tensor + residual`` and keep the new residual under ``key`` (this rank's, worker-side).
        key: the residuals' name; required with ``error_feedback`` or ``server_error_feedback``.
        emulate: an :class:`~commlab.topology.EmulatedTopology` whose link delays every payload message
            (chapter 8 measures compression on an emulated slow link this way). Every path then uses
            commlab's collectives built from point-to-point sends (ring AllReduce, ring AllGather in place of
            ``dist.all_gather``, :func:`~commlab.collectives.all_to_all` in place of
            ``dist.all_to_all_single``), whose sends the emulation can delay; the small agreement
            collectives are not delayed.
        path: ``"auto"`` (default): ``"all_reduce"`` for a linear compressor, else ``"all_gather"``.
            ``"all_reduce"`` (linear compressors only), ``"all_gather"`` or ``"two_phase"`` (any compressor;
            it pays for non-linear ones, see :mod:`commlab.compress.two_phase`) force one.
        server_error_feedback: ``"two_phase"`` only: an :class:`ErrorFeedback` wrapping ``compressor`` that
            keeps the chunk owner's residual of its recompressed sum, under ``(key, owner group rank)``.

    Returns:
        :class:`Aggregated` with the sum (input shape and dtype), the payload bytes, the bytes each rank
        sends, and the path taken. The sum of the all-gather path (and each owner's sum in the two-phase
        path) is accumulated in float32 (float64 for float64 input) over ranks in rank order, then rounded
        once to the input dtype, so every rank gets the same result.

    Raises:
        ValueError: an unknown ``path``, ``"all_reduce"`` for a non-linear compressor,
            ``server_error_feedback`` on another path; an error feedback without ``key``, or wrapping a
            different compressor.
        CollectiveMismatchError: the ranks' payloads differ in size, dtype or meta (on every rank).
        TypeError: a linear compressor whose payload dtype the ring cannot add.
        FloatingPointError: non-finite input on any rank (the compressors' policy), raised on every rank
            before anything is sent, so that all ranks can skip the step together; in the two-phase path also
            a chunk owner's sum that overflows when recompressed (on every rank, naming the owner).
    """
    size, _ = group_size_and_rank(group)
    name = getattr(compressor, "name", type(compressor).__name__)
    if path not in PATHS:
        raise ValueError(f"aggregate: path must be one of {PATHS}, got {path!r}")
    if path == "all_reduce" and not compressor.linear:
        raise ValueError(f"aggregate: path='all_reduce' adds payloads on the way, which {name} (not linear) does not "
                         "allow; use 'all_gather' or 'two_phase'")
    if server_error_feedback is not None and path != "two_phase":
        raise ValueError("aggregate: server_error_feedback is the chunk owners' error feedback of path='two_phase'; "
                         f"path={path!r} has no owners")
    if path == "auto":
        path = "all_reduce" if compressor.linear else "all_gather"
    agree_finite(tensor, group, "aggregate")
    if path == "two_phase":
        call = TwoPhaseCall(tensor, compressor, group, error_feedback=error_feedback,
                            server_error_feedback=server_error_feedback, key=key, emulate=emulate)
        call.start()
        call.middle()
        total = call.finish()
        return Aggregated(total, call.payload_nbytes, call.bytes_sent_per_rank, "two_phase", call.server_payload_nbytes)
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
    agree_payloads(payload, name, group, size)
    nbytes = payload.nbytes

    if path == "all_reduce":
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
    """Expected size of the union of m independent uniformly random k-subsets of ``numel`` positions:
    ``numel · (1 - (1 - k/numel)**m)`` (exact in expectation; a position misses each subset with probability
    ``1 - k/numel``).
    """
    if numel == 0:
        return 0.0
    return numel * (1.0 - (1.0 - k / numel) ** m)


def sparse_ring_fill_in(numel: int, k: int, n: int, value_bytes: int = 4, index_bytes: int = 4) -> SparseRingFillIn:
    """Expected message sizes of a ring AllReduce whose partial sums stay sparse (book §4.4).

    The chunk sent at ReduceScatter hop j holds j ranks' contributions; with each rank's k entries at
    independent random positions its support is the union of j index sets
    (:func:`expected_union_support`), growing towards dense, and the AllGather forwards chunks of all n.
    Random supports are the pessimistic model: real Top-K sets overlap (:func:`union_support_sizes`).

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
