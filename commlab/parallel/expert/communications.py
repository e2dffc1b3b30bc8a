"""The communication operators of expert parallelism: dispatch and combine as AllToAlls, with autograd.

:func:`all_to_all_autograd` runs :func:`commlab.collectives.all_to_all` on an ``[EP, ...]`` tensor (row j to
EP rank j); the AllToAll is its own inverse, so its backward is the AllToAll of the gradient (GShard,
Lepikhin et al. 2020, §2.2 and Algorithm 2; Switch, Fedus et al. 2021, §2.2 and Figure 3). The MoE layer
checks each call once, so these run with ``check=False``. With capacity-padded buffers each rank sends
``(EP - 1) / EP`` of its tensor whatever the routing; :class:`AllToAllCounter` adds up what a layer sent,
for comparison with :func:`commlab.parallel.expert.cost.moe_alltoall_nbytes`.

Dropless dispatch sends only the routed rows, an AllToAllV (:func:`all_to_all_v_autograd`, on
:func:`commlab.collectives.all_to_all_v`, the semantics of ``dist.all_to_all_single`` with split sizes); its
backward is the AllToAllV with the split sizes swapped.

Book: chapter 13, §13.3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.collectives import all_to_all, all_to_all_v
from commlab.collectives.common import group_size_and_rank

__all__ = ["AllToAllCounter", "AllToAll", "all_to_all_autograd", "AllToAllV", "all_to_all_v_autograd"]


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
        size, _ = group_size_and_rank(group, "AllToAllCounter")
        self._count(_row_nbytes(tensor) * (size - 1), backward)

    def add_v(self, tensor: torch.Tensor, input_split_sizes, me: int, backward: bool) -> None:
        """Count one AllToAllV of ``tensor``'s rows, ``input_split_sizes[j]`` to rank j (rank ``me``'s own stay)."""
        self._count(_row_nbytes(tensor) * (sum(input_split_sizes) - input_split_sizes[me]), backward)

    def _count(self, nbytes: int, backward: bool) -> None:
        self.sent_nbytes += nbytes
        self.calls += 1
        if backward:
            self.backward_calls += 1
        else:
            self.forward_calls += 1

    def reset(self) -> None:
        """Forget the calls counted so far."""
        self.sent_nbytes = 0
        self.calls = self.forward_calls = self.backward_calls = 0


def _row_nbytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0


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


def _exchange_v(x, output_split_sizes, input_split_sizes, group, counter, backward):
    if counter is not None:
        counter.add_v(x, input_split_sizes, group_size_and_rank(group, "all_to_all_v_autograd")[1], backward)
    return all_to_all_v(x.contiguous(), output_split_sizes, input_split_sizes, group, check=False)


class AllToAllV(torch.autograd.Function):
    """AllToAllV forward (``input_split_sizes[j]`` rows to rank j); backward the AllToAllV of the gradient with
    the split sizes swapped (its inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_split_sizes, input_split_sizes, group, counter):
        ctx.splits, ctx.group, ctx.counter = (output_split_sizes, input_split_sizes), group, counter
        return _exchange_v(x, output_split_sizes, input_split_sizes, group, counter, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange_v(grad, in_splits, out_splits, ctx.group, ctx.counter, backward=True), None, None, None, None


def all_to_all_v_autograd(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                          group: dist.ProcessGroup | None, counter: AllToAllCounter | None = None) -> torch.Tensor:
    """Rows ``x`` ``[R, ...]``: ``input_split_sizes[j]`` of them, in order, to EP rank j; returns the rows
    received, ``output_split_sizes[j]`` from rank j, in rank order. Differentiable.

    Communication: forward one AllToAllV, this rank sending ``sum(input_split_sizes) - input_split_sizes[me]``
    rows; backward one with the splits swapped. Rank i's ``input_split_sizes[j]`` must equal rank j's
    ``output_split_sizes[i]`` (not checked here: the MoE layer exchanges the counts first).
    """
    return AllToAllV.apply(x, list(output_split_sizes), list(input_split_sizes), group, counter)
