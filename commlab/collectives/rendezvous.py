"""A model of NCCL's point-to-point rendezvous, and a simulator that tells whether a plan can deadlock.

A *plan* lists, for every rank, the groups of messages it posts, in order (each group what one
:func:`commlab.collectives.p2p.exchange` posts). :func:`simulate_rendezvous` replays it under NCCL's rules
for ``ncclSend``/``ncclRecv`` (NCCL user guide, "Point-to-point communication"): (1) a rank runs its groups
in order; (2) a send and a receive meet only while both ranks are at the groups that hold them; (3) messages
between a pair match in order, in one direction; (4) a group completes once all its messages have met. If
no rank can move while some have groups left it raises :class:`RendezvousDeadlock`, naming where each rank
is stuck. This is the strict model: gloo completes every plan that passes here; PyTorch's NCCL backend
keys ungrouped operations by peer pair, so rule 1 holds per pair there. Messages are any objects with
``src`` and ``dst``; groups any objects with ``sends`` and ``recvs``. The pipeline's plans are checked
with it (:mod:`commlab.parallel.pipeline.plan`).

Book: chapter 2, §2.6.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

__all__ = ["Message", "Group", "RendezvousDeadlock", "meetings", "simulate_rendezvous"]


@dataclasses.dataclass(frozen=True)
class Message:
    """A message from rank ``src`` to rank ``dst``; ``label`` says what it carries (e.g. ``"x0"``)."""

    src: int
    dst: int
    label: str = ""

    def __str__(self) -> str:
        return f"{self.label}:{self.src}->{self.dst}"


@dataclasses.dataclass(frozen=True)
class Group:
    """The messages one rank posts together: ``sends`` and ``recvs``."""

    sends: tuple[Any, ...] = ()
    recvs: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return "[" + ", ".join([f"send {m}" for m in self.sends] + [f"recv {m}" for m in self.recvs]) + "]"


class RendezvousDeadlock(RuntimeError):
    """A plan cannot complete under NCCL's rendezvous rules; the message names the group each unfinished
    rank is stuck at.

    Attributes:
        positions: per rank, the index of the group it is stuck at (its number of groups if it finished).
    """

    def __init__(self, message: str, positions: Sequence[int]):
        super().__init__(message)
        self.positions = list(positions)


def meetings(plan: Sequence[Sequence[Any]]) -> list[tuple[Any, int, int]]:
    """Which group of the receiver each sent message meets (rule 3): ``(message, sender's group index,
    receiver's group index)`` for every message, in the senders' posting order.

    Raises:
        ValueError: a group sends a message that is not from its rank (or receives one not to it); a
            message sent that no rank receives, or the other way round; or the k-th message between two
            ranks differs between its two sides.
    """
    past = {"send": "sent", "recv": "received"}
    where: dict[tuple[str, int, int, int], tuple[int, Any]] = {}  # (side, src, dst, k) -> (group, message)
    count: dict[tuple[str, int, int], int] = {}
    for r, groups in enumerate(plan):
        for g, grp in enumerate(groups):
            for side, msgs in (("send", grp.sends), ("recv", grp.recvs)):
                for msg in msgs:
                    if (side == "send" and msg.src != r) or (side == "recv" and msg.dst != r):
                        raise ValueError(f"rank {r}'s group {g} {side}s {msg}, which is not its own message")
                    pair = (side, msg.src, msg.dst)
                    k = count.get(pair, 0)
                    count[pair] = k + 1
                    where[(side, msg.src, msg.dst, k)] = (g, msg)
    out = []
    for (side, a, b, k), (g, msg) in where.items():
        other = "recv" if side == "send" else "send"
        if (other, a, b, k) not in where:
            raise ValueError(f"message {k} from rank {a} to rank {b} ({msg}) is {past[side]} but never "
                             f"{past[other]}")
        if side == "send":
            g_recv, received = where[("recv", a, b, k)]
            if received != msg:
                raise ValueError(f"message {k} from rank {a} to rank {b}: sent as {msg}, received as {received}")
            out.append((msg, g, g_recv))
    return out


def simulate_rendezvous(plan: Sequence[Sequence[Any]]) -> int:
    """Replay ``plan`` (``plan[rank]`` = that rank's groups, in posting order) under the rules above.

    Returns:
        The number of rounds until every rank has completed all its groups; in a round every message whose
        two groups are both current meets, and every rank whose current group is then complete moves on
        (a measure of how serialised the plan is).

    Raises:
        ValueError: the plan is inconsistent (see :func:`meetings`).
        RendezvousDeadlock: no rank can move and some have groups left.
    """
    # held[r][g] = [(message number, peer rank, the peer's group that holds the other side)]
    held: list[list[list[tuple[int, int, int]]]] = [[[] for _ in groups] for groups in plan]
    for i, (msg, g_send, g_recv) in enumerate(meetings(plan)):
        held[msg.src][g_send].append((i, msg.dst, g_recv))
        held[msg.dst][g_recv].append((i, msg.src, g_send))
    pos = [0] * len(plan)
    done: set[int] = set()
    rounds = 0
    while any(pos[r] < len(groups) for r, groups in enumerate(plan)):
        current = [r for r, groups in enumerate(plan) if pos[r] < len(groups)]
        met = {i for r in current for i, peer, g in held[r][pos[r]] if i not in done and pos[peer] == g}
        done |= met
        movable = [r for r in current if all(i in done for i, _, _ in held[r][pos[r]])]
        if not movable and not met:
            stuck = "; ".join(f"rank {r} at {plan[r][pos[r]]}" for r in current)
            raise RendezvousDeadlock(f"the plan deadlocks under NCCL's rendezvous rules: {stuck}", pos)
        for r in movable:
            pos[r] += 1
        rounds += 1
    return rounds
