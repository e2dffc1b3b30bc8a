"""Do all ranks hold the same X? One helper, :func:`agree`, and one error, :class:`CollectiveMismatchError`.

Before ranks move data together they must agree on what they move (element counts, dtypes, ring orders,
model layouts, pipeline schedules, payload formats). :func:`agree` gathers a small description from every
rank (:func:`gather`: one all-gather of fixed-width int64 rows, or one ``all_gather_object``), and every rank
raises the same :class:`CollectiveMismatchError`, naming the ranks that differ and what they hold, so that
no rank waits in a later collective for a peer that has already given up. :func:`check_agreement` is the
hand-written collectives' use of it (one tensor's count, dtype, device and layout).
Chapter 3, section 3.10, shows one at work: an AllToAllV whose split sizes disagree is refused on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from commlab.collectives.common import (DTYPE_CODE, SUPPORTED_DTYPES, all_gather_single, dtype_name,
                                         group_size_and_rank)
from commlab.launch.device import group_device

__all__ = ["CollectiveMismatchError", "agree", "gather", "first_difference", "check_agreement"]


class CollectiveMismatchError(ValueError):
    """Ranks called the same operation with arguments that must agree but do not (tensors, ring orders, model
    layouts, schedules, payloads).

    Every rank raises it, with the same message, naming what each rank passed.
    """


def gather(mine: Any, group: dist.ProcessGroup | None = None, *, ints: bool = False) -> list:
    """Every rank's ``mine``, in group-rank order (a group of one: ``[mine]``, nothing sent).

    Args:
        mine: this rank's value. With ``ints=True`` a sequence of ints that fit in int64, of the same length
            on every rank; otherwise anything picklable.
        group: the process group (None: the world).
        ints: move ``mine`` as one all-gather of int64 on the group's device (one latency; rows come back as
            lists of ints) instead of ``all_gather_object`` (pickled, two latencies).

    Raises:
        RuntimeError: this rank is not a member of ``group``, or torch.distributed is not initialised.
    """
    size, _ = group_size_and_rank(group)
    if size == 1:
        return [list(mine) if ints else mine]
    if not ints:
        everyone: list = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        return everyone
    # On the group's device: the rank's own GPU under NCCL (a bare .cuda() would be GPU 0 on every rank
    # unless the launcher had bound the device), the CPU under gloo.
    row = torch.tensor(list(mine), dtype=torch.int64, device=group_device(group))
    rows = torch.empty(size * row.numel(), dtype=torch.int64, device=row.device)
    all_gather_single(rows, row, group=group)
    return rows.view(size, row.numel()).cpu().tolist()


def agree(name: str, mine: Any, group: dist.ProcessGroup | None = None, *, what: str = "arguments",
          problem: str | None = None, ints: bool = False, show: Callable[[Any], str] = repr,
          differ: Callable[[list], str | None] | None = None, advice: str = "", rank_word: str = "rank") -> list:
    """Make every rank of ``group`` hold the same ``mine``, or raise the same error on every rank.

    Every rank's value is gathered (:func:`gather`), together with whether it found a ``problem`` with its own
    arguments. Then, identically on every rank: if some rank had a problem, all raise naming it (and the
    rank); else if the values differ, all raise naming what each rank holds. Every rank of the group must call
    it, with a value of the same kind.

    Args:
        name: who checks, for messages (e.g. ``"build_mesh"``).
        mine: this rank's description (see :func:`gather` for ``ints``).
        group: the process group (None: the world).
        what, show: what the values are ("ranks hold different <what>"); how to print one rank's value.
        problem: this rank's own verdict on its arguments (None if valid).
        ints: the transport, as for :func:`gather` (problems then travel in a second exchange, on failure).
        differ: replaces the equality test: a function of every rank's value, in group-rank order, that
            returns a sentence saying what is wrong (raised as this error) or None; it may raise its own.
        advice: what to do, appended to the default message.
        rank_word: how messages call a group rank ("stage" for a pipeline group).

    Returns:
        Every rank's value, in group-rank order.

    Raises:
        CollectiveMismatchError: a rank had a problem, or the ranks' values differ (or ``differ`` said so).
    """
    if ints:
        rows = gather([*mine, int(problem is None)], group, ints=True)
        values, failed = [row[:-1] for row in rows], [r for r, row in enumerate(rows) if not row[-1]]
        problems = gather(problem, group) if failed else []
    else:
        pairs = gather((mine, problem), group)
        values, problems = [v for v, _ in pairs], [p for _, p in pairs]
        failed = [r for r, p in enumerate(problems) if p is not None]
    if failed:
        if len(failed) == len(values) and len(set(problems)) == 1:
            raise CollectiveMismatchError(f"{name}: {problems[0]} (on every {rank_word})")
        raise CollectiveMismatchError(f"{name}: " + "; ".join(f"{rank_word} {r}: {problems[r]}" for r in failed))
    if differ is not None:
        verdict = differ(values)
    elif any(v != values[0] for v in values[1:]):
        held = "; ".join(f"{rank_word} {r}: {show(v)}" for r, v in enumerate(values))
        verdict = f"ranks hold different {what} ({held})" + (f"; {advice}" if advice else "")
    else:
        verdict = None
    if verdict:
        raise CollectiveMismatchError(f"{name}: {verdict}")
    return values


def first_difference(values: list[Sequence], what: str, advice: str, rank_word: str = "group rank") -> str | None:
    """A ``differ`` for :func:`agree` over lists of records (a model's parameter names, shapes and dtypes): the
    first rank whose list differs from rank 0's, its first differing record and, if the lengths differ, both
    counts; None when all lists are equal."""
    ref = list(values[0])
    for r, theirs in enumerate(values[1:], start=1):
        theirs = list(theirs)
        if theirs == ref:
            continue
        first = next((i for i, (a, b) in enumerate(zip(ref, theirs)) if a != b), None)
        counts = f"{len(theirs)} entries on {rank_word} {r}, {len(ref)} on {rank_word} 0"
        if first is not None:
            detail = f"{rank_word} {r} has {theirs[first]} where {rank_word} 0 has {ref[first]}"
            if len(theirs) != len(ref):
                detail += f" ({counts})"
        else:   # one list is the other's beginning
            extra = (theirs if len(theirs) > len(ref) else ref)[min(len(ref), len(theirs))]
            detail = f"{counts}; the first entry only one of them has is {extra}"
        return f"ranks hold different {what}: {detail}; {advice}"
    return None


def check_agreement(name: str, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                    layout: Sequence[int] = (), layout_name: str = "ring order",
                    layout_problem: str | None = None, layout_rule: str = "", *, same_numel: bool = True,
                    layout_verdict: Callable[[list[tuple[int, ...]]], str | None] | None = None) -> None:
    """Make every rank of ``group`` agree on element count, dtype and layout, or all raise the same error.

    One :func:`agree` over ``7 + len(layout)`` int64 per rank (one latency). Without it a size mismatch
    hangs the point-to-point phases or silently mixes chunk boundaries, and a problem found on one rank
    only leaves the others waiting. A non-empty tensor must be on the group's device
    (:func:`commlab.launch.device.group_device`: the rank's GPU under NCCL, the CPU under gloo).

    Args:
        name, tensor, group: the collective's name (for messages), this rank's input, the process group.
        layout: what else must be identical on every rank (the ring order, the tree's root, the placement),
            as ints; the same length on every rank (callers normalise it, see :func:`resolve_ring`).
        layout_name: how messages call ``layout``.
        layout_problem: this rank's own verdict on its layout (None if valid).
        layout_rule: what a valid layout is, e.g. "a permutation of the group's ranks 0..3".
        same_numel: whether every rank must pass as many elements (False for AllToAllV).
        layout_verdict: replaces the equal-layouts test when layouts differ by rank (AllToAllV's splits):
            a pure function of every rank's layout, in group-rank order, returning what is wrong or None.

    Raises:
        TypeError: some rank's dtype is not in :data:`SUPPORTED_DTYPES` (on every rank).
        ValueError: some rank's tensor is not on the group's device, or some rank's layout is invalid (on
            every rank; a CollectiveMismatchError naming the ranks and their devices).
        CollectiveMismatchError: the ranks disagree, or ``layout_verdict`` found a problem (every rank
            raises the same message, listing what each rank passed).
    """
    size, _ = group_size_and_rank(group)
    supported = tensor.dtype in SUPPORTED_DTYPES
    device = group_device(group)
    on_device = tensor.numel() == 0 or tensor.device == device
    rule = f" must be {layout_rule}" if layout_rule else " must be valid"
    where = (-1, -1) if on_device else _device_code(tensor.device)
    mine = [tensor.numel(), DTYPE_CODE[tensor.dtype], int(supported), int(layout_problem is None), *where, *layout]

    def verdict_of(rows: list[list[int]]) -> None:
        bad_dtype = [(r, row[1]) for r, row in enumerate(rows) if not row[2]]
        if bad_dtype:
            raise TypeError(_unsupported_message(name, bad_dtype))
        bad_device = [(r, row[4], row[5]) for r, row in enumerate(rows) if row[4] >= 0]
        if bad_device:
            raise CollectiveMismatchError(_device_message(name, device, bad_device))
        rows = [row[:4] + row[6:] for row in rows]  # the layout follows the first four columns again
        bad_layout = [(r, row[4:]) for r, row in enumerate(rows) if not row[3]]
        if bad_layout and layout_problem and len(bad_layout) == size \
                and len({tuple(lay) for _, lay in bad_layout}) == 1:
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
                described = "; ".join(f"rank {r}: {row[0]} elements of {dtype_name(row[1])}"
                                      for r, row in enumerate(rows))
                parts.append(f"ranks passed incompatible tensors ({described}). Every rank of the group must "
                             "call it with the same number of elements and the same dtype.")
            elif tensors_differ:
                described = "; ".join(f"rank {r}: {dtype_name(row[1])}" for r, row in enumerate(rows))
                parts.append(f"ranks passed tensors of different dtypes ({described}). Every rank of the group must "
                             "call it with the same dtype.")
            if verdict:
                parts.append(verdict)
            if layouts_differ:
                described = "; ".join(f"rank {r}: {row[4:]}" for r, row in enumerate(rows))
                parts.append(f"ranks passed different {layout_name}s ({described}); every rank must pass the "
                             f"same {layout_name}.")
            raise CollectiveMismatchError(f"{name}: " + " ".join(parts))

    agree(name, mine, group, ints=True, differ=verdict_of)


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
    who = ", ".join(f"rank {r}: {dtype_name(code)}" for r, code in bad)
    dtypes = dtype_name(bad[0][1])
    return (f"{name}: dtype torch.{dtypes} is not supported ({who}); use one of "
            f"{[str(d).replace('torch.', '') for d in SUPPORTED_DTYPES]}")
