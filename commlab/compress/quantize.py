"""Quantization: fewer bits per element (QSGD's stochastic levels; deterministic INT8/INT4 rounding).

Both quantizers send codes plus one float32 scale per tensor, and the scale differs from rank to rank,
so two ranks' codes cannot be added: neither is linear, and their payloads are all-gathered
(:mod:`commlab.compress.aggregate`). This is where the source article goes wrong twice: it all-reduces a
dict of codes and scale, and its INT4 keeps each 4-bit code in a whole int8 byte. Here 4-bit codes are
packed two per byte (:func:`commlab.compress.bitpack.pack_nibbles`), so INT4 really sends half of
INT8's bytes.

Scales and norms travel as float32 whatever the input dtype: a bf16 scale would add its own 2**-8
relative error to every element, for a saving of 2 bytes per tensor.
"""

from __future__ import annotations

import math

import torch

from commlab.compress.base import Payload, check_finite, check_finite_output, float32_scale
from commlab.compress.bitpack import pack_nibbles, unpack_nibbles

__all__ = ["QSGD", "RoundingQuantizer", "qsgd_variance_bound"]

# Most levels a code of `bits` bits can hold: one bit for the sign, the rest for the level 0..s.
_MAX_LEVELS = {4: 7, 8: 127}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype: float64 for float64 input, else float32 (bf16/fp16 would round the levels)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _one_scalar(value: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 scale as a 1-element tensor; 0 elements for an empty input (nothing to scale)."""
    return value.to(torch.float32).reshape(1)[:1 if numel else 0]


def qsgd_variance_bound(numel: int, levels: int) -> float:
    """QSGD's variance bound, relative to ``||v||^2``: ``min(n / s^2, sqrt(n) / s)``.

    Alistarh et al. 2017, "QSGD: Communication-efficient SGD via gradient quantization and encoding"
    (NeurIPS), Lemma 3.1 (ii): ``E ||Q_s(v) - v||_2^2 <= min(n/s^2, sqrt(n)/s) ||v||_2^2`` for a vector of
    n elements quantized with s levels (one bucket, as :class:`QSGD` does).

    Raises:
        ValueError: ``numel < 0`` or ``levels < 1``.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1, got {levels!r}")
    return min(numel / levels ** 2, math.sqrt(numel) / levels)


class QSGD:
    """QSGD stochastic quantization with s levels: unbiased, one float32 norm per tensor.

    For ``v`` flattened to n elements: ``q_i = ||v||_2 * sign(v_i) * xi_i / s``, where ``xi_i`` is
    ``floor(r_i)`` or ``floor(r_i) + 1`` for ``r_i = s |v_i| / ||v||_2`` in [0, s], the latter with
    probability ``r_i - floor(r_i)``; so E[xi_i] = r_i and E[q] = v (Alistarh et al. 2017, NeurIPS,
    "QSGD", §3.1). Its variance is at most :func:`qsgd_variance_bound` times ``||v||^2`` (Lemma 3.1).
    The paper also splits v into buckets with a norm each and Elias-codes the levels (§3.2); this class
    uses one bucket per tensor and fixed-width codes, which is what a collective can move.

    Args:
        levels: s, in 1..127. Default 7 when neither argument is given: the most that fits 4 bits
            (sign + 3-bit level), i.e. 8x fewer bytes than float32 with a variance factor
            ``min(n/49, sqrt(n)/7)``.
        bits: 4 or 8 instead of ``levels``: s = 7 or 127, the most that the code width holds.
            Giving both is allowed if ``levels`` fits in ``bits``.
        seed: seeds this compressor's own generator (default 0). Give each rank a different seed
            (e.g. ``seed + rank``): with equal seeds the ranks' rounding errors are correlated and do not
            average out across ranks.

    Payload (n elements):
        ``codes``: sign and level per element. s <= 7: 4 bits each, nibble = ``negative << 3 | xi``,
            packed two per byte (uint8, ceil(n/2) bytes). 8 <= s <= 127, or ``bits=8``: int8 ``+-xi``
            (n bytes).
        ``norm``: ``||v||_2`` as float32 (4 bytes; none for an empty tensor).
        ``meta``: ``{"levels": s, "bits": 4 or 8}``.

    ``linear`` is False (each rank has its own norm). All-zero input gives all-zero output (no division
    by a zero norm); NaN/Inf input raises ``FloatingPointError``.
    """

    linear = False

    def __init__(self, levels: int | None = None, bits: int | None = None, seed: int = 0):
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or bits not in _MAX_LEVELS):
            raise ValueError(f"QSGD: bits must be 4 or 8 (codes packed two per byte, or one int8 each), got {bits!r}")
        if levels is None:
            levels = _MAX_LEVELS[bits] if bits is not None else 7
        if isinstance(levels, bool) or not isinstance(levels, int) or not (1 <= levels <= 127):
            raise ValueError(f"QSGD: levels (s) must be an int in 1..127 (a sign and a level 0..s must fit in "
                             f"8 bits), got {levels!r}")
        if bits is None:
            bits = 4 if levels <= _MAX_LEVELS[4] else 8
        elif levels > _MAX_LEVELS[bits]:
            raise ValueError(f"QSGD: {levels} levels do not fit in {bits}-bit codes (at most "
                             f"{_MAX_LEVELS[bits]}: one bit is the sign); use bits=8 or levels <= {_MAX_LEVELS[bits]}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"QSGD: seed must be an int >= 0, got {seed!r}")
        self.levels, self.bits, self.seed = levels, bits, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.name = f"qsgd(s={levels},{bits}bit)"

    def compress(self, tensor: torch.Tensor) -> Payload:
        check_finite(tensor, "QSGD input")
        acc = _acc_dtype(tensor.dtype)
        v = tensor.detach().reshape(-1).to(acc)
        n, s = v.numel(), self.levels
        # The norm is computed in float64 (no overflow of the squares) and rounded to float32 *before*
        # it is used, so that the sender's levels are relative to exactly the norm the receiver sees.
        norm32 = (float32_scale(torch.linalg.vector_norm(v.to(torch.float64)), "QSGD norm ||v||_2") if n
                  else torch.zeros((), dtype=torch.float32, device=v.device))
        norm = norm32.to(acc)
        if n and norm > 0:
            r = (v.abs() / norm * s).clamp_(max=s)
            low = r.floor()
            # Uniforms drawn on the CPU generator so that the stream does not depend on the device.
            u = torch.rand(n, generator=self.generator, dtype=acc).to(v.device)
            xi = (low + (u < (r - low)).to(acc)).clamp_(max=s).to(torch.int16)
        else:
            xi = torch.zeros(n, dtype=torch.int16, device=v.device)
        negative = v < 0
        if self.bits == 4:
            codes = pack_nibbles((negative.to(torch.int16) << 3) | xi)
        else:
            codes = torch.where(negative, -xi, xi).to(torch.int8)
        return Payload({"codes": codes, "norm": _one_scalar(norm32, n)}, tensor.shape, tensor.dtype,
                       {"levels": s, "bits": self.bits})

    def decompress(self, payload: Payload) -> torch.Tensor:
        n = math.prod(payload.shape)
        codes, norm = payload.tensors["codes"], payload.tensors["norm"]
        acc = _acc_dtype(payload.dtype)
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=codes.device)
        if payload.meta["bits"] == 4:
            nib = unpack_nibbles(codes, n).to(torch.int16)
            signed = torch.where(nib >= 8, -(nib & 7), nib & 7)
        else:
            signed = codes.to(torch.int16)
        out = signed.to(acc) * (norm.to(acc) / payload.meta["levels"])
        return check_finite_output(out.to(payload.dtype).view(payload.shape), "QSGD")


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
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in _MAX_LEVELS:
            raise ValueError(f"RoundingQuantizer: bits must be 8 (INT8) or 4 (INT4, two codes per byte), got {bits!r}")
        self.bits = bits
        self.qmax = _MAX_LEVELS[bits]
        self.name = f"int{bits}"

    def compress(self, tensor: torch.Tensor) -> Payload:
        check_finite(tensor, "RoundingQuantizer input")
        acc = _acc_dtype(tensor.dtype)
        v = tensor.detach().reshape(-1).to(acc)
        n = v.numel()
        scale32 = (float32_scale(v.abs().max().to(torch.float64) / self.qmax, "RoundingQuantizer scale") if n
                   else torch.zeros((), dtype=torch.float32, device=v.device))
        if n and scale32 > 0:
            codes = torch.round(v / scale32.to(acc)).clamp_(-self.qmax, self.qmax).to(torch.int8)
        else:
            codes = torch.zeros(n, dtype=torch.int8, device=v.device)
        if self.bits == 4:
            codes = pack_nibbles(codes.to(torch.int16) + 8)
        return Payload({"codes": codes, "scale": _one_scalar(scale32, n)}, tensor.shape, tensor.dtype,
                       {"bits": self.bits})

    def decompress(self, payload: Payload) -> torch.Tensor:
        n = math.prod(payload.shape)
        codes, scale = payload.tensors["codes"], payload.tensors["scale"]
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=codes.device)
        if payload.meta["bits"] == 4:
            signed = unpack_nibbles(codes, n).to(torch.int16) - 8
        else:
            signed = codes
        acc = _acc_dtype(payload.dtype)
        return check_finite_output((signed.to(acc) * scale.to(acc)).to(payload.dtype).view(payload.shape),
                                   "RoundingQuantizer")
