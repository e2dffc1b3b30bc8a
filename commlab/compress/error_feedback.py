"""Error feedback: remember what a compressor did not send, and add it to the next step's input.

Seide et al. 2014 ("1-bit stochastic gradient descent and its application to data-parallel distributed
training of speech DNNs", Interspeech, §3: "error feedback") quantized gradients to one bit and carried
the quantization error over to the next minibatch. Karimireddy et al. 2019 ("Error feedback fixes SignSGD
and other gradient compression schemes", ICML, §3, Algorithm 2 EF-SGD) show why: with the residual
added back, a biased compressor (sign, Top-K, deterministic rounding) converges like SGD, because nothing
is lost, only delayed.

State is explicit and per tensor (PyTorch's PowerSGD hook keeps its error dict the same way): each call
names the tensor with a ``key`` (a parameter name, a bucket index), and the residual of that key is
kept between calls. The source article keeps a single ``self.residual`` per compressor, so two layers
compressed by one object overwrite each other's residual.
"""

from __future__ import annotations

from typing import Hashable

import torch

from commlab.compress.base import Compressor, Payload

__all__ = ["ErrorFeedback", "check_error_feedback"]


class ErrorFeedback:
    """Wrap a compressor with per-key residuals: ``corrected = x + e; send C(corrected); e = corrected - sent``.

    Args:
        compressor: any :class:`commlab.compress.base.Compressor`.

    For each ``key``:

    1. ``corrected = tensor + residual[key]`` (residual 0 on the first call),
    2. ``payload = compressor.compress(corrected)``,
    3. ``residual[key] = corrected - compressor.decompress(payload)``, exactly what was not sent.

    The residual is kept in float32 for bfloat16/float16 tensors (float64 for float64): the small values
    error feedback exists to accumulate would otherwise be rounded away when added to a low-precision
    residual. ``corrected`` is rounded to the tensor's dtype before compression (the payload keeps the
    wire dtype), and that rounding is part of the residual too.

    When a key's tensor changes shape, dtype or device (a different bucket layout, a model cast to bf16)
    the old residual no longer lines up with the tensor, so it is dropped and the key starts again from
    zero; :meth:`residual` shows the new one. NaN/Inf input raises ``FloatingPointError`` (from the
    compressor) and leaves the residual unchanged.

    ``name`` is ``"ef-" + compressor.name``; ``linear`` is the compressor's: error feedback is local to each
    rank, so it does not change how payloads are aggregated.
    """

    def __init__(self, compressor: Compressor):
        if not all(hasattr(compressor, a) for a in ("compress", "decompress", "linear")):
            raise ValueError(f"ErrorFeedback needs a compressor with compress, decompress and linear "
                             f"(commlab.compress.base.Compressor), got {type(compressor).__name__}")
        self.compressor = compressor
        self.name = f"ef-{getattr(compressor, 'name', type(compressor).__name__)}"
        self.linear = compressor.linear
        # key -> (shape, dtype, device) of the tensor, residual in the accumulation dtype.
        self._state: dict[Hashable, tuple[tuple[torch.Size, torch.dtype, torch.device], torch.Tensor]] = {}

    @staticmethod
    def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    def compress(self, tensor: torch.Tensor, key: Hashable) -> Payload:
        """Compress ``tensor + residual(key)``, then store the new residual of ``key``.

        Returns the compressor's payload, for a tensor of ``tensor``'s shape and dtype.
        """
        if not tensor.is_floating_point():
            raise TypeError(f"ErrorFeedback needs a floating-point tensor (a residual is a real number), "
                            f"got {tensor.dtype} for key {key!r}")
        signature = (tensor.shape, tensor.dtype, tensor.device)
        acc = self._acc_dtype(tensor.dtype)
        corrected = tensor.detach().to(acc, copy=True)
        held = self._state.get(key)
        if held is not None and held[0] == signature:
            corrected += held[1]
        payload = self.compressor.compress(corrected.to(tensor.dtype))
        residual = corrected - self.compressor.decompress(payload).to(acc)
        self._state[key] = (signature, residual)
        return payload

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The wrapped compressor's decompress (error feedback changes only the sender)."""
        return self.compressor.decompress(payload)

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual stored for ``key`` (float32 for bf16/fp16 tensors), or None if there is none."""
        held = self._state.get(key)
        return None if held is None else held[1]

    def through(self, codec: Compressor) -> "ErrorFeedback":
        """These residuals, compressed through ``codec``: another view of the *same* compressor, e.g.
        :class:`commlab.compress.two_phase.ChunkedCompressor`, which sends a tensor chunk by chunk. The returned
        object shares this one's residuals (its :meth:`compress` reads and writes them), so that a residual is
        what was not sent, whichever view sent it."""
        view = ErrorFeedback(codec)
        view.name, view._state = self.name, self._state
        return view

    def set_residual(self, key: Hashable, residual: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Store ``residual`` (a copy) as the residual of ``key``, for tensors of its shape and device and of
        ``dtype`` (default: the residual's own dtype), e.g. when a checkpoint is restored.

        Raises:
            TypeError: ``residual`` is not floating point, or not in the accumulation dtype of ``dtype``
                (float32 for bf16/fp16/float32 tensors, float64 for float64): what :meth:`compress` keeps.
        """
        dtype = residual.dtype if dtype is None else dtype
        if not residual.is_floating_point() or residual.dtype != self._acc_dtype(dtype):
            raise TypeError(f"ErrorFeedback.set_residual: the residual of {dtype} tensors is kept in "
                            f"{self._acc_dtype(dtype)}, got {residual.dtype} for key {key!r}")
        self._state[key] = ((residual.shape, dtype, residual.device), residual.detach().clone())

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key``, or of every key when ``key`` is None (e.g. after a restart)."""
        if key is None:
            self._state.clear()
        else:
            self._state.pop(key, None)

    def keys(self) -> list:
        """Keys that currently hold a residual."""
        return list(self._state)


def check_error_feedback(error_feedback: ErrorFeedback | None, compressor: Compressor, key: Hashable | None,
                         what: str, label: str = "error_feedback") -> None:
    """Check that ``error_feedback`` (if given) wraps ``compressor`` itself and that ``key`` names its residual.

    Raises:
        ValueError: ``key`` is None, or ``error_feedback`` wraps another compressor object (both name ``what``
            and ``label``).
    """
    if error_feedback is None:
        return
    if key is None:
        raise ValueError(f"{what}: {label} needs a key naming this tensor's residual (e.g. the parameter's name "
                         "or the bucket's index)")
    if error_feedback.compressor is not compressor:
        raise ValueError(f"{what}: {label} wraps {error_feedback.name!r}, not the compressor passed "
                         f"({getattr(compressor, 'name', type(compressor).__name__)!r}); pass the same compressor "
                         "object to both")
