"""The two-phase compressed AllReduce: non-linear payloads summed at 2(N-1)/N of their bytes, not N-1 times.

Phase 1, an all-to-all: each rank cuts its flat gradient into N chunks, compresses each
(:class:`ChunkedCompressor`) and sends chunk j to its owner, rank j, which decompresses and sums the N
payloads, adds its server-side residual and compresses the sum again. Phase 2, an all-gather of the owners'
payloads, gives every rank the same sum. Each rank sends ``(N-1)(c_w + c_s)`` bytes
(:func:`two_phase_bytes_sent_per_rank`), flat in N like a ring AllReduce.

Entry point: :class:`TwoPhaseCall`, used by :func:`commlab.compress.aggregate.aggregate` and the DDP hooks.
Sources: Seide et al. 2014 (1-bit SGD), Bernstein et al. 2019 (signSGD majority vote), Tang et al. 2021
(DeepSpeed 1-bit Adam, ``NcclBackend.compressed_allreduce``), Wang et al. 2023 (ZeRO++ qgZ). Unlike
DeepSpeed: a scale per chunk, any Compressor, and the owner compresses the sum, not the mean.

Book: chapter 4, §4.3 (the paths), §4.6 (the server-side residual); chapter 8, §8.3 (the second compression).
"""

from __future__ import annotations

import math
from typing import Hashable

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives.common import all_gather_single, group_size_and_rank
from commlab.collectives.all_to_all import all_to_all
from commlab.collectives.ring import ring_all_gather
from commlab.compress.agreement import agree_payloads
from commlab.compress.base import Compressor, Payload, sum_dtype
from commlab.compress.error_feedback import ErrorFeedback, check_error_feedback
from commlab.topology.emulated import EmulatedTopology

__all__ = ["ChunkedCompressor", "TwoPhaseCall", "chunk_numel", "valid_numel", "server_key", "two_phase_bytes_sent_per_rank"]


def chunk_numel(numel: int, n: int) -> int:
    """Elements ``m`` of each of the ``n`` equal chunks of a ``numel``-element tensor: ``ceil(numel / n)``
    (0 for an empty tensor), padding included.

    Raises:
        ValueError: ``numel < 0`` or ``n < 1``.
    """
    checks.integer("numel", numel, least=0, where="chunk_numel")
    checks.integer("n", n, where="chunk_numel")
    return -(-numel // n)


def valid_numel(numel: int, n: int, owner: int) -> int:
    """Elements of chunk ``owner`` (0-based) that are the tensor's, not padding:
    ``min(m, max(0, numel - owner·m))`` with ``m = chunk_numel(numel, n)``."""
    m = chunk_numel(numel, n)
    return min(m, max(0, numel - owner * m))


def two_phase_bytes_sent_per_rank(worker_chunk_nbytes: float, server_chunk_nbytes: float, n: int) -> float:
    """Bytes each rank sends in the two-phase AllReduce: ``(n-1) · (c_w + c_s)``.

    Args:
        worker_chunk_nbytes: ``c_w``, bytes of one rank's payload of one chunk (phase 1 sends n-1 of them).
        server_chunk_nbytes: ``c_s``, bytes of one owner's payload (phase 2, an AllGather of n of them,
            forwards n-1).
        n: ranks (>= 1).

    Equal to ``(n-1)/n · (P_w + P_s)`` for the whole payloads ``P_w = n c_w`` and ``P_s = n c_s``.

    Raises:
        ValueError: negative bytes or ``n < 1``.
    """
    checks.integer("n", n, note="ranks")
    checks.number("worker_chunk_nbytes", worker_chunk_nbytes, least=0)
    checks.number("server_chunk_nbytes", server_chunk_nbytes, least=0)
    return float((n - 1) * (worker_chunk_nbytes + server_chunk_nbytes))


def _layout(payload: Payload) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, tuple(t.shape), t.dtype) for k, t in payload.tensors.items()]


class ChunkedCompressor:
    """A compressor applied chunk by chunk: the tensor, flattened, is padded with zeros to ``parts × m``
    elements (``m = ceil(numel / parts)``) and each chunk of ``m`` is compressed on its own. A
    :class:`~commlab.compress.base.Compressor` itself, so that error feedback can wrap it
    (:meth:`ErrorFeedback.through`): the residual is what the chunked payload did not send.

    Zero padding changes nothing for Top-K, INT8/INT4 or QSGD; for sign it lowers the padded chunk's scale
    ``mean |g|`` by ``valid/m`` (error feedback carries the difference). The padding is counted in the bytes
    and never reaches the result (the owner zeroes it in its sum).

    Args:
        compressor: any :class:`~commlab.compress.base.Compressor` whose payload layout (tensor names, shapes,
            dtypes) depends only on the chunk's length and dtype, which holds for every compressor of
            :mod:`commlab.compress`.
        parts: chunks, >= 1 (the two-phase AllReduce uses the group's size).

    Payload:
        ``tensors``: each payload tensor of the chunks stacked, shape ``[parts, ...]``; row j is chunk j's
            (so ``dist.all_to_all_single`` sends row j to rank j). ``nbytes`` is the sum over the chunks.
        ``shape``, ``dtype``: the tensor's. ``meta``: ``{"parts", "chunk_numel": m, "chunks": (meta of each
            chunk's payload, ...)}``.

    ``linear`` is the compressor's. Raises (from compress): ``ValueError`` when two chunks' payloads have
    different layouts (a data-dependent compressor, which cannot be stacked), and whatever the compressor
    raises (NaN/Inf: ``FloatingPointError``).
    """

    def __init__(self, compressor: Compressor, parts: int):
        missing = [a for a in ("compress", "decompress", "linear") if not hasattr(compressor, a)]
        if missing:
            raise ValueError(f"ChunkedCompressor needs a compressor with compress, decompress and linear "
                             f"(commlab.compress.base.Compressor); {type(compressor).__name__} lacks {missing}")
        checks.integer("parts", parts, where="ChunkedCompressor")
        self.compressor = compressor
        self.parts = parts
        self.linear = compressor.linear
        self.name = f"{getattr(compressor, 'name', type(compressor).__name__)} in {parts} chunks"

    def compress(self, tensor: torch.Tensor) -> Payload:
        flat = tensor.detach().reshape(-1)
        n, parts = flat.numel(), self.parts
        m = chunk_numel(n, parts)
        if parts * m != n:
            padded = torch.zeros(parts * m, dtype=flat.dtype, device=flat.device)
            padded[:n] = flat
        else:
            padded = flat
        chunks = [self.compressor.compress(padded[i * m:(i + 1) * m]) for i in range(parts)]
        first = _layout(chunks[0])
        for i, p in enumerate(chunks[1:], 1):
            if _layout(p) != first:
                raise ValueError(f"ChunkedCompressor: {self.name}'s payload of chunk {i} has the layout "
                                 f"{_layout(p)}, chunk 0's is {first}; chunks can be stacked (and all-to-all'd) "
                                 "only when the payload layout depends on the chunk's length alone")
        tensors = {k: torch.stack([p.tensors[k] for p in chunks]) for k in chunks[0].tensors}
        return Payload(tensors, tensor.shape, tensor.dtype,
                       {"parts": parts, "chunk_numel": m, "chunks": tuple(p.meta for p in chunks)})

    def chunk(self, payload: Payload, i: int, tensors: dict[str, torch.Tensor] | None = None) -> Payload:
        """The payload of chunk ``i`` (a tensor of ``chunk_numel`` elements); ``tensors`` replaces its wire
        tensors (e.g. rank r's row i, received by its owner)."""
        mine = {k: t[i] for k, t in payload.tensors.items()} if tensors is None else tensors
        return Payload(mine, torch.Size([payload.meta["chunk_numel"]]), payload.dtype, payload.meta["chunks"][i])

    def decompress(self, payload: Payload) -> torch.Tensor:
        numel = math.prod(payload.shape)
        parts = [self.compressor.decompress(self.chunk(payload, i)).reshape(-1) for i in range(payload.meta["parts"])]
        return torch.cat(parts)[:numel].view(payload.shape)


class _RoundedTo:
    """The compressor applied to a float32 (float64) sum rounded to the gradient's dtype first, so that the
    server's error feedback keeps that rounding in its residual too (the payload is the gradient dtype's)."""

    def __init__(self, compressor: Compressor, dtype: torch.dtype):
        self.compressor, self.dtype = compressor, dtype
        self.name, self.linear = getattr(compressor, "name", type(compressor).__name__), compressor.linear

    def compress(self, tensor: torch.Tensor) -> Payload:
        return self.compressor.compress(tensor.to(self.dtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.compressor.decompress(payload)


def server_key(key: Hashable, owner: int) -> tuple:
    """The key of an owner's server-side residual in its :class:`ErrorFeedback`: ``(key, owner)``."""
    return (key, owner)


class TwoPhaseCall:
    """One two-phase AllReduce of one tensor, in three stages (a DDP hook returns after launching phase 2).

    Use it through :func:`commlab.compress.aggregate.aggregate` (``path="two_phase"``) or
    :func:`commlab.compress.compression_hook`; both check finiteness first. :meth:`start` compresses the N
    chunks, agrees on the payloads, launches phase 1 and returns this rank's payload; :meth:`middle` waits,
    does the owner's step, launches phase 2 and returns its futures (empty if it ran synchronously);
    :meth:`finish` returns the sum over ranks (input shape and dtype, the same on every rank).

    Args:
        tensor, compressor, group: this rank's tensor (same shape, dtype on all ranks), any Compressor, the group.
        error_feedback, server_error_feedback, key: :class:`ErrorFeedback` objects wrapping ``compressor``:
            this rank's residual under ``key``; the owner's chunk-sum residual under ``server_key(key, owner)``
            (float32, float64 for float64). ``key`` is required with either.
        emulate: an emulated slow link delaying both phases (commlab's all-to-all and ring AllGather instead of
            ``dist.all_to_all_single`` / ``dist.all_gather_into_tensor``). what: the caller, for messages.

    Attributes (after :meth:`middle`): payload_nbytes ``P_w = N c_w``, server_payload_nbytes ``P_s = N c_s``,
    bytes_sent_per_rank (:func:`two_phase_bytes_sent_per_rank`).

    Raises:
        ValueError: error feedback without ``key`` or wrapping another compressor; chunk or owner payloads of
            different layouts (data-dependent sizes: raised on the finding rank only, peers time out).
        CollectiveMismatchError: the ranks' chunk payloads differ in layout or meta, on every rank.
        FloatingPointError: an owner's chunk sum overflows when recompressed (every rank, in :meth:`finish`).
    """

    def __init__(self, tensor: torch.Tensor, compressor: Compressor, group: dist.ProcessGroup | None = None, *,
                 error_feedback: ErrorFeedback | None = None, server_error_feedback: ErrorFeedback | None = None,
                 key: Hashable | None = None, emulate: EmulatedTopology | None = None, what: str = "aggregate"):
        self.size, self.rank = group_size_and_rank(group, what)
        check_error_feedback(error_feedback, compressor, key, what)
        check_error_feedback(server_error_feedback, compressor, key, what, "server_error_feedback")
        self.tensor, self.compressor, self.group, self.key, self.emulate, self.what = (
            tensor, compressor, group, key, emulate, what)
        self.error_feedback, self.server_error_feedback = error_feedback, server_error_feedback
        self.chunked = ChunkedCompressor(compressor, self.size)
        self.numel = tensor.numel()
        self.m = chunk_numel(self.numel, self.size)
        self.payload: Payload | None = None
        self.payload_nbytes = self.server_payload_nbytes = 0
        self.bytes_sent_per_rank = 0.0
        self._received: dict[str, torch.Tensor] = {}
        self._gathered: dict[str, torch.Tensor] = {}
        self._works: list = []
        self._server_meta: dict = {}
        self._server: Payload | None = None
        self._failure: FloatingPointError | None = None

    # ---------------------------------------------------------------------------------------- phase 1

    def start(self) -> Payload:
        """Compress the chunks, agree on them over the group, launch the all-to-all; return this rank's payload."""
        if self.error_feedback is not None:
            payload = self.error_feedback.through(self.chunked).compress(self.tensor, self.key)
        else:
            payload = self.chunked.compress(self.tensor)
        agree_payloads(payload, self.chunked.name, self.group, self.size, self.what)
        self.payload = payload
        for name, t in payload.tensors.items():
            if self.size == 1 or t.numel() == 0:
                self._received[name] = t  # nothing to move (the agreed sizes are equal, so every rank skips alike)
            elif self.emulate is not None:
                self._received[name] = all_to_all(t, self.group, emulate=self.emulate, check=False)
            else:
                out = torch.empty_like(t)
                self._works.append(dist.all_to_all_single(out, t.contiguous(), group=self.group, async_op=True))
                self._received[name] = out
        return payload

    # ------------------------------------------------------------------------------ the owner, phase 2

    def _owner_step(self) -> Payload:
        """Sum of the N received payloads of this rank's chunk, padding zeroed, compressed again."""
        dtype = self.payload.dtype
        acc = sum_dtype(dtype)
        total = torch.zeros(self.m, dtype=acc, device=self.tensor.device)
        for r in range(self.size):  # rank order, so the sum is the same whichever rank computes it
            part = self.chunked.chunk(self.payload, self.rank, {k: t[r] for k, t in self._received.items()})
            total += self.compressor.decompress(part).reshape(-1).to(acc)
        total[valid_numel(self.numel, self.size, self.rank):] = 0  # padding: keep nothing there
        if self.server_error_feedback is not None:
            return self.server_error_feedback.through(_RoundedTo(self.compressor, dtype)).compress(
                total, server_key(self.key, self.rank))
        return self.compressor.compress(total.to(dtype))

    def middle(self) -> list[torch.futures.Future]:
        """Wait for phase 1, run the owner's step, launch phase 2; return the futures of phase 2."""
        for w in self._works:
            w.wait()
        self._works = []
        mine = self.chunked.chunk(self.payload, self.rank)
        try:
            server = self._owner_step()
        except FloatingPointError as e:
            # Send a payload of the agreed layout whose floats are NaN: every rank sees it in finish() and raises
            # the same error, instead of this rank raising alone while its peers wait in phase 2.
            if not any(t.is_floating_point() and t.numel() for t in mine.tensors.values()):
                raise
            self._failure = e
            server = Payload({k: torch.full_like(t, math.nan) if t.is_floating_point() else torch.zeros_like(t)
                              for k, t in mine.tensors.items()}, mine.shape, mine.dtype, mine.meta)
        if _layout(server) != _layout(mine):
            raise ValueError(f"{self.what}: the owner's payload of {self.chunked.compressor.name} has the layout "
                             f"{_layout(server)}, a worker's chunk payload {_layout(mine)}; the two-phase AllReduce "
                             "needs a compressor whose payload layout depends on the chunk's length alone")
        self._server_meta = server.meta
        self._server = server  # the sent tensors stay alive until phase 2 has completed
        c_w = self.payload.nbytes // self.size
        c_s = server.nbytes
        self.payload_nbytes, self.server_payload_nbytes = self.payload.nbytes, self.size * c_s
        self.bytes_sent_per_rank = two_phase_bytes_sent_per_rank(c_w, c_s, self.size)
        futures = []
        for name, t in server.tensors.items():
            if self.size == 1 or t.numel() == 0:
                self._gathered[name] = t.unsqueeze(0).expand(self.size, *t.shape)
            elif self.emulate is not None:
                self._gathered[name] = ring_all_gather(t, self.group, emulate=self.emulate).view(self.size, *t.shape)
            else:
                # Flat output (the concatenated form): gloo refuses the stacked [N, ...] form NCCL accepts.
                out = torch.empty(self.size * t.numel(), dtype=t.dtype, device=t.device)
                work = all_gather_single(out, t.contiguous().view(-1), group=self.group, async_op=True)
                self._works.append(work)
                futures.append(work.get_future())
                self._gathered[name] = out.view(self.size, *t.shape)
        return futures

    # ------------------------------------------------------------------------------------------ result

    def finish(self, wait: bool = True) -> torch.Tensor:
        """Wait for phase 2; decompress and join the owners' chunks. Returns the sum (input shape and dtype).

        ``wait=False`` inside a callback of :meth:`middle`'s futures: they have completed, and waiting on a
        collective from its own completion callback blocks gloo's thread for good.
        """
        if wait:
            for w in self._works:
                w.wait()
        self._works = []
        bad = set()
        for t in self._gathered.values():
            if t.is_floating_point() and t.numel():
                bad.update(int(j) for j in torch.nonzero(~torch.isfinite(t.reshape(self.size, -1)).all(dim=1)).view(-1))
        if bad:
            err = FloatingPointError(
                f"{self.what}: the owner(s) of chunk(s) {sorted(bad)} could not decompress or recompress the sum "
                f"of their chunk ({self.chunked.compressor.name}, {self.payload.dtype}): a value or a scale overflows "
                "(the owner's own error is chained to this one on that rank); nothing was applied. Every rank "
                "raises this, so all can skip the step together; compress in a wider dtype or rescale the gradient")
            raise err from self._failure
        shape = torch.Size([self.m])
        dtype = self.payload.dtype
        chunks = [self.compressor.decompress(Payload({k: t[j] for k, t in self._gathered.items()}, shape, dtype,
                                                     self._server_meta)).reshape(-1)
                  for j in range(self.size)]
        return torch.cat(chunks)[:self.numel].view(self.tensor.shape)
