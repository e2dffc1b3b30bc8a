"""The profiler timeline of a data-parallel step: compute on one lane, each bucket's communication below it.

Input: the ``timeline`` of :class:`commlab.overlap.profile.OverlapProfile` (one per rank), bars in seconds
from the step's start. Forward, backward (compute, until the last gradient), the wait for the buckets and the
optimizer step share the top lane of a rank; each bucket's communication, from its launch to its completion,
is a bar on the lanes below (buckets in flight at the same time get separate lanes), labelled with its
index. Communication drawn under the backward bar is hidden; what sticks out to its right is exposed.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["plot_overlap_timeline"]

_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "wait": "tab:red", "optimizer": "tab:green"}
_COMM = "tab:purple"


def _lanes(bars) -> list[int]:
    """Greedy interval colouring: the first lane whose last bar ended before this one starts."""
    ends: list[float] = []
    lanes = []
    for b in bars:
        for i, e in enumerate(ends):
            if b.start_s >= e:
                ends[i] = b.end_s
                lanes.append(i)
                break
        else:
            ends.append(b.end_s)
            lanes.append(len(ends) - 1)
    return lanes


def plot_overlap_timeline(timelines: Sequence[Sequence], labels: Sequence[str] | None = None, ax=None,
                          title: str | None = None, show_gloo: bool = False, wait_label: str = "wait for buckets",
                          comm_label: str = "bucket launch → done"):
    """Draw one or more step timelines, one block of lanes per timeline; returns the matplotlib Figure.

    Args:
        timelines: for each rank (or each bucket size), a sequence of :class:`commlab.overlap.profile.Interval`
            (kinds forward, backward, wait, optimizer, comm; gloo ignored unless ``show_gloo``).
        labels: a label per timeline (default ``rank 0``, ``rank 1``, ...).
        ax: an Axes to draw into (None: a new figure sized to the lanes).
        title: the figure's title.
        show_gloo: also draw gloo's worker-thread execution (``gloo:all_reduce`` events) as thin grey bars.
        wait_label, comm_label: the legend's names for the wait bars and the communication bars (a sharded
            step's timeline waits for and draws AllGathers and ReduceScatters, not buckets).

    Times are drawn in milliseconds from each step's start.

    Raises:
        ValueError: no timelines, or a timeline without bars, or labels of the wrong length.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timelines or any(len(t) == 0 for t in timelines):
        raise ValueError("plot_overlap_timeline needs at least one non-empty timeline")
    labels = list(labels) if labels is not None else [f"rank {i}" for i in range(len(timelines))]
    if len(labels) != len(timelines):
        raise ValueError(f"{len(labels)} labels for {len(timelines)} timelines")
    blocks = []
    for tl in timelines:
        comm = sorted((b for b in tl if b.kind == "comm"), key=lambda b: b.start_s)
        lanes = _lanes(comm)
        blocks.append((tl, comm, lanes, 1 + (max(lanes) + 1 if lanes else 0)))
    rows = sum(n for *_, n in blocks)
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.42 * rows + 1.6))
    else:
        fig = ax.figure
    y, yticks, ylabels = 0.0, [], []
    span = max(b.end_s for tl in timelines for b in tl) * 1e3
    for (tl, comm, lanes, n), label in zip(blocks, labels):
        for b in tl:
            if b.kind in _COLORS:
                ax.broken_barh([(b.start_s * 1e3, max(b.duration_s * 1e3, span * 0.002))], (y - 0.4, 0.8),
                               facecolors=_COLORS[b.kind], edgecolors="white", linewidth=0.5)
        if show_gloo:
            for b in (b for b in tl if b.kind == "gloo"):
                ax.broken_barh([(b.start_s * 1e3, b.duration_s * 1e3)], (y + 0.45, 0.12), facecolors="0.5")
        yticks.append(y)
        ylabels.append(f"{label}: compute")
        for b, lane in zip(comm, lanes):
            yy = y + 1 + lane
            w = max(b.duration_s * 1e3, span * 0.002)
            ax.broken_barh([(b.start_s * 1e3, w)], (yy - 0.35, 0.7), facecolors=_COMM, edgecolors="white",
                           linewidth=0.5, alpha=0.85)
            if w > 0.02 * span:
                ax.text(b.start_s * 1e3 + w / 2, yy, b.label or str(b.bucket), ha="center", va="center", fontsize=7,
                        color="white")
        for lane in range(n - 1):
            yticks.append(y + 1 + lane)
            ylabels.append("comm" if lane == 0 else "")
        y += n + 0.5
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_ylim(y - 0.5 + 0.1, -0.7)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time from the start of the step (ms)")
    handles = [Patch(color=c, label=k if k != "wait" else wait_label) for k, c in _COLORS.items()]
    handles.append(Patch(color=_COMM, label=comm_label))
    if show_gloo:
        handles.append(Patch(color="0.5", label="gloo worker thread"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 1.2 / (rows + 4)), ncol=5,
              fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
