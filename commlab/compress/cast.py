"""Casting to a 16-bit float: the simplest compressor, and PyTorch's ``fp16_compress_hook`` (chapter 4).

The payload is the tensor cast to ``float16`` or ``bfloat16``: 2 bytes per element instead of 4 for
float32, so the ratio is exactly 2 (4 for float64 input). Decompression casts back to the original dtype.

Range and precision (IEEE 754-2008 binary16; Google's bfloat16, Kalamkar et al. 2019, "A Study of
BFLOAT16 for Deep Learning Training", arXiv:1905.12322):

========== ============ ================ ====================== =========================
dtype      mantissa     largest finite   smallest normal        smallest subnormal
========== ============ ================ ====================== =========================
float16    10 bits      65504            6.1e-05                6.0e-08
bfloat16   7 bits       3.4e38           1.2e-38                9.2e-41
========== ============ ================ ====================== =========================

* **Overflow** (float16 only, in practice): a value of magnitude above 65504 (more exactly, at or above
  65520, which rounds up) becomes ``inf``. Following the package's NaN/Inf policy
  (:func:`commlab.compress.base.check_finite`), :meth:`CastCompressor.compress` raises
  ``FloatingPointError`` instead of sending an infinity that would poison every rank's model. The cure is
  to scale the gradient down first (AMP's loss scaling in reverse) or to use bfloat16, which has float32's
  exponent range.
* **Underflow** is silent: values below half the smallest subnormal become 0 and small values lose
  relative precision (float16 keeps only absolute precision of 6e-8 below 6.1e-5). Mixed-precision
  training scales the loss up for this reason (Micikevicius et al. 2018, "Mixed Precision Training",
  ICLR). Nothing is raised: losing a tiny gradient component is rounding, not corruption.
* **Rounding**: each element is rounded to nearest-even once (relative error up to 2^-11 for float16,
  2^-8 for bfloat16).

``linear = True``: casts of several ranks can be summed element-wise and the sum decompressed, so the
payload rides an ordinary AllReduce. The sum itself is then computed in the 16-bit dtype, so each of the
N-1 additions of a ring rounds again, and a sum of N float16 values can overflow even when each value
fits; hooks therefore divide by N *before* casting (as PyTorch's ``fp16_compress_hook`` divides before
summing), see :func:`commlab.compress.hooks.compression_hook`.
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
            every GPU's and CPU's kernels; beware its small range, see the module docstring) or
            ``torch.bfloat16`` (float32's range, 3 fewer mantissa bits).

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
