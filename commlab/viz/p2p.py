"""Plans of grouped point-to-point messages, drawn with the outcome of NCCL's rendezvous rules.

The outcome is computed by :func:`commlab.collectives.rendezvous.simulate_rendezvous` on the very plan
that is drawn, so the picture says what the simulator says.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from commlab.collectives.rendezvous import RendezvousDeadlock, meetings, simulate_rendezvous

__all__ = ["plot_rendezvous"]


def plot_rendezvous(plans: Mapping[str, Sequence[Sequence[Any]]], panel_width: float = 4.2):
    """One panel per plan: ranks are rows, each rank's groups are boxes in posting order, lines join
    each send to the receive it meets; returns the matplotlib Figure.

    Colours: green = the group completes, red = the rank is stuck at this group, grey = never reached.
    The panel's title says whether the plan completes (and in how many rounds) or deadlocks.

    Args:
        plans: ``{title: plan}``, each plan as for :func:`~commlab.collectives.rendezvous.simulate_rendezvous`.
        panel_width: inches per panel.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plans), figsize=(panel_width * len(plans), 2.4), squeeze=False)
    for ax, (title, plan) in zip(axes[0], plans.items()):
        try:
            rounds = simulate_rendezvous(plan)
            positions = [len(groups) for groups in plan]
            outcome = f"completes in {rounds} round{'s' if rounds != 1 else ''}"
        except RendezvousDeadlock as e:
            positions = e.positions
            outcome = "deadlocks"
        width = max((len(groups) for groups in plan), default=1)
        for r, groups in enumerate(plan):
            for g, grp in enumerate(groups):
                colour = "#b7e4c7" if g < positions[r] else ("#f4a6a6" if g == positions[r] else "#dddddd")
                ax.add_patch(plt.Rectangle((g - 0.42, r - 0.3), 0.84, 0.6, facecolor=colour,
                                           edgecolor="black", lw=0.8))
                lines = [f"send {m.label}\u2192{m.dst}" for m in grp.sends]
                lines += [f"recv {m.label}\u2190{m.src}" for m in grp.recvs]
                ax.text(g, r, "\n".join(lines), ha="center", va="center", fontsize=7)
        for msg, g_send, g_recv in meetings(plan):
            ax.annotate("", xy=(g_recv, msg.dst), xytext=(g_send, msg.src),
                        arrowprops=dict(arrowstyle="->", color="tab:blue", lw=1,
                                        shrinkA=12, shrinkB=12, connectionstyle="arc3,rad=0.15"))
        ax.set_xlim(-0.6, width - 0.4)
        ax.set_ylim(len(plan) - 0.4, -0.6)
        ax.set_yticks(range(len(plan)))
        ax.set_yticklabels([f"rank {r}" for r in range(len(plan))], fontsize=8)
        ax.set_xticks(range(width))
        ax.set_xticklabels([f"group {g + 1}" for g in range(width)], fontsize=7)
        ax.set_title(f"{title}: {outcome}", fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig
