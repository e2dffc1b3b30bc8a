"""The one point-to-point primitive every hand-written collective and the pipeline use: a grouped exchange.

:func:`exchange` posts the sends and receives of one *step* together, as one
``torch.distributed.batch_isend_irecv`` call (NCCL's ``ncclGroupStart``/``ncclGroupEnd``), and returns an
:class:`Exchange` to wait on. NCCL only promises that a send and a receive progress together inside one
group (NCCL user guide, "Point-to-point communication"; NVIDIA/nccl issue #479; pytorch/pytorch #43995).
Every caller follows three rules, which :mod:`commlab.collectives.rendezvous` checks on replayed plans:
(1) one group per step, holding the step's sends and the receives they must progress with; (2) never a
receive posted in a group ahead of the send it depends on; (3) messages between one pair, in one
direction, match in the order they were posted. Empty tensors are left out on both sides; with an
:class:`~commlab.topology.EmulatedTopology` the rank waits as long as its sends would take on the emulated
link before posting them.

Book: chapter 2, §2.6 (why a step's send and receive go in one group).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives.common import group_size_and_rank
from commlab.topology.emulated import EmulatedTopology

__all__ = ["Exchange", "exchange", "wait_all"]

# One message: (tensor, peer), the peer as a *global* rank (its rank in the default group).
_Message = tuple[torch.Tensor, int]


class Exchange:
    """The requests of one posted group, and the tensors they read from or write into.

    Keep it until :meth:`wait` has returned: until then a sent tensor must not be modified and a received
    tensor must not be read (on a GPU the tensors must also stay alive, which holding this object
    guarantees). The requests are released only when this object is: on gloo, releasing a receive request
    right after waiting for it slows a ring step, so the ring drops step s's exchange only after posting s+1.

    Attributes:
        nbytes_sent: payload bytes of the group's sends (``numel * element_size``; headers not counted).
        nbytes_received: payload bytes of its receives.
        count: messages posted (empty tensors not counted).
    """

    __slots__ = ("_recv_works", "_send_works", "_recvs_done", "_sends_done", "_tensors", "_peers", "_recvs",
                 "nbytes_sent", "nbytes_received", "count")

    def __init__(self, works: list, tensors: list[torch.Tensor], peers: list[int], recvs: int,
                 nbytes_sent: int, nbytes_received: int):
        # Gloo returns one request per op, in the order posted (receives first, see exchange); NCCL returns
        # one request for the whole coalesced group, which then stands for the receives too.
        if len(works) == len(tensors):
            self._recv_works, self._send_works = works[:recvs], works[recvs:]
        else:
            self._recv_works, self._send_works = list(works), []
        # Each request is waited once: gloo's receive request blocks if waited a second time.
        self._recvs_done = self._sends_done = False
        self._tensors = tensors
        self._peers = peers
        self._recvs = recvs
        self.nbytes_sent = nbytes_sent
        self.nbytes_received = nbytes_received
        self.count = len(tensors)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every send and receive of the group has completed (on a GPU: until the current
        stream waits for them, which is what later kernels need). Waiting again returns at once.

        Args:
            timeout_s: seconds to wait at most for each request (default: the process group's timeout,
                which :func:`commlab.launch` sets short).

        Raises:
            RuntimeError (torch's ``DistBackendError``): a peer failed, or ``timeout_s`` passed.
        """
        self.wait_recvs(timeout_s)
        if not self._sends_done:
            self._wait(self._send_works, timeout_s)
            self._sends_done = True

    def wait_recvs(self, timeout_s: float | None = None) -> None:
        """Block until the group's receives have completed, so that the received tensors can be read; the
        sends may still be in flight (call :meth:`wait` before modifying a sent tensor).

        Where the backend runs the group as one request (NCCL), this waits for the whole group, sends
        included; on gloo it lets a rank go on with the data it has while its own message is still being
        read by the peer. Arguments and errors as :meth:`wait`.
        """
        if not self._recvs_done:
            self._wait(self._recv_works, timeout_s)
            self._recvs_done = True

    def _wait(self, works, timeout_s) -> None:
        try:
            for work in works:
                if timeout_s is None:
                    work.wait()
                else:
                    work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            # Name the messages, so that a timeout says which peer never came; torch's own text is kept at
            # the end (the launcher reads it to tell a root cause from a peer's reaction to it).
            raise RuntimeError(f"rank {dist.get_rank()}: a grouped exchange did not complete "
                               f"({self.describe()}): {e}") from e

    def describe(self) -> str:
        """The group's messages in words, e.g. ``receive of 1024 float32 (4096 bytes) from rank 3``."""
        parts = []
        for i, (t, peer) in enumerate(zip(self._tensors, self._peers)):
            what, where = ("receive", "from") if i < self._recvs else ("send", "to")
            parts.append(f"{what} of {t.numel()} {str(t.dtype).replace('torch.', '')} "
                         f"({t.numel() * t.element_size()} bytes) {where} rank {peer}")
        return "; ".join(parts) or "no messages"


def exchange(sends: Iterable[_Message] = (), recvs: Iterable[_Message] = (),
             group: dist.ProcessGroup | None = None, *,
             emulate: EmulatedTopology | None = None) -> Exchange:
    """Post one step's sends and receives as a single group; returns the :class:`Exchange` to wait on.

    Args:
        sends: ``(tensor, dst)`` pairs: send all of ``tensor`` (contiguous) to global rank ``dst``.
        recvs: ``(tensor, src)`` pairs: receive into all of ``tensor`` (contiguous, the sender's element
            count and dtype) from global rank ``src``.
        group: the process group both peers belong to (None: the default group); every message of the
            step goes through it.
        emulate: an :class:`~commlab.topology.EmulatedTopology` whose links delay this rank's sends.

    Returns:
        An :class:`Exchange`. Messages with an empty tensor are left out (the peer leaves out its side).

    Raises:
        RuntimeError: this rank is not a member of ``group`` (torch would only warn and post nothing, so
            the caller's receive buffers would silently keep their old contents); the message names the
            rank, and the group's global ranks where the group object knows them (``dist.new_group``
            gives the ranks it leaves out only ``GroupMember.NON_GROUP_MEMBER``).
        ValueError: a peer that is not an int, is this rank itself, or is not a member of ``group``; or
            tensors on different devices (one group runs on one device).
    """
    me = dist.get_rank()
    if group is not None and group is not dist.group.WORLD:
        group_size_and_rank(group, "exchange")
    ops: list[dist.P2POp] = []
    tensors: list[torch.Tensor] = []
    peers: list[int] = []
    nbytes = [0, 0]
    # Receives first: on gloo, which posts the list in order, the receive is then ready before this
    # rank's own send is queued, as an ungrouped ring posted it; on NCCL the order inside a group does not
    # matter (batch_isend_irecv's docstring).
    for kind, messages, op in ((1, recvs, dist.irecv), (0, sends, dist.isend)):
        for tensor, peer in messages:
            if tensor.numel() == 0:
                continue
            _check_peer(peer, me, group, "send to" if kind == 0 else "receive from")
            size = tensor.numel() * tensor.element_size()
            if kind == 0 and emulate is not None:
                emulate.wait_before_send(me, peer, size)
            nbytes[kind] += size
            ops.append(dist.P2POp(op, tensor, peer, group))
            tensors.append(tensor)
            peers.append(peer)
    if len({t.device for t in tensors}) > 1:
        raise ValueError("exchange: all tensors of one group must be on one device, got "
                         f"{sorted({str(t.device) for t in tensors})}")
    works = dist.batch_isend_irecv(ops) if ops else []
    recv_count = sum(1 for op in ops if op.op is dist.irecv)
    return Exchange(works, tensors, peers, recv_count, nbytes_sent=nbytes[0], nbytes_received=nbytes[1])


def wait_all(exchanges: Sequence[Exchange], timeout_s: float | None = None) -> None:
    """Wait for every exchange of ``exchanges``, in order (see :meth:`Exchange.wait`)."""
    for ex in exchanges:
        ex.wait(timeout_s)


def _check_peer(peer, me: int, group, what: str) -> None:
    if not checks.is_int(peer):
        raise ValueError(f"exchange: rank {me} was asked to {what} peer {peer!r}; a peer is a global rank (int)")
    if peer == me:
        raise ValueError(f"exchange: rank {me} was asked to {what} itself; a step exchanges with other ranks")
    if group is not None and group is not dist.group.WORLD:
        try:
            dist.get_group_rank(group, peer)
        except (ValueError, RuntimeError):
            members = dist.get_process_group_ranks(group)
            raise ValueError(f"exchange: rank {me} was asked to {what} global rank {peer}, which is not a "
                             f"member of the group (its global ranks: {members})") from None
    elif not 0 <= peer < dist.get_world_size():
        raise ValueError(f"exchange: rank {me} was asked to {what} rank {peer}; the world has ranks "
                         f"0..{dist.get_world_size() - 1}")
