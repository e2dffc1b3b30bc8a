"""Quantization: fewer bits per element (QSGD's stochastic levels; deterministic INT8/INT4 rounding).

Both quantizers send codes plus float32 scales (QSGD: one norm per bucket of entries; INT8/INT4: one scale
per tensor), and the scales differ from rank to rank, so two ranks' codes cannot be added: neither is
linear, and their payloads are all-gathered or reduced in two phases, the owner of each chunk requantizing
the sum (:mod:`commlab.compress.aggregate`, :mod:`commlab.compress.two_phase`). This is where the source
article goes wrong twice: it all-reduces a dict of codes and scale, and its INT4 keeps each 4-bit code in a
whole int8 byte. Here 4-bit codes are packed two per byte (:func:`commlab.compress.bitpack.pack_nibbles`),
so INT4 really sends half of INT8's bytes.

Scales and norms travel as float32 whatever the input dtype: a bf16 scale would add its own 2**-8
relative error to every element, for a saving of 2 bytes per scale.
"""

from __future__ import annotations

import math

import torch

from commlab import checks
from commlab.compress.base import (Payload, check_finite, check_finite_output, float32_scale, float64_pieces,
                                   output_fits)
from commlab.compress.bitpack import decode_bytes, nibble_table, pack_nibbles

__all__ = ["QSGD", "RoundingQuantizer", "qsgd_variance_bound", "QSGD_BUCKET_SIZE"]

# Most levels a code of `bits` bits can hold: one bit for the sign, the rest for the level 0..s.
_MAX_LEVELS = {4: 7, 8: 127}

#: QSGD's default bucket: entries that share one norm. Alistarh et al. 2017 quantize buckets of d consecutive
#: entries, each with its own norm (which replaces n by d in the variance bound), and 512 is the bucket size of
#: their 4-bit experiments.
QSGD_BUCKET_SIZE = 512


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype: float64 for float64 input, else float32 (bf16/fp16 would round the levels)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _one_scalar(value: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 scale as a 1-element tensor; 0 elements for an empty input (nothing to scale)."""
    return value.to(torch.float32).reshape(1)[:1 if numel else 0]


def _check_bucket_size(bucket_size, what: str) -> None:
    if bucket_size is not None:
        checks.integer("bucket_size", bucket_size, where=what, note=f"entries per norm; the paper's is "
                       f"{QSGD_BUCKET_SIZE}; or None: one bucket for the whole tensor")


def _bucket_entries(bucket_size: int | None, numel: int) -> int:
    """Entries per bucket for a tensor of ``numel``: the whole tensor for None, never more than it holds."""
    return numel if bucket_size is None else min(bucket_size, numel)


def _per_bucket(x: torch.Tensor, d: int, values: torch.Tensor, op) -> None:
    """``op(x_b, values[b])`` in place on each bucket of ``d`` consecutive entries of the 1-D ``x`` (the last
    bucket holds what is left, possibly fewer than ``d``)."""
    full = x.numel() // d * d
    if full:
        op(x[:full].view(-1, d), values[:full // d, None])
    if full < x.numel():
        op(x[full:], values[-1])


def qsgd_variance_bound(numel: int, levels: int, bucket_size: int | None = QSGD_BUCKET_SIZE) -> float:
    """QSGD's variance bound, relative to ``||v||^2``: ``min(d / s^2, sqrt(d) / s)`` for buckets of d entries.

    Alistarh et al. 2017 (NeurIPS), Lemma 3.1 (ii), with the tensor's n replaced by the bucket size d: each
    bucket has its own norm, their errors are independent and add, and the bound grows with d (book §6.3). A
    shorter last bucket only lowers it.

    Args:
        numel: n, entries of the tensor (>= 0).
        levels: s (>= 1).
        bucket_size: d, entries per norm (default :data:`QSGD_BUCKET_SIZE`, as :class:`QSGD`); None for one
            bucket (d = n). A tensor smaller than d is one bucket of n.

    Raises:
        ValueError: ``numel < 0``, ``levels < 1`` or ``bucket_size < 1``.
    """
    checks.integer("numel", numel, least=0)
    checks.integer("levels", levels)
    _check_bucket_size(bucket_size, "qsgd_variance_bound")
    d = _bucket_entries(bucket_size, numel)
    return min(d / levels ** 2, math.sqrt(d) / levels)


class QSGD:
    """QSGD stochastic quantization with s levels, in buckets of d entries with one float32 norm each: unbiased.

    For each bucket ``v``: ``q_i = ||v||_2 * sign(v_i) * xi_i / s``, where ``xi_i`` rounds ``r_i = s |v_i| / ||v||_2``
    stochastically to a neighbouring integer so that E[q] = v (Alistarh et al. 2017, "QSGD", NeurIPS, §3.1).
    Variance at most :func:`qsgd_variance_bound` x ``||v||^2`` (Lemma 3.1). Fixed-width codes, not the paper's
    Elias codes (§3.2): that is what a collective can move. Derivations: book chapter 6, §6.3.

    Args:
        levels: s, in 1..127. Default 7 when neither argument is given (sign + 3-bit level fit 4 bits).
        bits: 4 or 8 instead of ``levels``: s = 7 or 127. Both may be given if ``levels`` fits in ``bits``.
        seed: seeds this compressor's own generator (default 0); give each rank its own (e.g. ``seed + rank``)
            so that the ranks' rounding errors average out.
        bucket_size: d, consecutive (row-major) entries sharing one norm; default :data:`QSGD_BUCKET_SIZE`
            (512, the paper's). None: one bucket for the whole tensor. A short last bucket has its own norm.

    Payload (n elements, m = ceil(n / d) buckets):
        ``codes``: s <= 7: 4-bit nibbles ``negative << 3 | xi``, two per uint8 (ceil(n/2) bytes); else int8
            ``+-xi`` (n bytes).
        ``norm``: float32 norm of each bucket (4m bytes). ``meta``: ``{"levels", "bits", "bucket_size"}``.

    ``linear`` is False (each rank has its own norms). An all-zero bucket gives zeros; NaN/Inf input, or a
    bucket norm float32 cannot hold, raises ``FloatingPointError``. One CPU uniform per element whatever d,
    so a seed gives the same draws for every d and device.
    """

    linear = False

    def __init__(self, levels: int | None = None, bits: int | None = None, seed: int = 0,
                 bucket_size: int | None = QSGD_BUCKET_SIZE):
        if bits is not None:
            checks.one_of("bits", bits, (4, 8), note="codes packed two per byte, or one int8 each", where="QSGD")
        if levels is None:
            levels = _MAX_LEVELS[bits] if bits is not None else 7
        checks.integer("levels (s)", levels, 1, 127, note="a sign and a level 0..s must fit in 8 bits", where="QSGD")
        if bits is None:
            bits = 4 if levels <= _MAX_LEVELS[4] else 8
        elif levels > _MAX_LEVELS[bits]:
            raise ValueError(f"QSGD: {levels} levels do not fit in {bits}-bit codes (at most "
                             f"{_MAX_LEVELS[bits]}: one bit is the sign); use bits=8 or levels <= {_MAX_LEVELS[bits]}")
        checks.integer("seed", seed, least=0, where="QSGD")
        _check_bucket_size(bucket_size, "QSGD")
        self.levels, self.bits, self.seed, self.bucket_size = levels, bits, seed, bucket_size
        self.generator = torch.Generator().manual_seed(seed)
        self.name = f"qsgd(s={levels},{bits}bit,d={'n' if bucket_size is None else bucket_size})"

    def _norms(self, tensor: torch.Tensor, flat: torch.Tensor, d: int) -> torch.Tensor:
        """The float32 norm of each bucket: computed in float64 (no overflow of the squares) and rounded to
        float32 *before* it is used, so that the sender's levels are relative to exactly the norms the
        receiver sees. Raises on NaN/Inf input and on a norm that float32 cannot hold."""
        n = flat.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.float32, device=flat.device)
        full = n // d * d
        norms = torch.empty(-(-n // d), dtype=torch.float64, device=flat.device)
        for start, piece in float64_pieces(flat[:full], d):
            b = start // d
            torch.linalg.vector_norm(piece.view(-1, d), dim=1, out=norms[b:b + piece.numel() // d])
        if full < n:
            norms[-1] = torch.linalg.vector_norm(flat[full:].to(torch.float64))
        # A NaN or inf anywhere makes its bucket's norm non-finite: only then is the input searched.
        if not bool(torch.isfinite(norms).all()):
            check_finite(tensor, "QSGD input")
        norm32 = norms.to(torch.float32)
        bad = ~torch.isfinite(norm32) | ((norms > 0) & (norm32 == 0))
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            float32_scale(norms[b], f"QSGD norm ||v||_2 of bucket {b} (entries {b * d}..{min(n, b * d + d) - 1})")
        return norm32

    def compress(self, tensor: torch.Tensor) -> Payload:
        flat = tensor.detach().reshape(-1)
        n, s = flat.numel(), self.levels
        d = _bucket_entries(self.bucket_size, n)
        norm32 = self._norms(tensor, flat, d)
        acc = _acc_dtype(tensor.dtype)
        negative = flat < 0
        nonzero = norm32 > 0
        if n and bool(nonzero.any()):
            # r = s |v| / ||v_b||, in place in one buffer (fresh float buffers are what costs most on a CPU).
            # An all-zero bucket is divided by 1 instead of 0: its r is 0, so its levels are 0.
            r = flat.to(acc, copy=True).abs_()
            _per_bucket(r, d, torch.where(nonzero, norm32, 1.0).to(acc), torch.Tensor.div_)
            r.mul_(s).clamp_(max=s)
            low = r.floor()
            r -= low                        # the fractional part: the probability of rounding up
            xi = low.to(torch.uint8)
            # Uniforms drawn on the CPU generator so that the stream does not depend on the device; on a CPU
            # they go into low's memory, which is no longer needed.
            if flat.device.type == "cpu":
                u = low.uniform_(generator=self.generator)
            else:
                u = torch.rand(n, generator=self.generator, dtype=acc).to(flat.device)
            # xi <= s needs no clamp: r < s gives floor(r) <= s - 1, and r = s has no fractional part.
            xi += u < r
        else:
            xi = torch.zeros(n, dtype=torch.uint8, device=flat.device)
        if self.bits == 4:
            xi.add_(negative.view(torch.uint8), alpha=8)   # nibble = negative << 3 | xi (xi < 8)
            codes = pack_nibbles(xi, check=False)
        else:
            xi = xi.view(torch.int8)
            codes = torch.where(negative, -xi, xi)
        return Payload({"codes": codes, "norm": norm32}, tensor.shape, tensor.dtype,
                       {"levels": s, "bits": self.bits, "bucket_size": self.bucket_size})

    def decompress(self, payload: Payload) -> torch.Tensor:
        n = math.prod(payload.shape)
        codes, norm = payload.tensors["codes"], payload.tensors["norm"]
        acc = _acc_dtype(payload.dtype)
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=codes.device)
        s = payload.meta["levels"]
        if payload.meta["bits"] == 4:
            # Each byte straight to its two signed levels (nibble q: -(q & 7) if q >= 8, else q).
            nib = nibble_table(codes.device)
            out = decode_bytes(torch.where(nib >= 8, -(nib & 7), nib & 7).to(acc), codes, n)
        else:
            out = codes.to(acc)
        scale = norm.to(acc) / s
        _per_bucket(out, _bucket_entries(payload.meta.get("bucket_size"), n), scale, torch.Tensor.mul_)
        out = out.to(payload.dtype).view(payload.shape)
        # No output exceeds s times the largest scale, so the full pass is needed only if that does not fit.
        return out if output_fits(scale.max() * s, payload.dtype) else check_finite_output(out, "QSGD")


class RoundingQuantizer:
    """Deterministic INT8/INT4: round to nearest on a per-tensor max-abs scale.

    ``scale = max|v| / qmax`` (float32) with ``qmax = 2**(bits-1) - 1`` (127 or 7, symmetric so that 0 is
    exact); ``code_i = round(v_i / scale)`` in [-qmax, qmax] (round half to even); decompress gives
    ``code_i * scale``. The error per element is at most ``scale / 2``.

    Biased, unlike :class:`QSGD`: the same input always rounds the same way, so every entry with
    ``|v_i| < scale / 2`` becomes 0 at every step, and a small but persistent gradient component is lost
    for good. Error feedback (:class:`commlab.compress.error_feedback.ErrorFeedback`) removes that bias
    by carrying the rounding error to the next step.

    Args:
        bits: 8 (default: error at most max|v|/254 per element, 4x fewer bytes than float32) or 4 (error up
            to max|v|/14, 8x fewer bytes).

    Payload (n elements):
        ``codes``: bits=8: int8, one per element (n bytes). bits=4: ``code + 8`` in 1..15 packed two per
            byte with :func:`commlab.compress.bitpack.pack_nibbles` (ceil(n/2) bytes). INT4 of 7 elements
            is 4 + 4 = 8 bytes against INT8's 7 + 4 = 11.
        ``scale``: float32 (4 bytes; none for an empty tensor).
        ``meta``: ``{"bits": bits}``.

    ``linear`` is False (per-rank scales). All-zero input has scale 0 and decompresses to zeros. NaN/Inf
    input raises ``FloatingPointError``.
    """

    linear = False

    def __init__(self, bits: int = 8):
        checks.one_of("bits", bits, (8, 4), note="INT8, or INT4 with two codes per byte", where="RoundingQuantizer")
        self.bits = bits
        self.qmax = _MAX_LEVELS[bits]
        self.name = f"int{bits}"

    def compress(self, tensor: torch.Tensor) -> Payload:
        flat = tensor.detach().reshape(-1)
        n = flat.numel()
        acc = _acc_dtype(tensor.dtype)
        if n:
            # max |v| from one min/max pass; a NaN or inf makes it non-finite, and only then is the input searched.
            lo, hi = torch.aminmax(flat)
            amax = torch.maximum(-lo, hi).to(torch.float64)
            if not bool(torch.isfinite(amax)):
                check_finite(tensor, "RoundingQuantizer input")
            scale32 = float32_scale(amax / self.qmax, "RoundingQuantizer scale")
        else:
            scale32 = torch.zeros((), dtype=torch.float32, device=flat.device)
        if n and scale32 > 0:
            # One buffer, rounded and clamped in place. The clamp matters only for a subnormal scale, whose
            # few significant bits can put max|v| / scale beyond qmax + 0.5.
            q = flat.to(acc, copy=True).div_(scale32.to(acc)).round_().clamp_(-self.qmax, self.qmax)
            codes = q.to(torch.int8)
        else:
            codes = torch.zeros(n, dtype=torch.int8, device=flat.device)
        if self.bits == 4:
            codes = pack_nibbles(codes.add_(8).view(torch.uint8), check=False)
        return Payload({"codes": codes, "scale": _one_scalar(scale32, n)}, tensor.shape, tensor.dtype,
                       {"bits": self.bits})

    def decompress(self, payload: Payload) -> torch.Tensor:
        n = math.prod(payload.shape)
        codes, scale = payload.tensors["codes"], payload.tensors["scale"]
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=codes.device)
        acc = _acc_dtype(payload.dtype)
        if payload.meta["bits"] == 4:
            out = decode_bytes((nibble_table(codes.device) - 8).to(acc), codes, n)
        else:
            out = codes.to(acc)
        out.mul_(scale.to(acc))
        out = out.to(payload.dtype).view(payload.shape)
        largest = scale.to(acc) * _MAX_LEVELS[payload.meta["bits"]]
        return out if output_fits(largest, payload.dtype) else check_finite_output(out, "RoundingQuantizer")
