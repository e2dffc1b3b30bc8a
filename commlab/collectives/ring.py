"""Ring ReduceScatter, AllGather and AllReduce, built from point-to-point exchanges alone.

The ring of Patarasuk & Yuan 2009 (J. Parallel Distrib. Comput. 69(2), §3; the ring NCCL runs): the
tensor is cut into N chunks (the ``torch.tensor_split`` rule, :func:`chunk_bounds`; empty chunks are
skipped); in each of N-1 steps every rank sends one chunk to its successor and receives one from its
predecessor, in one grouped exchange (:func:`commlab.collectives.p2p.exchange`).
:func:`ring_reduce_scatter` adds what it receives and leaves each rank its own group rank's chunk of the
sum (``dist.reduce_scatter_tensor``); :func:`ring_all_gather` stores it; :func:`ring_all_reduce` is the two
in turn, ``2(N-1)/N`` of the tensor's bytes per rank, the lower bound. Partial sums travel in the input
dtype and each hop's addition is rounded back to it, as NCCL and gloo do. Every function first checks,
with one tiny all-gather, that all ranks agree (:class:`CollectiveMismatchError` on every rank otherwise).
Costs: :func:`ring_bytes_sent_per_rank` and the ``*_seconds`` functions.

Book: chapter 2 (§2.1 the ring step by step, §2.2 uneven chunks, §2.3 why 2(N-1)/N, §2.4 on real processes).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from commlab import arithmetic
from commlab.collectives import p2p
from commlab.collectives.common import (RingGeometry, check_cost_args, chunk_bounds, group_size_and_rank, resolve_ring,
                                         ring_geometry, work_buffer, write_back)
from commlab.collectives.agreement import check_agreement
from commlab.topology.emulated import EmulatedTopology

__all__ = [
    "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
    "reduce_scatter_send_chunk", "reduce_scatter_recv_chunk",
    "all_gather_send_chunk", "all_gather_recv_chunk",
    "ring_reduce_scatter_seconds", "ring_all_gather_seconds", "ring_all_reduce_seconds",
    "ring_bytes_sent_per_rank", "reduce_scatter_phase", "all_gather_phase", "ring_steps",
]


# ------------------------------------------------------------------------------------ the schedule
# Pure functions of (ring position, step, N): the code below and the chapter's figure both use them.

def reduce_scatter_send_chunk(position: int, step: int, n: int, order: Sequence[int] | None = None) -> int:
    """Index of the chunk the rank at ring ``position`` sends in ReduceScatter ``step`` (0-based)."""
    order = range(n) if order is None else order
    return order[(position - step - 1) % n]


def reduce_scatter_recv_chunk(position: int, step: int, n: int, order: Sequence[int] | None = None) -> int:
    """Index of the chunk the rank at ring ``position`` receives (and adds to) in ReduceScatter ``step``.

    It is the chunk its predecessor sends: ``reduce_scatter_send_chunk(position - 1, step, n)``.
    """
    order = range(n) if order is None else order
    return order[(position - step - 2) % n]


def all_gather_send_chunk(position: int, step: int, n: int, order: Sequence[int] | None = None) -> int:
    """Index of the chunk the rank at ring ``position`` forwards in AllGather ``step``.

    At step 0 it is the rank's own chunk ``order[position]``; afterwards, the chunk it received
    in the previous step.
    """
    order = range(n) if order is None else order
    return order[(position - step) % n]


def all_gather_recv_chunk(position: int, step: int, n: int, order: Sequence[int] | None = None) -> int:
    """Index of the chunk the rank at ring ``position`` receives in AllGather ``step``."""
    order = range(n) if order is None else order
    return order[(position - step - 1) % n]


# ------------------------------------------------------------------------------------ collectives

def ring_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                        ring: Sequence[int] | None = None, *,
                        emulate: EmulatedTopology | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group and return this rank's chunk of the sum.

    Args:
        tensor: any shape, contiguous or not, one of the supported dtypes; same element count and
            dtype on every rank. It is not modified.
        group: process group (default: the world).
        ring: ring order as a permutation of group ranks (default ``0..N-1``); same on every rank.
        emulate: an :class:`~commlab.topology.EmulatedTopology` whose inter-node link delays each message
            that crosses emulated nodes (see :mod:`commlab.topology.emulated`).

    Returns:
        1-D tensor of the input dtype holding elements ``[start, stop)`` of the flattened sum, where
        ``(start, stop) = chunk_bounds(tensor.numel(), N)[group_rank]``. With ``numel`` divisible by N
        this equals ``dist.reduce_scatter_tensor`` on the flattened tensor.

    Raises:
        CollectiveMismatchError: ranks disagree on element count, dtype or ring (raised on every rank).
        TypeError: unsupported dtype. ValueError: ``ring`` is not a permutation of the group's ranks.
    """
    geom = _agreed_geometry("ring_reduce_scatter", tensor, group, ring, check=True)
    work = tensor.detach().reshape(-1).clone()
    bounds = chunk_bounds(work.numel(), geom.size)
    chunks = [work[a:b] for a, b in bounds]
    reduce_scatter_phase(chunks, geom, group, emulate)
    return chunks[geom.group_rank].clone()


def ring_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    ring: Sequence[int] | None = None, *,
                    emulate: EmulatedTopology | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (flattened) in group-rank order.

    Args:
        tensor: any shape, contiguous or not; same element count and dtype on every rank.
        group, ring: as in :func:`ring_reduce_scatter`.

    Returns:
        1-D tensor of ``N * tensor.numel()`` elements, the input dtype; equals
        ``dist.all_gather_into_tensor`` on the flattened tensors.

    Raises:
        as :func:`ring_reduce_scatter`.
    """
    geom = _agreed_geometry("ring_all_gather", tensor, group, ring, check=True)
    m = tensor.numel()
    out = torch.empty(geom.size * m, dtype=tensor.dtype, device=tensor.device)
    chunks = [out[i * m:(i + 1) * m] for i in range(geom.size)]
    chunks[geom.group_rank].copy_(tensor.detach().reshape(-1))
    all_gather_phase(chunks, geom, group, emulate)
    return out


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    ring: Sequence[int] | None = None, *, inplace: bool = False,
                    check: bool = True, emulate: EmulatedTopology | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group with a ring ReduceScatter followed by a ring AllGather.

    Args:
        tensor: any shape, contiguous or not; same element count and dtype on every rank.
        group, ring: as in :func:`ring_reduce_scatter`.
        inplace: write the sum into ``tensor`` (as ``dist.all_reduce`` does) instead of a new tensor.
        check: first make all ranks agree on element count, dtype and ring (one tiny all-gather, i.e.
            one extra latency). Pass False only where agreement is guaranteed by construction (the
            same model on every rank); a mismatch then fails inside the point-to-point phase, or hangs
            until the operation timeout, and a bad ring raises on the rank that passed it only.

    Returns:
        The sum, with the shape and dtype of ``tensor`` (``tensor`` itself when ``inplace``); equals
        ``dist.all_reduce(tensor)`` (exactly for integer data, up to rounding order otherwise).

    Raises:
        as :func:`ring_reduce_scatter`.
    """
    geom = _agreed_geometry("ring_all_reduce", tensor, group, ring, check)
    work = work_buffer(tensor, inplace)
    if geom.size > 1 and work.numel() > 0:
        bounds = chunk_bounds(work.numel(), geom.size)
        chunks = [work[a:b] for a, b in bounds]
        reduce_scatter_phase(chunks, geom, group, emulate)
        all_gather_phase(chunks, geom, group, emulate)
    return write_back(tensor, work, inplace)


def _agreed_geometry(name: str, tensor: torch.Tensor, group, ring, check: bool) -> RingGeometry:
    """Validate the ring on every rank together (when ``check``), then resolve this rank's neighbours."""
    size, _ = group_size_and_rank(group)
    order, problem = resolve_ring(size, ring)
    if check:
        check_agreement(name, tensor, group, order, "ring order", problem,
                        f"a permutation of the group's ranks 0..{size - 1}")
    return ring_geometry(group, order)


def reduce_scatter_phase(chunks: list[torch.Tensor], geom: RingGeometry, group, emulate=None) -> None:
    """The ring ReduceScatter's N-1 steps over ``chunks`` (one per rank, summed in place): afterwards
    ``chunks[geom.group_rank]`` holds the sum of every rank's chunk. Used by the hierarchical AllReduce too."""
    n, p = geom.size, geom.position
    if n == 1:
        return
    # One step = one grouped exchange (commlab.collectives.p2p): send to the successor and receive from
    # the predecessor together, so that NCCL progresses both; the next step's receive is posted with the
    # next step's send, never ahead of it. So one receive buffer, sized for the largest chunk, serves every
    # step: a step's data has been added before the next step's receive is posted (on a GPU, stream order
    # keeps the same promise). One buffer, not two, is also half the fresh memory a call touches.
    big = max(c.numel() for c in chunks)
    scratch = torch.empty(big, dtype=chunks[0].dtype, device=chunks[0].device)

    def buffers(step):
        into = chunks[reduce_scatter_recv_chunk(p, step, n, geom.order)]
        return chunks[reduce_scatter_send_chunk(p, step, n, geom.order)], scratch[:into.numel()], into

    ring_steps(n, geom, group, emulate, buffers)


def all_gather_phase(chunks: list[torch.Tensor], geom: RingGeometry, group, emulate=None) -> None:
    """The ring AllGather's N-1 steps over ``chunks``: each rank's own chunk reaches every rank."""
    n, p = geom.size, geom.position
    if n == 1:
        return
    # What arrives in one step is what this rank forwards in the next.
    ring_steps(n, geom, group, emulate, lambda step: (
        chunks[all_gather_send_chunk(p, step, n, geom.order)],
        chunks[all_gather_recv_chunk(p, step, n, geom.order)], None))


def ring_steps(n: int, geom: RingGeometry, group, emulate, step_buffers) -> None:
    """The N-1 steps of a ring phase, one grouped exchange each.

    ``step_buffers(step)`` gives ``(send, receive into, add into)`` (``add into`` None: store only). A
    step's receive is waited for before the next step is posted (the next send forwards what arrived);
    its send only after (a chunk, once sent, is not written again in the phase), so at most two sends are
    in flight and the previous step's exchange is released off the critical path; all are done when the
    phase returns.
    """
    previous = None
    for step in range(n - 1):
        send, recv, add_into = step_buffers(step)
        ex = p2p.exchange([(send, geom.next_global)], [(recv, geom.prev_global)], group, emulate=emulate)
        ex.wait_recvs()
        if add_into is not None:
            add_into.add_(recv)
        if previous is not None:
            previous.wait()
        previous = ex
    previous.wait()


# ----------------------------------------------------------------------------- α-β cost, beside the code

def ring_bytes_sent_per_rank(nbytes: float, n: int, collective: str = "all_reduce") -> float:
    """Bytes each rank sends in a ring collective over ``n`` ranks on a tensor of ``nbytes`` bytes.

    ReduceScatter and AllGather: (n-1)/n · nbytes; AllReduce: 2(n-1)/n · nbytes (the formulas live in
    :mod:`commlab.arithmetic`, chapter 1). For AllGather ``nbytes`` is the size of the gathered output,
    as in nccl-tests.

    Raises:
        ValueError: ``n < 1``, negative ``nbytes`` or an unknown ``collective``.
    """
    per_rank = {"reduce_scatter": arithmetic.ring_reduce_scatter_bytes_per_rank,
                "all_gather": arithmetic.ring_all_gather_bytes_per_rank,
                "all_reduce": arithmetic.ring_allreduce_bytes_per_rank}
    if collective not in per_rank:
        raise ValueError(f"collective must be one of {sorted(per_rank)}, got {collective!r}")
    return per_rank[collective](nbytes, n)


def ring_reduce_scatter_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                                gamma_s_per_byte: float = 0.0) -> float:
    """α-β-γ time of a ring ReduceScatter: (n-1)·α + (n-1)/n · nbytes · (β + γ).

    α: per-message latency (s); β: inverse per-direction link bandwidth (s/byte); γ: time to add one
    byte of received data into the local buffer (s/byte; 0 ignores the arithmetic). Source: Thakur,
    Rabenseifner & Gropp 2005, "Optimization of collective communication operations in MPICH",
    IJHPCA 19(1), section 4.
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, gamma_s_per_byte=gamma_s_per_byte)
    return (n - 1) * alpha_s + (n - 1) / n * nbytes * (beta_s_per_byte + gamma_s_per_byte)


def ring_all_gather_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """α-β time of a ring AllGather producing ``nbytes`` bytes: (n-1)·α + (n-1)/n · nbytes · β."""
    return ring_reduce_scatter_seconds(nbytes, n, alpha_s, beta_s_per_byte)


def ring_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                            gamma_s_per_byte: float = 0.0) -> float:
    """α-β-γ time of a ring AllReduce (ReduceScatter + AllGather):
    2(n-1)·α + 2(n-1)/n · nbytes · β + (n-1)/n · nbytes · γ."""
    return (ring_reduce_scatter_seconds(nbytes, n, alpha_s, beta_s_per_byte, gamma_s_per_byte)
            + ring_all_gather_seconds(nbytes, n, alpha_s, beta_s_per_byte))
