"""Pipeline timelines: one row per stage, forwards and backwards as bars, the bubble as the grey between.

The same drawing serves the ideal schedule (:func:`commlab.parallel.pipeline.ideal_timeline`, unit = one
forward) and a measured one (:attr:`commlab.parallel.pipeline.PipelineResult.timeline`, seconds), so the
book can put the model and the measurement side by side.
"""

from __future__ import annotations

from typing import Sequence

from commlab.parallel.pipeline.schedules import FORWARD, TimedOp, idle_fraction

__all__ = ["plot_timeline"]

_COLORS = {"F": "tab:blue", "B": "tab:orange"}


def plot_timeline(timeline: Sequence[TimedOp], ax=None, title: str | None = None, unit: str = "s",
                  label_microbatches: bool = True):
    """Draw a pipeline timeline; returns the matplotlib Figure.

    Args:
        timeline: ops with start/end (ideal or measured); stages are rows, stage 0 on top.
        ax: an Axes to draw into (None: a new figure sized to the number of stages).
        title: the title; default says how many stages and micro-batches and the idle fraction.
        unit: label of the time axis (``"s"`` for measured timelines, ``"forward times"`` for ideal ones);
            measured seconds are drawn in milliseconds for readability.
        label_microbatches: write the micro-batch index into each bar wide enough to hold it.

    Every stage's row is shaded grey over the whole step first, so that the time a stage spends waiting
    (the bubble) stays grey and the compute shows in color: forward blue, backward orange.

    Raises:
        ValueError: an empty timeline.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timeline:
        raise ValueError("plot_timeline needs at least one op")
    scale, xlabel = (1e3, "time (ms)") if unit == "s" else (1.0, f"time ({unit})")
    stages = sorted({t.stage for t in timeline})
    t0 = min(t.start_s for t in timeline)
    t1 = max(t.end_s for t in timeline)
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.55 * len(stages) + 1.3))
    else:
        fig = ax.figure
    span = (t1 - t0) * scale
    for s in stages:
        y = s - 0.4
        ax.broken_barh([(0, span)], (y, 0.8), facecolors="0.88", edgecolors="none")
        for t in (t for t in timeline if t.stage == s):
            x, w = (t.start_s - t0) * scale, t.duration_s * scale
            ax.broken_barh([(x, w)], (y, 0.8), facecolors=_COLORS.get(t.kind, "tab:gray"),
                           edgecolors="white", linewidth=0.5)
            # Only label bars wide enough to read (about 1.5 % of the axis per character).
            if label_microbatches and w > 0.015 * span * len(str(t.microbatch)):
                ax.text(x + w / 2, s, str(t.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)  # stage 0 on top, as in the papers' figures
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    ax.legend(handles=[Patch(color=_COLORS["F"], label="forward"), Patch(color=_COLORS["B"], label="backward"),
                       Patch(color="0.88", label="idle (bubble)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(stages) < 3 else -0.2), ncol=3, fontsize=8,
              frameon=False)
    if title is None:
        m = sum(1 for t in timeline if t.kind == FORWARD) // len(stages)
        title = f"p = {len(stages)} stages, m = {m} micro-batches: idle fraction {idle_fraction(timeline):.2f}"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
