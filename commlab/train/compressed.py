"""Data-parallel training of the digits MLP with a compressed gradient sum (chapters 4 and 5, lab 4).

:func:`compressed_all_reduce` turns any compressor (optionally wrapped in error feedback) into the
``all_reduce_fn`` that :func:`commlab.train.train_data_parallel` expects, aggregating the flat gradient
the way the compressor allows (:func:`commlab.compress.aggregate`: AllReduce for linear compressors,
AllGather otherwise) and logging the bytes of every step. :func:`train_compressed` runs one training with
it inside a rank and returns the losses, the test accuracy and the bytes per step.

The training goes through commlab's one data-parallel path, :class:`commlab.overlap.BucketedDataParallel`,
with the whole gradient in one bucket: the compressor sees it as one tensor, so Top-K on it is a *global*
selection over the model (chapter 5 compares it with layer-wise selection). Like every DDP bucket it holds
the parameters in reverse registration order (the last layer first).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from commlab.collectives import ring_all_reduce, ring_bytes_sent_per_rank
from commlab.compress.aggregate import aggregate, agree_finite
from commlab.compress.base import Compressor
from commlab.compress.error_feedback import ErrorFeedback
from commlab.train.data_parallel import train_data_parallel

__all__ = ["CompressedRun", "compressed_all_reduce", "train_compressed"]


@dataclasses.dataclass(frozen=True)
class CompressedRun:
    """One data-parallel training run with a compressed gradient sum (identical on every rank).

    Attributes:
        name: a label, e.g. ``"topk(0.01) + EF"``.
        losses: training loss per step (mean over ranks).
        test_accuracy: accuracy of the final model on the held-out digits.
        dense_nbytes: bytes of one rank's uncompressed gradient (elements times their dtype's size).
        payload_nbytes: bytes of one rank's compressed gradient (per step; the dense size for no compressor).
        bytes_sent_per_rank: bytes each rank sends per step to sum the gradient (ring AllReduce of the
            payload for linear compressors, ring AllGather otherwise).
        path: ``"all_reduce"`` or ``"all_gather"``.
        diverged_at_step: None, or the 0-based step whose gradient held a NaN/Inf on some rank; the
            run stopped there (``losses`` is then empty and ``test_accuracy`` NaN).
    """

    name: str
    losses: list[float]
    test_accuracy: float
    dense_nbytes: int
    payload_nbytes: int
    bytes_sent_per_rank: float
    path: str
    diverged_at_step: int | None = None


def compressed_all_reduce(compressor: Compressor | None, error_feedback=None, key: str = "flat_grad",
                          group: dist.ProcessGroup | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """An ``all_reduce_fn(flat_grad) -> sum over ranks`` that compresses with ``compressor``.

    Args:
        compressor: a :class:`commlab.compress.base.Compressor`, or None for commlab's dense ring AllReduce.
        error_feedback: None, True (wrap ``compressor`` in a fresh :class:`ErrorFeedback`), or an
            error-feedback object with ``compressor`` (the same object) and ``compress(tensor, key)``, such
            as the one a learner writes in lab 4.
        key: the residual's key (one residual: call the function with one tensor per step, e.g. one bucket).
        group: the group to sum over (None: the default group).

    Returns:
        The function; its attribute ``log`` is a list with one ``(payload_nbytes, bytes_sent_per_rank,
        path)`` tuple per call.

    Raises:
        ValueError: ``error_feedback`` without a compressor.
    """
    if compressor is None and error_feedback not in (None, False):
        raise ValueError("compressed_all_reduce: error feedback needs a compressor (got compressor=None)")
    ef = ErrorFeedback(compressor) if error_feedback is True else (error_feedback or None)
    log: list[tuple[int, float, str]] = []

    def all_reduce_fn(flat: torch.Tensor) -> torch.Tensor:
        # Every rank raises together on a NaN/Inf anywhere: aggregate agrees on it before compressing, and
        # the dense path does the same here.
        if compressor is None:
            agree_finite(flat, group, f"step {len(log)}: training diverged (lower the learning rate)")
            nbytes = flat.numel() * flat.element_size()
            log.append((nbytes, ring_bytes_sent_per_rank(nbytes, dist.get_world_size(group), "all_reduce"),
                        "all_reduce"))
            return ring_all_reduce(flat, group)
        out = aggregate(flat, compressor, group, error_feedback=ef, key=key if ef is not None else None)
        log.append((out.payload_nbytes, out.bytes_sent_per_rank, out.path))
        return out.sum

    all_reduce_fn.log = log
    return all_reduce_fn


def train_compressed(compressor: Compressor | None = None, error_feedback=None, *, name: str | None = None,
                     steps: int = 60, batch_size: int = 32, lr: float = 0.5, seed: int = 0) -> CompressedRun:
    """Train the digits MLP data-parallel on the current process group, compressing the gradient sum.

    Call it inside every rank (e.g. through :func:`commlab.launch`). Arguments as in
    :func:`compressed_all_reduce` and :func:`commlab.train.train_data_parallel`.

    Returns:
        :class:`CompressedRun`. Bytes are those of the first step (they are the same every step for
        fixed-size payloads, which is all that :func:`commlab.compress.aggregate` accepts).
    """
    fn = compressed_all_reduce(compressor, error_feedback)
    if name is None:
        name = "dense" if compressor is None else getattr(compressor, "name", type(compressor).__name__)
        if error_feedback not in (None, False):
            name += " + EF"
    try:
        result = train_data_parallel(fn, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    except FloatingPointError:
        payload_nbytes, sent, path = fn.log[0] if fn.log else (0, 0.0, "")
        return CompressedRun(name, [], float("nan"), 0, payload_nbytes, sent, path, diverged_at_step=len(fn.log))
    payload_nbytes, sent, path = fn.log[0]
    return CompressedRun(name, result.losses, result.test_accuracy, result.grad_nbytes, payload_nbytes, sent, path)
