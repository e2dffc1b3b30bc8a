"""The communication operators of tensor parallelism, as autograd functions over an explicit TP group.

Megatron-LM's conjugate pair (Shoeybi et al. 2019, arXiv:1909.08053, §3, Figure 3): :func:`f` (identity
forward, all-reduce backward) where a replicated activation enters a column-split linear, and :func:`g`
(all-reduce forward, identity backward) where a row-split linear's partial sums leave the block.
Sequence parallelism's pair (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2, the paper's g and ḡ):
:func:`gather_sequence` (all-gather along the sequence forward, reduce-scatter backward) and
:func:`reduce_scatter_sequence` (the reverse), the same bytes on a ring. For single layers:
:func:`gather_last_dim` and :func:`split_last_dim`. An all-reduce of a ``(batch, seq, hidden)`` activation
carries ``batch·seq·hidden·e`` bytes (a ring sends ``2(t-1)/t`` of it per rank). Each operator comes from
:func:`conjugate_pair`; inside ``with timed(group, timer):`` each collective on ``group`` is timed into a
:class:`CommTimer`.

Book: chapter 10, §10.2 and §10.9; chapter 13, §13.1.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["F", "G", "f", "g", "GatherLastDim", "SplitLastDim", "gather_last_dim", "split_last_dim",
           "GatherSequence", "ReduceScatterSequence", "gather_sequence", "reduce_scatter_sequence", "SEQ_DIM",
           "group_size", "group_rank", "CommTimer", "timed", "untimed", "conjugate_pair"]


class CommTimer:
    """Seconds and calls of the TP collectives timed into it (see :func:`timed`).

    Args:
        clock: a :class:`commlab.launch.Clock` on the group's device (host clock on the CPU, CUDA events on
            a GPU: there a collective's time is how long the compute stream waited for it).

    Attributes:
        calls: collectives timed since the last :meth:`reset`.
    """

    def __init__(self, clock):
        self.clock = clock
        self._spans: list = []
        self.calls = 0

    def _add(self, start, end) -> None:
        self._spans.append((start, end))
        self.calls += 1

    def seconds(self) -> float:
        """Total seconds of the timed collectives (on a GPU this waits for their events: read after the step)."""
        return sum(self.clock.elapsed(a, b) for a, b in self._spans)

    def reset(self) -> None:
        """Forget the collectives timed so far."""
        self._spans.clear()
        self.calls = 0


# group -> timer, only inside ``timed``: the operators are autograd functions whose backward runs wherever
# autograd calls it, so a timer cannot be passed down as an argument without changing every layer.
_TIMERS: dict = {}


@contextlib.contextmanager
def timed(group: dist.ProcessGroup | None, timer: CommTimer) -> Iterator[CommTimer]:
    """Time every collective of f, g, gather_last_dim, split_last_dim, gather_sequence and reduce_scatter_sequence
    on ``group`` into ``timer`` while
    inside (forward and backward alike). Groups of one rank run no collective and time nothing.

    Raises:
        RuntimeError: ``group`` is already being timed (nested ``timed`` on one group).
    """
    if group in _TIMERS:
        raise RuntimeError("this tensor-parallel group is already being timed (nested timed(...) on one group)")
    _TIMERS[group] = timer
    try:
        yield timer
    finally:
        del _TIMERS[group]


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Time nothing inside, on any group (for work that is not the step's own, such as a shape probe)."""
    saved = dict(_TIMERS)
    _TIMERS.clear()
    try:
        yield
    finally:
        _TIMERS.update(saved)


@contextlib.contextmanager
def _timing(group, op: str) -> Iterator[None]:
    """Time the collective on ``group``'s timer, if any, inside a ``tp::<op>`` profiler range (the name
    :mod:`commlab.overlap.trace` reads as TP)."""
    with torch.profiler.record_function(f"tp::{op}"):
        timer = _TIMERS.get(group)
        if timer is None:
            yield
            return
        start = timer.clock.mark()
        yield
        timer._add(start, timer.clock.mark())


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (``None``: the world)."""
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's rank inside ``group``; RuntimeError if it is not a member."""
    r = dist.get_rank(group)
    if r < 0:
        raise RuntimeError("this rank is not a member of the tensor-parallel group it was given")
    return r


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    # Reduce a copy: the input may be saved for another function's backward, or be a view of a leaf.
    out = x.contiguous().clone()
    with _timing(group, "all_reduce"):
        dist.all_reduce(out, group=group)
    return out


def _gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    with _timing(group, "all_gather"):
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    return _gather_along(x, group, -1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be divisible by the tensor-parallel size ({n}) "
                         "to split it evenly across the group")
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


#: The sequence dimension of the ``(batch, seq, hidden)`` activations the TP layers take.
SEQ_DIM = 1


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return _gather_along(x, group, SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.dim() <= SEQ_DIM or x.shape[SEQ_DIM] % n:
        raise ValueError(f"sequence parallelism splits dimension {SEQ_DIM} of (batch, seq, hidden) across the "
                         f"tensor-parallel group: its length must be divisible by the tensor-parallel size ({n}), got "
                         f"shape {list(x.shape)}; pad the sequence to a multiple of {n}")
    parts = [p.contiguous() for p in x.chunk(n, dim=SEQ_DIM)]
    out = torch.empty_like(parts[0])
    with _timing(group, "reduce_scatter"):
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out


def conjugate_pair(forward_op, backward_op):
    """The ``forward`` and ``backward`` staticmethods of an autograd function over a group: ``forward_op(x,
    group)`` forward and ``backward_op(grad, group)`` backward, each ``(tensor, group) -> tensor``.

    Every operator below is such a pair of collectives (Megatron-LM's ``mappings.py`` writes them the same way),
    so each class is one line: ``forward, backward = conjugate_pair(op, its_conjugate)``.
    """

    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return forward_op(x, group)

    def backward(ctx, grad: torch.Tensor):
        return backward_op(grad, ctx.group), None

    return staticmethod(forward), staticmethod(backward)


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    # Returned as-is, autograd still records a node (it makes the output a view): no copy, no communication.
    return x


class F(torch.autograd.Function):
    """Megatron-LM's f (Shoeybi et al. 2019, §3, Fig. 3): identity forward, all-reduce (sum) backward."""

    forward, backward = conjugate_pair(_identity, _all_reduce)


class G(torch.autograd.Function):
    """Megatron-LM's g (Shoeybi et al. 2019, §3, Fig. 3): all-reduce (sum) forward, identity backward."""

    forward, backward = conjugate_pair(_all_reduce, _identity)


class GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension forward; this rank's slice of the gradient backward."""

    forward, backward = conjugate_pair(_gather_last, _split_last)


class SplitLastDim(torch.autograd.Function):
    """This rank's slice of the last dimension forward; all-gather of the gradient backward."""

    forward, backward = conjugate_pair(_split_last, _gather_last)


class GatherSequence(torch.autograd.Function):
    """Sequence parallelism's g (Korthikanti et al. 2022, §4.2.2, Fig. 5): all-gather along the sequence
    forward, reduce-scatter (sum) backward."""

    forward, backward = conjugate_pair(_gather_seq, _reduce_scatter_seq)


class ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallelism's ḡ (Korthikanti et al. 2022, §4.2.2, Fig. 5): reduce-scatter (sum) along the
    sequence forward, all-gather backward."""

    forward, backward = conjugate_pair(_reduce_scatter_seq, _gather_seq)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence parallelism's g: every rank's ``(batch, seq/t, ...)`` concatenated along the sequence, in
    group-rank order, ``(batch, seq, ...)``; in backward the gradient is reduce-scattered (summed) back.

    Communication: an all-gather (each rank contributes ``x.numel() * x.element_size()`` bytes) forward, a
    reduce-scatter of the ``t``-times larger gradient backward. Every rank must pass the same shape.

    Raises:
        ValueError (backward): the gathered sequence not divisible by ``t`` (it always is when the shapes agree).
    """
    return GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence parallelism's ḡ: ``(batch, seq, ...)`` partial sums -> this rank's ``(batch, seq/t, ...)`` of
    their sum over the group (rank r keeps tokens ``r * seq/t ..``); in backward the gradient is all-gathered.

    Communication: a reduce-scatter of ``x.numel() * x.element_size()`` bytes forward (a ring sends ``(t-1)/t``
    of it from each rank), an all-gather backward.

    Raises:
        ValueError: ``seq`` not divisible by the group size.
    """
    return ReduceScatterSequence.apply(x, group)


def f(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's f: ``x`` unchanged; in backward, the gradient is all-reduced (summed) over ``group``.

    Shape: any; returns the same shape. Communication: none forward; one all-reduce of ``x.numel() *
    x.element_size()`` bytes backward.
    """
    return F.apply(x, group)


def g(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's g: ``x`` all-reduced (summed) over ``group``; the gradient passes through unchanged.

    Shape: any; returns the same shape. Communication: one all-reduce of ``x.numel() * x.element_size()``
    bytes forward; none backward. Every rank of ``group`` must call it with the same shape and dtype.
    """
    return G.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in group-rank order.

    Shape: ``(..., k)`` -> ``(..., t * k)`` for a group of ``t``. Communication: an all-gather in which each rank
    contributes ``x.numel() * x.element_size()`` bytes (forward); none backward.
    """
    return GatherLastDim.apply(x, group)


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of the last dimension: ``(..., t * k)`` -> ``(..., k)``.

    Communication: none forward; an all-gather of the gradient backward (each rank contributes its slice).

    Raises:
        ValueError: the last dimension is not divisible by the group size.
    """
    return SplitLastDim.apply(x, group)
