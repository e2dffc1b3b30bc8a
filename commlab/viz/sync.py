"""Streaming DiLoCo's fragment schedule as a picture: fragments on rows, inner steps on x.

Input: the :class:`commlab.sync.FragmentSync` tuples of :func:`commlab.sync.fragment_schedule` (or
``DiLoCo.schedule``). Each sync is a bar from its send step to its apply step (the tau inner steps its outer
AllReduce is in flight), with a dot where the outer step lands; every inner step is a tick. Book: the chapter on
syncing less often.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["plot_fragment_schedule"]


def plot_fragment_schedule(schedule: Sequence, inner_steps: int, ax=None, title: str | None = None):
    """Draw ``schedule`` (FragmentSync tuples) over the steps it spans; returns the matplotlib Figure.

    Args:
        schedule: FragmentSync(fragment, send_step, apply_step) tuples, steps counted from 1.
        inner_steps: H, drawn as dashed lines at each multiple (the end of a cycle).
        ax: an Axes to draw on (a new figure when None). title: the Axes' title.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * (1 + max(s.fragment for s in schedule))))
    fragments = 1 + max(s.fragment for s in schedule)
    last = max(s.apply_step for s in schedule)
    for s in schedule:
        y = s.fragment
        color = f"C{s.fragment % 10}"
        if s.apply_step > s.send_step:
            ax.barh(y, s.apply_step - s.send_step, left=s.send_step, height=0.5, color=color, alpha=0.35)
        ax.plot([s.send_step], [y], ">", color=color, ms=7)
        ax.plot([s.apply_step], [y], "o", color=color, ms=7)
    for c in range(inner_steps, last + 1, inner_steps):
        ax.axvline(c, color="0.5", ls="--", lw=0.8)
    ax.set_xlim(0, last + 1)
    ax.set_xticks(range(0, last + 1, max(1, (last + 1) // 16)))
    ax.set_yticks(range(fragments), [f"fragment {p}" for p in range(fragments)])
    ax.set_ylim(fragments - 0.5, -0.5)
    ax.set_xlabel("inner step (▶ send: the outer AllReduce starts; ● apply: the outer step lands)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    return ax.figure
