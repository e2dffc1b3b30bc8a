"""Ring attention: each rank keeps its queries, the K/V blocks travel round the ring, the softmax is online.

:func:`ring_attention`: each of the N ranks of the CP group holds ``seq/N`` tokens of q, k, v
(``[batch, heads, seq_local, head_dim]``); at step t rank i attends to the K/V block of rank ``(i - t) mod N``
(:func:`~commlab.parallel.context.layout.block_plan`) while passing it on
(:func:`~commlab.parallel.context.communications.ring_pass`), with an online softmax and ``lse = m + log l``
saved for the backward; float32 arithmetic and dK/dV for half-precision inputs. Sources: Liu, Zaharia &
Abbeel 2023 (arXiv:2310.01889, §3, Alg. 1); Dao 2023, FlashAttention-2 (arXiv:2307.08691, Algs. 1-2).

Why an explicit backward: autograd through the ring pass would save every K/V block, the whole sequence on
every rank. The explicit one saves only this rank's q, k, v, out, lse and sends the blocks round again with
their dK/dV accumulators: two blocks held, no double backward, two to three times the forward's bytes
(:func:`commlab.parallel.context.cost.ring_attention_nbytes`). Book: chapter 13, §13.2.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from commlab.parallel.context.attention import check_inputs
from commlab.parallel.context.communications import ring_pass
from commlab.parallel.context.layout import block_plan, positions

__all__ = ["RingAttentionStats", "RingAttention", "ring_attention"]


@dataclasses.dataclass
class RingAttentionStats:
    """What ring attention did on this rank, accumulated over calls (pass one to :func:`ring_attention`).

    Attributes:
        forward_nbytes_sent, backward_nbytes_sent: payload bytes this rank sent (K/V forward; K/V and dK/dV
            backward).
        forward_exchanges, backward_exchanges: grouped exchanges posted.
        score_entries: query x key score entries this rank computed in forward passes (per batch and head):
            under a causal mask the load-balanced layout makes it the same on every rank.
    """

    forward_nbytes_sent: int = 0
    backward_nbytes_sent: int = 0
    forward_exchanges: int = 0
    backward_exchanges: int = 0
    score_entries: int = 0


def _scores(qf, kf, plan, pq, pk, scale):
    qs, ks = plan.q_rows, plan.k_cols
    sc = (qf[:, :, qs] @ kf[:, :, ks].transpose(-1, -2)) * scale
    if plan.masked:  # only the block of the rank's own tokens: positions decide
        sc = sc.masked_fill(pk[ks][None, :] > pq[qs][:, None], float("-inf"))
    return sc


class RingAttention(torch.autograd.Function):
    """Ring attention's forward (online softmax over the blocks as they arrive) and explicit backward (the
    module docstring says why explicit). Use :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, group, n, rank, causal, load_balance, scale, stats):
        b, h, s, d = q.shape
        work = torch.promote_types(q.dtype, torch.float32)
        qf = q.to(work)
        m = torch.full((b, h, s), float("-inf"), dtype=work, device=q.device)
        l = torch.zeros((b, h, s), dtype=work, device=q.device)
        acc = torch.zeros((b, h, s, d), dtype=work, device=q.device)
        pq = positions(rank, n, s, load_balance, q.device)
        kv = [k.contiguous(), v.contiguous()]
        held = None  # the last exchange, released only after the next is posted (see p2p.Exchange)
        for step in range(n):
            src = (rank - step) % n
            ex = None
            if step < n - 1:  # post the next block's transfer first, so that it overlaps this block's arithmetic
                nxt, ex = ring_pass(kv, group)
            plan = block_plan(rank, src, n, s, causal, load_balance)
            if plan is not None:
                qs = plan.q_rows
                sc = _scores(qf, kv[0].to(work), plan, pq, pq, scale)
                m_old = m[:, :, qs]
                m_new = torch.maximum(m_old, sc.amax(-1))   # finite: step 0 gives every row its own token
                p = torch.exp(sc - m_new[..., None])
                rescale = torch.exp(m_old - m_new)
                l[:, :, qs] = l[:, :, qs] * rescale + p.sum(-1)
                acc[:, :, qs] = acc[:, :, qs] * rescale[..., None] + p @ kv[1][:, :, plan.k_cols].to(work)
                m[:, :, qs] = m_new
                if stats is not None:
                    stats.score_entries += sc.shape[-2] * sc.shape[-1]
            if ex is not None:
                ex.wait()
                held = ex
                kv = nxt
                if stats is not None:
                    stats.forward_nbytes_sent += ex.nbytes_sent
                    stats.forward_exchanges += 1
        del held
        out = acc / l[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, n, rank, causal, load_balance, scale, stats)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, n, rank, causal, load_balance, scale, stats = ctx.args
        s = q.shape[2]
        work = out.dtype
        qf, do = q.to(work), dout.to(work)
        delta = (do * out).sum(-1)                      # D_i = sum_j dO_ij O_ij (FlashAttention-2, Alg. 2)
        dq = torch.zeros_like(qf)
        pq = positions(rank, n, s, load_balance, q.device)
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros(k.shape, dtype=work, device=k.device), torch.zeros(v.shape, dtype=work, device=v.device)]
        held = []
        for step in range(n):
            src = (rank - step) % n
            posted = []
            if step < n - 1:
                nxt_kv, ex = ring_pass(kv, group)
                posted.append(ex)
            plan = block_plan(rank, src, n, s, causal, load_balance)
            if plan is not None:
                qs, ks = plan.q_rows, plan.k_cols
                kf, vf = kv[0].to(work), kv[1].to(work)
                p = torch.exp(_scores(qf, kf, plan, pq, pq, scale) - lse[:, :, qs, None])  # masked -> 0
                dkv[1][:, :, ks] += p.transpose(-1, -2) @ do[:, :, qs]
                ds = p * (do[:, :, qs] @ vf[:, :, ks].transpose(-1, -2) - delta[:, :, qs, None])
                dq[:, :, qs] += (ds @ kf[:, :, ks]) * scale
                dkv[0][:, :, ks] += (ds.transpose(-1, -2) @ qf[:, :, qs]) * scale
            if n > 1:  # this block's accumulator goes on; after step N-1 it reaches the block's owner
                nxt_dkv, ex = ring_pass(dkv, group)
                posted.append(ex)
            for ex in posted:
                ex.wait()
                if stats is not None:
                    stats.backward_nbytes_sent += ex.nbytes_sent
                    stats.backward_exchanges += 1
            held = posted
            if step < n - 1:
                kv = nxt_kv
            if n > 1:
                dkv = nxt_dkv
        del held
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)) + (None,) * 7


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   causal: bool = False, load_balance: bool = False, scale: float | None = None,
                   check: bool = True, stats: RingAttentionStats | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, with K/V blocks passed round the CP ring.

    Args:
        q, k, v: ``[batch, heads, seq_local, head_dim]``, this rank's tokens (``seq = N * seq_local``) in the
            layout of ``load_balance`` (:func:`commlab.parallel.context.layout.shard_sequence`), on the
            group's device; the same shape on every rank. Differentiable in all three.
        group: the CP group (None: the world).
        causal: causal mask over global positions. load_balance: the zigzag layout (rank i holds chunks i and
            2N-1-i of 2N; ``seq_local`` even): every rank then does the same causal work.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        check: agree on shapes and options first (one small all-gather, :func:`~commlab.parallel.context.
            attention.check_inputs`); pass False only where that is guaranteed.
        stats: a :class:`RingAttentionStats` to add this call's bytes, exchanges and score entries to.

    Returns:
        ``[batch, heads, seq_local, head_dim]`` in q's dtype: this rank's rows of softmax(q K^T * scale) V
        over the whole sequence. Bytes sent: :func:`commlab.parallel.context.cost.ring_attention_nbytes`.

    Raises:
        CollectiveMismatchError, TypeError, RuntimeError: as :func:`~commlab.parallel.context.attention.
            check_inputs` (wrong dims, shapes that differ between ranks or from q's, odd ``seq_local`` with
            ``load_balance``, ...), on every rank.
    """
    n, rank = check_inputs("ring_attention", q, k, v, group, causal=causal, load_balance=load_balance, check=check)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, group, n, rank, bool(causal), bool(load_balance), scale, stats)
