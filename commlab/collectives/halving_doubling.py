"""Recursive halving-doubling (Rabenseifner) and recursive doubling AllReduce, from point-to-point exchanges.

In a step at distance ``d`` (a power of two) rank ``v`` exchanges with ``v XOR d`` in one grouped exchange
(:func:`commlab.collectives.p2p.exchange`). :func:`recursive_doubling_all_reduce`: ``log2 N`` whole-vector
exchanges (latency-optimal, ``log2 N · n`` bytes per rank). :func:`rhd_all_reduce`: a ReduceScatter by
recursive halving, then an AllGather by recursive doubling, ``2·log2 N`` messages and ``2(N-1)/N · n``
bytes per rank. For N not a power of two a pre-step folds ``r = N - p`` ranks into partners and a
post-step returns the result (:func:`power_of_two_layout`, :func:`virtual_rank`). The vector is cut into
``p`` blocks by :func:`chunk_bounds`; empty blocks are skipped. Partial sums travel and are rounded in the
input dtype, as in :mod:`commlab.collectives.ring`. :func:`rhd_all_reduce_seconds` and
:func:`recursive_doubling_all_reduce_seconds` give the α-β-γ times.

Source: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1), §4.4; Rabenseifner 2004, ICCS, LNCS 3036.
Book: chapter 3, §3.3 (the table) and §3.6 (running them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.collectives import p2p
from commlab.collectives.common import (ceil_log2, check_cost_args, chunk_bounds, global_rank, ring_geometry,
                                         work_buffer, write_back)
from commlab.collectives.agreement import check_agreement
from commlab.topology.emulated import EmulatedTopology

__all__ = [
    "rhd_all_reduce", "recursive_doubling_all_reduce",
    "power_of_two_layout", "virtual_rank", "real_rank", "halving_steps", "doubling_steps",
    "rhd_all_reduce_seconds", "recursive_doubling_all_reduce_seconds",
]


# ------------------------------------------------------------------------------------ the schedule
# Pure functions of (rank, N): the code below, the tests and the chapter's figure use them.

def power_of_two_layout(n: int) -> tuple[int, int]:
    """``(p, r)`` for ``n`` ranks: ``p = 2^floor(log2 n)`` ranks run the core algorithm, ``r = n - p``
    ranks are folded into a partner by the pre-step.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"need at least one rank, got n={n}")
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def virtual_rank(rank: int, n: int) -> int | None:
    """Virtual rank (``0..p-1``) of group rank ``rank`` in the power-of-two core, or None if it sits out.

    Ranks ``0..2r-1`` pair up; the odd one of each pair carries the pair's sum as virtual rank
    ``rank // 2``; the even one sits out. Ranks ``>= 2r`` take virtual rank ``rank - r``.
    """
    _, r = power_of_two_layout(n)
    if rank < 2 * r:
        return rank // 2 if rank % 2 == 1 else None
    return rank - r


def real_rank(vrank: int, n: int) -> int:
    """Group rank of virtual rank ``vrank`` (the inverse of :func:`virtual_rank`)."""
    _, r = power_of_two_layout(n)
    return 2 * vrank + 1 if vrank < r else vrank + r


def halving_steps(vrank: int, p: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """The recursive-halving ReduceScatter of virtual rank ``vrank`` among ``p`` (a power of two) ranks.

    Returns:
        One ``(partner, keep, send)`` per step, distances ``p/2, p/4, ..., 1``: ``partner = vrank XOR d``;
        ``keep`` and ``send`` are half-open ranges of *block* indices. The rank sends its partial sums of
        ``send`` and adds the partner's partial sums of ``keep`` into its own. The last ``keep`` is
        ``(vrank, vrank + 1)``: virtual rank v ends with the full sum of block v.
    """
    steps, lo, hi, d = [], 0, p, p // 2
    while d >= 1:
        mid = (lo + hi) // 2
        # The rank whose bit d is clear keeps the lower half, so that after all bits the range is [v, v+1).
        if vrank & d:
            keep, send = (mid, hi), (lo, mid)
        else:
            keep, send = (lo, mid), (mid, hi)
        steps.append((vrank ^ d, keep, send))
        lo, hi = keep
        d //= 2
    return steps


def doubling_steps(vrank: int, p: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """The recursive-doubling AllGather that undoes :func:`halving_steps` (distances ``1, 2, ..., p/2``).

    Returns:
        One ``(partner, send, recv)`` per step in block indices: the rank sends the blocks it holds
        complete and receives the partner's, which are exactly the blocks it gave away in the mirrored
        halving step.
    """
    return [(partner, keep, send) for partner, keep, send in reversed(halving_steps(vrank, p))]


# ------------------------------------------------------------------------------------ collectives

def rhd_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *, inplace: bool = False,
                   check: bool = True, emulate: EmulatedTopology | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group with Rabenseifner's recursive halving + recursive doubling.

    Args:
        tensor: any shape, contiguous or not, a supported dtype; same element count and dtype on every rank.
        group: process group (default: the world); partners are computed from group ranks.
        inplace: write the sum into ``tensor`` (as ``dist.all_reduce`` does) instead of a new tensor.
        check: first make all ranks agree on element count and dtype (one tiny all-gather).
        emulate: an :class:`~commlab.topology.EmulatedTopology` that delays messages crossing nodes.

    Returns:
        The sum, shape and dtype of ``tensor`` (``tensor`` itself when ``inplace``).

    Raises:
        CollectiveMismatchError: ranks disagree on element count or dtype (on every rank).
        TypeError: unsupported dtype. RuntimeError: no process group, or this rank is not in ``group``.
    """
    return _run("rhd_all_reduce", _rhd_core, tensor, group, inplace, check, emulate)


def recursive_doubling_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                                  inplace: bool = False, check: bool = True,
                                  emulate: EmulatedTopology | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group by recursive doubling: ``log2 N`` whole-vector exchanges.

    Arguments, result and errors as :func:`rhd_all_reduce`. Latency-optimal (fewest steps), but each rank
    sends ``log2 N`` times the whole vector, so it only pays off for small messages.
    """
    return _run("recursive_doubling_all_reduce", _doubling_core, tensor, group, inplace, check, emulate)


def _run(name, core, tensor, group, inplace, check, emulate):
    geom = ring_geometry(group, None)  # validates the group; its order is the identity
    if check:
        check_agreement(name, tensor, group)
    work = work_buffer(tensor, inplace)
    if geom.size > 1 and work.numel() > 0:
        core(work, geom.group_rank, geom.size, group, emulate)
    return write_back(tensor, work, inplace)


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group, emulate) -> None:
    # Both directions of a step in one group (commlab.collectives.p2p): each partner sends and receives at
    # once, which NCCL only guarantees to progress when the two are grouped.
    p2p.exchange([(send, peer)], [(recv, peer)], group, emulate=emulate).wait()


def _fold(work, rank, n, group, emulate, scratch) -> int | None:
    """Pre-step for non-power-of-two N; returns this rank's virtual rank (None: it sits out)."""
    _, r = power_of_two_layout(n)
    if rank < 2 * r:
        if rank % 2 == 0:
            p2p.exchange(sends=[(work, global_rank(group, rank + 1))], group=group, emulate=emulate).wait()
        else:
            p2p.exchange(recvs=[(scratch[:work.numel()], global_rank(group, rank - 1))], group=group).wait()
            work.add_(scratch[:work.numel()])
    return virtual_rank(rank, n)


def _unfold(work, rank, n, group, emulate) -> None:
    """Post-step: each odd rank of the folded pairs hands the result back to its even partner."""
    _, r = power_of_two_layout(n)
    if rank < 2 * r:
        if rank % 2 == 0:
            p2p.exchange(recvs=[(work, global_rank(group, rank + 1))], group=group).wait()
        else:
            p2p.exchange(sends=[(work, global_rank(group, rank - 1))], group=group, emulate=emulate).wait()


def _rhd_core(work: torch.Tensor, rank: int, n: int, group, emulate) -> None:
    p, _ = power_of_two_layout(n)
    numel = work.numel()
    starts = [a for a, _ in chunk_bounds(numel, p)] + [numel]

    def elems(blocks):
        return work[starts[blocks[0]]:starts[blocks[1]]]

    # Large enough for the pre-step's whole vector and for any halving step's half.
    scratch = torch.empty(numel, dtype=work.dtype, device=work.device)
    v = _fold(work, rank, n, group, emulate, scratch)
    if v is not None:
        for partner, keep, send in halving_steps(v, p):
            mine = elems(keep)
            incoming = scratch[:mine.numel()]
            _exchange(elems(send), incoming, global_rank(group, real_rank(partner, n)), group, emulate)
            mine.add_(incoming)
        for partner, send, recv in doubling_steps(v, p):
            _exchange(elems(send), elems(recv), global_rank(group, real_rank(partner, n)), group, emulate)
    _unfold(work, rank, n, group, emulate)


def _doubling_core(work: torch.Tensor, rank: int, n: int, group, emulate) -> None:
    p, _ = power_of_two_layout(n)
    scratch = torch.empty_like(work)
    v = _fold(work, rank, n, group, emulate, scratch)
    if v is not None:
        d = 1
        while d < p:
            _exchange(work, scratch, global_rank(group, real_rank(v ^ d, n)), group, emulate)
            work.add_(scratch)
            d *= 2
    _unfold(work, rank, n, group, emulate)


# ----------------------------------------------------------------------------- α-β cost, beside the code

def rhd_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                           gamma_s_per_byte: float = 0.0) -> float:
    """α-β-γ time (seconds) of Rabenseifner's AllReduce (:func:`rhd_all_reduce`) on ``nbytes`` bytes over ``n`` ranks.

    With ``p = 2^floor(log2 n)``::

        T = 2·ceil(log2 n)·α + 2(p-1)/p · nbytes·β + (p-1)/p · nbytes·γ
            + [n != p] · (2·nbytes·β + nbytes·γ)

    Thakur, Rabenseifner & Gropp 2005 (IJHPCA 19(1)), §4.4; the last term is the pre-step (whole vector,
    one addition) and post-step (whole vector) for ``n`` not a power of two.

    Args:
        nbytes: bytes of the vector on each rank. n: ranks (>= 1).
        alpha_s: per-message latency (s). beta_s_per_byte: inverse link bandwidth per direction (s/byte).
        gamma_s_per_byte: time to add one byte of data (s/byte); 0 ignores the arithmetic.

    Raises:
        ValueError: ``n < 1`` or ``nbytes < 0``.
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, gamma_s_per_byte=gamma_s_per_byte)
    p, r = power_of_two_layout(n)
    t = 2 * ceil_log2(n) * alpha_s + (p - 1) / p * nbytes * (2 * beta_s_per_byte + gamma_s_per_byte)
    if r:
        t += nbytes * (2 * beta_s_per_byte + gamma_s_per_byte)
    return t


def recursive_doubling_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                                          gamma_s_per_byte: float = 0.0) -> float:
    """α-β-γ time of :func:`recursive_doubling_all_reduce`.

    For a power of two ``n``: ``log2 n · (α + nbytes·β + nbytes·γ)`` (Thakur et al. 2005, section 4.4).
    Otherwise, with ``p = 2^floor(log2 n)``, the pre-step costs one more ``α + nbytes·β + nbytes·γ`` and
    the post-step ``α + nbytes·β``::

        T = ceil(log2 n)·(α + nbytes·β + nbytes·γ) + [n != p]·(α + nbytes·β)

    Arguments and errors as :func:`rhd_all_reduce_seconds`.
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, gamma_s_per_byte=gamma_s_per_byte)
    _, r = power_of_two_layout(n)
    t = ceil_log2(n) * (alpha_s + nbytes * (beta_s_per_byte + gamma_s_per_byte))
    if r:
        t += alpha_s + nbytes * beta_s_per_byte
    return t
