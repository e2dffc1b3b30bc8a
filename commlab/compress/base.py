"""The one small protocol every compressor follows (chapters 4-7).

``compress(tensor) -> Payload`` and ``decompress(payload) -> tensor`` of the original shape and dtype. A
:class:`Payload` holds exactly the tensors that would travel on the wire (values, indices, packed bits,
low-rank factors, scales), so its :attr:`~Payload.nbytes` is the true message size, and
``compression ratio = dense bytes / payload bytes``.

Two properties decide how a compressor's payloads can be aggregated across ranks
(:mod:`commlab.compress.aggregate`):

* ``linear``: adding payloads element-wise and then decompressing gives the sum of the decompressed
  tensors (casting to fp16; Random-K with indices shared by all ranks). Such payloads can ride an
  AllReduce, including a ring, which adds them hop by hop.
* otherwise (Top-K, quantizers with per-rank scales, sign): a sum of payloads means nothing (two ranks'
  Top-K indices differ; two int8 codes with different scales cannot be added), so payloads are
  all-gathered and each rank decompresses and sums them.

NaN/Inf policy (all compressors): :func:`check_finite` raises ``FloatingPointError`` naming the tensor
when its input holds a NaN or an infinity, before anything is compressed. A silently compressed NaN
would otherwise be hidden by a scale or a selection and corrupt every rank's model; training code that
wants to skip such a step (as AMP's grad scaler does) catches the error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable

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


def check_finite(tensor: torch.Tensor, what: str = "tensor") -> None:
    """Raise ``FloatingPointError`` if ``tensor`` holds a NaN or an infinity (the compressors' policy)."""
    if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(tensor).all():
        n_nan = int(torch.isnan(tensor).sum())
        n_inf = int(torch.isinf(tensor).sum())
        raise FloatingPointError(f"{what} holds {n_nan} NaN and {n_inf} infinite values out of {tensor.numel()}; "
                                 "compression refuses non-finite input (skip this step, or fix its cause)")


def compression_ratio(tensor: torch.Tensor, payload: Payload) -> float:
    """Dense bytes of ``tensor`` divided by ``payload.nbytes``."""
    dense = tensor.numel() * tensor.element_size()
    return math.inf if payload.nbytes == 0 and dense else (dense / payload.nbytes if payload.nbytes else 1.0)
