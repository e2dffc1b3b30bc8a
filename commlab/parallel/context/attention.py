"""What the context-parallel attention layers share: the input check every rank agrees on, the reference
attention of one process, and the all-gathered-K/V baseline.

Attention here is softmax(Q K^T * scale) V per head, ``scale = 1 / sqrt(head_dim)`` unless given, with an
optional causal mask (query at position i sees keys at positions <= i). Tensors are ``[batch, heads, seq,
head_dim]``; under context parallelism each rank passes its ``seq_local = seq / N`` tokens in the layout of
:mod:`commlab.parallel.context.layout`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from commlab.collectives.common import group_size_and_rank
from commlab.collectives.agreement import check_agreement
from commlab.parallel.context.communications import all_gather_sequence
from commlab.parallel.context.layout import positions

__all__ = ["attention", "check_inputs", "all_gather_attention"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, q_positions: torch.Tensor | None = None,
              k_positions: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v in one process, with autograd: the reference the parallel layers must equal.

    Args:
        q: ``[..., sq, d]``; k, v: ``[..., sk, d]``. causal: mask key positions after the query's.
        scale: default ``1 / sqrt(d)``.
        q_positions, k_positions: global positions (int64 ``[sq]``, ``[sk]``) for the causal mask; default
            ``0..sq-1`` and ``0..sk-1``.

    Returns:
        ``[..., sq, d]``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        pq = torch.arange(q.shape[-2], device=q.device) if q_positions is None else q_positions
        pk = torch.arange(k.shape[-2], device=q.device) if k_positions is None else k_positions
        scores = scores.masked_fill(pk[None, :] > pq[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def check_inputs(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None, *,
                 causal: bool, load_balance: bool = False, heads_multiple: bool = False,
                 grouped_kv: bool = False, check: bool = True) -> tuple[int, int]:
    """Check one rank's q, k, v and make every rank of ``group`` agree on them, or all raise the same error.

    Every rank must pass 4-dim ``[batch, heads, seq_local, head_dim]`` tensors, k and v of q's shape, one
    floating dtype, on the group's device, the same shapes and options (``causal``, ``load_balance``) as the
    other ranks; ``seq_local`` even with ``load_balance`` (two chunks of ``seq / 2N``); ``heads`` a multiple
    of N when ``heads_multiple`` (Ulysses). With ``grouped_kv`` k and v may have fewer heads than q, a divisor
    of q's (grouped-query attention).

    One small all-gather of int64 (:func:`commlab.collectives.common.check_agreement`): without it a shape
    mismatch would hang a grouped exchange until the timeout or silently mix blocks, and a problem found on one
    rank would leave the others waiting.

    Returns:
        ``(N, this rank's group rank)``.

    Raises:
        CollectiveMismatchError (a ValueError): on every rank, naming what each rank passed: ranks disagree on
            shapes or options, or a rank's input is invalid (wrong number of dims, k/v not of q's shape,
            dtypes or devices that differ, not a floating dtype, odd ``seq_local`` with ``load_balance``,
            ``heads`` not a multiple of N), or not on the group's device. With ``check=False`` only this
            rank's own problems are found (ValueError, on this rank).
        TypeError: a dtype commlab's collectives do not move (on every rank).
        RuntimeError: this rank is not a member of ``group``.
    """
    n, rank = group_size_and_rank(group, name)
    shapes = [list(t.shape) for t in (q, k, v)]
    problem = None
    if any(t.dim() != 4 for t in (q, k, v)):
        problem = (f"q, k and v must each be [batch, heads, seq_local, head_dim] (4 dims), got shapes {shapes}; "
                   "move the heads before the sequence (e.g. x.view(b, s, h, d).transpose(1, 2))")
    elif k.shape != v.shape or (k.shape != q.shape and not (
            grouped_kv and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:] and q.shape[1] % k.shape[1] == 0)):
        problem = ("k and v must have q's shape [batch, heads, seq_local, head_dim]"
                   + (" (or fewer heads, a divisor of q's: grouped-query attention)" if grouped_kv else "")
                   + f", got {shapes}")
    elif len({q.dtype, k.dtype, v.dtype}) > 1 or not q.dtype.is_floating_point:
        problem = (f"q, k and v must share one floating dtype, got {[str(t.dtype) for t in (q, k, v)]}")
    elif len({q.device, k.device, v.device}) > 1:
        problem = f"q, k and v must be on one device, got {[str(t.device) for t in (q, k, v)]}"
    elif load_balance and q.shape[2] % 2:
        problem = (f"with load_balance=True each rank holds two chunks of seq / 2N tokens, so seq_local must be "
                   f"even, got {q.shape[2]} (the sequence, {q.shape[2] * n} tokens, must be a multiple of 2N = "
                   f"{2 * n}); pad it, or use load_balance=False")
    elif heads_multiple and q.shape[1] % n:
        problem = (f"DeepSpeed-Ulysses gives each rank heads / N of the query heads: heads ({q.shape[1]}) must be a "
                   f"multiple of the context-parallel size N = {n} (K/V heads need not be: each rank is sent those "
                   "its query heads use); "
                   f"use a group whose size divides {q.shape[1]}, or ring attention, which has no such limit")
    if not check:
        if problem:
            raise ValueError(f"{name}: {problem}")
        return n, rank
    # Shapes padded to 4 entries each (-1 for a missing dimension), so every rank sends as many ints.
    layout = [x for s in shapes for x in (s + [-1] * 4)[:4]] + [int(causal), int(load_balance)]
    check_agreement(name, q, group, layout, "[q shape, k shape, v shape, causal, load_balance] list", problem,
                    "4-dim [batch, heads, seq_local, head_dim] q, k, v of one shape and floating dtype"
                    + (", seq_local even" if load_balance else "") + (f", heads a multiple of {n}" if heads_multiple
                                                                      else ""))
    return n, rank


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                         *, causal: bool = False, load_balance: bool = False, scale: float | None = None,
                         check: bool = True) -> torch.Tensor:
    """Context-parallel attention with all-gathered K and V: every rank gathers the whole sequence's K/V and
    attends its own queries to it (Llama 3's context parallelism, Dubey et al. 2024, §3.3.2: with grouped-query
    attention K and V are small, and one all-gather is simpler than a ring).

    Args:
        q, k, v: ``[batch, heads, seq_local, head_dim]``, this rank's tokens in the layout of ``load_balance``
            (:func:`commlab.parallel.context.layout.shard_sequence`); the same shape on every rank.
        group: the CP group (None: the world). causal, scale: as :func:`attention`.
        check: agree on shapes first (:func:`check_inputs`, one small all-gather).

    Returns:
        ``[batch, heads, seq_local, head_dim]``: this rank's rows of attention over the whole sequence.

    Communication: forward, an AllGather of K and V (each rank sends ``(N-1) * 2 * k.numel() * e`` bytes on a
    ring); backward, a ReduceScatter of their gradients (the same volume). Memory: the whole sequence's K and V
    on every rank, which ring attention avoids.

    Raises:
        as :func:`check_inputs`.
    """
    n, rank = check_inputs("all_gather_attention", q, k, v, group, causal=causal, load_balance=load_balance,
                           check=check)
    kv = all_gather_sequence(torch.stack([k, v]), group)            # [N, 2, b, h, s/N, d]
    k_all, v_all = kv.movedim(0, 3).flatten(3, 4).unbind(0)         # [b, h, N s/N, d], rank order
    s_local = q.shape[2]
    pq = positions(rank, n, s_local, load_balance, q.device)
    pk = torch.cat([positions(r, n, s_local, load_balance, q.device) for r in range(n)])
    return attention(q, k_all, v_all, causal, scale, pq, pk)
