"""Pictures for the chapter "When it goes wrong": what the overlap checker found in profiled steps.

:func:`plot_overlap_reports` draws :class:`commlab.overlap.trace.OverlapReport` objects side by side: each step's
critical path as a strip (compute, idle, and each kind of communication the step's end waited on), and each step's
communication split into the seconds hidden under compute and the seconds exposed. The straggler figure is
:func:`commlab.experiments.stragglers.plot`. Book: chapter 13b, §13b.3.
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping

from commlab import checks

__all__ = ["plot_overlap_reports", "PATH_COLORS"]

#: Colour of each critical-path label; a kind not listed gets the next colour of matplotlib's cycle.
PATH_COLORS = {"compute": "#9aa5b1", "idle": "#ffffff", "DP AllReduce": "#d62728", "TP": "#9467bd",
               "PP send/recv": "#8c564b", "ZeRO/FSDP AllGather": "#1f77b4", "ZeRO/FSDP ReduceScatter": "#17becf",
               "compressor": "#bcbd22"}


def plot_overlap_reports(reports: Mapping[str, object], title: str | None = None):
    """Draw ``reports`` (label -> OverlapReport, drawn top to bottom in their order); returns the Figure.

    Left: each step's critical path from its start, in milliseconds, one strip per report (idle hatched).
    Right: each step's communication (the union over every kind), hidden under compute and exposed, in ms, with
    the exposed share written beside the bar.

    Raises:
        ValueError: no reports, or a value that is not an OverlapReport (it has no ``critical_path``).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not reports:
        checks.fail("reports", reports, "at least one label -> OverlapReport")
    for label, r in reports.items():
        if not hasattr(r, "critical_path") or not hasattr(r, "all_comm"):
            checks.fail(f"reports[{label!r}]", type(r).__name__, "an OverlapReport (commlab.overlap.trace)")
    labels = list(reports)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 1.7 + 0.75 * len(labels)), width_ratios=(2.4, 1))
    colors = dict(PATH_COLORS)
    cycle = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    used: dict[str, str] = {}
    for i, label in enumerate(labels):
        r = reports[label]
        t0 = r.critical_path[0].start_s if r.critical_path else 0.0
        for seg in r.critical_path:
            if seg.label not in colors:
                colors[seg.label] = next(cycle)
            color = colors[seg.label]
            used[seg.label] = color
            ax.barh(i, (seg.end_s - seg.start_s) * 1e3, left=(seg.start_s - t0) * 1e3, height=0.6, color=color,
                    edgecolor="#555555" if seg.label == "idle" else "none", hatch="//" if seg.label == "idle" else None,
                    linewidth=0.5 if seg.label == "idle" else 0)
        c = r.all_comm
        bx.barh(i, c.hidden_s * 1e3, height=0.6, color="#2ca02c")
        bx.barh(i, c.exposed_s * 1e3, left=c.hidden_s * 1e3, height=0.6, color="#d62728")
        bx.text(c.total_s * 1e3, i, f"  {100 * c.exposed_fraction:.0f} % exposed", va="center", fontsize=8)
    for a in (ax, bx):
        a.set_yticks(range(len(labels)), labels)
        a.set_ylim(len(labels) - 0.5, -0.5)
    ax.set(xlabel="ms from the step's start", title=title or "what the step's end waited on (critical path)")
    bx.set(xlabel="communication (ms)", title="hidden / exposed")
    bx.set_xlim(0, 1.45 * max(reports[lab].all_comm.total_s * 1e3 for lab in labels) or 1.0)
    handles = [Patch(facecolor=col, edgecolor="#555555", hatch="//" if lab == "idle" else None, label=lab)
               for lab, col in used.items()]
    handles += [Patch(color="#2ca02c", label="hidden"), Patch(color="#d62728", label="exposed")]
    ncol = min(5, len(handles))
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=ncol, frameon=False)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, (0.15 + 0.25 * math.ceil(len(handles) / ncol)) / height, 1, 1))
    return fig
