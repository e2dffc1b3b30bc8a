"""Point-to-point messages between adjacent pipeline stages, over an explicit process group.

The pipeline group's rank *is* the stage index: stage s sends activations forward to stage s+1 and
receives gradients back from it. Four operations name that traffic (the names Megatron-LM's pipeline
code uses, Narayanan et al. 2021, SC'21, §2.2):

* :func:`send_forward` (stage s -> s+1, the activation of a micro-batch) and :func:`recv_forward`;
* :func:`send_backward` (stage s -> s-1, the gradient w.r.t. that stage's output) and :func:`recv_backward`.

Design choices, and why:

* **Sends return a handle, receives block.** A receive must complete before its data is used, so it
  waits inside. A send only has to complete before the step ends: if sends blocked, stage s sending an
  activation to s+1 while s+1 sends a gradient back to s would wait on each other (the classic 1F1B
  deadlock). The caller keeps the handles in a :class:`PendingSends` and waits for all of them once per
  step; every handle is waited, none is dropped. The tensor of a pending send is kept alive by the handle
  list and must not be modified until then.
* **Shapes agreed up front.** A receiver must allocate its buffer before the data arrives, so it must
  know the shape. :func:`agree_boundary_shapes` passes them down the pipeline once, before the first
  micro-batch: stage 0 knows the micro-batch shape, runs its own module once on zeros to learn its output
  shape, and sends that shape to stage 1, and so on. After that every message is a bare tensor.
* **Messages between a pair of stages are matched by order.** Activations only go s -> s+1 and gradients
  only s+1 -> s, each in the order the schedule produces them, so no tags are needed.

Empty tensors are not sent (:mod:`commlab.collectives.p2p` skips them on both sides).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from commlab.collectives import p2p

__all__ = ["PendingSends", "stage_of", "neighbour", "send_forward", "recv_forward", "send_backward",
           "recv_backward", "agree_boundary_shapes", "activation_nbytes"]


class PendingSends:
    """Handles of sends still in flight, with the tensors they read from; :meth:`wait_all` before reuse.

    Attributes:
        nbytes_sent: bytes handed to sends so far (the payload; gloo/NCCL headers not counted).
        count: number of sends posted so far.
    """

    def __init__(self):
        self._pending: list[tuple[object, torch.Tensor]] = []
        self.nbytes_sent = 0
        self.count = 0

    def add(self, handle, tensor: torch.Tensor) -> None:
        """Remember a send's handle (None for an empty tensor) and keep its tensor alive until waited."""
        self.count += 1
        self.nbytes_sent += tensor.numel() * tensor.element_size()
        if handle is not None:
            self._pending.append((handle, tensor))

    def wait_all(self) -> None:
        """Wait for every pending send; afterwards their tensors may be freed or modified."""
        pending, self._pending = self._pending, []
        for handle, _ in pending:
            handle.wait()

    def __len__(self) -> int:
        return len(self._pending)


def stage_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(stage, number of stages)``: this rank's rank in the pipeline group, and the group's size.

    Raises:
        RuntimeError: torch.distributed not initialised, or this rank not in ``group``.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run inside commlab.launch(...) or call "
                           "dist.init_process_group first")
    stage = dist.get_rank(group)
    if stage < 0:
        raise RuntimeError(f"global rank {dist.get_rank()} is not a member of the pipeline group it was given")
    return stage, dist.get_world_size(group)


def neighbour(group: dist.ProcessGroup | None, offset: int) -> int:
    """Global rank of the stage ``offset`` away from this one (+1 = next, -1 = previous) in ``group``.

    Raises:
        ValueError: there is no such stage (sending forward from the last stage, backward from the first).
    """
    stage, p = stage_of(group)
    other = stage + offset
    if not 0 <= other < p:
        direction = "forward from the last" if offset > 0 else "backward from the first"
        raise ValueError(f"stage {stage} of {p} has no stage {other}: nothing is sent {direction} stage")
    if group is None or group is dist.group.WORLD:
        return other
    return dist.get_global_rank(group, other)


def send_forward(activation: torch.Tensor, group: dist.ProcessGroup | None, pending: PendingSends) -> None:
    """Post the send of an activation (any shape, detached) to the next stage; its handle goes to ``pending``.

    Raises:
        ValueError: called on the last stage.
    """
    t = activation.detach().contiguous()
    pending.add(p2p.isend(t, neighbour(group, +1), group), t)


def send_backward(grad: torch.Tensor, group: dist.ProcessGroup | None, pending: PendingSends) -> None:
    """Post the send of the gradient w.r.t. this stage's input to the previous stage; handle to ``pending``.

    Raises:
        ValueError: called on the first stage.
    """
    t = grad.detach().contiguous()
    pending.add(p2p.isend(t, neighbour(group, -1), group), t)


def _recv(shape: Sequence[int], dtype: torch.dtype, src: int, group, device) -> torch.Tensor:
    buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    p2p.wait(p2p.irecv(buf, src, group))
    return buf


def recv_forward(shape: Sequence[int], dtype: torch.dtype, group: dist.ProcessGroup | None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Receive the previous stage's activation of the given shape and dtype; blocks until it has arrived.

    Returns:
        A fresh tensor (not requiring grad; the engine turns that on to get the input's gradient).

    Raises:
        ValueError: called on the first stage.
    """
    return _recv(shape, dtype, neighbour(group, -1), group, device)


def recv_backward(shape: Sequence[int], dtype: torch.dtype, group: dist.ProcessGroup | None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Receive, from the next stage, the gradient w.r.t. this stage's output (shape of that output); blocks.

    Raises:
        ValueError: called on the last stage.
    """
    return _recv(shape, dtype, neighbour(group, +1), group, device)


# Shape messages carry at most this many dimensions (a fixed-size int64 buffer, so the receiver can
# allocate it without knowing anything).
_MAX_DIMS = 8


def agree_boundary_shapes(module: nn.Module, microbatch_shape: Sequence[int], dtype: torch.dtype,
                          group: dist.ProcessGroup | None,
                          device: torch.device | str = "cpu") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Pass activation shapes down the pipeline once, so later messages need no shape header.

    Stage 0 takes ``microbatch_shape`` as its input shape; every stage runs ``module`` once on zeros of its
    input shape (without autograd, in eval mode) to learn its output shape and sends it to the next stage.
    Costs p-1 tiny messages and one extra forward of one micro-batch per stage; the engine pays it at the
    start of every :func:`~commlab.parallel.pipeline.engine.pipeline_step` (before the timed part), which
    keeps each step self-contained. A module whose output shape depends on the values of its input (not
    only its shape) cannot be pipelined this way.

    Args:
        module: this stage's part of the model.
        microbatch_shape: shape of one micro-batch of the model's input (used on stage 0 only, ignored
            elsewhere, but pass it everywhere).
        dtype: activation dtype on every boundary.
        group: the pipeline group; group rank = stage.

    Returns:
        ``(input_shape, output_shape)`` of this stage's module for one micro-batch.

    Raises:
        ValueError: an output with more than 8 dimensions.
    """
    stage, p = stage_of(group)
    if stage == 0:
        in_shape = tuple(int(d) for d in microbatch_shape)
    else:
        header = _recv((_MAX_DIMS + 1,), torch.int64, neighbour(group, -1), group, device)
        ndim = int(header[0])
        in_shape = tuple(int(d) for d in header[1:1 + ndim])
    was_training = module.training
    # eval() so that a dry run cannot update running statistics (BatchNorm) or draw dropout masks.
    module.eval()
    with torch.no_grad():
        out_shape = tuple(module(torch.zeros(in_shape, dtype=dtype, device=device)).shape)
    module.train(was_training)
    if stage < p - 1:
        if len(out_shape) > _MAX_DIMS:
            raise ValueError(f"stage {stage}'s output has {len(out_shape)} dimensions; at most {_MAX_DIMS} "
                             "can be announced to the next stage")
        header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=device)
        header[0] = len(out_shape)
        header[1:1 + len(out_shape)] = torch.tensor(out_shape, dtype=torch.int64)
        p2p.wait(p2p.isend(header, neighbour(group, +1), group))
    return in_shape, out_shape


def activation_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one boundary message of ``shape`` and ``dtype`` (activation forward = gradient backward)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()
