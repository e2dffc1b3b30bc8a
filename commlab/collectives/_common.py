"""What every hand-written collective needs before it moves data: group geometry and agreement.

Kept apart from the algorithms so that ``ring.py`` (and later the tree and halving-doubling
modules) read as the algorithm alone.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

# Dtypes the hand-written collectives accept, with the code each rank sends in the agreement check.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


# torch 2.13 renamed the tensor-in/tensor-out collectives (*_into_tensor / *_tensor -> *_single);
# take whichever this torch has so that no deprecation warning reaches a reader's output.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveMismatchError(ValueError):
    """Ranks called the same collective with incompatible tensors or ring orders.

    Every rank raises it, with the same message, naming what each rank passed.
    """


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


def ring_geometry(group: dist.ProcessGroup | None, ring: Sequence[int] | None) -> RingGeometry:
    """Resolve ``group`` and ``ring`` into this rank's neighbours.

    Args:
        group: a process group, or None for the default (world) group.
        ring: ring order as a permutation of the group's ranks (group ranks, not global ranks), or
            None for ``0, 1, ..., N-1``.

    Raises:
        ValueError: ``ring`` is not a permutation of ``range(N)`` (checked locally, before any
            communication).
        RuntimeError: the calling rank is not a member of ``group``.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run inside commlab.launch(...) or "
                           "call dist.init_process_group first")
    group_rank = dist.get_rank(group)
    if group_rank < 0:
        raise RuntimeError("this rank is not a member of the process group it called the collective on")
    size = dist.get_world_size(group)
    order = tuple(range(size)) if ring is None else tuple(int(r) for r in ring)
    if sorted(order) != list(range(size)):
        raise ValueError(f"ring must be a permutation of the group's ranks 0..{size - 1}, got {list(order)}")
    position = order.index(group_rank)
    nxt = order[(position + 1) % size]
    prv = order[(position - 1) % size]
    return RingGeometry(size=size, group_rank=group_rank, position=position, order=order,
                        next_global=_global(group, nxt), prev_global=_global(group, prv))


def _global(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def check_agreement(name: str, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                    order: Sequence[int]) -> None:
    """Make every rank of ``group`` agree on element count, dtype and ring order, or all raise.

    One small all-gather of 3 int64 per rank (a few microseconds of payload; the cost is one
    latency). Without it a size mismatch makes the point-to-point phases either hang until the
    operation timeout or, worse, silently mix chunk boundaries.

    Raises:
        TypeError: a dtype outside :data:`SUPPORTED_DTYPES` (checked locally first).
        CollectiveMismatchError: the ranks disagree; the message lists each rank's element count,
            dtype and ring order, identically on every rank.
    """
    if tensor.dtype not in _DTYPE_CODE:
        raise TypeError(f"{name}: dtype {tensor.dtype} is not supported; use one of "
                        f"{[str(d).replace('torch.', '') for d in SUPPORTED_DTYPES]}")
    size = dist.get_world_size(group)
    if size == 1:
        return
    order_code = hash(tuple(order)) & 0x7FFF_FFFF_FFFF_FFFF
    mine = torch.tensor([tensor.numel(), _DTYPE_CODE[tensor.dtype], order_code], dtype=torch.int64)
    backend = dist.get_backend(group)
    if backend == "nccl":
        mine = mine.cuda()
    everyone = torch.empty(size * 3, dtype=torch.int64, device=mine.device)
    all_gather_single(everyone, mine, group=group)
    rows = everyone.view(size, 3).cpu().tolist()
    if any(row != rows[0] for row in rows):
        described = "; ".join(
            f"rank {r}: {row[0]} elements of {str(SUPPORTED_DTYPES[row[1]]).replace('torch.', '')}"
            for r, row in enumerate(rows))
        orders_differ = len({row[2] for row in rows}) > 1
        hint = " The ring orders differ as well: every rank must pass the same ring." if orders_differ else ""
        raise CollectiveMismatchError(
            f"{name}: ranks passed incompatible tensors ({described}). Every rank of the group must "
            f"call it with the same number of elements and the same dtype.{hint}")


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
