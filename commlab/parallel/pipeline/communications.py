"""Messages between adjacent pipeline stages, over an explicit process group, one grouped exchange each.

The pipeline group's rank *is* the stage index: stage s sends activations forward to stage s+1 and
receives gradients back from it. Which messages a stage posts together, and when, is the plan of
:mod:`~commlab.parallel.pipeline.plan` (data derived from the schedule); :func:`communicate` posts one
group of that plan as one :func:`commlab.collectives.p2p.exchange` (one ``batch_isend_irecv``), so that a
send and the receive it must progress with cannot wait on each other under NCCL.

Design choices, and why:

* **A group's receives are waited for at once, its sends at the end of the step.** A computation needs its
  inputs, so :func:`communicate` returns only when the group's receives have arrived. A send only has to
  complete before the step ends (and before its tensor is modified); the :class:`PendingSends` of the
  step keeps every exchange, with the tensors it reads, until :meth:`PendingSends.wait_all`; none is
  dropped, so no message is lost when a rank returns.
* **Shapes agreed up front.** A receiver must allocate its buffer before the data arrives, so it must
  know the shape. :func:`agree_boundary_shapes` passes them down the pipeline once, before the first
  micro-batch: stage 0 knows the micro-batch shape, runs its own module once on zeros to learn its output
  shape, and sends that shape to stage 1, and so on. After that every message is a bare tensor.
* **Messages between a pair of stages are matched by order.** Activations only go s -> s+1 and gradients
  only s+1 -> s, each in the order the schedule produces them, so no tags are needed.
* **Every buffer on the group's device** (:func:`commlab.launch.device.group_device`: the CPU under gloo,
  the rank's GPU under NCCL, which moves only CUDA tensors).

Empty tensors are not sent (:mod:`commlab.collectives.p2p` skips them on both sides).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from commlab.collectives import p2p
from commlab.parallel.pipeline.plan import CommGroup

__all__ = ["PendingSends", "stage_of", "neighbour", "stage_rank", "communicate", "agree_boundary_shapes",
           "activation_nbytes"]


class PendingSends:
    """The exchanges of one step whose sends may still be in flight; :meth:`wait_all` before reuse.

    Attributes:
        nbytes_sent: bytes handed to sends so far (the payload; gloo/NCCL headers not counted).
        count: number of messages sent so far (empty tensors not counted).
    """

    def __init__(self):
        self._pending: list[p2p.Exchange] = []
        self.nbytes_sent = 0
        self.count = 0

    def add(self, exchange: p2p.Exchange, sends: int) -> None:
        """Keep ``exchange`` (and the tensors it reads from) until :meth:`wait_all`; it posted ``sends``
        messages."""
        self.count += sends
        self.nbytes_sent += exchange.nbytes_sent
        self._pending.append(exchange)

    def wait_all(self) -> None:
        """Wait for every pending exchange; afterwards their tensors may be freed or modified."""
        pending, self._pending = self._pending, []
        p2p.wait_all(pending)

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


def stage_rank(group: dist.ProcessGroup | None, stage: int) -> int:
    """Global rank of ``stage`` (its rank in the pipeline group)."""
    if group is None or group is dist.group.WORLD:
        return stage
    return dist.get_global_rank(group, stage)


def communicate(step: CommGroup, outbox: dict[tuple[str, int], torch.Tensor],
                shapes: dict[str, Sequence[int]], dtype: torch.dtype, group: dist.ProcessGroup | None,
                pending: PendingSends, device: torch.device | str = "cpu") -> dict[tuple[str, int], torch.Tensor]:
    """Post one group of the plan as one grouped exchange; return its received tensors once they arrived.

    Args:
        step: the group (its sends and receives; see :mod:`~commlab.parallel.pipeline.plan`).
        outbox: tensors produced by earlier computations, keyed ``(kind, microbatch)``; each one this group
            sends is taken out of it (detached, made contiguous).
        shapes: the shape of a received activation (``shapes["activation"]``, this stage's input) and of a
            received gradient (``shapes["gradient"]``, this stage's output), as agreed by
            :func:`agree_boundary_shapes`.
        dtype: the dtype of every boundary tensor.
        group: the pipeline group (group rank = stage).
        pending: where the exchange waits for its sends to complete (the step's :class:`PendingSends`).
        device: where received tensors are allocated (the group's device).

    Returns:
        ``{(kind, microbatch): tensor}`` for each receive of the group (fresh tensors, not requiring grad).

    Raises:
        KeyError: the plan sends a tensor no computation has produced (a plan that does not fit the
            schedule).
    """
    sends = [(outbox.pop((msg.kind, msg.microbatch)).detach().contiguous(), stage_rank(group, msg.dst))
             for msg in step.sends]
    received = {(msg.kind, msg.microbatch): torch.empty(tuple(shapes[msg.kind]), dtype=dtype, device=device)
                for msg in step.recvs}
    recvs = [(received[(msg.kind, msg.microbatch)], stage_rank(group, msg.src)) for msg in step.recvs]
    ex = p2p.exchange(sends, recvs, group)
    ex.wait_recvs()
    pending.add(ex, len(sends))
    return received


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
        header = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=device)
        p2p.exchange(recvs=[(header, neighbour(group, -1))], group=group).wait()
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
        p2p.exchange(sends=[(header, neighbour(group, +1))], group=group).wait()
    return in_shape, out_shape


def activation_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one boundary message of ``shape`` and ``dtype`` (activation forward = gradient backward)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()
