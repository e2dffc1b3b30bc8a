"""The pipeline's communication plan, as data, and a simulator that proves it cannot deadlock on NCCL.

:func:`communication_plan` turns a schedule (:mod:`~commlab.parallel.pipeline.schedules`) into, per
stage, its computations with the groups of messages posted between them (each group one
:func:`commlab.collectives.p2p.exchange`): between two computations, one group of what the first produced
and what the second needs (Megatron-LM's ``send_forward_recv_backward`` and ``send_backward_recv_forward``
in the 1F1B steady state); for interleaved 1F1B, one group between Megatron-LM's *steps* (a steady-state
forward-backward pair is one step), as ``forward_backward_pipelining_with_interleaving`` does.
:func:`simulate_plan` replays a plan under NCCL's rendezvous rules (:mod:`commlab.collectives.rendezvous`)
and names the stuck groups if it deadlocks. Pure functions of ``(schedule, p, m)``, so the engine, the
tests and the book read the same lists. Sources: Narayanan et al. 2021 (SC'21); Megatron-LM's
``p2p_communication.py``.

Book: chapter 10, §10.10; chapter 2, §2.6 (why one group per step).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from commlab import checks
from commlab.collectives.rendezvous import RendezvousDeadlock, simulate_rendezvous
from commlab.parallel.pipeline.schedules import BACKWARD, FORWARD, Op, interleaved_schedule, interleaved_warmup

__all__ = ["ACTIVATION", "GRADIENT", "Message", "CommGroup", "PlanItem", "communication_plan",
           "ungrouped_plan", "simulate_plan", "RendezvousDeadlock"]

ACTIVATION = "activation"  # the output of F j on stage s, sent to s+1
GRADIENT = "gradient"  # the gradient w.r.t. the input of B j on stage s, sent to s-1


@dataclasses.dataclass(frozen=True)
class Message:
    """One tensor between neighbouring stages: ``kind`` (activation or gradient) of ``microbatch``,
    from stage ``src`` to stage ``dst``; in an interleaved pipeline from model chunk ``src_chunk`` of ``src``
    to chunk ``dst_chunk`` of ``dst`` (both 0 otherwise)."""

    kind: str
    microbatch: int
    src: int
    dst: int
    src_chunk: int = 0
    dst_chunk: int = 0

    def __str__(self) -> str:
        if self.src_chunk or self.dst_chunk:
            return f"{self.kind[0]}{self.microbatch}:{self.src}.{self.src_chunk}->{self.dst}.{self.dst_chunk}"
        return f"{self.kind[0]}{self.microbatch}:{self.src}->{self.dst}"


@dataclasses.dataclass(frozen=True)
class CommGroup:
    """Messages one stage posts together (one grouped exchange): its ``sends`` and its ``recvs``.

    Attributes:
        stage: the stage that posts the group.
        sends, recvs: the messages, in the order they are posted.
    """

    stage: int
    sends: tuple[Message, ...] = ()
    recvs: tuple[Message, ...] = ()

    @property
    def name(self) -> str:
        """Megatron-LM's name for this kind of group (e.g. ``send_forward_recv_backward``)."""
        parts = [f"send_{'forward' if m.kind == ACTIVATION else 'backward'}" for m in self.sends]
        parts += [f"recv_{'forward' if m.kind == ACTIVATION else 'backward'}" for m in self.recvs]
        return "_".join(parts) or "nothing"

    def __str__(self) -> str:
        return "[" + ", ".join([f"send {m}" for m in self.sends] + [f"recv {m}" for m in self.recvs]) + "]"


#: A plan item: a computation of the schedule, or a group of messages.
PlanItem = Union[Op, CommGroup]


def _message(kind: str, op: Op, src_vs: int, dst_vs: int, p: int) -> Message:
    return Message(kind, op.microbatch, src_vs % p, dst_vs % p, src_vs // p, dst_vs // p)


def _produces(op: Op, p: int, v: int = 1) -> Message | None:
    """What ``op`` sends: a forward its activation to virtual stage k + 1, a backward its input's gradient
    to k - 1 (none past either end; v = 1: stage s ± 1)."""
    vs = op.chunk * p + op.stage
    if op.kind == FORWARD:
        return _message(ACTIVATION, op, vs, vs + 1, p) if vs < p * v - 1 else None
    if op.kind == BACKWARD:
        return _message(GRADIENT, op, vs, vs - 1, p) if vs > 0 else None
    return None  # a weight gradient (W) stays on its stage


def _needs(op: Op, p: int, v: int = 1) -> Message | None:
    """What ``op`` receives: a forward the activation of virtual stage k - 1, a backward the gradient from
    k + 1 (the first forward and the last backward nothing)."""
    vs = op.chunk * p + op.stage
    if op.kind == FORWARD:
        return _message(ACTIVATION, op, vs - 1, vs, p) if vs > 0 else None
    if op.kind == BACKWARD:
        return _message(GRADIENT, op, vs + 1, vs, p) if vs < p * v - 1 else None
    return None


def communication_plan(schedule: Sequence[Sequence[Op]], v: int = 1) -> list[list[PlanItem]]:
    """The grouped plan of a schedule: per stage, its computations with the groups between them.

    Between ``o_i`` and ``o_{i+1}``, one group of what ``o_i`` produces and what ``o_{i+1}`` needs; before the
    first computation, the group of what it needs; after the last, the group of what it produces. A stage with
    nothing to exchange at a boundary posts nothing. With ``v > 1`` the same rule between Megatron-LM's
    *steps* (a steady-state forward-backward pair is one step, its group holds both their messages and both
    the next step's).

    Args:
        schedule: per-stage op lists, e.g. from :func:`~commlab.parallel.pipeline.schedules.make_schedule`,
            or for ``v > 1`` exactly :func:`~commlab.parallel.pipeline.schedules.interleaved_schedule`
            ``(p, m, v)``.
        v: model chunks per stage (1: GPipe, 1F1B, one chunk each).

    Returns:
        ``plan[s]``: stage s's items in the order it runs them; every :class:`CommGroup` has at least one
        message (v = 1: at most one send and one receive; v > 1: at most two of each).

    Raises:
        ValueError: v not an int >= 1; with v > 1, a schedule that is not ``interleaved_schedule(p, m, v)``
            (the steps are those of its warm-up, steady state and drain).
    """
    checks.integer("v", v, note="model chunks per stage", where="communication_plan")
    p = len(schedule)
    if v == 1:
        steps = [[[op] for op in ops] for ops in schedule]
    else:
        steps = _interleaved_steps(schedule, p, v)
    plan = []
    for s, stage_steps in enumerate(steps):
        items: list[PlanItem] = []
        previous: list[Op] = []
        for step in stage_steps + [[]]:  # the empty last step: the group of what the last one produced
            sends = tuple(msg for msg in (_produces(op, p, v) for op in previous) if msg is not None)
            recvs = tuple(msg for msg in (_needs(op, p, v) for op in step) if msg is not None)
            if sends or recvs:
                items.append(CommGroup(s, sends, recvs))
            items.extend(step)
            previous = step
        plan.append(items)
    return plan


def _interleaved_steps(schedule: Sequence[Sequence[Op]], p: int, v: int) -> list[list[list[Op]]]:
    """Per stage, Megatron-LM's steps of the interleaved schedule: each warm-up forward alone, each steady
    forward-backward pair together, each drain backward alone."""
    n_forward = sum(op.kind == FORWARD for op in schedule[0]) if schedule else 0
    m = n_forward // v
    try:
        expected = interleaved_schedule(p, m, v)
    except ValueError as e:
        raise ValueError(f"communication_plan with v={v} takes interleaved_schedule(p, m, v); this schedule's "
                         f"p={p}, {n_forward} forwards per stage do not make one ({e})") from None
    if [list(ops) for ops in schedule] != expected:
        raise ValueError(f"communication_plan with v={v} groups the steps of interleaved_schedule(p={p}, m={m}, "
                         f"v={v}); this schedule has another order")
    steps = []
    for s, ops in enumerate(schedule):
        warmup = interleaved_warmup(p, m, v, s)
        steady = m * v - warmup
        stage_steps = [[op] for op in ops[:warmup]]
        stage_steps += [list(ops[warmup + 2 * k:warmup + 2 * k + 2]) for k in range(steady)]
        stage_steps += [[op] for op in ops[warmup + 2 * steady:]]
        steps.append(stage_steps)
    return steps


def ungrouped_plan(schedule: Sequence[Sequence[Op]]) -> list[list[PlanItem]]:
    """The plan of the engine before grouping: every send and every receive a group of its own, each
    receive just before the computation that needs it, each send just after the one that produced it.

    Kept to show what :func:`simulate_plan` catches: under NCCL's rules it deadlocks in the 1F1B steady
    state. (GPipe and 1F1B only, one chunk per stage.)
    """
    p = len(schedule)
    plan = []
    for s, ops in enumerate(schedule):
        items: list[PlanItem] = []
        for op in ops:
            need, out = _needs(op, p), _produces(op, p)
            if need is not None:
                items.append(CommGroup(s, recvs=(need,)))
            items.append(op)
            if out is not None:
                items.append(CommGroup(s, sends=(out,)))
        plan.append(items)
    return plan


def simulate_plan(plan: Sequence[Sequence[PlanItem]]) -> int:
    """Replay a plan's groups under NCCL's rendezvous rules (:func:`commlab.collectives.rendezvous.
    simulate_rendezvous`, stages as ranks; computations take no time); return the number of rounds.

    Raises:
        ValueError: the plan is inconsistent (a message sent but never received, or received as another).
        RendezvousDeadlock: the plan deadlocks; the message names the group each stuck stage waits at.
    """
    return simulate_rendezvous([[it for it in items if isinstance(it, CommGroup)] for items in plan])
