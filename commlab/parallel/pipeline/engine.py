"""Run one training step of a model cut into pipeline stages, with the GPipe, 1F1B or interleaved 1F1B schedule.

Each rank of the pipeline group (group rank = stage) holds one slice of an ``nn.Sequential``
(:func:`split_sequential`) or, interleaved, v chunks (:func:`split_interleaved`: chunk c of rank s is
virtual stage ``c·p + s``, Narayanan et al. 2021, SC'21, §2.2.2). :func:`pipeline_step` splits the batch
into m micro-batches, runs forwards and backwards in the order of :mod:`~commlab.parallel.pipeline.schedules`
and posts between them the messages of :mod:`~commlab.parallel.pipeline.plan`. Micro-batch losses are
divided by m, so ``.grad`` is the whole batch's (float32 tests: ``allclose(rtol=1e-5, atol=1e-6)`` against
the unsplit model). Ops are timed with a :class:`commlab.launch.device.Clock` from a barrier at the start
and returned as a :class:`PipelineResult`. The group is explicit, so pipelines can run side by side.

Book: chapter 10, §10.10.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from commlab import checks
from commlab.launch.device import Clock, group_device
from commlab.parallel.pipeline.communications import (ENGINE_SCHEDULES, PendingSends, agree_chunk_boundaries,
                                                      agree_step, communicate, stage_of, stage_rank)
from commlab.parallel.pipeline.plan import ACTIVATION, GRADIENT, CommGroup, communication_plan
from commlab.parallel.pipeline.schedules import (FORWARD, TimedOp, bubble_fraction, idle_fraction,
                                                 interleaved_bubble_time_ratio, interleaved_schedule, make_schedule,
                                                 stage_busy_idle)

__all__ = ["split_sequential", "split_interleaved", "PipelineResult", "pipeline_step"]


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


def split_interleaved(model: nn.Sequential, p: int, v: int,
                      sizes: Sequence[int] | None = None) -> list[list[nn.Sequential]]:
    """Cut ``model`` into ``p·v`` contiguous pieces and deal them to p ranks as v model chunks each, the
    way Megatron-LM's interleaving assigns them: chunk c of rank s is virtual stage ``c·p + s`` (Narayanan
    et al. 2021, SC'21, §2.2.2). Rank 0 holds pieces 0, p, 2p, ...; rank p - 1 the last one.

    Args:
        model: the whole model; its children run in order.
        p: pipeline ranks (stages), >= 1.
        v: model chunks per rank, >= 1 (1: :func:`split_sequential`'s stages, one per rank).
        sizes: children per virtual stage (``p·v`` counts, in model order; default as equal as possible).

    Returns:
        ``chunks[s][c]`` = virtual stage ``c·p + s`` (an ``nn.Sequential`` sharing the model's modules);
        ``nn.Sequential(*[chunks[k % p][k // p] for k in range(p·v)])`` computes the same function as
        ``model``. Pass ``chunks[s]`` to :func:`pipeline_step` on rank s with ``schedule="interleaved"``.

    Raises:
        ValueError: p or v not an int >= 1, ``p·v`` above the number of children, or bad ``sizes`` (see
            :func:`split_sequential`).
    """
    checks.integer("p", p, where="split_interleaved")
    checks.integer("v", v, where="split_interleaved")
    pieces = split_sequential(model, p * v, sizes)
    return [[pieces[c * p + s] for c in range(v)] for s in range(p)]


@dataclasses.dataclass
class PipelineResult:
    """What :func:`pipeline_step` returns, on every stage.

    Attributes:
        loss: mean loss over the whole batch (sum over micro-batches of ``loss_j / m``), a float, on every
            stage (the last stage broadcasts it in the pipeline group).
        timeline: every stage's ops with start/end in seconds since that stage's start of the step,
            sorted by (stage, start); gathered from all stages (each op's ``chunk`` set when interleaved).
        busy_s, idle_s: per stage (list index = stage), compute time and the rest of the step, seconds.
        idle_fraction: total idle / (p × step time), measured; compare with :attr:`bubble_fraction`.
        bubble_fraction: the ideal ``(p-1)/(m+p-1)``; interleaved, ``f/(1+f)`` of ``f = (p-1)/(v·m)``.
        step_s: this stage's wall time of the whole step (including waiting for its sends), seconds.
        nbytes_sent: bytes this stage sent (activations forward plus gradients backward).
        schedule, p, m: as run.
        v: model chunks per stage (1 unless interleaved).
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
    v: int = 1


def pipeline_step(stage_module: nn.Module | Sequence[nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], m: int,
                  group: dist.ProcessGroup | None, schedule: str = "1f1b") -> PipelineResult:
    """Forward and backward of one batch through the pipeline, on every rank of ``group`` with its stage (group
    rank s = stage s); gradients accumulate into ``.grad``: zero them and step the optimizer around it.

    Args:
        stage_module: this rank's stage (:func:`split_sequential`); interleaved, a list of its v >= 2 chunks,
            chunk c being virtual stage ``c·p + rank`` (:func:`split_interleaved`).
        inputs: the whole batch, ``(batch, ...)``; values read on stage 0 only (any dtype; boundary dtypes
            and shapes are passed down), but pass it on every stage: its batch size and device are used.
        targets: the whole batch's targets, ``(batch, ...)``; read on the last stage only.
        loss_fn: ``loss_fn(output, target) -> scalar``, a *mean* over the micro-batch (a sum is scaled wrong).
        m: micro-batches; divides the batch size; interleaved, also a multiple of p.
        group: the pipeline group (None: the default group).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (Megatron-LM's interleaved 1F1B).

    Returns:
        :class:`PipelineResult` (the same loss, timeline and per-stage times on every stage).

    Raises:
        ValueError: unknown schedule, bad m, batch on another device, stages disagreeing on schedule, m,
            batch size or chunks (listing each stage's); interleaved: m not a multiple of p, p < 2, < 2 chunks
            or not a list; a tensor to send whose shape/dtype differs from the agreed one (stage, micro-batch).
        RuntimeError: this rank not in ``group``; a stage output not depending on its input; a stage that
            failed while the boundary shapes were agreed.
    """
    stage, p = stage_of(group)
    batch = inputs.shape[0] if inputs.dim() > 0 else 0
    device = group_device(group)
    interleaved = schedule == "interleaved"
    # Each stage judges its own arguments; agree_step then makes every stage raise if any stage found a
    # problem or the stages disagree, instead of leaving the others waiting for messages.
    chunks, problem = _chunks_of(stage_module, interleaved)
    v = len(chunks)
    if schedule not in ENGINE_SCHEDULES:
        problem = f"unknown pipeline schedule {schedule!r}; choose one of {sorted(ENGINE_SCHEDULES)}"
    elif not checks.is_int(m) or m < 1 or batch % m != 0:
        problem = f"m={m!r} micro-batches must be a positive integer dividing the batch size {batch}"
    elif interleaved and p < 2:
        problem = f"interleaved 1F1B needs p >= 2 pipeline stages, got p={p}; with one stage use '1f1b'"
    elif interleaved and m % p:
        problem = (f"interleaved 1F1B needs the m={m} micro-batches to be a multiple of p={p} (Megatron-LM "
                   f"asserts it); choose m from {[p * k for k in range(1, 4)]}, ... dividing the batch size {batch}")
    elif problem is None and (inputs.device != device or targets.device != device):
        problem = (f"the pipeline group's messages travel on {device}, but inputs are on {inputs.device} and "
                   f"targets on {targets.device}; move the batch (and the stage module) to {device}")
    # A collective over the whole pipeline group before its first point-to-point message: on NCCL the first
    # batch_isend_irecv on a communicator must involve every rank of the group (torch's docstring), and the
    # shape agreement's first message involves stages 0 and 1 only.
    agree_step(schedule, m, batch, problem, group, v=v)
    n_virtual = p * v
    mb_shape = (batch // m,) + tuple(inputs.shape[1:])
    ops = interleaved_schedule(p, m, v) if interleaved else make_schedule(schedule, p, m)
    my_plan = communication_plan(ops, v)[stage]
    x_mb = inputs.chunk(m) if stage == 0 else None
    y_mb = targets.chunk(m) if stage == (n_virtual - 1) % p else None
    # The boundary pass ends with an all-gather over the pipeline group, which is also the stages' common
    # start of the step (so that their timelines line up).
    boundaries = agree_chunk_boundaries(chunks, mb_shape, inputs.dtype, group, device)

    pending = PendingSends()
    # Keyed (kind, microbatch, chunk): received and not yet used, produced and not yet sent.
    inbox: dict[tuple[str, int, int], torch.Tensor] = {}
    outbox: dict[tuple[str, int, int], torch.Tensor] = {}
    stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    clock = Clock(device)
    marks: list[tuple[str, int, int, object, object]] = []

    t0 = clock.mark()
    for item in my_plan:
        if isinstance(item, CommGroup):
            inbox.update(communicate(item, outbox, boundaries, group, pending, device))
            continue
        j, c = item.microbatch, item.chunk
        vs = c * p + stage
        first, last = vs == 0, vs == n_virtual - 1
        module = chunks[c]
        if item.kind == FORWARD:
            x = x_mb[j] if first else inbox.pop((ACTIVATION, j, c)).requires_grad_()
            start = clock.mark()
            out = module(x)
            if last:
                loss = loss_fn(out, y_mb[j]) / m
                loss_total += loss.detach().to(torch.float64)
                stored[(j, c)] = (None if first else x, loss)
            else:
                # Store x (to read its .grad after backward) and out (to backpropagate into).
                stored[(j, c)] = (None if first else x, out)
                outbox[(ACTIVATION, j, c)] = out
        else:
            x, out = stored.pop((j, c))
            grad_out = None if last else inbox.pop((GRADIENT, j, c))
            start = clock.mark()
            torch.autograd.backward(out, grad_out)  # grad_out None: out is the last stage's scalar loss
            if not first:
                if x.grad is None:
                    where = f"stage {stage}" if v == 1 else f"stage {stage}'s chunk {c} (virtual stage {vs})"
                    before = f"stage {stage - 1}" if v == 1 else f"virtual stage {vs - 1}"
                    raise RuntimeError(
                        f"{where}: backward of micro-batch {j} left no gradient on the stage's input, so "
                        f"there is nothing to send back to {before}: the stage's output does not depend "
                        "on the activation it received (a detach(), a constant output, or an input it ignores); "
                        "a pipeline stage must compute from its input")
                outbox[(GRADIENT, j, c)] = x.grad
        marks.append((item.kind, j, c, start, clock.mark()))
    pending.wait_all()  # every exchange waited before the step returns
    t_end = clock.mark()
    times = [(kind, j, c, clock.elapsed(t0, a), clock.elapsed(t0, b)) for kind, j, c, a, b in marks]
    step_s = clock.elapsed(t0, t_end)

    # The loss lives on the last virtual stage's rank; share it (one scalar, on the group's device) so every
    # stage returns the same result.
    loss_buf = loss_total.clone()
    with torch.profiler.record_function("pp::loss"):
        dist.broadcast(loss_buf, src=stage_rank(group, (n_virtual - 1) % p), group=group)
    everyone: list = [None] * p
    with torch.profiler.record_function("stats::pipeline_timeline"):   # commlab.overlap.trace: step statistics
        dist.all_gather_object(everyone, times, group=group)
    timeline = sorted((TimedOp(s, k, j, a, b, c) for s, ts in enumerate(everyone) for k, j, c, a, b in ts),
                      key=lambda t: (t.stage, t.start_s))
    per_stage = stage_busy_idle(timeline)
    if interleaved:
        ratio = interleaved_bubble_time_ratio(p, m, v)
        ideal = ratio / (1 + ratio)
    else:
        ideal = bubble_fraction(p, m)
    return PipelineResult(loss=float(loss_buf), timeline=timeline,
                          busy_s=[per_stage[s][0] for s in range(p)], idle_s=[per_stage[s][1] for s in range(p)],
                          idle_fraction=idle_fraction(timeline), bubble_fraction=ideal,
                          step_s=step_s, nbytes_sent=pending.nbytes_sent, schedule=schedule, p=p, m=m, v=v)


def _chunks_of(stage_module, interleaved: bool) -> tuple[list[nn.Module], str | None]:
    """This rank's chunks and its own verdict on them (None: fine): GPipe and 1F1B take one module,
    interleaved a list (tuple, ``nn.ModuleList``) of v >= 2 modules. With a problem, no chunks (v = 0): the
    stages' agreement then raises it on every stage."""
    if not interleaved:
        if isinstance(stage_module, nn.Module):
            return [stage_module], None
        return [], (f"the stage must be one nn.Module for this schedule, got {type(stage_module).__name__}; "
                    "pass the chunks of an interleaved pipeline with schedule='interleaved'")
    if isinstance(stage_module, (list, tuple, nn.ModuleList)):
        chunks = list(stage_module)
        if len(chunks) < 2 or not all(isinstance(c, nn.Module) for c in chunks):
            return [], (f"interleaved 1F1B needs v >= 2 model chunks (nn.Module) on every stage, got "
                        f"{len(chunks)} ({', '.join(type(c).__name__ for c in chunks) or 'none'}); with one "
                        "chunk per stage use schedule='1f1b'")
        return chunks, None
    return [], (f"interleaved 1F1B needs this stage's v model chunks as a list (split_interleaved(model, p, v)"
                f"[stage]), got one {type(stage_module).__name__}")
