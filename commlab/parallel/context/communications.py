"""The communication operators of context parallelism, over an explicit context-parallel (CP) group.

Named after the papers' operations: :func:`ring_pass`, ring attention's step (Liu, Zaharia & Abbeel 2023,
arXiv:2310.01889, §3), one grouped exchange to the next rank (not an autograd function:
:mod:`commlab.parallel.context.ring` writes the backward); :class:`SeqToHeads` / :class:`HeadsToSeq`,
DeepSpeed-Ulysses' AllToAll (Jacobs et al. 2023, arXiv:2309.14509, §3.1), each the other's backward, on
:func:`commlab.collectives.all_to_all`; :class:`AllGatherSequence`, Llama 3's all-gathered K/V (§3.3.2),
reduce-scattering the gradients backward. Shapes ``[..., heads, seq, head_dim]``; nothing is sent when
N == 1; every rank calls each operator with the same shapes.

Book: chapter 13, §13.2.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from commlab.collectives import p2p
from commlab.collectives.common import all_gather_single, reduce_scatter_single, ring_geometry
from commlab.collectives.all_to_all import all_to_all
from commlab.parallel.tensor.communications import conjugate_pair

__all__ = ["ring_pass", "SeqToHeads", "HeadsToSeq", "AllGatherSequence", "seq_to_heads", "heads_to_seq",
           "all_gather_sequence"]


def ring_pass(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor],
                                                                                          p2p.Exchange]:
    """Post one ring step: send each of ``tensors`` to the next rank, receive as many from the previous one.

    Args:
        tensors: contiguous tensors on the group's device; the previous rank sends tensors of the same shapes
            and dtypes (every rank runs the same schedule).
        group: the CP group (None: the world). The ring is group-rank order: rank i sends to i+1 mod N.

    Returns:
        ``(received, exchange)``: new buffers the previous rank's tensors arrive in (read them only after
        ``exchange.wait()`` or ``wait_recvs()``), and the :class:`~commlab.collectives.p2p.Exchange` to wait
        on. Do not modify ``tensors`` before waiting. Bytes sent: ``sum(t.numel() * t.element_size())``, in
        ``exchange.nbytes_sent``.
    """
    geom = ring_geometry(group, None)
    received = [torch.empty_like(t) for t in tensors]
    ex = p2p.exchange([(t, geom.next_global) for t in tensors],
                      [(t, geom.prev_global) for t in received], group)
    return received, ex


def _to_heads(x: torch.Tensor, group) -> torch.Tensor:
    # [..., h, s/N, d] -> [N, ..., h/N, s/N, d]: block j (heads j h/N .. (j+1) h/N - 1) goes to rank j.
    n = dist.get_world_size(group)
    if n == 1:
        return x
    send = x.unflatten(-3, (n, x.shape[-3] // n)).movedim(-4, 0).contiguous()
    recv = all_to_all(send, group, check=False)  # row j: sequence block j of this rank's heads
    return recv.movedim(0, -3).flatten(-3, -2)     # [..., h/N, N, s/N, d] -> [..., h/N, s, d]


def _to_seq(y: torch.Tensor, group) -> torch.Tensor:
    # [..., h/N, s, d] -> [N, ..., h/N, s/N, d]: sequence block j goes back to rank j.
    n = dist.get_world_size(group)
    if n == 1:
        return y
    send = y.unflatten(-2, (n, y.shape[-2] // n)).movedim(-3, 0).contiguous()
    recv = all_to_all(send, group, check=False)  # row j: this rank's sequence block of head group j
    return recv.movedim(0, -4).flatten(-4, -3)     # [..., N, h/N, s/N, d] -> [..., h, s/N, d]


class SeqToHeads(torch.autograd.Function):
    """Ulysses' first AllToAll (Jacobs et al. 2023, §3.1): ``[..., h, s/N, d]`` (a sequence shard of every
    head) -> ``[..., h/N, s, d]`` (the whole sequence of this rank's heads). Backward: :class:`HeadsToSeq`."""

    forward, backward = conjugate_pair(_to_heads, _to_seq)


class HeadsToSeq(torch.autograd.Function):
    """Ulysses' second AllToAll: ``[..., h/N, s, d]`` -> ``[..., h, s/N, d]``. Backward: :class:`SeqToHeads`."""

    forward, backward = conjugate_pair(_to_seq, _to_heads)


class AllGatherSequence(torch.autograd.Function):
    """All-gather ``[..., s/N, d]`` into ``[N, ..., s/N, d]`` (row j: rank j's block), forward; reduce-scatter
    (sum) of the gradient, backward: every rank's queries contributed to every block's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        x = x.contiguous()
        out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        if n == 1:
            out[0].copy_(x)
        else:
            all_gather_single(out.view(-1), x.view(-1), group=group)  # flat: gloo wants [N * numel]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_world_size(ctx.group) == 1:
            return grad[0], None
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(out.view(-1), grad.view(-1), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """:class:`SeqToHeads`: ``[..., h, s/N, d]`` -> ``[..., h/N, s, d]`` (heads divisible by N; unchecked here).

    Communication: one AllToAll; each rank sends ``(N-1)/N`` of ``x``'s bytes (forward, and the same in
    backward).
    """
    return SeqToHeads.apply(x, group)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """:class:`HeadsToSeq`: ``[..., h/N, s, d]`` -> ``[..., h, s/N, d]``. Communication as :func:`seq_to_heads`."""
    return HeadsToSeq.apply(y, group)


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """:class:`AllGatherSequence`: ``[...]`` -> ``[N, ...]``, row j rank j's ``x``.

    Communication: an AllGather in which each rank sends ``(N-1)`` times ``x``'s bytes on a ring (forward); a
    ReduceScatter of the same volume (backward).
    """
    return AllGatherSequence.apply(x, group)
