"""Where each token of the sequence lives under context parallelism, and which blocks ring attention computes.

Pure arithmetic, no process group. Contiguous layout (``load_balance=False``) or the load-balanced zigzag of
Llama 3 (§3.3.2) and Megatron-Core (rank i holds chunks i and 2N-1-i of 2N): :func:`chunk_indices`,
:func:`positions`, :func:`shard_sequence`. :func:`block_plan`: what rank i computes of the K/V block of rank
``src = (i - t) mod N`` at ring step t under a causal mask; :func:`covered_pairs` checks a plan.

============== ===================== ========================= ===========================
layout         ``src == i``          ``src < i``               ``src > i``
============== ===================== ========================= ===========================
contiguous     all x all, masked     all x all                 nothing
load-balanced  all x all, masked     all x first half of K/V   second half of Q x all
============== ===================== ========================= ===========================

Book: chapter 13, §13.2.
"""

from __future__ import annotations

import dataclasses

import torch

from commlab import checks

__all__ = ["BlockPlan", "block_plan", "chunk_indices", "covered_pairs", "positions", "shard_sequence",
           "unshard_sequence"]


def _check_n_rank(n: int, rank: int | None = None) -> None:
    checks.integer("n", n, note="the context-parallel group size")
    if rank is not None:
        checks.integer("rank", rank, 0, n - 1)


def chunk_indices(rank: int, n: int, load_balance: bool) -> tuple[int, ...]:
    """The chunks of the sequence rank ``rank`` holds, in the order it holds them.

    Contiguous: ``(rank,)`` of ``n`` chunks. Load-balanced: ``(rank, 2n - 1 - rank)`` of ``2n`` chunks.

    Raises:
        ValueError: ``n`` not an int >= 1 or ``rank`` not in ``0..n-1``.
    """
    _check_n_rank(n, rank)
    return (rank, 2 * n - 1 - rank) if load_balance else (rank,)


def _check_seq(seq: int, n: int, load_balance: bool) -> int:
    """Tokens per chunk, or ValueError when ``seq`` does not split evenly."""
    parts = 2 * n if load_balance else n
    if not checks.is_int(seq) or seq < 1 or seq % parts:
        how = f"2N = {parts} chunks (load_balance=True: rank i holds chunks i and 2N-1-i)" if load_balance \
            else f"N = {parts} blocks"
        raise ValueError(f"the sequence length ({seq}) must be a positive multiple of {how}; pad the sequence "
                         f"to a multiple of {parts}")
    return seq // parts


def positions(rank: int, n: int, seq_local: int, load_balance: bool,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Global token positions of rank ``rank``'s ``seq_local`` tokens (int64, shape ``[seq_local]``).

    Raises:
        ValueError: bad ``n``/``rank``, or ``seq_local`` odd with ``load_balance`` (two chunks per rank).
    """
    chunks = chunk_indices(rank, n, load_balance)
    c = _check_seq(seq_local * n, n, load_balance)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks])


def shard_sequence(x: torch.Tensor, rank: int, n: int, load_balance: bool = False, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s part of the whole sequence ``x`` along ``dim`` (default 2, as in ``[batch, heads, seq,
    head_dim]``): its chunks (:func:`chunk_indices`), concatenated. A new contiguous tensor.

    Raises:
        ValueError: the sequence length is not a multiple of ``n`` (of ``2n`` with ``load_balance``).
    """
    c = _check_seq(x.shape[dim], n, load_balance)
    chunks = x.split(c, dim=dim)
    return torch.cat([chunks[i] for i in chunk_indices(rank, n, load_balance)], dim=dim).contiguous()


def unshard_sequence(parts: list[torch.Tensor], load_balance: bool = False, dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` from rank r): inverse of :func:`shard_sequence`.

    Raises:
        ValueError: no parts, parts of different shapes, or a local length that is odd with ``load_balance``.
    """
    n = len(parts)
    _check_n_rank(n)
    if len({tuple(p.shape) for p in parts}) != 1:
        raise ValueError(f"every rank's part must have the same shape, got {[list(p.shape) for p in parts]}")
    c = _check_seq(parts[0].shape[dim] * n, n, load_balance)
    chunks: list = [None] * (2 * n if load_balance else n)
    for r, part in enumerate(parts):
        for i, piece in zip(chunk_indices(r, n, load_balance), part.split(c, dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """What one ring step computes: ``q[..., q_rows, :]`` against ``k[..., k_cols, :]`` (slices of the local
    sequence), element-wise causally masked when ``masked`` (by global positions)."""

    q_rows: slice
    k_cols: slice
    masked: bool


def block_plan(rank: int, src: int, n: int, seq_local: int, causal: bool, load_balance: bool) -> BlockPlan | None:
    """The part of the (rank's queries) x (rank ``src``'s keys) block that attention needs (module table).

    Args:
        rank: the rank whose queries attend. src: the rank whose K/V block it holds. n: ranks.
        seq_local: tokens per rank (even with ``load_balance``). causal: causal mask or none.
        load_balance: the layout (:func:`chunk_indices`).

    Returns:
        A :class:`BlockPlan`, or None when the block is wholly masked (nothing to compute).

    Raises:
        ValueError: bad ``n``/``rank``/``src``, or an odd ``seq_local`` with ``load_balance``.
    """
    _check_n_rank(n, rank)
    _check_n_rank(n, src)
    half = _check_seq(seq_local * n, n, load_balance) if load_balance else None
    everything = slice(0, seq_local)
    if not causal:
        return BlockPlan(everything, everything, False)
    if src == rank:
        return BlockPlan(everything, everything, True)
    if not load_balance:
        return BlockPlan(everything, everything, False) if src < rank else None
    if src < rank:  # both of this rank's chunks come after chunk src and before chunk 2N-1-src
        return BlockPlan(everything, slice(0, half), False)
    # src > rank: chunk 2N-1-rank comes after both of src's chunks; chunk rank before both
    return BlockPlan(slice(half, seq_local), everything, False)


def covered_pairs(n: int, seq: int, causal: bool, load_balance: bool) -> torch.Tensor:
    """How many times ring attention's schedule computes each (query, key) pair of the whole sequence.

    Returns:
        An int64 ``[seq, seq]`` matrix (rows: query positions, columns: key positions). A correct schedule
        gives exactly the mask: 1 where query i may attend to key j (``j <= i`` when ``causal``, everywhere
        otherwise) and 0 elsewhere.

    Raises:
        ValueError: ``seq`` not a multiple of ``n`` (``2n`` with ``load_balance``).
    """
    _check_n_rank(n)
    _check_seq(seq, n, load_balance)
    seq_local = seq // n
    count = torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(n):
        pq = positions(rank, n, seq_local, load_balance)
        for step in range(n):
            src = (rank - step) % n
            plan = block_plan(rank, src, n, seq_local, causal, load_balance)
            if plan is None:
                continue
            rows, cols = pq[plan.q_rows], positions(src, n, seq_local, load_balance)[plan.k_cols]
            keep = (cols[None, :] <= rows[:, None]) if plan.masked else torch.ones(len(rows), len(cols), dtype=torch.bool)
            count[rows[:, None], cols[None, :]] += keep.long()
    return count
