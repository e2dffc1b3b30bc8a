"""DeepSpeed-Ulysses: an AllToAll turns a sequence shard of every head into the whole sequence of some heads.

Jacobs et al. 2023 (arXiv:2309.14509), §3.1 and Figure 2. :func:`ulysses_attention`: one AllToAll of q, k
and v gives each rank the whole sequence for ``heads / N`` query heads, ordinary attention runs per head, and
a second AllToAll returns the output to sequence shards (the backward runs the inverses,
:mod:`commlab.parallel.context.communications`). N must divide the query heads; grouped K/V heads (``a_kv``)
that N does not divide are first replicated ``r = N / gcd(N, a_kv)`` times (:func:`kv_replication`), so that
each rank receives whole K/V heads for its query heads (verl's rule, verl-project/verl#1226: N divides the
query heads, and the K/V heads or is divided by them, K/V repeated when N exceeds them). Bytes per rank and pass: :func:`commlab.parallel.context.cost.ulysses_nbytes`.
Contiguous layout only (the causal mask follows rank order).

Book: chapter 13, §13.2 (*DeepSpeed-Ulysses*).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from commlab import checks
from commlab.parallel.context.attention import check_inputs
from commlab.parallel.context.communications import heads_to_seq, seq_to_heads

__all__ = ["kv_replication", "ulysses_attention"]


def kv_replication(kv_heads: int, n: int) -> int:
    """How many copies of each K/V head Ulysses sends over N ranks: ``N / gcd(N, kv_heads)`` (1 when N divides
    ``kv_heads``; ``N / kv_heads`` when ``kv_heads`` divides N). The ``kv_heads * r`` heads then split evenly,
    ``lcm(N, kv_heads) / N`` to a rank, each rank's query heads sharing them in groups.

    Raises:
        ValueError: ``kv_heads`` or ``n`` not an int >= 1.
    """
    checks.integer("kv_heads", kv_heads)
    checks.integer("n", n, note="the context-parallel size")
    return n // math.gcd(n, kv_heads)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                      *, causal: bool = False, scale: float | None = None, check: bool = True) -> torch.Tensor:
    """Attention over the whole sequence by DeepSpeed-Ulysses' head-parallel AllToAll.

    Args:
        q: ``[batch, heads, seq_local, head_dim]``, this rank's contiguous ``seq_local = seq / N`` tokens (rank i
            holds tokens ``i * seq_local ..``), on the group's device; the same shape on every rank; ``heads`` a
            multiple of N. Differentiable.
        k, v: ``[batch, kv_heads, seq_local, head_dim]``, ``kv_heads`` a divisor of ``heads`` (grouped-query
            attention: query head j uses K/V head ``j // (heads / kv_heads)``); replicated
            :func:`kv_replication` times before the AllToAll when N does not divide ``kv_heads``.
        group: the CP group (None: the world). causal: causal mask over global positions.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        check: agree on shapes and options first (one small all-gather).

    Returns:
        ``[batch, heads, seq_local, head_dim]``: this rank's rows of attention over the whole sequence.

    Communication per rank: forward one AllToAll of q, k, v (k and v replicated) and one of the output,
    ``(N-1)/N`` of ``(2 q.numel() + 2 r k.numel()) * e`` bytes in all; backward the same.

    Raises:
        CollectiveMismatchError (a ValueError): on every rank, ``heads`` not a multiple of N, ``kv_heads`` not a
            divisor of ``heads``, or as :func:`~commlab.parallel.context.attention.check_inputs`.
    """
    n, _ = check_inputs("ulysses_attention", q, k, v, group, causal=causal, heads_multiple=True, grouped_kv=True,
                        check=check)
    heads, kv_heads = q.shape[1], k.shape[1]
    r = kv_replication(kv_heads, n)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    qn, kvn = heads // n, kv_heads * r // n           # query and K/V heads each rank receives
    # Rank j's block: its query heads, then its K/V heads: one AllToAll moves all three.
    blocks = [t.unflatten(1, (n, t.shape[1] // n)) for t in (q, k, v)]
    sent = torch.cat(blocks, dim=2).flatten(1, 2)                   # [b, N * (qn + 2 kvn), s/N, d]
    qh, kh, vh = seq_to_heads(sent, group).split([qn, kvn, kvn], dim=1)  # [b, qn | kvn | kvn, s, d]
    group_size = qn // kvn                                          # query heads per K/V head here
    if group_size > 1:
        kh, vh = kh.repeat_interleave(group_size, dim=1), vh.repeat_interleave(group_size, dim=1)
    out = Fn.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return heads_to_seq(out, group)
