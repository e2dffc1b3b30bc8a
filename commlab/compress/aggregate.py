"""Summing compressed tensors over ranks, the way each compressor allows, with exact byte accounting.

:func:`aggregate` returns an :class:`Aggregated` (the sum, the payload bytes, the bytes each rank sends) by
one of three paths: ``"all_reduce"`` for linear compressors (payloads ride commlab's ring AllReduce,
``2 (N-1)/N × payload`` bytes per rank); ``"all_gather"`` for the others (``(N-1) × payload``, growing with
N, as torch's prototype ``quantization_pertensor_hook``); ``"two_phase"`` for any
(:mod:`commlab.compress.two_phase`, about ``2 (N-1)/N × payload``). :func:`sparse_ring_fill_in`,
:func:`expected_union_support` and :func:`union_support_sizes` count why Top-K payloads cannot be added
inside a ring, as the source article does: each hop's partial sum covers the union of more index sets.
The DDP hook :func:`commlab.compress.compression_hook` takes the same path: both run an
:class:`AggregateCall` (compress, agree, launch; then decompress and sum), the hook returning in between.

Book: chapter 4, §4.3 (the three paths) and §4.4 (the sparse ring).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives import ring_all_gather, ring_all_reduce, ring_bytes_sent_per_rank
from commlab.collectives.common import SUPPORTED_DTYPES, group_size_and_rank
from commlab.collectives.agreement import gather
from commlab.compress.agreement import agree_finite, agree_payloads
from commlab.compress.base import Compressor, Payload, divide_sum, sum_dtype
from commlab.compress.error_feedback import ErrorFeedback, check_error_feedback
from commlab.compress.two_phase import TwoPhaseCall
from commlab.topology.emulated import EmulatedTopology

__all__ = ["Aggregated", "aggregate", "AggregateCall", "PATHS", "SparseRingFillIn", "sparse_ring_fill_in",
           "expected_union_support", "union_support_sizes", "agree_finite"]

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
        tensor: this rank's tensor (a gradient); the same shape and dtype on every rank. group: None = default.
        compressor: any :class:`commlab.compress.base.Compressor`.
        error_feedback, key: an :class:`ErrorFeedback` wrapping ``compressor`` (same object), its residuals
            kept under ``key`` (required with ``error_feedback`` or ``server_error_feedback``).
        emulate: an :class:`~commlab.topology.EmulatedTopology` delaying every payload send (all paths then use
            commlab's point-to-point collectives; agreement collectives are not delayed).
        path: ``"auto"`` (default: ``"all_reduce"`` if linear, else ``"all_gather"``), ``"all_reduce"``
            (linear only), ``"all_gather"`` or ``"two_phase"`` (:mod:`commlab.compress.two_phase`).
        server_error_feedback: ``"two_phase"`` only: an :class:`ErrorFeedback` wrapping ``compressor`` for the
            chunk owner's residual, under ``(key, owner group rank)``.

    Returns:
        :class:`Aggregated`: the sum (input shape and dtype), payload bytes, bytes each rank sends, path. Gathered
        sums are accumulated in float32 (float64 for float64 input; int64, exactly, for integers) in rank order,
        rounded once: the same on all ranks.

    Raises:
        ValueError: an unknown ``path``, ``"all_reduce"`` for a non-linear compressor, ``server_error_feedback``
            on another path, error feedback without ``key`` or wrapping another compressor.
        CollectiveMismatchError: payloads differ across ranks. TypeError: a payload dtype the ring cannot add.
        FloatingPointError: non-finite input on any rank, or (two-phase) an owner's recompressed sum overflows;
            raised on every rank (before sending), so all ranks can skip the step.
    """
    call = AggregateCall(tensor, compressor, group, error_feedback=error_feedback, key=key, emulate=emulate,
                         path=path, server_error_feedback=server_error_feedback)
    call.start()
    total = call.finish()
    return Aggregated(total, call.payload_nbytes, call.bytes_sent_per_rank, call.path, call.server_payload_nbytes)


class AggregateCall:
    """One compressed sum (or mean) over a group in two stages, so that a DDP hook can return in between.

    :meth:`start` compresses (through error feedback), agrees and launches; :meth:`finish` decompresses and sums.
    :func:`aggregate` runs both at once; :func:`commlab.compress.compression_hook` returns between them.

    Args:
        tensor, compressor, group, error_feedback, key, emulate, path, server_error_feedback: as :func:`aggregate`.
        mean: return the mean, not the sum. A linear payload is divided by N *before* the sum (as PyTorch's
            ``fp16_compress_hook``, so a float16 sum cannot overflow): needs floating-point payloads and a
            compressor linear in the full sense (casts, Random-K with shared indices); other paths divide the sum.
        overlap: linear payloads go through torch's async ``dist.all_reduce`` (futures returned by :meth:`start`);
            False (default): commlab's synchronous ring AllReduce, which ``emulate`` can delay.
        ragged: payloads may differ in size by rank (threshold sparsifiers): shapes are exchanged and payloads
            all-gathered padded to the longest. Default False: layouts must agree.
        what: the caller, for messages.

    Attributes (after :meth:`start`):
        path, payload (this rank's); payload_nbytes, bytes_sent_per_rank, server_payload_nbytes: as
        :class:`Aggregated`.

    Raises:
        ValueError: as :func:`aggregate`; ``overlap`` with ``emulate``.
        TypeError: a linear payload the sum cannot take (``mean``: not floating point; ring: a dtype it cannot add).
        CollectiveMismatchError, FloatingPointError: as :func:`aggregate`.
    """

    def __init__(self, tensor: torch.Tensor, compressor: Compressor, group: dist.ProcessGroup | None = None, *,
                 error_feedback: ErrorFeedback | None = None, key: Hashable | None = None,
                 emulate: EmulatedTopology | None = None, path: str = "auto",
                 server_error_feedback: ErrorFeedback | None = None, mean: bool = False, overlap: bool = False,
                 ragged: bool = False, what: str = "aggregate"):
        self.size, _ = group_size_and_rank(group, what)
        self.name = getattr(compressor, "name", type(compressor).__name__)
        if path not in PATHS:
            raise ValueError(f"{what}: path must be one of {PATHS}, got {path!r}")
        if path == "all_reduce" and not compressor.linear:
            raise ValueError(f"{what}: path='all_reduce' adds payloads on the way, which {self.name} (not linear) "
                             "does not allow; use 'all_gather' or 'two_phase'")
        if server_error_feedback is not None and path != "two_phase":
            raise ValueError(f"{what}: server_error_feedback is the chunk owners' error feedback of "
                             f"path='two_phase'; path={path!r} has no owners")
        if overlap and emulate is not None:
            raise ValueError(f"{what}: overlap launches torch's collectives, which an EmulatedTopology cannot "
                             "delay; pass emulate without overlap")
        check_error_feedback(error_feedback, compressor, key, what)
        self.path = ("all_reduce" if compressor.linear else "all_gather") if path == "auto" else path
        self.tensor, self.compressor, self.group, self.key, self.emulate = tensor, compressor, group, key, emulate
        self.error_feedback, self.server_error_feedback = error_feedback, server_error_feedback
        self.mean, self.overlap, self.ragged, self.what = mean, overlap, ragged, what
        self.payload: Payload | None = None
        self.payload_nbytes = self.server_payload_nbytes = 0
        self.bytes_sent_per_rank = 0.0
        self._two_phase: TwoPhaseCall | None = None
        self._works: list = []
        self._summed: dict[str, torch.Tensor] = {}          # "all_reduce": the payload's tensors, summed
        self._gathered: list[dict[str, torch.Tensor]] = []  # "all_gather": every rank's payload tensors

    def start(self) -> list[torch.futures.Future]:
        """Agree on finiteness, compress, launch the collectives; return the futures still in flight (empty when
        everything ran synchronously)."""
        agree_finite(self.tensor, self.group, self.what)
        if self.path == "two_phase":
            self._two_phase = call = TwoPhaseCall(
                self.tensor, self.compressor, self.group, error_feedback=self.error_feedback,
                server_error_feedback=self.server_error_feedback, key=self.key, emulate=self.emulate,
                what=self.what)
            self.payload = call.start()
            # Phase 1 is waited for on this thread and phase 2 launched from it: a collective issued from a
            # future's callback would race with the next bucket's (see powersgd_hook).
            futures = call.middle()
            self.payload_nbytes, self.server_payload_nbytes = call.payload_nbytes, call.server_payload_nbytes
            self.bytes_sent_per_rank = call.bytes_sent_per_rank
            return futures
        if self.error_feedback is not None:
            self.payload = self.error_feedback.compress(self.tensor, self.key)
        else:
            self.payload = self.compressor.compress(self.tensor)
        if not self.ragged:
            agree_payloads(self.payload, self.name, self.group, self.size, self.what)
        self.payload_nbytes = self.payload.nbytes
        if self.path == "all_reduce":
            self._start_all_reduce()
        else:
            self._start_all_gather()
        return [w.get_future() for w in self._works]

    def _start_all_reduce(self) -> None:
        tensors = self.payload.tensors
        bad = {k: t.dtype for k, t in tensors.items()
               if (not t.is_floating_point() if self.mean else t.dtype not in SUPPORTED_DTYPES)}
        if bad:
            why = ("a linear payload is scaled by 1/N before the sum, which integer codes do not allow" if self.mean
                   else "the ring cannot add these dtypes; a linear compressor must send an addable dtype")
            raise TypeError(f"{self.what}: {self.name} is marked linear but its payload tensors {bad} cannot be "
                            f"summed: {why}")
        for name, t in tensors.items():
            if self.mean:
                t = t.div(self.size)  # a fresh tensor: a payload may share memory with the input (a same-dtype cast)
            if self.overlap:
                self._works.append(dist.all_reduce(t, group=self.group, async_op=True))
                self._summed[name] = t
            else:
                # The payloads' agreement was checked above, so the ring skips its own check.
                self._summed[name] = ring_all_reduce(t, self.group, check=False, emulate=self.emulate)
        self.bytes_sent_per_rank = ring_bytes_sent_per_rank(self.payload_nbytes, self.size, "all_reduce")

    def _start_all_gather(self) -> None:
        local = self.payload.tensors
        if self.ragged:
            shapes = _payload_shapes(self.payload, self.group)
        else:
            shapes = [[t.shape for t in local.values()]] * self.size
        self._gathered = [dict() for _ in range(self.size)]
        for j, (name, t) in enumerate(local.items()):
            numels = [math.prod(shapes[r][j]) for r in range(self.size)]
            longest = max(numels)
            flat = t.reshape(-1)
            if flat.numel() < longest:  # ragged: padded to the longest
                flat = torch.cat([flat, flat.new_zeros(longest - flat.numel())])
            if self.size == 1 or longest == 0:
                parts = [flat] * self.size  # nothing to move (every rank knows the sizes, so all skip alike)
            elif self.emulate is not None:
                parts = list(ring_all_gather(flat, self.group, emulate=self.emulate).view(self.size, -1).unbind(0))
            else:
                parts = [torch.empty_like(flat) for _ in range(self.size)]
                self._works.append(dist.all_gather(parts, flat.contiguous(), group=self.group, async_op=True))
            for r in range(self.size):
                self._gathered[r][name] = parts[r][:numels[r]].view(shapes[r][j])
        # A ring AllGather of N payloads: each rank forwards N-1 of them.
        self.bytes_sent_per_rank = ring_bytes_sent_per_rank(self.size * self.payload_nbytes, self.size, "all_gather")

    def sent(self) -> torch.Tensor:
        """This rank's payload decompressed: what its peers receive from it (the input's shape and dtype).
        ``tensor - sent()`` is what compression lost, the residual an error feedback keeps."""
        payload = self.payload
        decompress = self._two_phase.chunked.decompress if self._two_phase is not None else self.compressor.decompress
        return decompress(payload).reshape(self.tensor.shape).to(self.tensor.dtype)

    def finish(self, wait: bool = True) -> torch.Tensor:
        """Wait for the collectives (``wait=False`` inside a callback of :meth:`start`'s futures: they have
        completed), decompress and sum; returns the sum (the mean with ``mean``) in the input's shape and dtype,
        the same on every rank."""
        if self._two_phase is not None:
            total = self._two_phase.finish(wait=wait)
            return divide_sum(total, self.size) if self.mean else total
        if wait:
            for w in self._works:
                w.wait()
        self._works = []
        payload = self.payload
        if self.path == "all_reduce":
            return self.compressor.decompress(Payload(self._summed, payload.shape, payload.dtype, payload.meta))
        acc = sum_dtype(payload.dtype)
        total = torch.zeros(payload.shape, dtype=acc, device=self.tensor.device)
        for r in range(self.size):  # rank order, so that every rank adds the same way
            total += self.compressor.decompress(Payload(self._gathered[r], payload.shape, payload.dtype,
                                                        payload.meta)).to(acc)
        if self.mean:
            divide_sum(total, self.size)
        return total.to(payload.dtype)


def _payload_shapes(payload: Payload, group: dist.ProcessGroup | None) -> list[list[torch.Size]]:
    """Every rank's payload tensor shapes, ``shapes[rank][j]`` for the payload's j-th tensor (one small
    all-gather through :func:`commlab.collectives.agreement.gather`), for payloads whose sizes depend on the data."""
    everyone = gather([tuple(t.shape) for t in payload.tensors.values()], group)
    return [[torch.Size(s) for s in shapes] for shapes in everyone]


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
        checks.integer(label, v, where="sparse_ring_fill_in")
    checks.integer("k", k, 1, numel, note="at most numel", where="sparse_ring_fill_in")
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
