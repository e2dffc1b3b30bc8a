"""The pipeline's communication plan, as data, and a simulator that proves it cannot deadlock on NCCL.

A schedule (:mod:`~commlab.parallel.pipeline.schedules`) says in which order a stage computes; the *plan*
says which messages it exchanges between those computations, and which of them are posted together as
one group (one :func:`commlab.collectives.p2p.exchange`, i.e. one ``batch_isend_irecv``). Both are pure
functions of ``(schedule, p, m)``, so the engine, the tests and the book read the same lists.

**Messages.** Forward ``F j`` on stage s needs micro-batch j's activation from stage s-1 and produces the
activation that stage s+1 needs; backward ``B j`` needs the gradient of its output from stage s+1 and
produces the gradient that stage s-1 needs. The first stage receives no activation and sends no gradient;
the last sends no activation and receives no gradient (it differentiates the loss).

**Groups.** Between two consecutive computations ``o_i`` and ``o_{i+1}`` of a stage, the stage posts one
group: what ``o_i`` produced and what ``o_{i+1}`` needs (one step, one group). In the 1F1B steady state
these are Megatron-LM's ``send_forward_recv_backward`` (after a forward, before a backward: activation out
to s+1, gradient in from s+1) and ``send_backward_recv_forward`` (after a backward, before a forward:
gradient out to s-1, activation in from s-1); Narayanan et al. 2021, SC'21, and Megatron-LM's
``p2p_communication.py``. There the grouping is what makes the pipeline run at all: stage s sends
micro-batch j+1's activation forward while stage s+1 sends micro-batch j's gradient back, and ungrouped,
on NCCL, each send waits for the other's receive, which is posted behind the other's send -- the classic
1F1B deadlock. In the warm-up, the cool-down and GPipe's two halves the send and the receive go to
different neighbours; Megatron-LM posts them one after the other, and the simulator shows that either
form completes, but one group lets both progress at once and keeps one rule for every boundary.

**The simulator** (:func:`simulate_plan`) replays a plan under NCCL's rendezvous rules
(:mod:`commlab.collectives.rendezvous`): each stage runs its groups one after another, in order (one
stream); a send and a receive meet only while both stages are at the groups that hold them; a group
completes when all of its messages have met. Computations always finish. If no stage can move and some
have groups left, the plan deadlocks, and the simulator names the stuck groups. The tests run it for GPipe
and 1F1B at every ``p <= 8, m <= 16``, and show that the old plan -- every send and every receive a group
of its own -- deadlocks in the 1F1B steady state.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from commlab.collectives.rendezvous import RendezvousDeadlock, simulate_rendezvous
from commlab.parallel.pipeline.schedules import FORWARD, Op

__all__ = ["ACTIVATION", "GRADIENT", "Message", "CommGroup", "PlanItem", "communication_plan",
           "ungrouped_plan", "simulate_plan", "RendezvousDeadlock"]

ACTIVATION = "activation"  # the output of F j on stage s, sent to s+1
GRADIENT = "gradient"  # the gradient w.r.t. the input of B j on stage s, sent to s-1


@dataclasses.dataclass(frozen=True)
class Message:
    """One tensor between neighbouring stages: ``kind`` (activation or gradient) of ``microbatch``,
    from stage ``src`` to stage ``dst``."""

    kind: str
    microbatch: int
    src: int
    dst: int

    def __str__(self) -> str:
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


def _produces(op: Op, p: int) -> Message | None:
    if op.kind == FORWARD:
        return Message(ACTIVATION, op.microbatch, op.stage, op.stage + 1) if op.stage < p - 1 else None
    return Message(GRADIENT, op.microbatch, op.stage, op.stage - 1) if op.stage > 0 else None


def _needs(op: Op, p: int) -> Message | None:
    if op.kind == FORWARD:
        return Message(ACTIVATION, op.microbatch, op.stage - 1, op.stage) if op.stage > 0 else None
    return Message(GRADIENT, op.microbatch, op.stage + 1, op.stage) if op.stage < p - 1 else None


def communication_plan(schedule: Sequence[Sequence[Op]]) -> list[list[PlanItem]]:
    """The grouped plan of a schedule: per stage, its computations with the groups between them.

    Rule (see the module docstring): between ``o_i`` and ``o_{i+1}``, one group of what ``o_i`` produces
    and what ``o_{i+1}`` needs; before the first computation, the group of what it needs; after the
    last, the group of what it produces. A stage with nothing to exchange at a boundary posts nothing.

    Args:
        schedule: per-stage op lists, e.g. from :func:`~commlab.parallel.pipeline.schedules.make_schedule`.

    Returns:
        ``plan[s]``: stage s's items in the order it runs them; every :class:`CommGroup` has at least one
        message.
    """
    p = len(schedule)
    plan = []
    for s, ops in enumerate(schedule):
        items: list[PlanItem] = []
        for i, op in enumerate(ops):
            out = _produces(ops[i - 1], p) if i > 0 else None
            need = _needs(op, p)
            _boundary(items, s, out, need)
            items.append(op)
        _boundary(items, s, _produces(ops[-1], p) if ops else None, None)
        plan.append(items)
    return plan


def _boundary(items: list, s: int, out: Message | None, need: Message | None) -> None:
    sends, recvs = (() if out is None else (out,)), (() if need is None else (need,))
    if sends or recvs:
        items.append(CommGroup(s, sends, recvs))


def ungrouped_plan(schedule: Sequence[Sequence[Op]]) -> list[list[PlanItem]]:
    """The plan of the engine before grouping: every send and every receive a group of its own, each
    receive just before the computation that needs it, each send just after the one that produced it.

    Kept to show what :func:`simulate_plan` catches: under NCCL's rules it deadlocks in the 1F1B steady
    state.
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
