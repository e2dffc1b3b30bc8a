"""DeepSpeed-Ulysses: an AllToAll turns a sequence shard of every head into the whole sequence of some heads.

Jacobs et al. 2023 (arXiv:2309.14509), §3.1 and Figure 2. :func:`ulysses_attention`: one AllToAll of q, k
and v stacked gives each rank the whole sequence for ``heads / N`` heads, ordinary attention runs per head,
and a second AllToAll returns the output to sequence shards (the backward runs the inverses,
:mod:`commlab.parallel.context.communications`). Each rank sends ``4 (N-1)/N · B · e`` bytes per pass for a
block of ``B`` elements (:mod:`commlab.parallel.context.cost`); ``heads`` (K/V heads too) must be a
multiple of N. Contiguous layout only (the causal mask follows rank order).

Book: chapter 13, §13.2 (*DeepSpeed-Ulysses*).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from commlab.parallel.context.attention import check_inputs
from commlab.parallel.context.communications import heads_to_seq, seq_to_heads

__all__ = ["ulysses_attention"]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                      *, causal: bool = False, scale: float | None = None, check: bool = True) -> torch.Tensor:
    """Attention over the whole sequence by DeepSpeed-Ulysses' head-parallel AllToAll.

    Args:
        q, k, v: ``[batch, heads, seq_local, head_dim]``, this rank's contiguous ``seq_local = seq / N`` tokens
            (rank i holds tokens ``i * seq_local ..``), on the group's device; the same shape on every rank;
            ``heads`` a multiple of N. Differentiable.
        group: the CP group (None: the world). causal: causal mask over global positions.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        check: agree on shapes and options first (one small all-gather).

    Returns:
        ``[batch, heads, seq_local, head_dim]``: this rank's rows of attention over the whole sequence.

    Communication per rank: forward one AllToAll of q, k, v stacked and one of the output, ``4 (N-1)/N *
    q.numel() * e`` bytes in all; backward the same.

    Raises:
        CollectiveMismatchError (a ValueError): on every rank, ``heads`` not a multiple of N, or as
            :func:`~commlab.parallel.context.attention.check_inputs`.
    """
    check_inputs("ulysses_attention", q, k, v, group, causal=causal, heads_multiple=True, check=check)
    qh, kh, vh = seq_to_heads(torch.stack([q, k, v]), group).unbind(0)   # [b, h/N, seq, d] each
    out = Fn.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return heads_to_seq(out, group)
