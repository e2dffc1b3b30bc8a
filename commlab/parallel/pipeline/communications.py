"""Messages between adjacent pipeline stages, over an explicit process group, one grouped exchange each.

The pipeline group's rank is the stage index. :func:`communicate` posts one group of the plan
(:mod:`~commlab.parallel.pipeline.plan`) as one :func:`commlab.collectives.p2p.exchange` and returns once
its receives have arrived; its sends are waited for at the end of the step (:class:`PendingSends`).
:func:`agree_step` makes every stage agree on (schedule, m, batch size, v) with one all-gather, and
:func:`agree_boundary_shapes` (:func:`agree_chunk_boundaries` with v chunks) passes each boundary's shape
and dtype down the pipeline once, from a dry run, so later messages are bare tensors checked against the
agreed :class:`Boundary`. Messages between a pair of stages match by order (activations s -> s+1,
gradients back; interleaved, between virtual stages, so the last stage also sends to stage 0). Buffers
live on the group's device (:func:`commlab.launch.device.group_device`); empty tensors are not sent.

Book: chapter 10, §10.10; chapter 2, §2.6.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from commlab.collectives import p2p
from commlab.collectives.common import ALL_DTYPES, DTYPE_CODE, as_int64, group_size_and_rank
from commlab.collectives.agreement import agree, gather
from commlab.parallel.pipeline.plan import ACTIVATION, CommGroup
from commlab.parallel.pipeline.schedules import SCHEDULES

#: Schedules :func:`agree_step` (and the engine) know: those of :data:`SCHEDULES`, and interleaved 1F1B.
ENGINE_SCHEDULES = tuple(sorted(SCHEDULES)) + ("interleaved",)
from commlab.parallel.tensor.communications import untimed

__all__ = ["ENGINE_SCHEDULES", "PendingSends", "Boundary", "stage_of", "neighbour", "stage_rank", "communicate",
           "agree_step", "agree_boundary_shapes", "agree_chunk_boundaries", "activation_nbytes"]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """What crosses this stage's two boundaries for one micro-batch, as the stages agreed before the first.

    Attributes:
        in_shape, in_dtype: the activation this stage receives from stage s-1 (on stage 0: one micro-batch
            of the model's input) and, the same, the gradient it sends back to s-1.
        out_shape, out_dtype: the activation it sends forward to stage s+1 and the gradient it receives
            back from s+1.
    """

    in_shape: tuple[int, ...]
    in_dtype: torch.dtype
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype

    def received(self, kind: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of a received message of ``kind`` (activation: the input; gradient: the output)."""
        return (self.in_shape, self.in_dtype) if kind == ACTIVATION else (self.out_shape, self.out_dtype)

    def sent(self, kind: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of a sent message of ``kind`` (activation: the output; gradient: the input)."""
        return (self.out_shape, self.out_dtype) if kind == ACTIVATION else (self.in_shape, self.in_dtype)


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
        RuntimeError: torch.distributed not initialised, or this rank not in ``group`` (the package's one
            membership check, :func:`commlab.collectives.common.group_size_and_rank`).
    """
    p, stage = group_size_and_rank(group, "the pipeline")
    return stage, p


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


def communicate(step: CommGroup, outbox: dict[tuple[str, int, int], torch.Tensor],
                boundary: Boundary | Sequence[Boundary], group: dist.ProcessGroup | None, pending: PendingSends,
                device: torch.device | str = "cpu") -> dict[tuple[str, int, int], torch.Tensor]:
    """Post one group of the plan as one grouped exchange; return its received tensors once they arrived.

    Args:
        step: the group (its sends and receives; see :mod:`~commlab.parallel.pipeline.plan`).
        outbox: tensors produced by earlier computations, keyed ``(kind, microbatch, chunk)`` (the chunk that
            produced it; 0 with one chunk per stage); each one this group sends is taken out of it
            (detached, made contiguous).
        boundary: the shapes and dtypes of what this stage sends and receives, as agreed by
            :func:`agree_boundary_shapes`; with v chunks per stage, one per chunk
            (:func:`agree_chunk_boundaries`).
        group: the pipeline group (group rank = stage).
        pending: where the exchange waits for its sends to complete (the step's :class:`PendingSends`).
        device: where received tensors are allocated (the group's device).

    Returns:
        ``{(kind, microbatch, chunk): tensor}`` for each receive of the group, keyed by the chunk that
        consumes it (fresh tensors, not requiring grad).

    Raises:
        KeyError: the plan sends a tensor no computation has produced (a plan that does not fit the
            schedule).
        ValueError: a tensor to send whose shape or dtype is not the agreed one (a module whose output shape
            depends on its input's values, not only on its shape), naming the stage and the micro-batch;
            raised before anything of the group is posted.
    """
    boundaries = [boundary] if isinstance(boundary, Boundary) else list(boundary)
    sends = []
    for msg in step.sends:
        tensor = outbox.pop((msg.kind, msg.microbatch, msg.src_chunk)).detach().contiguous()
        shape, dtype = boundaries[msg.src_chunk].sent(msg.kind)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"stage {msg.src}: the {msg.kind} of micro-batch {msg.microbatch} for stage {msg.dst} has shape "
                f"{tuple(tensor.shape)} and dtype {_name(tensor.dtype)}, but the stages agreed on {shape} "
                f"{_name(dtype)} from a dry run on zeros before the first micro-batch; a pipeline stage's "
                "output shape and dtype must depend only on its input's shape and dtype, not on its values")
        sends.append((tensor, stage_rank(group, msg.dst)))
    received = {}
    for msg in step.recvs:
        shape, dtype = boundaries[msg.dst_chunk].received(msg.kind)
        received[(msg.kind, msg.microbatch, msg.dst_chunk)] = torch.empty(shape, dtype=dtype, device=device)
    recvs = [(received[(msg.kind, msg.microbatch, msg.dst_chunk)], stage_rank(group, msg.src)) for msg in step.recvs]
    with torch.profiler.record_function("pp::send_recv"):  # the name commlab.overlap.trace reads as PP
        ex = p2p.exchange(sends, recvs, group)
        ex.wait_recvs()
    pending.add(ex, len(sends))
    return received


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def agree_step(schedule, m, batch: int, problem: str | None, group: dist.ProcessGroup | None, v: int = 1) -> None:
    """Make every stage agree on (schedule, m, batch size, model chunks v), or raise the same error on every
    stage.

    One :func:`~commlab.collectives.agree`: an all-gather of 5 int64 per stage over the pipeline group, on
    its device (one latency). It is also the collective
    over the whole group that NCCL needs before the group's first point-to-point message (torch's
    ``batch_isend_irecv`` docstring). Without it, stages running different schedules wait for messages
    that never come until the timeout, and a different m or batch size fails inside a computation.

    Args:
        schedule: this stage's schedule name.
        m: this stage's number of micro-batches.
        batch: this stage's batch size.
        problem: this stage's own verdict on its arguments (None if valid), e.g. "m=3 does not divide the
            batch size 8"; a stage with a problem makes every stage raise.
        group: the pipeline group; group rank = stage.
        v: this stage's number of model chunks (1 unless interleaved).

    Raises:
        CollectiveMismatchError (a ValueError): some stage's arguments are invalid (the message gives each such
            stage's ``problem``), or the stages disagree (it lists every stage's schedule, m and batch size, and
            v where some stage's is not 1); the same message on every stage.
    """
    names = list(ENGINE_SCHEDULES)
    code = names.index(schedule) if isinstance(schedule, str) and schedule in names else -1

    def differ(rows: list[list[int]]) -> str | None:
        if len({tuple(row) for row in rows}) == 1:
            return None
        chunked = any(row[3] != 1 for row in rows)
        described = "; ".join(
            f"stage {s}: schedule {names[c]!r}, m={mm}, batch {b}" + (f", v={vv}" if chunked else "")
            for s, (c, mm, b, vv) in enumerate(rows))
        what = "schedule, m, batch size and number of model chunks v" if chunked else "schedule, m and batch size"
        return f"every stage must be called with the same {what} ({described})"

    # The stages' own verdicts travel only on the failure path (a second, object all-gather), so that every
    # stage raises the same message, and whichever error a launcher reports says it.
    with torch.profiler.record_function("pp::agree_schedule"):
        agree("pipeline_step", [code, as_int64(m), as_int64(batch), as_int64(v)], group, ints=True,
              problem=problem, differ=differ, rank_word="stage")


# Shape messages carry at most this many dimensions (a fixed-size int64 buffer, so the receiver can
# allocate it without knowing anything). Layout: [ok, ndim, dims..., dtype code].
_MAX_DIMS = 8
_HEADER = _MAX_DIMS + 3


def agree_boundary_shapes(module: nn.Module, microbatch_shape: Sequence[int], dtype: torch.dtype,
                          group: dist.ProcessGroup | None, device: torch.device | str = "cpu") -> Boundary:
    """Pass activation shapes and dtypes down the pipeline once, so later messages need no header.

    Stage 0 takes ``microbatch_shape`` and ``dtype`` as its input; every stage runs ``module`` once on zeros
    of its input shape and dtype (without autograd, in eval mode) to learn its output's shape and dtype and
    sends both to the next stage: p-1 tiny messages, one extra forward of one micro-batch per stage, and one
    all-gather of one int64 per stage that tells every stage whether each succeeded. A module whose output
    shape depends on its input's values cannot be pipelined this way (:func:`communicate` refuses it).

    Args:
        module: this stage's part of the model.
        microbatch_shape: shape of one micro-batch of the model's input (used on stage 0 only, ignored
            elsewhere, but pass it everywhere).
        dtype: the model's input dtype (used on stage 0 only; an integer dtype for an embedding is fine).
        group: the pipeline group; group rank = stage.
        device: the group's device, where the headers and the dry run's zeros are allocated.

    Returns:
        This stage's :class:`Boundary` (input and output shape and dtype for one micro-batch).

    Raises:
        ValueError: an output with more than 8 dimensions, or an output with an integer or bool dtype on a
            stage other than the last (no gradient can flow back through it), on that stage.
        RuntimeError: on every other stage when some stage failed here (naming it); the failing stage
            raises its own error (also the module's own exception from the dry run).
    """
    return agree_chunk_boundaries([module], microbatch_shape, dtype, group, device)[0]


def agree_chunk_boundaries(chunks: Sequence[nn.Module], microbatch_shape: Sequence[int], dtype: torch.dtype,
                           group: dist.ProcessGroup | None, device: torch.device | str = "cpu") -> list[Boundary]:
    """:func:`agree_boundary_shapes` for a stage holding v model chunks (interleaved 1F1B): the shapes pass
    along the ``p·v`` virtual stages, chunk c of stage s being virtual stage ``k = c·p + s``, so they go
    round the stages v times (the last stage's chunk c hands on to stage 0's chunk c + 1).

    Costs ``p·v - 1`` tiny messages, one dry-run forward per chunk and the closing all-gather. With one
    chunk it is :func:`agree_boundary_shapes`, messages included.

    Args:
        chunks: this stage's v chunks in order (chunk c = virtual stage ``c·p + stage``).
        microbatch_shape, dtype, group, device: as for :func:`agree_boundary_shapes`.

    Returns:
        One :class:`Boundary` per chunk.

    Raises:
        ValueError, RuntimeError: as :func:`agree_boundary_shapes`, the failing chunk named by its virtual
            stage when v > 1.
    """
    stage, p = stage_of(group)
    v = len(chunks)
    last = p * v - 1
    failure: BaseException | None = None
    skipped = False  # a chunk here was not dry-run because a virtual stage before it failed
    boundaries = []
    for c, module in enumerate(chunks):
        vs = c * p + stage
        name = f"stage {stage}" if v == 1 else f"stage {stage}'s chunk {c} (virtual stage {vs})"
        upstream_ok = True
        if vs == 0:
            in_shape, in_dtype = tuple(int(d) for d in microbatch_shape), dtype
        else:
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            p2p.exchange(recvs=[(header, stage_rank(group, (vs - 1) % p))], group=group).wait()
            values = header.cpu().tolist()
            upstream_ok, ndim = bool(values[0]), values[1]
            in_shape = tuple(values[2:2 + ndim])
            in_dtype = ALL_DTYPES[values[-1]] if upstream_ok else dtype
        skipped = skipped or not upstream_ok
        out_shape, out_dtype = (), in_dtype
        if upstream_ok and failure is None:
            try:
                out_shape, out_dtype = _dry_run(module, in_shape, in_dtype, device)
                if vs < last:
                    if len(out_shape) > _MAX_DIMS:
                        raise ValueError(f"{name}'s output has {len(out_shape)} dimensions; at most "
                                         f"{_MAX_DIMS} can be announced to the next stage")
                    if not (out_dtype.is_floating_point or out_dtype.is_complex):
                        raise ValueError(f"{name}'s output has dtype {_name(out_dtype)}; every boundary after "
                                         "the model's input must carry a floating-point activation, since the "
                                         "gradient flows back through it (only stage 0's input may be an "
                                         "integer)")
            except Exception as e:  # noqa: BLE001 -- re-raised below, after the other stages were told
                failure = e
        ok = upstream_ok and failure is None
        if vs < last:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
            if ok:
                header[:2 + len(out_shape)] = torch.tensor([1, len(out_shape), *out_shape], dtype=torch.int64)
                header[-1] = DTYPE_CODE[out_dtype]
            p2p.exchange(sends=[(header, stage_rank(group, (vs + 1) % p))], group=group).wait()
        boundaries.append(Boundary(in_shape, in_dtype, out_shape, out_dtype))
    # 0: failed here, 1: fine, 2: skipped because a stage before failed.
    status = [0 if failure is not None else (2 if skipped else 1)]
    with torch.profiler.record_function("pp::agree_shapes"):
        failed = [s for s, row in enumerate(gather(status, group, ints=True)) if row[0] == 0]
    if failed:
        # The failure path only: every stage learns the failing stage's error, so that whichever error a
        # launcher reports names the cause.
        errors = gather(None if failure is None else f"{type(failure).__name__}: {failure}", group)
        if failure is not None:
            raise failure
        raise RuntimeError("pipeline_step: " + "; ".join(f"stage {s} failed while the stages agreed on their "
                                                          f"boundary shapes ({errors[s]})" for s in failed)
                           + f"; stage {stage} stops too")
    return boundaries


def _dry_run(module: nn.Module, in_shape: tuple[int, ...], in_dtype: torch.dtype,
             device) -> tuple[tuple[int, ...], torch.dtype]:
    was_training = module.training
    # eval() so that a dry run cannot update running statistics (BatchNorm) or draw dropout masks.
    module.eval()
    try:
        # untimed: a TP layer's collectives in this shape probe are not the step's forward and backward,
        # so a CommTimer of the step (the capstone's TP time) must not count them.
        with torch.no_grad(), untimed():
            out = module(torch.zeros(in_shape, dtype=in_dtype, device=device))
    finally:
        module.train(was_training)
    return tuple(out.shape), out.dtype


def activation_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one boundary message of ``shape`` and ``dtype`` (activation forward = gradient backward)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()
