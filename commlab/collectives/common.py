"""What every hand-written collective needs before it moves data: group geometry, dtypes, cost-argument checks.

Kept apart from the algorithms so that ``ring.py`` (and later the tree and halving-doubling
modules) read as the algorithm alone. Agreement between ranks is :mod:`commlab.collectives.agreement`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import torch
import torch.distributed as dist

from commlab import checks

# Dtypes the hand-written collectives accept.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
)
# Every dtype this torch knows, in a fixed order, so that ranks can name each other's dtype by number.
ALL_DTYPES: tuple[torch.dtype, ...] = tuple(sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
DTYPE_CODE = {dt: i for i, dt in enumerate(ALL_DTYPES)}


def dtype_name(code: int) -> str:
    """The name of the dtype with this :data:`DTYPE_CODE` (e.g. ``"float32"``)."""
    return str(ALL_DTYPES[code]).replace("torch.", "")


# torch 2.13 renamed the tensor-in/tensor-out collectives (*_into_tensor / *_tensor -> *_single);
# take whichever this torch has so that no deprecation warning reaches a reader's output.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class RingGeometry:
    """Where this rank sits in a ring over a process group.

    Attributes:
        size: number of ranks in the group (N).
        group_rank: this rank's rank inside the group.
        position: this rank's position in the ring order (``order[position] == group_rank``).
        order: the ring order, a permutation of ``range(size)`` in group ranks.
        next_global, prev_global: global ranks of the ring neighbours this rank sends to and
            receives from.
    """

    size: int
    group_rank: int
    position: int
    order: tuple[int, ...]
    next_global: int
    prev_global: int


def as_int64(value) -> int:
    """``value`` as an int the agreement check can carry, or -1 when it is not an integer (a float, a bool)
    or does not fit in int64. Negative values are invalid everywhere they are used, so -1 loses nothing."""
    if isinstance(value, bool):
        return -1
    try:
        v = operator.index(value)
    except TypeError:
        return -1
    return v if -2**63 <= v < 2**63 else -1


def resolve_ring(size: int, ring: Sequence[int] | None) -> tuple[tuple[int, ...], str | None]:
    """Normalise a ring order for a group of ``size`` ranks, without raising.

    Returns:
        ``(order, problem)``: ``order`` has exactly ``size`` ints (entries that are not integers become
        -1, so that the agreement check can still show them); ``problem`` is None for a valid ring, else
        a sentence saying what is wrong. The caller raises it on every rank through
        :func:`~commlab.collectives.agreement.check_agreement`, or locally when the check is off.
    """
    if ring is None:
        return tuple(range(size)), None
    entries = [as_int64(r) for r in ring]
    order = tuple((entries + [-1] * size)[:size])
    if len(entries) != size or sorted(entries) != list(range(size)):
        return order, f"ring must be a permutation of the group's ranks 0..{size - 1}, got {list(ring)}"
    return order, None


def ring_geometry(group: dist.ProcessGroup | None, ring: Sequence[int] | None) -> RingGeometry:
    """Resolve ``group`` and ``ring`` into this rank's neighbours.

    Args:
        group: a process group, or None for the default (world) group.
        ring: ring order as a permutation of the group's ranks (group ranks, not global ranks), or
            None for ``0, 1, ..., N-1``.

    Raises:
        ValueError: ``ring`` is not a permutation of ``range(N)`` (checked locally; the collectives check
            it on every rank first, through :func:`~commlab.collectives.agreement.check_agreement`).
        RuntimeError: torch.distributed is not initialised, or the calling rank is not in ``group``.
    """
    size, group_rank = group_size_and_rank(group)
    order, problem = resolve_ring(size, ring)
    if problem:
        raise ValueError(problem)
    position = order.index(group_rank)
    nxt = order[(position + 1) % size]
    prv = order[(position - 1) % size]
    return RingGeometry(size=size, group_rank=group_rank, position=position, order=order,
                        next_global=global_rank(group, nxt), prev_global=global_rank(group, prv))


def group_size_and_rank(group: dist.ProcessGroup | None, what: str = "the collective") -> tuple[int, int]:
    """``(N, this rank's group rank)`` of ``group`` (None: the world), checking that this rank belongs to it.

    The one membership check of the package: the collectives, the compressors' aggregation and hooks,
    PowerSGD and the data-parallel wrapper all call it, so a rank outside its group gets the same error
    everywhere instead of an ``IndexError`` or ``AttributeError`` from deep inside. ``dist.new_group``
    returns ``GroupMember.NON_GROUP_MEMBER`` (an int) to the ranks it leaves out; passing that on is the
    usual way to get here.

    Args:
        group: a ProcessGroup, None, or ``GroupMember.NON_GROUP_MEMBER``.
        what: who asks, for the message (e.g. ``"PowerSGDState"``).

    Raises:
        RuntimeError: torch.distributed is not initialised, or this rank is not a member of ``group``
            ("rank r is not a member of the process group passed to ...").
        ValueError: ``group`` is neither a ProcessGroup nor None.
    """
    outsider = group is dist.GroupMember.NON_GROUP_MEMBER
    if group is not None and not outsider and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{what}: process_group must be a torch.distributed ProcessGroup or None, "
                         f"got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run inside commlab.launch(...) or "
                           "call dist.init_process_group first")
    group_rank = -1 if outsider else dist.get_rank(group)
    if group_rank < 0:
        hint = (" (dist.new_group returns GroupMember.NON_GROUP_MEMBER to the ranks it leaves out)" if outsider
                else f" (its ranks: {dist.get_process_group_ranks(group)})")
        raise RuntimeError(f"rank {dist.get_rank()} is not a member of the process group passed to {what}{hint}; "
                           "call it only on the group's members, with a group this rank belongs to")
    return dist.get_world_size(group), group_rank


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (None or the world: itself)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def work_buffer(tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """A flat buffer to reduce in: ``tensor``'s own storage when that is possible (inplace, contiguous)."""
    if inplace and tensor.is_contiguous():
        return tensor.detach().view(-1)
    return tensor.detach().reshape(-1).clone()


def write_back(tensor: torch.Tensor, work: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Return the result in ``tensor``'s shape; for ``inplace``, copy it into ``tensor`` if needed."""
    if inplace:
        if work.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.detach().copy_(work.view(tensor.shape))
        return tensor
    return work.view(tensor.shape)


def check_cost_args(nbytes: float, n: int | None = None, **rates: float) -> None:
    """Validate the inputs of an α-β(-γ) cost function, the same way for every algorithm.

    Raises:
        ValueError: ``nbytes`` not a finite number >= 0; ``n`` (when given) not an int >= 1; a rate
            (α in s, β or γ in s/byte) not a finite number >= 0.
    """
    checks.number("nbytes", nbytes, least=0)
    if n is not None:
        checks.integer("n", n, note="ranks")
    for name, v in rates.items():
        checks.number(name, v, least=0)


def check_counts(**counts: int) -> None:
    """Raise ``ValueError`` naming the first count (nodes, devices, NICs, ...) that is not an int >= 1."""
    for name, v in counts.items():
        checks.integer(name, v)


def ceil_log2(n: int) -> int:
    """``ceil(log2 n)`` for an integer ``n >= 1``, computed exactly (0 for n = 1)."""
    return (n - 1).bit_length()


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` contiguous chunks, as ``torch.tensor_split`` does.

    The first ``numel % parts`` chunks hold ``ceil(numel / parts)`` elements, the others
    ``floor(numel / parts)``; chunks may be empty when ``numel < parts``.

    Returns:
        ``[(start, stop), ...]`` of length ``parts``, in element offsets.
    """
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
