"""DeepSpeed-Ulysses: an AllToAll turns a sequence shard of every head into the whole sequence of some heads.

Jacobs et al. 2023 (arXiv:2309.14509), §3.1 and Figure 2. :func:`ulysses_attention`: one AllToAll of q, k
and v gives each rank the whole sequence for ``heads / N`` query heads, ordinary attention runs per head, and
a second AllToAll returns the output to sequence shards (the backward runs the inverses,
:mod:`commlab.parallel.context.communications`). N must divide the query heads. With grouped K/V heads
(``a_kv``) each rank receives only the K/V heads its query heads use (:func:`kv_heads_per_rank`), the same
number from every rank (a rank whose queries use fewer gets a repeat): ``a_kv / N`` when N divides ``a_kv``, one
when ``a_kv`` divides N (verl's cases, verl-project/verl#1226), and e.g. 2 for a = 12, a_kv = 4, N = 3.
Bytes per rank and pass: :func:`commlab.parallel.context.cost.ulysses_nbytes`.
Contiguous layout only (the causal mask follows rank order).

Book: chapter 13, §13.2 (*DeepSpeed-Ulysses*).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from commlab import checks
from commlab.parallel.context.attention import check_inputs
from commlab.parallel.context.communications import heads_to_seq, seq_to_heads

__all__ = ["kv_heads_per_rank", "ulysses_attention"]


def _kv_heads_used(heads: int, kv_heads: int, n: int) -> list[list[int]]:
    """Per rank, the K/V heads (ascending) its ``heads / n`` query heads use; query head i uses ``i // group``."""
    qn, group = heads // n, heads // kv_heads
    return [sorted({i // group for i in range(j * qn, (j + 1) * qn)}) for j in range(n)]


def kv_heads_per_rank(heads: int, kv_heads: int, n: int) -> int:
    """K/V heads each of N ranks receives in Ulysses: the most any rank's ``heads / N`` query heads use (query
    head i uses K/V head ``i // (heads / kv_heads)``). ``kv_heads / N`` when N divides ``kv_heads``; 1 when
    ``kv_heads`` divides N; 2 for ``heads = 12, kv_heads = 4, N = 3``.

    Raises:
        ValueError: a size not an int >= 1; ``heads`` not a multiple of N or of ``kv_heads``.
    """
    checks.integer("heads", heads)
    checks.integer("kv_heads", kv_heads)
    checks.integer("n", n, note="the context-parallel size")
    if heads % n or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of n ({n}) and of kv_heads ({kv_heads})")
    return max(len(used) for used in _kv_heads_used(heads, kv_heads, n))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                      *, causal: bool = False, scale: float | None = None, check: bool = True) -> torch.Tensor:
    """Attention over the whole sequence by DeepSpeed-Ulysses' head-parallel AllToAll.

    Args:
        q: ``[batch, heads, seq_local, head_dim]``, this rank's contiguous ``seq_local = seq / N`` tokens (rank i
            holds tokens ``i * seq_local ..``), on the group's device; the same shape on every rank; ``heads`` a
            multiple of N. Differentiable.
        k, v: ``[batch, kv_heads, seq_local, head_dim]``, ``kv_heads`` a divisor of ``heads`` (grouped-query
            attention: query head j uses K/V head ``j // (heads / kv_heads)``); each rank is sent the
            :func:`kv_heads_per_rank` K/V heads its query heads use.
        group: the CP group (None: the world). causal: causal mask over global positions.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        check: agree on shapes and options first (one small all-gather).

    Returns:
        ``[batch, heads, seq_local, head_dim]``: this rank's rows of attention over the whole sequence.

    Communication per rank: forward one AllToAll of q, k, v and one of the output, ``(N-1)/N`` of
    ``(2 q.numel() + 2 N kvn k.numel() / kv_heads) * e`` bytes in all, ``kvn`` = :func:`kv_heads_per_rank`;
    backward the same.

    Raises:
        CollectiveMismatchError (a ValueError): on every rank, ``heads`` not a multiple of N, ``kv_heads`` not a
            divisor of ``heads``, or as :func:`~commlab.parallel.context.attention.check_inputs`.
    """
    n, rank = check_inputs("ulysses_attention", q, k, v, group, causal=causal, heads_multiple=True, grouped_kv=True,
                        check=check)
    heads, kv_heads = q.shape[1], k.shape[1]
    used = _kv_heads_used(heads, kv_heads, n)
    qn, kvn = heads // n, max(len(u) for u in used)  # query and K/V heads each rank receives
    # Rank j's block: its query heads, then the K/V heads they use (the last repeated to kvn); one AllToAll.
    pick = torch.tensor([u[min(i, len(u) - 1)] for u in used for i in range(kvn)], device=k.device)
    blocks = [q.unflatten(1, (n, qn))] + [t.index_select(1, pick).unflatten(1, (n, kvn)) for t in (k, v)]
    sent = torch.cat(blocks, dim=2).flatten(1, 2)                   # [b, N * (qn + 2 kvn), s/N, d]
    qh, kh, vh = seq_to_heads(sent, group).split([qn, kvn, kvn], dim=1)  # [b, qn | kvn | kvn, s, d]
    # This rank's query head i (global rank*qn + i) uses K/V head (rank*qn + i) // group: its place here.
    mine, group_size = used[rank], heads // kv_heads
    place = torch.tensor([mine.index((rank * qn + i) // group_size) for i in range(qn)], device=k.device)
    kh, vh = kh.index_select(1, place), vh.index_select(1, place)
    out = Fn.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return heads_to_seq(out, group)
