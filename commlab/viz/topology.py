"""Pictures of the hardware the collectives run on: a node's GPUs, NVSwitch and NICs, the rails between
nodes, and the switch tree of an in-network (SHARP) reduction.

Drawn from the same objects the cost models use: a :class:`commlab.topology.cluster.Cluster` preset
(``commlab/data/clusters.json``) and the fat-tree model of :mod:`commlab.collectives.in_network`.
"""

from __future__ import annotations

import math

from commlab.collectives.in_network import fat_tree_down_ports, switch_tree_levels
from commlab.topology.cluster import Cluster

__all__ = ["plot_node_rails", "switch_tree", "plot_switch_tree"]


def _gb(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.0f} GB/s"


def plot_node_rails(cluster: Cluster):
    """Two nodes of ``cluster``, mirrored: each GPU linked to its node's NVSwitch and to a NIC, NIC i of
    both nodes on rail switch i (the rail-optimised fabric NCCL's multi-rail rings use).

    The GPU and NIC counts and the link rates in the labels come from the cluster
    (``devices_per_node``, ``nics_per_node``, ``intra.bytes_per_s``, ``inter.bytes_per_s``). NICs are
    shared evenly when a node has fewer NICs than GPUs (GPU g uses NIC ``g * nics // gpus``).

    Returns:
        The Figure. Its axes hold one line (``Line2D``) per link: ``2 * (gpus + gpus + nics)`` --
        GPU-NVSwitch, GPU-NIC and NIC-rail switch.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    g, k = cluster.devices_per_node, cluster.nics_per_node
    width = max(g, k)
    fig, ax = plt.subplots(figsize=(min(6.8, 0.85 * width + 0.9), 5.2))

    def box(x, y, w, h, text, fc, fontsize=9):
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.03", fc=fc, ec="black",
                                    lw=0.8, zorder=3))
        ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, zorder=4)

    def link(x0, y0, x1, y1, **kw):
        ax.plot([x0, x1], [y0, y1], zorder=1, **kw)

    nic_x = [(j + 0.5) * g / k - 0.5 for j in range(k)]
    rail_x = nic_x  # rail j sits between NIC j of the two nodes
    for n, sign in ((0, 1), (1, -1)):
        def yy(v):
            return sign * v
        ax.add_patch(FancyBboxPatch((-0.5, min(yy(0.75), yy(3.35))), g, 2.6, boxstyle="round,pad=0.02",
                                    fill=False, ec="grey", ls="--", lw=0.8))
        ax.text(-0.45, yy(3.2), f"node {n}", fontsize=9, va="center")
        box((g - 1) / 2, yy(2.85), g - 0.3, 0.4, f"NVSwitch: {_gb(cluster.intra.bytes_per_s)} per GPU per direction",
            "#e8e8e8")
        for d in range(g):
            link(d, yy(2.05), d, yy(2.65), color="tab:green", lw=1.6)
            link(d, yy(1.75), nic_x[d * k // g], yy(1.2), color="tab:blue", lw=1)
            box(d, yy(1.9), 0.78, 0.32, f"GPU {n * g + d}", "#c9e4c5", fontsize=9 if g <= 8 else 7)
        for j in range(k):
            box(nic_x[j], yy(1.05), 0.78, 0.3, f"NIC {j}", "#cfe0f3")
            link(nic_x[j], yy(0.9), rail_x[j], yy(0.2), color="tab:blue", lw=0.9)
    for j in range(k):
        box(rail_x[j], 0, min(0.9, 0.9 * g / k), 0.34, f"rail {j}", "#f6dcc9")
    ax.set_title(f"{cluster.name}: {g} GPUs, {k} NICs per node; NVLink (green), network (blue) "
                 f"{_gb(cluster.inter.bytes_per_s)} per NIC per direction", fontsize=9, wrap=True)
    ax.set_xlim(-0.6, g - 0.4)
    ax.set_ylim(-3.5, 3.5)
    ax.axis("off")
    fig.tight_layout()
    return fig


def switch_tree(n: int, radix: int) -> list[list[int]]:
    """The reduction tree of an in-network AllReduce over ``n`` endpoints on ``radix``-port switches.

    The smallest fat tree that joins them (:func:`~commlab.collectives.in_network.switch_tree_levels`,
    :func:`~commlab.collectives.in_network.fat_tree_down_ports`), pruned to the switches the reduction
    uses: level 0 (the leaves) takes ``radix/2`` endpoints each (``radix`` if it is the top), each higher
    level joins as many switches of the level below as it has down ports.

    Returns:
        ``parents[level][i]``: the index, one level up, of switch i of that level; level 0's list
        maps endpoints to leaves (so ``len(result) = levels + 1``, the last list has one entry per
        top switch, all ``-1``).

    Raises:
        ValueError: as :func:`~commlab.collectives.in_network.switch_tree_levels`.
    """
    levels = switch_tree_levels(n, radix)
    down = fat_tree_down_ports(radix, levels)
    parents, count = [], n
    for k in down:
        parents.append([i // k for i in range(count)])
        count = math.ceil(count / k)
    parents.append([-1] * count)
    return parents


def plot_switch_tree(n: int = 8, radix: int = 4):
    """The switch tree an in-network (SHARP) AllReduce climbs over ``n`` endpoints of ``radix``-port
    switches: each endpoint sends its M bytes up once and receives the sum once; each switch adds what
    arrives from below.

    Returns:
        The Figure: one up arrow and one down arrow (``FancyArrowPatch``) per edge of
        :func:`switch_tree`, i.e. ``2 * (endpoints + switches - top switches)`` arrows.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    parents = switch_tree(n, radix)
    levels = len(parents) - 1
    fig, ax = plt.subplots(figsize=(min(6.8, 0.75 * n + 1.0), 1.2 + 1.05 * levels))
    xs = [[float(i) for i in range(n)]]
    for lev in range(1, levels + 1):
        count = len(parents[lev])
        xs.append([sum(x for x, p in zip(xs[-1], parents[lev - 1]) if p == i) /
                   max(1, parents[lev - 1].count(i)) for i in range(count)])

    def y(lev):
        return 1.1 * lev

    for lev in range(levels):
        for i, p in enumerate(parents[lev]):
            (x0, y0), (x1, y1) = (xs[lev][i], y(lev)), (xs[lev + 1][p], y(lev + 1))
            for a, b, color, off in (((x0, y0), (x1, y1), "tab:red", -0.07), ((x1, y1), (x0, y0), "tab:blue", 0.07)):
                ax.add_patch(FancyArrowPatch((a[0] + off, a[1]), (b[0] + off, b[1]), arrowstyle="-|>",
                                             mutation_scale=8, color=color, lw=1, shrinkA=9, shrinkB=9))
    for i, x in enumerate(xs[0]):
        ax.add_patch(FancyBboxPatch((x - 0.32, -0.16), 0.64, 0.32, boxstyle="round,pad=0.02", fc="#c9e4c5", ec="k",
                                    lw=0.8, zorder=3))
        ax.text(x, 0, f"node {i}", ha="center", va="center", fontsize=8, zorder=4)
    for lev in range(1, levels + 1):
        for i, x in enumerate(xs[lev]):
            ax.add_patch(FancyBboxPatch((x - 0.42, y(lev) - 0.16), 0.84, 0.32, boxstyle="round,pad=0.02",
                                        fc="#f6dcc9", ec="k", lw=0.8, zorder=3))
            ax.text(x, y(lev), f"switch {'+' if lev < levels else 'top'}", ha="center", va="center", fontsize=8,
                    zorder=4)
    ax.set_title(f"{n} nodes, {radix}-port switches, {levels} levels:\nred = M bytes up (summed in each switch), "
                 "blue = the sum down", fontsize=9)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(-0.35, y(levels) + 0.35)
    ax.axis("off")
    fig.tight_layout()
    return fig
