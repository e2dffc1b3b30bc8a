"""The communication operators of expert parallelism: dispatch and combine as AllToAlls, with autograd.

Source: Lepikhin et al. (2020), "GShard: Scaling Giant Models with Conditional Computation and Automatic
Sharding", arXiv:2006.16668, §2.2 and Algorithm 2 (the dispatched tensor ``[E, C, M]`` is all-to-all'ed so
that each device holds its own experts' slots from every device, and all-to-all'ed back after the experts);
Fedus et al. (2021), "Switch Transformers", arXiv:2101.03961, §2.2 and Figure 3 (capacity-padded buffers make
the exchange equal-sized).

Both directions are the same operation: :func:`commlab.collectives.all_to_all` on a tensor ``[EP, ...]``
whose row j goes to EP rank j. It is its own inverse (row j of rank i's output is row i of rank j's input),
so the backward of an AllToAll is the AllToAll of the gradient. Every call is checked once by the MoE layer
(:mod:`commlab.parallel.expert.layers`), so the operators here run with ``check=False``.

Bytes: with capacity-padded buffers every call moves the same amount whatever the routing: each rank sends
``(EP - 1) / EP`` of its ``[EP, ...]`` tensor (its own row stays). :class:`AllToAllCounter` adds up what a
layer actually handed to its peers, for comparison with :func:`commlab.parallel.expert.cost.moe_alltoall_nbytes`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.collectives import all_to_all
from commlab.collectives._common import group_size_and_rank

__all__ = ["AllToAllCounter", "AllToAll", "all_to_all_autograd"]


class AllToAllCounter:
    """Bytes and calls of the expert-parallel AllToAlls a layer ran (forward and backward).

    Attributes:
        sent_nbytes: bytes this rank sent to other ranks (the rows not its own), summed over calls.
        calls: AllToAlls run.
        forward_calls, backward_calls: of those, how many in the forward and in the backward pass.
    """

    def __init__(self):
        self.reset()

    def add(self, tensor: torch.Tensor, group, backward: bool) -> None:
        size, me = group_size_and_rank(group, "AllToAllCounter")
        row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        self.sent_nbytes += row * (size - 1)
        self.calls += 1
        if backward:
            self.backward_calls += 1
        else:
            self.forward_calls += 1

    def reset(self) -> None:
        """Forget the calls counted so far."""
        self.sent_nbytes = 0
        self.calls = self.forward_calls = self.backward_calls = 0


def _exchange(x: torch.Tensor, group, counter: AllToAllCounter | None, backward: bool) -> torch.Tensor:
    if counter is not None:
        counter.add(x, group, backward)
    return all_to_all(x.contiguous(), group, check=False)


class AllToAll(torch.autograd.Function):
    """AllToAll forward (row j to EP rank j); the AllToAll of the gradient backward (its inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, counter):
        ctx.group, ctx.counter = group, counter
        return _exchange(x, group, counter, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group, ctx.counter, backward=True), None, None


def all_to_all_autograd(x: torch.Tensor, group: dist.ProcessGroup | None,
                        counter: AllToAllCounter | None = None) -> torch.Tensor:
    """Row j of ``x`` ``[EP, ...]`` to EP rank j; returns the rows received, row j from rank j. Differentiable.

    Communication: forward one AllToAll of ``x.numel() * x.element_size()`` bytes per rank (each rank sends
    ``(EP-1)/EP`` of it); backward one of the same size. Every rank of ``group`` must call it with the same shape
    and dtype (not checked here: the caller checks once per layer call).
    """
    return AllToAll.apply(x, group, counter)
