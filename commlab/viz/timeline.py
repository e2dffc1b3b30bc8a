"""Where the time of one training step goes, stage by stage: the planner's step timeline as a figure.

Input: a :class:`commlab.parallel.planner.timeline.StepTimeline` (:func:`~commlab.parallel.planner.timeline.
step_timeline`). One row per pipeline stage, stage 0 on top: the compute stream as full-height bars, one
colour per kind (forward, backward, recomputation, the compute's slowdown while communication runs beside
it, exposed TP, the sender's pipeline stall, the wait for a message in flight, exposed DP, optimizer,
bubble, idle until the slowest stage is done), and under it a thin strip of the communication that runs
beside compute (hidden TP, hidden pipeline sends, overlapped DP).
"""

from __future__ import annotations

__all__ = ["plot_step_timeline", "KIND_COLORS", "KIND_LABELS"]

#: Colour of each interval kind (:data:`commlab.parallel.planner.timeline.KINDS`).
KIND_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "#9ecae1", "slowdown": "#dbdb8d",
               "tp": "tab:purple", "pp_send": "tab:red", "pp_recv": "#f4a6a6", "dp_reduce_scatter": "tab:green",
               "dp_all_gather": "#98df8a", "optimizer": "tab:brown", "bubble": "0.82", "idle": "0.93"}

#: Legend text of each kind.
KIND_LABELS = {"forward": "forward", "backward": "backward", "recompute": "recompute",
               "slowdown": "slowed by overlap", "tp": "TP comm.", "pp_send": "PP send", "pp_recv": "PP recv wait",
               "dp_reduce_scatter": "DP ReduceScatter", "dp_all_gather": "DP AllGather", "optimizer": "optimizer",
               "bubble": "bubble", "idle": "idle (step end)"}


def plot_step_timeline(timeline, ax=None, title: str | None = None, width_in: float = 6.88):
    """Draw a step timeline, one row per pipeline stage; returns the matplotlib Figure.

    Args:
        timeline: a :class:`~commlab.parallel.planner.timeline.StepTimeline`.
        ax: an Axes to draw into (None: a new figure ``width_in`` wide, sized to the stages).
        title: the title; default names the layout (if known), the schedule and the step time.
        width_in: figure width, inches; 6.88 in at 100 dpi is the book's 688 px column, so the 9 pt text is
            not shrunk.

    Times are seconds from the step's start. Only the kinds present appear in the legend.

    Raises:
        ValueError: a timeline without intervals.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timeline.intervals:
        raise ValueError("plot_step_timeline needs a recorded timeline (step_timeline(..., record=True))")
    p = timeline.pp
    if ax is None:
        fig, ax = plt.subplots(figsize=(width_in, 0.24 * p + 2.2), dpi=100)
    else:
        fig = ax.figure
    present = set()
    for kind in KIND_COLORS:
        for lane, (dy, h) in (("compute", (-0.42, 0.62)), ("comm", (0.24, 0.18))):
            by_stage: dict[int, list] = {}
            for iv in timeline.intervals:
                if iv.kind == kind and iv.lane == lane and iv.duration_s > 0:
                    by_stage.setdefault(iv.stage, []).append((iv.start_s, iv.duration_s))
            for s, xs in by_stage.items():
                ax.broken_barh(xs, (s + dy, h), facecolors=KIND_COLORS[kind], edgecolors="none")
            if by_stage:
                present.add(kind)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in range(p)], fontsize=9)
    ax.set_ylim(p - 0.5, -0.6)
    ax.set_xlim(0, timeline.step_s)
    ax.set_xlabel("time from the start of the step (s)", fontsize=9)
    ax.tick_params(axis="x", labelsize=9)
    handles = [Patch(color=KIND_COLORS[k], label=KIND_LABELS[k]) for k in KIND_COLORS if k in present]
    if title is None:
        name = timeline.layout.short() if timeline.layout is not None else f"p = {p}"
        title = f"{name}, {timeline.schedule}: step {timeline.step_s:.2f} s (thin strip: overlapped comm.)"
    ax.set_title(title, fontsize=9)
    rows = -(-len(handles) // 4)
    legend_in = 0.22 * rows + 0.1
    ax.figure.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, legend_in / fig.get_size_inches()[1], 1, 1))
    return fig
