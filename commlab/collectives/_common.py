"""What every hand-written collective needs before it moves data: group geometry and agreement.

Kept apart from the algorithms so that ``ring.py`` (and later the tree and halving-doubling
modules) read as the algorithm alone.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from commlab.launch.device import group_device

# Dtypes the hand-written collectives accept.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
)
# Every dtype this torch knows, in a fixed order, so that ranks can name each other's dtype by number.
_ALL_DTYPES: tuple[torch.dtype, ...] = tuple(sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_DTYPE_CODE = {dt: i for i, dt in enumerate(_ALL_DTYPES)}


def _dtype_name(code: int) -> str:
    return str(_ALL_DTYPES[code]).replace("torch.", "")


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
        :func:`check_agreement`, or locally when the check is off.
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
            it on every rank first, through :func:`check_agreement`).
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
                        next_global=_global(group, nxt), prev_global=_global(group, prv))


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


def _global(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def check_agreement(name: str, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                    layout: Sequence[int] = (), layout_name: str = "ring order",
                    layout_problem: str | None = None, layout_rule: str = "", *, same_numel: bool = True,
                    layout_verdict: Callable[[list[tuple[int, ...]]], str | None] | None = None) -> None:
    """Make every rank of ``group`` agree on element count, dtype and layout, or all raise the same error.

    One small all-gather of ``6 + len(layout)`` int64 per rank, on the group's device (the cost is one
    latency). Without it a size mismatch makes the point-to-point phases hang until the operation timeout
    or, worse, silently mix chunk boundaries; and a problem found on one rank only (a bad ring order, a
    tensor on the wrong device) would leave the others waiting for it.

    The tensor must be on the group's device (:func:`commlab.launch.device.group_device`: the rank's own
    GPU under NCCL, the CPU under gloo), since NCCL moves only CUDA tensors and a CPU tensor would fail
    later, inside a point-to-point phase, with only the peers waiting. An empty tensor moves nothing and
    may be anywhere.

    Args:
        name: the collective's name, for messages.
        tensor: this rank's input.
        group: the process group.
        layout: what else must be identical on every rank (the ring order, the tree's root, the placement),
            as ints; the same length on every rank (callers normalise it, see :func:`resolve_ring`).
        layout_name: how messages call ``layout``.
        layout_problem: this rank's own verdict on its layout (None if valid).
        layout_rule: what a valid layout is, e.g. "a permutation of the group's ranks 0..3" (the same
            text on every rank, so that every rank raises the same message).
        same_numel: whether every rank must pass as many elements (False for a collective whose ranks send
            different amounts, such as AllToAllV; the dtype must still agree).
        layout_verdict: for a layout that is *not* the same on every rank (AllToAllV's split sizes: rank i's
            sends to rank j must match rank j's receives from rank i), a pure function of every rank's
            layout, in group-rank order, that returns a sentence saying what is wrong, or None. It replaces
            the test that all layouts are equal; every rank calls it on the same gathered layouts, so every
            rank raises the same message. With one rank it is called on this rank's layout alone.

    Raises:
        TypeError: some rank's dtype is not in :data:`SUPPORTED_DTYPES` (on every rank).
        ValueError: some rank's tensor is not on the group's device, or some rank's layout is invalid (on
            every rank; a CollectiveMismatchError naming the ranks and their devices).
        CollectiveMismatchError: the ranks disagree, or ``layout_verdict`` found a problem; the message
            lists what each rank passed, identically on every rank.
    """
    size, _ = group_size_and_rank(group)
    supported = tensor.dtype in SUPPORTED_DTYPES
    device = group_device(group)
    on_device = tensor.numel() == 0 or tensor.device == device
    if size == 1:
        if not supported:
            raise TypeError(_unsupported_message(name, [(0, _DTYPE_CODE[tensor.dtype])]))
        if not on_device:
            raise CollectiveMismatchError(_device_message(name, device, [(0, *_device_code(tensor.device))]))
        if layout_problem:
            raise CollectiveMismatchError(f"{name}: {layout_problem}")
        verdict = layout_verdict([tuple(layout)]) if layout_verdict else None
        if verdict:
            raise CollectiveMismatchError(f"{name}: {verdict}")
        return
    rule = f" must be {layout_rule}" if layout_rule else " must be valid"
    # On the group's device (the rank's own GPU under NCCL, which moves only CUDA tensors; a bare .cuda()
    # would put every rank's tensor on GPU 0 unless the launcher had bound the device).
    where = (-1, -1) if on_device else _device_code(tensor.device)
    mine = torch.tensor([tensor.numel(), _DTYPE_CODE[tensor.dtype], int(supported), int(layout_problem is None),
                         *where, *layout],
                        dtype=torch.int64, device=device)
    width = mine.numel()
    everyone = torch.empty(size * width, dtype=torch.int64, device=mine.device)
    all_gather_single(everyone, mine, group=group)
    rows = everyone.view(size, width).cpu().tolist()
    bad_dtype = [(r, row[1]) for r, row in enumerate(rows) if not row[2]]
    if bad_dtype:
        raise TypeError(_unsupported_message(name, bad_dtype))
    bad_device = [(r, row[4], row[5]) for r, row in enumerate(rows) if row[4] >= 0]
    if bad_device:
        raise CollectiveMismatchError(_device_message(name, device, bad_device))
    rows = [row[:4] + row[6:] for row in rows]  # the layout follows the first four columns again
    bad_layout = [(r, row[4:]) for r, row in enumerate(rows) if not row[3]]
    if bad_layout and layout_problem and len(bad_layout) == size and len({tuple(lay) for _, lay in bad_layout}) == 1:
        # Every rank passed the same invalid layout, so every rank found the same problem: say it plainly.
        raise CollectiveMismatchError(f"{name}: {layout_problem}")
    if bad_layout:
        who = "; ".join(f"rank {r} passed {lay}" for r, lay in bad_layout)
        note = "; entries that are not integers show as -1" if any(-1 in lay for _, lay in bad_layout) else ""
        raise CollectiveMismatchError(f"{name}: the {layout_name}{rule} ({who}{note}); every rank must pass "
                                      f"the same valid {layout_name}")
    tensors_differ = len({(row[0] if same_numel else 0, row[1]) for row in rows}) > 1
    verdict = layout_verdict([tuple(row[4:]) for row in rows]) if layout_verdict else None
    layouts_differ = layout_verdict is None and len({tuple(row[4:]) for row in rows}) > 1
    if tensors_differ or layouts_differ or verdict:
        parts = []
        if tensors_differ and same_numel:
            described = "; ".join(f"rank {r}: {row[0]} elements of {_dtype_name(row[1])}"
                                  for r, row in enumerate(rows))
            parts.append(f"ranks passed incompatible tensors ({described}). Every rank of the group must "
                         "call it with the same number of elements and the same dtype.")
        elif tensors_differ:
            described = "; ".join(f"rank {r}: {_dtype_name(row[1])}" for r, row in enumerate(rows))
            parts.append(f"ranks passed tensors of different dtypes ({described}). Every rank of the group must "
                         "call it with the same dtype.")
        if verdict:
            parts.append(verdict)
        if layouts_differ:
            described = "; ".join(f"rank {r}: {row[4:]}" for r, row in enumerate(rows))
            parts.append(f"ranks passed different {layout_name}s ({described}); every rank must pass the "
                         f"same {layout_name}.")
        raise CollectiveMismatchError(f"{name}: " + " ".join(parts))


# Device types a rank can name to the others by number (anything else shows as "another device").
_DEVICE_TYPES = ("cpu", "cuda", "meta", "mps", "xpu")


def _device_code(device: torch.device) -> tuple[int, int]:
    kind = _DEVICE_TYPES.index(device.type) if device.type in _DEVICE_TYPES else len(_DEVICE_TYPES)
    return kind, -1 if device.index is None else device.index


def _device_message(name: str, device: torch.device, bad: list[tuple[int, int, int]]) -> str:
    def show(kind: int, index: int) -> str:
        base = _DEVICE_TYPES[kind] if kind < len(_DEVICE_TYPES) else "another device"
        return base if index < 0 else f"{base}:{index}"
    who = ", ".join(f"rank {r}: {show(kind, index)}" for r, kind, index in bad)
    return (f"{name}: every rank's tensor must be on its process group's device ({device.type}: the rank's own "
            f"GPU under NCCL, the CPU under gloo), but {who}; move it there first "
            "(commlab.launch.device.group_device(group) names it)")


def _unsupported_message(name: str, bad: list[tuple[int, int]]) -> str:
    who = ", ".join(f"rank {r}: {_dtype_name(code)}" for r, code in bad)
    dtypes = _dtype_name(bad[0][1])
    return (f"{name}: dtype torch.{dtypes} is not supported ({who}); use one of "
            f"{[str(d).replace('torch.', '') for d in SUPPORTED_DTYPES]}")


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
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be an int >= 1 (ranks), got {n!r}")
    for name, v in rates.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def check_counts(**counts: int) -> None:
    """Raise ``ValueError`` naming the first count (nodes, devices, NICs, ...) that is not an int >= 1."""
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


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


def check_same_layout(name: str, layout: Sequence[tuple], group: dist.ProcessGroup | None,
                      what: str = "layouts", advice: str = "build the same model on every rank") -> None:
    """Make every rank of ``group`` agree on a list of records (a model's parameter names, shapes and dtypes, a
    sharding's sizes), or all raise the same :class:`CollectiveMismatchError`.

    The layout check of what holds *many* tensors (a sharded model), where :func:`check_agreement` checks one
    tensor: one ``all_gather_object`` of every rank's records (a few hundred bytes per parameter, once at
    construction). The message names the first rank that differs from group rank 0, the first record where
    it does and, if their numbers differ, both counts, identically on every rank, since every rank compares the
    same gathered lists. A rank whose arguments are invalid can send a record saying so instead of its layout,
    so that the others raise rather than wait for it.

    Args:
        name: who checks, for messages (e.g. ``"ShardedDataParallel"``).
        layout: this rank's records, each a tuple of plain values (str, int, tuple), e.g.
            ``("0.weight", (17, 64), "float64")``.
        group: the process group (None: the world).
        what: what the records are, for messages.
        advice: what to do, for messages.

    Raises:
        CollectiveMismatchError: some rank's records differ from group rank 0's (on every rank).
        RuntimeError: this rank is not a member of ``group``.
    """
    size, _ = group_size_and_rank(group, name)
    mine = [tuple(r) for r in layout]
    if size == 1:
        return
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    ref = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs == ref:
            continue
        first = next((i for i, (a, b) in enumerate(zip(ref, theirs)) if a != b), None)
        counts = f"{len(theirs)} entries on group rank {r}, {len(ref)} on group rank 0"
        if first is not None:
            detail = f"group rank {r} has {theirs[first]} where group rank 0 has {ref[first]}"
            if len(theirs) != len(ref):
                detail += f" ({counts})"
        else:   # one list is the other's beginning
            extra = (theirs if len(theirs) > len(ref) else ref)[min(len(ref), len(theirs))]
            detail = f"{counts}; the first entry only one of them has is {extra}"
        raise CollectiveMismatchError(f"{name}: ranks hold different {what}: {detail}; {advice}")
