"""DeepSpeed-Ulysses: an AllToAll turns a sequence shard of every head into the whole sequence of some heads.

Source: Jacobs, Tanaka, Zhang, Zhang, Song, Rajbhandari, He (2023), "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models", arXiv:2309.14509, §3.1 and Figure 2.

Each of the N ranks holds ``seq / N`` contiguous tokens of q, k and v for all ``heads`` heads. One AllToAll
(q, k and v stacked, so one call and one latency per peer) gives each rank the whole sequence for ``heads / N``
heads; attention is then an ordinary single-process attention per head (no communication inside it); a second
AllToAll brings the output back to sequence sharding. The backward pass runs the two AllToAlls' inverses
(:mod:`commlab.parallel.context.communications`).

Per rank and per pass the bytes sent are ``(N-1)/N`` of the four local tensors (q, k, v, out), ``4 (N-1)/N *
B * e`` for a block of ``B`` elements: it *falls* with N relative to the block, where ring attention's ``2 (N-1)
B e`` grows (:mod:`commlab.parallel.context.cost`). Its limits: ``heads`` must be a multiple of N (so N is at
most the number of heads, or of K/V heads under grouped-query attention), and every rank holds the whole
sequence's scores for its heads.

Contiguous layout only: the causal mask is applied to the gathered sequence in order, which is rank order.
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
