"""The one small protocol every compressor follows.

``compress(tensor) -> Payload`` and ``decompress(payload) -> tensor`` of the original shape and dtype. A
:class:`Payload` holds exactly the tensors that would travel on the wire, so :attr:`~Payload.nbytes` is the
true message size and ``compression ratio = dense bytes / payload bytes``. ``linear`` says whether
payloads can be summed element-wise (they ride an AllReduce) or must be all-gathered
(:mod:`commlab.compress.aggregate`). NaN/Inf policy: :func:`check_finite` raises ``FloatingPointError``
naming the tensor before anything is compressed; :func:`float32_scale` and :func:`check_finite_output`
do the same for a scale or an output that overflows. Across ranks, :mod:`commlab.compress.agreement`
makes every rank raise together.

Book: chapter 4, §4.2 (the protocol), §4.3 (linear and non-linear), §4.7 (NaN and Inf).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class Payload:
    """What a compressor sends for one tensor.

    Attributes:
        tensors: the wire content, name -> tensor (e.g. ``{"values": ..., "indices": ...}``); only these
            count towards :attr:`nbytes`.
        shape, dtype: of the original tensor, to rebuild it.
        meta: small plain-Python facts both sides know without sending them (the chosen k, the number of
            levels, a shared seed); never data that differ between tensors of the same shape and dtype.
    """

    tensors: dict[str, torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the sum over :attr:`tensors` of ``numel * element_size``."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the uncompressed tensor."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def ratio(self) -> float:
        """dense bytes / payload bytes (inf for an empty payload of a non-empty tensor; 1 for empty)."""
        if self.nbytes == 0:
            return 1.0 if self.dense_nbytes == 0 else math.inf
        return self.dense_nbytes / self.nbytes


@runtime_checkable
class Compressor(Protocol):
    """A compressor: a name, whether payloads can be summed, and the two functions."""

    name: str
    linear: bool

    def compress(self, tensor: torch.Tensor) -> Payload: ...

    def decompress(self, payload: Payload) -> torch.Tensor: ...


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN and no infinity (True for other dtypes and empty tensors).

    One reading pass: a finite sum clears the tensor (NaN or inf make any sum non-finite); only a non-finite
    sum, which an overflowing sum of finite values can also give, falls back to ``isfinite(t).all()``.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def check_finite(tensor: torch.Tensor, what: str = "tensor") -> None:
    """Raise ``FloatingPointError`` if ``tensor`` holds a NaN or an infinity (the compressors' policy)."""
    if not all_finite(tensor):
        n_nan = int(torch.isnan(tensor).sum())
        n_inf = int(torch.isinf(tensor).sum())
        raise FloatingPointError(f"{what} holds {n_nan} NaN and {n_inf} infinite values out of {tensor.numel()}; "
                                 "compression refuses non-finite input (skip this step, or fix its cause)")


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which decompressed tensors of ``dtype`` are summed over ranks: at least float32 for floating
    point (float64 for float64), int64 for integers and bool, so that an integer sum is exact (float32 holds
    integers exactly only up to 2**24)."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.promote_types(dtype, torch.float32)
    return torch.int64


def divide_sum(total: torch.Tensor, n: int) -> torch.Tensor:
    """``total / n`` in place for floating point; for an integer sum, the quotient truncated towards zero (what
    a float mean cast back to an integer dtype gives, but exact)."""
    if total.is_floating_point() or total.is_complex():
        return total.div_(n)
    return total.div_(n, rounding_mode="trunc")


def float32_scale(value: torch.Tensor, what: str) -> torch.Tensor:
    """Round a non-negative scale (a norm, a max, a mean) computed in float64 to the float32 that is sent.

    Raises ``FloatingPointError`` when float32 cannot hold it: above about 3.4e38 the scale would become
    inf and the receiver would rebuild NaN or inf from finite input; a non-zero value below about 1e-45
    would become 0 and silently zero the whole tensor. Rescale such a tensor before compressing it.
    """
    v64 = value.to(torch.float64)
    v32 = v64.to(torch.float32)
    if not torch.isfinite(v32) or (v64 > 0 and v32 == 0):
        raise FloatingPointError(f"{what} = {float(v64):.3e} does not fit in the float32 that is sent "
                                 "(range about 1.4e-45 .. 3.4e38); rescale the tensor before compressing it")
    return v32


def check_finite_output(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Return ``tensor`` if finite, else raise ``FloatingPointError``: a decompressed value that overflows
    the original dtype (fp16 above 65504, say, after Random-K's ``numel/k`` scaling) is refused, not
    returned as inf."""
    if not all_finite(tensor):
        raise FloatingPointError(f"{what}: the decompressed values overflow {tensor.dtype} "
                                 f"(largest finite {torch.finfo(tensor.dtype).max:.4g}); compress in a wider dtype "
                                 "or rescale the tensor")
    return tensor


def output_fits(largest: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``largest`` (the largest magnitude a decoder can produce, computed the way it computes its
    outputs, e.g. ``levels * scale``) is finite once cast to ``dtype``.

    Rounding and casting are monotonic, so when it is, every output is finite and the full
    :func:`check_finite_output` pass over the outputs can be skipped; when it is not, that pass decides.
    """
    return bool(torch.isfinite(largest.to(dtype)).all())


#: Elements converted to float64 at a time on a CPU by :func:`float64_pieces`: 16 Ki (a 128 KiB buffer, which stays
#: in cache), half of torch's parallel grain size (``at::internal::GRAIN_SIZE``, 32768), so that each call on a
#: piece runs on the calling thread. Larger pieces are split over threads that must all finish every call; on a
#: machine whose cores are busy with other work, that wait costs far more than the arithmetic.
FLOAT64_CHUNK = 1 << 14


def float64_pieces(flat: torch.Tensor, multiple: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, flat[start:start + k] in float64)`` for consecutive pieces of a 1-D tensor.

    For the compressors' float64 norms and means without converting a large CPU tensor whole: each piece of at
    most ``max(FLOAT64_CHUNK, multiple)`` elements is converted into one reused buffer (valid until the next
    piece is yielded; the caller may overwrite it). Every piece but the last holds a multiple of ``multiple``
    elements; a tensor that fits in one piece (always, on a GPU) gives the result of
    ``flat.to(torch.float64)``. Sums over several pieces add in a different order than one reduction.
    """
    n = flat.numel()
    step = max(n, 1) if flat.device.type != "cpu" else max(1, FLOAT64_CHUNK // multiple) * multiple
    buffer = torch.empty(min(n, step), dtype=torch.float64, device=flat.device)
    for start in range(0, n, step):
        piece = buffer[:min(step, n - start)]
        piece.copy_(flat[start:start + step])
        yield start, piece


def compression_ratio(tensor: torch.Tensor, payload: Payload) -> float:
    """Dense bytes of ``tensor`` divided by ``payload.nbytes``."""
    dense = tensor.numel() * tensor.element_size()
    return math.inf if payload.nbytes == 0 and dense else (dense / payload.nbytes if payload.nbytes else 1.0)
