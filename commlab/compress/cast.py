"""Casting to a 16-bit float: the simplest compressor, and PyTorch's ``fp16_compress_hook``.

:class:`CastCompressor`: the payload is the tensor cast to ``float16`` or ``bfloat16`` (IEEE 754-2008
binary16; bfloat16, Kalamkar et al. 2019, arXiv:1905.12322), ratio exactly 2 for float32 input (4 for
float64); decompression casts back. Each element is rounded to nearest-even once. A float16 overflow
(magnitude at or above 65520) raises ``FloatingPointError`` (:func:`commlab.compress.base.check_finite`)
instead of sending an infinity; underflow is silent rounding. ``linear = True``: payloads ride an
AllReduce, summed in the 16-bit dtype, so the hooks divide by N before casting, as PyTorch's does
(:func:`commlab.compress.hooks.compression_hook`).

Book: chapter 6, §6.5 (range, precision and the fp16 hook); chapter 4, §4.7 (NaN and Inf).
"""

from __future__ import annotations

import torch

from commlab.compress.base import Payload, all_finite, check_finite

__all__ = ["CastCompressor"]

_ALLOWED = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class CastCompressor:
    """Cast to ``float16`` or ``bfloat16`` on the wire; cast back on arrival.

    Args:
        dtype: ``torch.float16`` (default: the dtype of PyTorch's ``fp16_compress_hook``, supported by
            every GPU's and CPU's kernels; largest finite 65504) or ``torch.bfloat16`` (float32's range, 3
            fewer mantissa bits).

    Raises:
        ValueError: another dtype.
    """

    linear = True

    def __init__(self, dtype: torch.dtype = torch.float16):
        if dtype not in _ALLOWED:
            raise ValueError(f"CastCompressor casts to torch.float16 or torch.bfloat16, got {dtype!r}; "
                             "for 8-bit or fewer bits use a quantizer (commlab.compress.quantize)")
        self.dtype = dtype
        self.name = f"cast-{_ALLOWED[dtype]}"

    def __repr__(self) -> str:
        return f"CastCompressor(dtype={self.dtype})"

    def compress(self, tensor: torch.Tensor) -> Payload:
        """Cast ``tensor`` to :attr:`dtype`. The payload holds one tensor, ``"values"``, of the same shape.

        Raises:
            TypeError: ``tensor`` is not floating point (a cast of integers is not a gradient compressor).
            FloatingPointError: ``tensor`` holds NaN or inf, or a finite value too large for
                :attr:`dtype` (it would become inf).
        """
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} compresses floating-point tensors, got {tensor.dtype}")
        values = tensor.to(self.dtype)
        # Checking the (smaller) cast result catches all three cases: NaN and inf in the input stay NaN and
        # inf, and an overflow shows up as a new inf (all_finite reads it once, with no mask). Only then do we
        # look at the input, to tell the reader which case it was.
        if not all_finite(values):
            check_finite(tensor, f"{self.name} input")
            too_big = tensor.abs() > torch.finfo(self.dtype).max
            raise FloatingPointError(
                f"{self.name}: {int(too_big.sum())} of {tensor.numel()} values exceed the largest finite "
                f"{self.dtype} ({torch.finfo(self.dtype).max:g}); the largest magnitude is "
                f"{float(tensor.abs().max()):g}. Scale the tensor down before casting, or use "
                "CastCompressor(torch.bfloat16), which has float32's range")
        return Payload({"values": values}, tensor.shape, tensor.dtype, {})

    def decompress(self, payload: Payload) -> torch.Tensor:
        """Cast ``payload.tensors["values"]`` back to ``payload.dtype`` (exact: every 16-bit value is representable)."""
        return payload.tensors["values"].to(payload.dtype).reshape(payload.shape)
