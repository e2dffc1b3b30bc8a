"""Which parameters form each fragment, and at which inner step each fragment's outer sync is sent and lands.

:func:`split_fragments` cuts a model's parameter list into contiguous groups of about equal element counts (layers
that sit together sync together); :func:`fragment_schedule` is Streaming DiLoCo's staggered schedule, one
:class:`FragmentSync` per fragment and cycle. Steps count inner optimizer steps from 1.

Book: chapter 8b, §8b.3 (the schedules drawn); the lab asks to predict them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from commlab import checks

__all__ = ["FragmentSync", "fragment_schedule", "split_fragments", "check_schedule"]


@dataclasses.dataclass(frozen=True)
class FragmentSync:
    """One outer sync of one fragment.

    Attributes:
        fragment: the fragment's index (0-based).
        send_step: the inner step after which its pseudo-gradient is taken and its outer AllReduce starts.
        apply_step: the inner step after which the averaged pseudo-gradient is applied (``send_step + tau``).
    """

    fragment: int
    send_step: int
    apply_step: int


def check_schedule(inner_steps: int, fragments: int, sync_delay: int, where: str = "fragment_schedule") -> int:
    """Check H, F and tau together; return the period ``H / F`` (inner steps between two fragments' syncs).

    Raises:
        ValueError: ``inner_steps < 1``; ``fragments < 1`` or not dividing ``inner_steps``; ``sync_delay`` outside
            ``0 .. H/F - 1`` (a fragment's sync must land before the next fragment's is sent, as torchft requires).
    """
    h = checks.integer("inner_steps", inner_steps, where=where, note="H, inner steps between two syncs of a fragment")
    f = checks.integer("fragments", fragments, where=where)
    if h % f:
        checks.fail("inner_steps", h, f"a multiple of fragments={f}", where=where,
                    note="each fragment syncs once every H steps, one every H/F steps")
    period = h // f
    checks.integer("sync_delay", sync_delay, 0, period - 1, where=where,
                   note=f"tau must stay below H/F = {period}: a fragment's sync lands before the next is sent")
    return period


def fragment_schedule(inner_steps: int, fragments: int = 1, sync_delay: int = 0,
                      cycles: int = 1) -> tuple[FragmentSync, ...]:
    """Streaming DiLoCo's staggered schedule over ``cycles`` cycles of H inner steps.

    Fragment ``p`` (0-based) of cycle ``c`` lands after inner step ``c H + (p + 1) H / F`` and is sent
    ``sync_delay`` (tau) steps earlier; so every fragment syncs once every H steps and one fragment every H/F steps,
    as torchft's ``DiLoCo`` (``sync_every=H``, ``fragment_sync_delay=tau``) and Douillard et al. 2025
    (arXiv:2501.18512) schedule it. F = 1, tau = 0 is DiLoCo (arXiv:2311.08105): one sync after every H steps.

    Returns:
        :class:`FragmentSync` tuples in the order they land.

    Raises:
        ValueError: as :func:`check_schedule`; ``cycles < 1``.
    """
    period = check_schedule(inner_steps, fragments, sync_delay)
    checks.integer("cycles", cycles, where="fragment_schedule")
    out = []
    for c in range(cycles):
        for p in range(fragments):
            land = c * inner_steps + (p + 1) * period
            out.append(FragmentSync(p, land - sync_delay, land))
    return tuple(out)


def split_fragments(params: Sequence[torch.Tensor], fragments: int) -> list[list[int]]:
    """Cut ``params`` (in model order) into ``fragments`` contiguous groups of about equal element counts.

    Returns:
        ``fragments`` lists of indices into ``params``, each non-empty, in order; the cut before group ``k``
        is the tensor boundary nearest to ``k / fragments`` of the elements.

    Raises:
        ValueError: no ``params``; ``fragments`` outside ``1 .. len(params)``.
    """
    n = len(params)
    if n == 0:
        checks.fail("params", list(params), "at least one tensor", where="split_fragments")
    checks.integer("fragments", fragments, 1, n, where="split_fragments",
                   note=f"at most the number of parameter tensors, {n}")
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    ends = [0]
    for s in sizes:
        ends.append(ends[-1] + s)
    cuts = [0]
    for k in range(1, fragments):
        target = total * k / fragments
        lo, hi = cuts[-1] + 1, n - (fragments - k)  # leave at least one tensor on each side
        cut = min(range(lo, hi + 1), key=lambda i: (abs(ends[i] - target), i))
        cuts.append(cut)
    cuts.append(n)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]
