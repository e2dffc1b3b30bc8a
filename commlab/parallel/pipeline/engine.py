"""Run one training step of a model cut into pipeline stages, with the GPipe or the 1F1B schedule.

Each rank of the pipeline group holds one stage: a contiguous slice of an ``nn.Sequential``
(:func:`split_sequential`). :func:`pipeline_step` splits the batch into m equal micro-batches and runs
the stage's operations in the order of :mod:`commlab.parallel.pipeline.schedules`:

* forward ``F j``: micro-batch j's activation from the previous stage (stage 0 slices the input), run the
  stage, keep input and output for the backward, hand the output to the next send;
* backward ``B j``: the gradient of the output from the next stage (the last stage differentiates
  ``loss_j / m`` instead), backpropagate through the stage, hand the input's gradient to the next send,
  drop the stored activations.

Between two computations the stage posts one group of messages: what the last computation produced and
what the next one needs, as the communication plan of :mod:`commlab.parallel.pipeline.plan` says (in the
1F1B steady state, Megatron-LM's ``send_forward_recv_backward`` and ``send_backward_recv_forward``). The
plan is data derived from the schedule, and a simulator of NCCL's rendezvous rules checks that it cannot
deadlock; the engine only executes it.

Gradients accumulate in ``.grad`` over the micro-batches. Each micro-batch loss is a mean over its
rows divided by m, so with equal micro-batches the accumulated gradient is the gradient of the mean loss
over the whole batch: the same as running the unsplit model on the batch, up to float rounding
(tests: ``allclose(rtol=1e-5, atol=1e-6)`` in float32).

Timing: every op is timed from after its inputs arrived to the end of its computation, so the wait for a
neighbour counts as idle, the compute as busy, with a :class:`commlab.launch.device.Clock` on the group's
device: the host clock on the CPU, CUDA events on a GPU (which complete when the GPU reaches them, so they
time the kernels rather than their launch). Each stage measures from its own start of the step, taken right
after a barrier of the pipeline group; the stages' clocks therefore agree to within the barrier's skew
(microseconds on one machine), which is enough to draw the bubble.

The pipeline group is explicit (DESIGN.md, layer 5): pass the sub-group of the ranks that form this
pipeline, whose group rank is the stage index. Several pipelines can run side by side in disjoint groups
(data parallelism across them: :mod:`commlab.parallel.data_parallel`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from commlab.launch.device import Clock, group_device
from commlab.parallel.pipeline.communications import (PendingSends, agree_boundary_shapes, agree_step,
                                                      communicate, stage_of, stage_rank)
from commlab.parallel.pipeline.plan import ACTIVATION, GRADIENT, CommGroup, communication_plan
from commlab.parallel.pipeline.schedules import (FORWARD, SCHEDULES, TimedOp, bubble_fraction, idle_fraction,
                                                 make_schedule, stage_busy_idle)

__all__ = ["split_sequential", "PipelineResult", "pipeline_step"]


def split_sequential(model: nn.Sequential, p: int, sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut ``model`` into p contiguous ``nn.Sequential`` stages that share its modules (and parameters).

    Args:
        model: the whole model; its children run in order.
        p: number of stages, 1 <= p <= number of children.
        sizes: number of children per stage (sum = number of children, each >= 1). Default: as equal as
            possible, the first ``len(model) % p`` stages one child longer. Balance by compute, not by
            count, when the layers differ in cost: the slowest stage sets the pipeline's pace.

    Returns:
        The p stages; ``nn.Sequential(*stages)`` computes the same function as ``model``.

    Raises:
        ValueError: p out of range, or ``sizes`` of the wrong length, sum or with an empty stage.
    """
    children = list(model.children())
    n = len(children)
    if not 1 <= p <= n:
        raise ValueError(f"cannot cut a Sequential of {n} modules into p={p} non-empty stages; need 1 <= p <= {n}")
    if sizes is None:
        sizes = [n // p + (1 if s < n % p else 0) for s in range(p)]
    sizes = list(sizes)
    if len(sizes) != p or sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"sizes must be {p} positive counts summing to {n} (the model's modules), got {sizes}")
    stages, start = [], 0
    for size in sizes:
        stages.append(nn.Sequential(*children[start:start + size]))
        start += size
    return stages


@dataclasses.dataclass
class PipelineResult:
    """What :func:`pipeline_step` returns, on every stage.

    Attributes:
        loss: mean loss over the whole batch (sum over micro-batches of ``loss_j / m``), a float, on every
            stage (the last stage broadcasts it in the pipeline group).
        timeline: every stage's ops with start/end in seconds since that stage's start of the step,
            sorted by (stage, start); gathered from all stages.
        busy_s, idle_s: per stage (list index = stage), compute time and the rest of the step, seconds.
        idle_fraction: total idle / (p × step time), measured; compare with :attr:`bubble_fraction`.
        bubble_fraction: the ideal ``(p-1)/(m+p-1)``.
        step_s: this stage's wall time of the whole step (including waiting for its sends), seconds.
        nbytes_sent: bytes this stage sent (activations forward plus gradients backward).
        schedule, p, m: as run.
    """

    loss: float
    timeline: list[TimedOp]
    busy_s: list[float]
    idle_s: list[float]
    idle_fraction: float
    bubble_fraction: float
    step_s: float
    nbytes_sent: int
    schedule: str
    p: int
    m: int


def pipeline_step(stage_module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], m: int,
                  group: dist.ProcessGroup | None, schedule: str = "1f1b") -> PipelineResult:
    """Forward and backward of one batch through the pipeline; gradients accumulate into ``.grad``.

    Call it on every rank of ``group`` with that rank's stage (group rank s = stage s). It does not zero
    the gradients and does not step an optimizer: do both around it, as for an ordinary backward.

    Args:
        stage_module: this rank's stage (from :func:`split_sequential`).
        inputs: the whole batch's input, shape ``(batch, ...)``; its values and dtype are read on stage 0
            only (an integer dtype for an embedding is fine: each boundary's dtype is the previous stage's
            output dtype, passed down with its shape), but pass it on every stage: its batch size and
            device are used everywhere.
        targets: the whole batch's targets, shape ``(batch, ...)``; read on the last stage only.
        loss_fn: ``loss_fn(output, target) -> scalar``, a *mean* over the micro-batch's rows (e.g.
            ``nn.functional.cross_entropy``); a sum-reduced loss would be scaled wrong by 1/m.
        m: micro-batches; must divide the batch size (so that the mean of micro-batch means is the
            batch mean).
        group: the pipeline group (None: the default group).
        schedule: ``"gpipe"`` or ``"1f1b"``.

    Returns:
        :class:`PipelineResult` (the same loss, timeline and per-stage times on every stage).

    Raises:
        ValueError: on every stage: unknown schedule, m not an integer >= 1 or not dividing the batch size,
            the batch on another device than the group's, or stages called with different schedules, m or
            batch sizes (the message lists each stage's). On the stage concerned (the others wait for
            it until the timeout): a tensor to send whose shape or dtype differs from the one agreed
            before the first micro-batch (an output shape that depends on the input's values), naming the
            stage and micro-batch.
        RuntimeError: this rank is not in ``group``; on the stage concerned, a stage whose output does not
            depend on its input (no gradient to send back), naming the stage and micro-batch; on every
            stage, when a stage failed while the boundary shapes were agreed (its dry run raised, or its
            output is an integer tensor that is not the last stage's).
    """
    stage, p = stage_of(group)
    batch = inputs.shape[0] if inputs.dim() > 0 else 0
    device = group_device(group)
    # Each stage judges its own arguments; agree_step then makes every stage raise if any stage found a
    # problem or the stages disagree, instead of leaving the others waiting for messages.
    problem = None
    if schedule not in SCHEDULES:
        problem = f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)}"
    elif isinstance(m, bool) or not isinstance(m, int) or m < 1 or batch % m != 0:
        problem = f"m={m!r} micro-batches must be a positive integer dividing the batch size {batch}"
    elif inputs.device != device or targets.device != device:
        problem = (f"the pipeline group's messages travel on {device}, but inputs are on {inputs.device} and "
                   f"targets on {targets.device}; move the batch (and the stage module) to {device}")
    # A collective over the whole pipeline group before its first point-to-point message: on NCCL the first
    # batch_isend_irecv on a communicator must involve every rank of the group (torch's docstring), and the
    # shape agreement's first message involves stages 0 and 1 only.
    agree_step(schedule, m, batch, problem, group, device)
    first, last = stage == 0, stage == p - 1
    mb_shape = (batch // m,) + tuple(inputs.shape[1:])
    my_plan = communication_plan(make_schedule(schedule, p, m))[stage]
    x_mb = inputs.chunk(m) if first else None
    y_mb = targets.chunk(m) if last else None
    # The boundary pass ends with an all-gather over the pipeline group, which is also the stages' common
    # start of the step (so that their timelines line up).
    boundary = agree_boundary_shapes(stage_module, mb_shape, inputs.dtype, group, device)

    pending = PendingSends()
    inbox: dict[tuple[str, int], torch.Tensor] = {}  # received, not yet used
    outbox: dict[tuple[str, int], torch.Tensor] = {}  # produced, not yet sent
    stored: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    clock = Clock(device)
    marks: list[tuple[str, int, object, object]] = []

    t0 = clock.mark()
    for item in my_plan:
        if isinstance(item, CommGroup):
            inbox.update(communicate(item, outbox, boundary, group, pending, device))
            continue
        j = item.microbatch
        if item.kind == FORWARD:
            x = x_mb[j] if first else inbox.pop((ACTIVATION, j)).requires_grad_()
            start = clock.mark()
            out = stage_module(x)
            if last:
                loss = loss_fn(out, y_mb[j]) / m
                loss_total += loss.detach().to(torch.float64)
                stored[j] = (None if first else x, loss)
            else:
                # Store x (to read its .grad after backward) and out (to backpropagate into).
                stored[j] = (None if first else x, out)
                outbox[(ACTIVATION, j)] = out
        else:
            x, out = stored.pop(j)
            grad_out = None if last else inbox.pop((GRADIENT, j))
            start = clock.mark()
            torch.autograd.backward(out, grad_out)  # grad_out None: out is the last stage's scalar loss
            if not first:
                if x.grad is None:
                    raise RuntimeError(
                        f"stage {stage}: backward of micro-batch {j} left no gradient on the stage's input, so "
                        f"there is nothing to send back to stage {stage - 1}: the stage's output does not depend "
                        "on the activation it received (a detach(), a constant output, or an input it ignores); "
                        "a pipeline stage must compute from its input")
                outbox[(GRADIENT, j)] = x.grad
        marks.append((item.kind, j, start, clock.mark()))
    pending.wait_all()  # every exchange waited before the step returns
    t_end = clock.mark()
    times = [(kind, j, clock.elapsed(t0, a), clock.elapsed(t0, b)) for kind, j, a, b in marks]
    step_s = clock.elapsed(t0, t_end)

    # The loss lives on the last stage; share it (one scalar, on the group's device) so every stage returns
    # the same result.
    loss_buf = loss_total.clone()
    dist.broadcast(loss_buf, src=stage_rank(group, p - 1), group=group)
    everyone: list = [None] * p
    dist.all_gather_object(everyone, times, group=group)
    timeline = sorted((TimedOp(s, k, j, a, b) for s, ts in enumerate(everyone) for k, j, a, b in ts),
                      key=lambda t: (t.stage, t.start_s))
    per_stage = stage_busy_idle(timeline)
    return PipelineResult(loss=float(loss_buf), timeline=timeline,
                          busy_s=[per_stage[s][0] for s in range(p)], idle_s=[per_stage[s][1] for s in range(p)],
                          idle_fraction=idle_fraction(timeline), bubble_fraction=bubble_fraction(p, m),
                          step_s=step_s, nbytes_sent=pending.nbytes_sent, schedule=schedule, p=p, m=m)
