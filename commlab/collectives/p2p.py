"""The one point-to-point primitive every hand-written collective and the pipeline use: a grouped exchange.

:func:`exchange` posts the sends and receives of one *step* together, as one
``torch.distributed.batch_isend_irecv`` call, and returns an :class:`Exchange` to wait on.

Why grouped, and not ``dist.isend`` / ``dist.irecv`` one by one:

* **NCCL only promises progress inside a group.** ``ncclSend`` and ``ncclRecv`` block the GPU stream
  they run on until the peer's matching call runs; several of them progress concurrently only when they
  are fused between ``ncclGroupStart`` and ``ncclGroupEnd`` (NCCL user guide, "Point-to-point
  communication" and the ``ncclSend``/``ncclRecv`` API pages). Two ranks that each send to the other and
  then receive, ungrouped, can wait on each other forever; the NCCL developers' answer is to put the send
  and the receive in one group (NVIDIA/nccl issue #479).
* **``batch_isend_irecv`` is torch's group.** PyTorch added it for exactly this (pytorch/pytorch
  issue #43995, the RFC "Batch point-to-point communication"): on NCCL it issues the list inside one
  ``ncclGroupStart``/``ncclGroupEnd`` (torch 2.13, ``torch/distributed/distributed_c10d.py``, which
  coalesces the list when the backend supports coalescing); its docstring says the order of sends and
  receives inside the list does not matter and cannot deadlock. Gloo does not coalesce: it posts each
  op of the list as an ordinary ``isend``/``irecv``, so on a laptop the grouped form computes exactly
  what the ungrouped one did. What it can cost there is the latency an ungrouped ring hid by posting its
  next receive early, which rule 2 below forbids: gloo moves a message only once its receive is posted.

The rule every caller follows:

1. **One group per step.** A step's sends and the receives they must progress with go into one
   :func:`exchange` call (a ring step: send to the successor *and* receive from the predecessor).
2. **Never a receive posted in a group ahead of the send it depends on.** NCCL runs a rank's groups in
   order on one stream, so a group holding only a receive for step s+1, posted before the group that
   sends step s+1, blocks that send until the receive completes -- and the receive completes only after
   the peer's step-s+1 send, which waits the same way. Post the next step's receive with the next step's
   send, not before it.

   How strict this is on torch depends on the communicator torch picks. For an ungrouped ``isend``/``irecv``
   PyTorch's ``ProcessGroupNCCL`` keys the communicator and its stream by the peer pair (``"low:high"``;
   ``pointToPoint`` in ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``, and a maintainer's answer in
   pytorch/pytorch issue #132852): ungrouped operations to *different* peers then run on different streams
   and do not queue behind each other, so a bare 3-rank ring would probably not hang there. Operations to
   the same peer always share a stream, so the hazards that remain are the same-pair ones -- a 2-rank
   ring, where successor and predecessor are one rank, and 1F1B's activation and gradient between the
   same two stages -- and the order of the groups themselves. A group created with its device (as
   commlab's launchers do) may use the group's own communicator for point-to-point in recent torch
   versions, which brings the one-stream picture back; the rule holds in every case.
3. **Messages between one pair, in one direction, match in the order they were posted**, within a group
   and across groups (no tags are needed when both sides follow the same schedule).

:mod:`commlab.collectives.rendezvous` replays plans of groups under these rules and tells whether they can
deadlock; the tests run the pipeline's plans and the ring's through it.

What else the primitive does, so that no caller has to:

* **Empty tensors are skipped** on both sides: both neighbours compute the same empty size from the same
  chunk arithmetic and leave the message out together. A step with nothing left to send or receive posts
  nothing (an :class:`Exchange` with no requests).
* **Emulated links**: with an :class:`~commlab.topology.EmulatedTopology`, the rank waits before posting
  the group for as long as each of its sends would take on the emulated link (the sends one after the
  other, as they leave through one NIC); the messages themselves then use the real transport.

On NCCL, torch requires that a ``batch_isend_irecv`` that is the *first* operation on a communicator
involve every rank of the group (its docstring). commlab's collectives start with their agreement check, a
collective over the whole group, unless called with ``check=False``; a process group initialised with its
device (``init_process_group(device_id=...)``) creates its NCCL communicator eagerly, which satisfies the
rule from the start.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives._common import group_size_and_rank
from commlab.topology.emulated import EmulatedTopology

__all__ = ["Exchange", "exchange", "wait_all"]

# One message: (tensor, peer), the peer as a *global* rank (its rank in the default group).
_Message = tuple[torch.Tensor, int]


class Exchange:
    """The requests of one posted group, and the tensors they read from or write into.

    Keep it until :meth:`wait` has returned: until then a sent tensor must not be modified and a
    received tensor must not be read (on a GPU the tensors must also stay alive, which holding this
    object guarantees). The requests themselves are released only when this object is: on gloo,
    releasing a receive request right after waiting for it made each ring step about twice as slow in our
    measurements on a 2-core machine (4 ranks, 256 KiB messages), so a caller that drops the exchange of
    step s only after posting step s+1 (as the ring does) keeps that cost off its critical path.

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
