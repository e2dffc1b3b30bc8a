"""Scaled sign compression: one bit per element plus one float32 scale (or one per segment of the input).

signSGD (Bernstein et al. 2018, "signSGD: Compressed optimisation for non-convex problems", ICML, Algorithm 1)
sends ``sign(g)``; Karimireddy et al. 2019 ("Error feedback fixes SignSGD and other gradient compression
schemes", ICML, §3, the compressor ``C(v) = ||v||_1 / d * sign(v)``) scale it by the mean magnitude so
that the result has the gradient's size, and add error feedback
(:class:`commlab.compress.error_feedback.ErrorFeedback`) so that what the sign loses is sent later.

A sign compressor written with ``torch.sign`` (as the "1-bit" compression the source article lists
in its §5.2 table invites) keeps one sign per byte or per float and maps 0 to 0, a third value that one
bit cannot hold. Here the bits are packed 8 per byte and 0 maps to +1.
"""

from __future__ import annotations

import math

import torch

from typing import Sequence

from commlab import checks
from commlab.compress.base import Payload, check_finite, check_finite_output, float32_scale, float64_pieces
from commlab.compress.bitpack import bit_table, decode_bytes, pack_bits_

__all__ = ["SignCompressor"]


class SignCompressor:
    """``mean|g| * sign(g)``, with sign(0) = +1, in ceil(n/8) + 4 bytes.

    Payload (n elements):
        ``bits``: uint8, ceil(n/8) bytes from :func:`commlab.compress.bitpack.pack_bits`; bit 1 means
            non-negative (``g_i >= 0``, which includes 0 and -0.0), bit 0 negative. A sign of 17 elements
            is 3 bytes + the 4-byte scale.
        ``scale``: ``mean |g_i|`` = ``||g||_1 / n`` as float32 (4 bytes; none for an empty tensor).
        ``meta``: empty.

    Why sign(0) = +1: a bit has two values, and some choice must be made; +1 for zero is the convention of
    ``g >= 0`` and costs nothing in expectation for gradients, where exact zeros are rare (except for
    all-zero tensors, whose scale 0 makes the output exactly 0 anyway).

    Biased (E[output] != g), and ``linear`` is False: each rank has its own scale, and a sum of bits is
    not a sign. Output dtype and shape are the input's. NaN/Inf input raises ``FloatingPointError``.

    Args:
        segments: None (default): one scale for the whole input. Otherwise the sizes of consecutive segments
            of the flattened input (e.g. the parameters of a gradient bucket), each scaled by its own mean
            ``|g|``: ``scale`` then holds one float32 per segment (an empty segment's is 0), ``meta`` the sizes.
            An attribute, so that a caller may set it for each bucket; ``compress`` raises ``ValueError`` when
            the sizes do not add up to the input's numel.
    """

    linear = False

    def __init__(self, segments: Sequence[int] | None = None):
        self.segments = segments

    @property
    def name(self) -> str:
        return "sign" if self.segments is None else "sign(per segment)"

    @property
    def segments(self) -> tuple[int, ...] | None:
        return self._segments

    @segments.setter
    def segments(self, sizes: Sequence[int] | None) -> None:
        if sizes is not None:
            sizes = tuple(checks.integer(f"segments[{i}]", v, least=0, where="SignCompressor")
                          for i, v in enumerate(sizes))
        self._segments = sizes

    def compress(self, tensor: torch.Tensor) -> Payload:
        flat = tensor.detach().reshape(-1)
        n = flat.numel()
        if self.segments is not None:
            if sum(self.segments) != n:
                raise ValueError(f"SignCompressor: segments add up to {sum(self.segments)} elements, the input has "
                                 f"{n}; give the sizes of the input's consecutive parts")
            scale = torch.stack([self._scale(part) for part in flat.split(self.segments)]) if self.segments else \
                torch.zeros(0, dtype=torch.float32, device=flat.device)
            return Payload({"bits": pack_bits_(flat >= 0), "scale": scale}, tensor.shape, tensor.dtype,
                           {"segments": self.segments})
        scale = self._scale(flat).reshape(1) if n else torch.zeros(0, dtype=torch.float32, device=flat.device)
        return Payload({"bits": pack_bits_(flat >= 0), "scale": scale}, tensor.shape, tensor.dtype, {})

    @staticmethod
    def _scale(flat: torch.Tensor) -> torch.Tensor:
        """mean |g| of a 1-D tensor as the float32 that is sent (0 for an empty one)."""
        n = flat.numel()
        if n == 0:
            return torch.zeros((), dtype=torch.float32, device=flat.device)
        # sum |g_i| in float64; a NaN or inf in the input makes it non-finite, and only then is the input
        # searched (check_finite), so a finite tensor is read once for its scale and once for its signs.
        total = sum(piece.abs_().sum() for _, piece in float64_pieces(flat))
        mean = total / n
        if not bool(torch.isfinite(mean)):
            check_finite(flat, "SignCompressor input")
        return float32_scale(mean, "sign scale mean|g|")

    def decompress(self, payload: Payload) -> torch.Tensor:
        n = math.prod(payload.shape)
        bits, scale = payload.tensors["bits"], payload.tensors["scale"]
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=bits.device)
        acc = torch.float64 if payload.dtype == torch.float64 else torch.float32
        segments = payload.meta.get("segments")
        if segments is not None:
            signs = decode_bytes(bit_table(bits.device).to(acc) * 2 - 1, bits, n)
            sizes = torch.tensor(segments, device=bits.device)
            out = (signs * scale.to(acc).repeat_interleave(sizes, output_size=n)).to(payload.dtype)
            return check_finite_output(out, "SignCompressor").view(payload.shape)
        # The 256 possible bytes decoded once to +-scale (in the output dtype), then one gather per byte. Every
        # output is +scale or -scale, so the table is finite exactly when the output is.
        table = ((bit_table(bits.device).to(acc) * 2 - 1) * scale.to(acc)).to(payload.dtype)
        check_finite_output(table, "SignCompressor")
        return decode_bytes(table, bits, n).view(payload.shape)
