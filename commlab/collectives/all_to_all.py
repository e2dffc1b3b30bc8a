"""AllToAll by pairwise exchange: block j of every rank's tensor goes to rank j, in one grouped exchange.

Each rank passes a tensor whose first dimension has N rows (N = group size); row j is the block meant for
group rank j. Each rank gets back a tensor of the same shape whose row j is the block rank j meant for it
(row i of rank j's input, for this rank i). That is ``dist.all_to_all_single(out, inp)`` with equal splits,
and the tests check it against that.

All N-1 sends and N-1 receives of a rank are posted as one group (:func:`commlab.collectives.p2p.exchange`),
the way NCCL's user guide writes an all-to-all from ``ncclSend``/``ncclRecv`` (one ``ncclGroupStart`` /
``ncclGroupEnd`` around a send and a receive per peer, "Point-to-point communication"): grouped, the
messages progress together and cannot deadlock. Rank i sends to i+1, i+2, ... in that order (the pairwise
schedule), so that the ranks do not all start on the same peer.

Why here: the two-phase compressed AllReduce (:mod:`commlab.compress.two_phase`) moves its first phase with
an all-to-all. Built from point-to-point messages, an :class:`~commlab.topology.EmulatedTopology` can delay
them (each send that crosses emulated nodes waits its turn on the node's NIC before the group is posted),
as it delays the ring's; with no emulation, callers use ``dist.all_to_all_single`` directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.collectives import p2p
from commlab.collectives._common import _global, check_agreement, check_cost_args, group_size_and_rank
from commlab.topology.emulated import EmulatedTopology

__all__ = ["all_to_all", "all_to_all_seconds"]


def all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
               emulate: EmulatedTopology | None = None, check: bool = True) -> torch.Tensor:
    """Send row j of ``tensor`` to group rank j; return the rows received, row j from rank j.

    Args:
        tensor: shape ``[N, ...]`` (N = the group's size), one of the supported dtypes; the same shape and
            dtype on every rank. It is not modified.
        group: process group (None: the world).
        emulate: an :class:`~commlab.topology.EmulatedTopology` whose inter-node link delays each send that
            crosses emulated nodes.
        check: first make every rank agree on element count, dtype and first dimension (one tiny
            all-gather; every rank raises the same error). Pass False only where that is guaranteed.

    Returns:
        A new tensor of ``tensor``'s shape and dtype; row j is row (this rank) of rank j's ``tensor``.
        Row (this rank) is this rank's own row, copied.

    Raises:
        CollectiveMismatchError: the ranks' tensors differ in element count or dtype, or a first dimension is
            not N (on every rank, with ``check``; without it a wrong first dimension raises ``ValueError`` on
            the rank that passed it).
        TypeError: an unsupported dtype.
    """
    size, me = group_size_and_rank(group, "all_to_all")
    rows = tensor.shape[0] if tensor.dim() >= 1 else -1
    problem = None if rows == size else (f"all_to_all needs a tensor whose first dimension is the group size {size} "
                                         f"(one row per destination rank), got shape {list(tensor.shape)}")
    if check:
        check_agreement("all_to_all", tensor, group, (rows,), "first dimension", problem, f"the group size {size}")
    elif problem:
        raise ValueError(problem)
    inp = tensor.detach().contiguous()
    out = torch.empty_like(inp)
    out[me].copy_(inp[me])
    if size > 1 and inp.numel() > 0:
        peers = [(me + s) % size for s in range(1, size)]
        ex = p2p.exchange([(inp[j], _global(group, j)) for j in peers],
                          [(out[j], _global(group, j)) for j in peers], group, emulate=emulate)
        ex.wait()
    return out


def all_to_all_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """α-β time of a pairwise-exchange AllToAll of ``nbytes`` per rank (the whole ``[N, ...]`` input):
    ``(n-1)·α + (n-1)/n · nbytes · β``.

    Each rank sends n-1 blocks of ``nbytes/n`` through one port (its NIC sends one message at a time, the
    single-port model of the ring's cost functions), each paying α; its own block does not move.

    Raises:
        ValueError: as the other cost functions (:func:`commlab.collectives._common.check_cost_args`).
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte)
    return (n - 1) * alpha_s + (n - 1) / n * nbytes * beta_s_per_byte
