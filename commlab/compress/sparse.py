"""Sparsification: send k of a tensor's numel entries (Top-K by magnitude, or Random-K).

:class:`TopK` (Aji & Heafield 2017, EMNLP, §2; Lin et al. 2018, Deep Gradient Compression, ICLR, §3) sends
the k largest magnitudes as (values, indices); each rank picks its own indices, so it is not linear and its
payloads are all-gathered or reduced in two phases (:mod:`commlab.compress.aggregate`). :func:`topk_global`
selects over several tensors at once. :class:`RandomK` (Stich et al. 2018, NeurIPS, §2; Wangni et al. 2018,
NeurIPS, §3) draws the same indices on every rank from a shared seed, sends no indices, and is linear.
Indices are int32 when ``numel < 2**31`` (the same on every rank), else int64.

Book: chapter 5 (§5.2 layer-wise or global, §5.3 bias and variance, §5.5 byte accounting); chapter 4, §4.4.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from commlab import checks
from commlab.compress.base import Payload, check_finite, check_finite_output

__all__ = ["TopK", "RandomK", "topk_global", "resolve_k", "index_dtype"]

# Default fraction kept when neither ratio nor k is given: 1%, the source article's setting and the
# usual starting point (Deep Gradient Compression reaches 0.1% only with momentum correction, local
# clipping and warm-up, which are beyond a plain compressor).
DEFAULT_RATIO = 0.01


def index_dtype(numel: int) -> torch.dtype:
    """int32 when every index of a ``numel``-element tensor fits (``numel < 2**31``), else int64."""
    return torch.int32 if numel < 2 ** 31 else torch.int64


def _validate_ratio_k(cls_name: str, ratio, k) -> tuple[float | None, int | None]:
    if ratio is not None and k is not None:
        raise ValueError(f"{cls_name}: give ratio or k, not both (got ratio={ratio!r}, k={k!r})")
    if k is not None:
        return None, checks.integer("k", k, note="it is clipped to the tensor's numel", where=cls_name)
    if ratio is None:
        ratio = DEFAULT_RATIO
    return checks.share("ratio", ratio, zero=False, note="the fraction of entries kept", where=cls_name), None


def resolve_k(numel: int, ratio: float | None = None, k: int | None = None) -> int:
    """The number of entries kept from a tensor of ``numel`` elements.

    ``k`` given: ``min(k, numel)``. ``ratio`` given: ``max(1, round(ratio * numel))`` clipped to
    ``numel`` (Python's ``round``, half to even), so a tiny tensor still sends one entry rather than
    nothing. 0 only for an empty tensor.
    """
    if numel == 0:
        return 0
    if k is not None:
        return min(k, numel)
    return min(numel, max(1, round(ratio * numel)))


def _topk_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending, int64) of the k largest entries of the 1-D ``magnitude``; ties -> lower index.

    ``torch.topk`` does not promise which of several equal values it returns, and a compressor whose
    output depends on that would differ between runs and devices. Its *values* are well defined, so:
    take the k-th largest magnitude t, keep every entry above t, and fill up with the lowest-indexed
    entries equal to t. O(numel), deterministic. One comparison and one ``nonzero`` over the tensor find
    both kinds at once (``>= t``, in ascending index order); the ties beyond the k are dropped from that
    short list.
    """
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=magnitude.device)
    if k == magnitude.numel():
        return torch.arange(k, device=magnitude.device)
    threshold = torch.topk(magnitude, k, sorted=False).values.min()
    candidates = torch.nonzero(magnitude >= threshold).view(-1)
    if candidates.numel() == k:
        return candidates
    above = magnitude[candidates] > threshold
    ties_kept = (~above).cumsum(0) <= k - int(above.sum())
    return candidates[above | ties_kept]


class TopK:
    """Keep the k entries of largest magnitude; send (values, indices).

    Args:
        ratio: fraction of entries kept, in (0, 1]; ``k = max(1, round(ratio * numel))``, clipped to numel.
            Default 0.01 (the source article's 1%) when neither ratio nor k is given.
        k: a fixed number of entries instead of a fraction (>= 1, clipped to numel).

    Payload (for a tensor of ``numel`` elements, k as above):
        ``values``: the k kept entries, input dtype, in ascending index order.
        ``indices``: their flat (row-major) positions, int32 when numel < 2**31 else int64.
        ``nbytes = k * (element_size + index_size)``: Top-K of 10 float32 entries is 10*4 + 10*4 = 80 bytes,
        so it only pays when k < numel / 2 (for fp32 values and int32 indices).
        ``meta``: ``{"k": k}``.

    Ties in magnitude go to the lower index, so the result is deterministic. ``linear`` is False: ranks
    choose different indices (see :mod:`commlab.compress.aggregate`). NaN/Inf input raises
    ``FloatingPointError`` (:func:`commlab.compress.base.check_finite`).

    Source: Aji & Heafield 2017 (EMNLP) §2; Lin et al. 2018, Deep Gradient Compression (ICLR) §3.
    """

    linear = False

    def __init__(self, ratio: float | None = None, k: int | None = None):
        self.ratio, self.k = _validate_ratio_k("TopK", ratio, k)
        self.name = f"topk(k={self.k})" if self.k is not None else f"topk({self.ratio:g})"

    def k_for(self, numel: int) -> int:
        """Entries kept from a tensor of ``numel`` elements (see :func:`resolve_k`)."""
        return resolve_k(numel, self.ratio, self.k)

    def compress(self, tensor: torch.Tensor) -> Payload:
        check_finite(tensor, "TopK input")
        flat = tensor.detach().reshape(-1)
        k = self.k_for(flat.numel())
        idx = _topk_indices(flat.abs(), k)
        return Payload({"values": flat[idx], "indices": idx.to(index_dtype(flat.numel()))},
                       tensor.shape, tensor.dtype, {"k": k})

    def decompress(self, payload: Payload) -> torch.Tensor:
        return _scatter(payload)


def _scatter(payload: Payload, scale: float | None = None) -> torch.Tensor:
    """A zero tensor of the payload's shape and dtype with ``values`` written at ``indices``."""
    values, idx = payload.tensors["values"], payload.tensors["indices"]
    out = torch.zeros(math.prod(payload.shape), dtype=payload.dtype, device=values.device)
    if scale is not None and scale != 1:
        # (k = numel sends every entry: no scaling, so that integer tensors come back exact.)
        # Scale in at least float32: numel/k can exceed fp16's range-safe factors, and one rounding to
        # the output dtype is better than two.
        acc = torch.promote_types(values.dtype, torch.float32)
        values = (values.to(acc) * scale).to(payload.dtype)
    out[idx.long()] = values.to(payload.dtype)
    return out.view(payload.shape)


def topk_global(tensors: Sequence[torch.Tensor], ratio: float | None = None, k: int | None = None) -> list[Payload]:
    """Top-K over the concatenation of several tensors; one :class:`TopK`-format payload per tensor.

    The k largest magnitudes of the whole model (book §5.2): per-tensor counts then change from step to step
    and from rank to rank, so these payloads cannot be all-gathered as fixed-size tensors
    (:func:`commlab.compress.aggregate.aggregate` refuses them). Magnitudes are compared in the promoted dtype
    of all tensors (at least float32); ties go to the lower position in the concatenation.

    Args:
        tensors: the tensors, any shapes and floating dtypes.
        ratio, k: as in :class:`TopK`, applied to the total element count.

    Returns:
        ``[Payload]``, one per tensor in order, each decodable with ``TopK().decompress``; ``meta["k"]``
        is that tensor's share (possibly 0: empty values and indices). The shares sum to the global k.

    Raises:
        ValueError: bad ratio/k (as TopK). FloatingPointError: a non-finite input.
    """
    ratio, k = _validate_ratio_k("topk_global", ratio, k)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_finite(t, f"topk_global input {i}")
    if not tensors:
        return []
    acc = torch.float32
    for t in tensors:
        acc = torch.promote_types(acc, t.dtype)
    flats = [t.detach().reshape(-1) for t in tensors]
    sizes = [f.numel() for f in flats]
    magnitude = torch.cat([f.abs().to(acc) for f in flats])
    chosen = _topk_indices(magnitude, resolve_k(magnitude.numel(), ratio, k))
    payloads, start = [], 0
    for t, flat, size in zip(tensors, flats, sizes):
        # chosen is sorted, so each tensor's share is one contiguous slice of it.
        lo = int(torch.searchsorted(chosen, start))
        hi = int(torch.searchsorted(chosen, start + size))
        local = chosen[lo:hi] - start
        payloads.append(Payload({"values": flat[local], "indices": local.to(index_dtype(size))},
                                t.shape, t.dtype, {"k": hi - lo}))
        start += size
    return payloads


class RandomK:
    """Keep k entries at random indices shared by every rank; scale them by numel/k (unbiased).

    Args:
        ratio, k: as in :class:`TopK` (default ratio 0.01).
        seed: shared by all ranks (default 0). The indices of the ``step``-th call to :meth:`compress`
            come from a generator seeded with ``(seed, step)``, so ranks that call ``compress`` on the
            same sequence of tensors (as data-parallel ranks do, bucket by bucket) draw the same indices.

    Payload:
        ``values``: the k entries at the drawn indices, input dtype, unscaled; ``nbytes = k * element_size``.
        No indices are sent: both sides regenerate them from ``meta = {"k", "seed", "step"}``.
        ``decompress`` scatters them and multiplies by ``numel / k``: each entry is kept with probability
        k/numel, so E[decompress(compress(x))] = x. (Stich et al. 2018 §2 define rand_k without the
        factor, as a biased operator used with memory; the 1/p rescaling that makes a sparsifier unbiased
        is that of Wangni et al. 2018 §3, here with the uniform p = k/numel.)

    ``linear`` is True: with the same indices on every rank, summing payloads and then decompressing
    gives the sum of the decompressed tensors, so payloads ride an AllReduce. The price is variance:
    ``E||decompress - x||^2 = (numel/k - 1) ||x||^2``, which is why Random-K is usually paired with error
    feedback or used at modest compression.
    """

    linear = True

    def __init__(self, ratio: float | None = None, k: int | None = None, seed: int = 0):
        self.ratio, self.k = _validate_ratio_k("RandomK", ratio, k)
        checks.integer("seed", seed, least=0, note="the same on every rank", where="RandomK")
        self.seed = seed
        self.step = 0
        self.name = f"randomk(k={self.k})" if self.k is not None else f"randomk({self.ratio:g})"

    def k_for(self, numel: int) -> int:
        """Entries kept from a tensor of ``numel`` elements (see :func:`resolve_k`)."""
        return resolve_k(numel, self.ratio, self.k)

    @staticmethod
    def indices(numel: int, k: int, seed: int, step: int, device=None) -> torch.Tensor:
        """The k indices (ascending, int64) of call ``step``: a function of its arguments only.

        Drawn by numpy's PCG64 seeded with ``SeedSequence((seed, step))``, which hashes the whole pair into
        the generator's state: torch's CPU generator keeps only 32 bits of its seed, so a combined seed
        such as ``(seed << 32) + step`` would give every seed the same indices.
        """
        rng = np.random.default_rng([seed, step])
        idx = np.sort(rng.choice(numel, size=k, replace=False, shuffle=False)).astype(np.int64)
        return torch.from_numpy(idx).to(device)

    def compress(self, tensor: torch.Tensor) -> Payload:
        check_finite(tensor, "RandomK input")
        flat = tensor.detach().reshape(-1)
        k = self.k_for(flat.numel())
        step = self.step
        self.step += 1
        idx = self.indices(flat.numel(), k, self.seed, step, flat.device)
        return Payload({"values": flat[idx]}, tensor.shape, tensor.dtype,
                       {"k": k, "seed": self.seed, "step": step})

    def decompress(self, payload: Payload) -> torch.Tensor:
        numel, m = math.prod(payload.shape), payload.meta
        values = payload.tensors["values"]
        idx = self.indices(numel, m["k"], m["seed"], m["step"], values.device)
        scale = numel / m["k"] if m["k"] else 1.0
        return check_finite_output(
            _scatter(Payload({"values": values, "indices": idx}, payload.shape, payload.dtype), scale), "RandomK")
