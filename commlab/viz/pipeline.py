"""Pipeline timelines: one row per stage, forwards and backwards as bars, the bubble as the grey between.

The same drawing serves the ideal schedule (:func:`commlab.parallel.pipeline.ideal_timeline`, unit = one
forward) and a measured one (:attr:`commlab.parallel.pipeline.PipelineResult.timeline`, seconds), so the
book can put the model and the measurement side by side. Interleaved schedules hatch the bars of chunks
1, 2, ... (chunk 0 plain); zero-bubble schedules draw the weight gradient W in green beside the input
gradient B. :func:`plot_schedule_comparison` stacks 1F1B, interleaved 1F1B and ZB-H1 on one time axis, from
:func:`commlab.parallel.pipeline.compare_bubbles`.
"""

from __future__ import annotations

from typing import Sequence

from commlab.parallel.pipeline.schedules import FORWARD, WEIGHT, TimedOp, compare_bubbles, idle_fraction

__all__ = ["plot_timeline", "plot_schedule_comparison"]

_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
_HATCHES = ["", "///", "...", "xxx", "\\\\\\", "+++"]  # chunk 0, 1, ... of an interleaved schedule


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
    (the bubble) stays grey and the compute shows in color: forward blue, backward orange (in a zero-bubble
    schedule: input gradient B orange, weight gradient W green); chunks 1, 2, ... of an interleaved
    schedule hatched.

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
    v = 1 + max(t.chunk for t in timeline)
    split = any(t.kind == WEIGHT for t in timeline)
    for s in stages:
        y = s - 0.4
        ax.broken_barh([(0, span)], (y, 0.8), facecolors="0.88", edgecolors="none")
        for t in (t for t in timeline if t.stage == s):
            x, w = (t.start_s - t0) * scale, t.duration_s * scale
            ax.broken_barh([(x, w)], (y, 0.8), facecolors=_COLORS.get(t.kind, "tab:gray"),
                           edgecolors="white", linewidth=0.5, hatch=_HATCHES[t.chunk % len(_HATCHES)] or None)
            # Only label bars wide enough to read (about 1.5 % of the axis per character).
            if label_microbatches and w > 0.015 * span * len(str(t.microbatch)):
                ax.text(x + w / 2, s, str(t.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)  # stage 0 on top, as in the papers' figures
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    handles = [Patch(color=_COLORS["F"], label="forward"),
               Patch(color=_COLORS["B"], label="input gradient (B)" if split else "backward")]
    if split:
        handles.append(Patch(color=_COLORS["W"], label="weight gradient (W)"))
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch=_HATCHES[c], label=f"chunk {c}")
                for c in range(1, v)]
    handles.append(Patch(color="0.88", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(stages) < 3 else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    if title is None:
        m = sum(1 for t in timeline if t.kind == FORWARD) // (len(stages) * v)
        title = f"p = {len(stages)} stages, m = {m} micro-batches: idle fraction {idle_fraction(timeline):.2f}"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_schedule_comparison(p: int = 4, m: int = 8, v: int = 2):
    """1F1B, interleaved 1F1B (v chunks) and ZB-H1 for p stages and m micro-batches, one panel each on a
    common time axis (unit: one stage's forward; backward 2, split into B = W = 1 in ZB-H1), each titled with
    its step time and its bubble measured on the ideal timeline beside its source's formula
    (:func:`commlab.parallel.pipeline.compare_bubbles`). Returns the matplotlib Figure.

    Raises:
        ValueError: what the schedules raise (interleaved: p < 2 or m not a multiple of p).
    """
    import matplotlib.pyplot as plt

    rows = compare_bubbles(p, m, v)
    fig, axes = plt.subplots(len(rows), 1, figsize=(6.88, len(rows) * (0.45 * p + 1.3)))
    longest = max(r["step"] for r in rows)
    for ax, r in zip(axes, rows):
        plot_timeline(r["timeline"], ax=ax, unit="forward times",
                      title=f"{r['name']}: step {r['step']:g}, bubble {r['bubble_time_ratio']:.3f} of the compute "
                            f"(formula {r['formula']:.3f}), peak activations {r['peak_activations']:g} micro-batches")
        ax.set_xlim(0, longest)
    fig.suptitle(f"p = {p} stages, m = {m} micro-batches: the same work, three schedules", fontsize=10)
    fig.tight_layout()
    return fig
