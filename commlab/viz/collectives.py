"""Who sends what to whom, step by step, in the AllReduce algorithms of chapters 2 and 3.

Every picture here is drawn from a *transfer list* computed by the schedule functions the collectives
themselves run (:mod:`commlab.collectives.ring`, :func:`commlab.collectives.tree.binomial_tree`,
:func:`commlab.collectives.halving_doubling.halving_steps`, :func:`commlab.collectives.hierarchical.hierarchy_layout`),
so the figure cannot disagree with the code. A transfer list is a list of steps, each
``(title, [(src, dst, label), ...])``: one arrow per message, ``label`` naming the chunk or blocks it carries.
"""

from __future__ import annotations

import math
from typing import Sequence

from commlab import checks
from commlab.collectives.halving_doubling import doubling_steps, halving_steps, power_of_two_layout, real_rank
from commlab.collectives.hierarchical import hierarchy_layout
from commlab.collectives.ring import all_gather_send_chunk, reduce_scatter_send_chunk
from commlab.collectives.tree import binomial_tree

__all__ = ["ring_transfers", "tree_transfers", "halving_doubling_transfers", "hierarchical_transfers",
           "plot_transfers", "circle_positions", "tree_positions", "line_positions", "node_grid_positions"]

Step = tuple[str, list[tuple[int, int, str]]]


def _check_n(n: int, least: int = 1) -> None:
    checks.integer("n", n, least, note="the number of ranks N")


def ring_transfers(n: int) -> list[Step]:
    """The ring AllReduce on ``n`` ranks (identity order): 2(n-1) steps of n messages, chunk ``c{i}`` each.

    From :func:`~commlab.collectives.ring.reduce_scatter_send_chunk` and
    :func:`~commlab.collectives.ring.all_gather_send_chunk`; rank p always sends to p+1 (mod n).

    Raises:
        ValueError: ``n < 2``.
    """
    _check_n(n, 2)
    steps = []
    for phase, send_chunk in (("ReduceScatter", reduce_scatter_send_chunk), ("AllGather", all_gather_send_chunk)):
        for s in range(n - 1):
            steps.append((f"{phase} step {s}", [(p, (p + 1) % n, f"c{send_chunk(p, s, n)}") for p in range(n)]))
    return steps


def tree_transfers(n: int, root: int = 0) -> list[Step]:
    """The binomial-tree AllReduce on ``n`` ranks, in rounds: the reduce, then the broadcast.

    Edges from :func:`~commlab.collectives.tree.binomial_tree`. The collective is event-driven (a rank
    sends to its parent once all its children have arrived); the round of an edge is when that happens if
    every message takes one round: a child whose relative rank has lowest set bit 2^k sends up in round k
    and receives back in broadcast round ``ceil(log2 n) - 1 - k``. Every message carries the whole vector,
    so the labels are empty.

    Raises:
        ValueError: ``n < 2`` or ``root`` outside ``0..n-1``.
    """
    _check_n(n, 2)
    depth = math.ceil(math.log2(n))
    up = [[] for _ in range(depth)]
    down = [[] for _ in range(depth)]
    for rank in range(n):
        parent, _ = binomial_tree(rank, n, root)
        if parent is None:
            continue
        v = (rank - root) % n
        k = (v & -v).bit_length() - 1
        up[k].append((rank, parent, ""))
        down[depth - 1 - k].append((parent, rank, ""))
    return ([(f"reduce, round {k}", sorted(t)) for k, t in enumerate(up)]
            + [(f"broadcast, round {k}", sorted(t)) for k, t in enumerate(down)])


def _blocks(rng: tuple[int, int]) -> str:
    lo, hi = rng
    return f"b{lo}" if hi - lo == 1 else f"b{lo}-{hi - 1}"


def halving_doubling_transfers(n: int) -> list[Step]:
    """Rabenseifner's AllReduce on ``n`` ranks: fold pre-step (if n is not a power of two), recursive
    halving, recursive doubling, unfold post-step; labels name the *blocks* each message carries
    (``b2-3`` = blocks 2 and 3 of ``p = 2^floor(log2 n)``; ``all`` = the whole vector).

    From :func:`~commlab.collectives.halving_doubling.halving_steps`,
    :func:`~commlab.collectives.halving_doubling.doubling_steps` and
    :func:`~commlab.collectives.halving_doubling.real_rank`.

    Raises:
        ValueError: ``n < 2``.
    """
    _check_n(n, 2)
    p, r = power_of_two_layout(n)
    steps: list[Step] = []
    if r:
        steps.append(("fold: even rank to odd", [(2 * i, 2 * i + 1, "all") for i in range(r)]))
    per_rank = [halving_steps(v, p) for v in range(p)]
    for s in range(len(per_rank[0])):
        d = p >> (s + 1)
        steps.append((f"halving, distance {d}",
                      [(real_rank(v, n), real_rank(per_rank[v][s][0], n), _blocks(per_rank[v][s][2]))
                       for v in range(p)]))
    per_rank = [doubling_steps(v, p) for v in range(p)]
    for s in range(len(per_rank[0])):
        steps.append((f"doubling, distance {1 << s}",
                      [(real_rank(v, n), real_rank(per_rank[v][s][0], n), _blocks(per_rank[v][s][1]))
                       for v in range(p)]))
    if r:
        steps.append(("unfold: odd rank to even", [(2 * i + 1, 2 * i, "all") for i in range(r)]))
    return steps


def hierarchical_transfers(placement: Sequence[int]) -> list[Step]:
    """The hierarchical AllReduce for ``placement[rank] = node``: ring ReduceScatter inside every node,
    ring AllReduce between nodes of each local index's chunk, ring AllGather inside every node.

    Groups from :func:`~commlab.collectives.hierarchical.hierarchy_layout`; chunk indices from the ring's
    schedule functions, as :func:`~commlab.collectives.hierarchical.hierarchical_all_reduce` runs them.
    Labels: ``c{j}`` = the j-th of d chunks (inside the node); ``c{j}.{i}`` = the i-th of ``nodes`` pieces
    of chunk j (between nodes).

    Raises:
        ValueError: as :func:`~commlab.collectives.hierarchical.hierarchy_layout`.
    """
    layout = hierarchy_layout(placement)
    nodes, d = len(layout), len(layout[0])
    steps: list[Step] = []
    for s in range(d - 1):
        steps.append((f"1. in node:\nReduceScatter step {s}",
                      [(ranks[j], ranks[(j + 1) % d], f"c{reduce_scatter_send_chunk(j, s, d)}")
                       for ranks in layout for j in range(d)]))
    for phase, send_chunk in (("ReduceScatter", reduce_scatter_send_chunk), ("AllGather", all_gather_send_chunk)):
        for s in range(nodes - 1):
            steps.append((f"2. across nodes:\n{phase} step {s}",
                          [(layout[i][j], layout[(i + 1) % nodes][j], f"c{j}.{send_chunk(i, s, nodes)}")
                           for j in range(d) for i in range(nodes)]))
    for s in range(d - 1):
        steps.append((f"3. in node:\nAllGather step {s}",
                      [(ranks[j], ranks[(j + 1) % d], f"c{all_gather_send_chunk(j, s, d)}")
                       for ranks in layout for j in range(d)]))
    return steps


def circle_positions(n: int) -> list[tuple[float, float]]:
    """Rank p at angle 90° - 360°·p/n on the unit circle: rank 0 on top, the ranks clockwise."""
    return [(math.cos(math.pi / 2 - 2 * math.pi * p / n), math.sin(math.pi / 2 - 2 * math.pi * p / n))
            for p in range(n)]


def tree_positions(n: int, root: int = 0) -> list[tuple[float, float]]:
    """Rank at x = its rank relative to ``root``, y = minus its depth in the binomial tree of
    :func:`~commlab.collectives.tree.binomial_tree` (relative ranks in order are the tree's preorder)."""
    _check_n(n)
    pos = [(0.0, 0.0)] * n
    for rank in range(n):
        v = (rank - root) % n
        pos[rank] = (float(v), -float(bin(v).count("1")))
    return pos


def line_positions(n: int) -> list[tuple[float, float]]:
    """The ranks in a row, rank p at x = p. With ``plot_transfers(..., bend=0.2)`` messages to a higher
    rank arc above the row and messages to a lower rank below it (halving-doubling's butterfly)."""
    _check_n(n)
    return [(float(p), 0.0) for p in range(n)]


def node_grid_positions(placement: Sequence[int]) -> list[tuple[float, float]]:
    """Each node of :func:`~commlab.collectives.hierarchical.hierarchy_layout` a row, its ranks in
    local-index order along it."""
    pos = [(0.0, 0.0)] * len(placement)
    for i, ranks in enumerate(hierarchy_layout(placement)):
        for j, rank in enumerate(ranks):
            pos[rank] = (1.6 * j, -1.6 * i)
    return pos


def plot_transfers(steps: Sequence[Step], positions: Sequence[tuple[float, float]], *, ncols: int = 4,
                   title: str = "", panel_inches: float = 1.75, node_labels: Sequence[str] | None = None,
                   groups: Sequence[Sequence[int]] = (), bend: float = 0.12):
    """One panel per step: the ranks as circles at ``positions``, one arrow per message, labelled.

    Args:
        steps: a transfer list (``(title, [(src, dst, label), ...])`` per step).
        positions: (x, y) of each rank.
        ncols: panels per row (the grid keeps each panel readable at a 688 px text column).
        title: figure title.
        panel_inches: width of one panel, inches (all text is 9 pt; keep ``ncols * panel_inches`` at most
            6.9 so that the figure is not shrunk at the 688 px column).
        node_labels: text inside each rank's circle (default: the rank).
        groups: sets of ranks to outline together (the nodes of a hierarchical AllReduce).
        bend: curvature of the arrows (``arc3`` radius); a pair sending both ways bends twice as much.

    Returns:
        The Figure; ``fig.axes[i]`` holds step i's arrows as ``FancyArrowPatch`` es, one per message, and
        its non-empty labels as texts, so that tests can count them against the schedule.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch

    n = len(positions)
    labels = list(node_labels) if node_labels is not None else [str(p) for p in range(n)]
    rows = math.ceil(len(steps) / ncols)
    cols = min(ncols, len(steps))
    xs = [x for x, _ in positions]
    ys = [y for _, y in positions]
    pad = 0.45
    width = max(xs) - min(xs) + 2 * pad
    # Circles a fixed share of the panel, so fonts fit whatever the layout's units.
    radius = min(0.3, 0.066 * width)
    pad = max(pad, radius + 0.15)

    def curvature(sends, s, d):
        return 2 * bend if any(a == d and b == s for a, b, _ in sends) else bend

    # Room above and below for the arcs (a row of ranks has nothing else to give it height).
    sagitta = max((curvature(sends, s, d) * math.dist(positions[s], positions[d]) / 2
                   for _, sends in steps for s, d, _ in sends), default=0.0)
    pad_y = max(pad, sagitta + 0.3)
    width, height = max(xs) - min(xs) + 2 * pad, max(ys) - min(ys) + 2 * pad_y
    title_lines = max(name.count("\n") + 1 for name, _ in steps)
    fig, axes = plt.subplots(rows, cols, squeeze=False,
                             figsize=(panel_inches * cols,
                                      rows * (panel_inches * height / width + 0.2 * title_lines + 0.1)
                                      + (0.35 if title else 0)))
    # Arrows stop at the circles' edges: the radius in points, from the panel's width in data units.
    shrink = radius * 72 * panel_inches * 0.9 / width
    for i, ax in enumerate(axes.flat):
        ax.set_xlim(min(xs) - pad, max(xs) + pad)
        ax.set_ylim(min(ys) - pad_y, max(ys) + pad_y)
        ax.set_aspect("equal")
        ax.axis("off")
        if i >= len(steps):
            fig.delaxes(ax)  # the grid's unused cells: fig.axes holds exactly one panel per step
            continue
        name, sends = steps[i]
        ax.set_title(name, fontsize=9)
        for g in groups:
            gx = [positions[p][0] for p in g]
            gy = [positions[p][1] for p in g]
            m = radius + 0.12
            ax.add_patch(FancyBboxPatch((min(gx) - m, min(gy) - m), max(gx) - min(gx) + 2 * m,
                                        max(gy) - min(gy) + 2 * m, boxstyle="round,pad=0.02",
                                        fill=False, ls="--", lw=0.8, ec="grey"))
        for p, (x, y) in enumerate(positions):
            ax.add_patch(Circle((x, y), radius, fc="#dbe9f6", ec="#1f4e79", lw=1, zorder=3))
            ax.text(x, y, labels[p], ha="center", va="center", fontsize=9, zorder=4)
        # Two messages between the same pair in opposite directions (halving-doubling) bend apart.
        for s, d, label in sends:
            (x0, y0), (x1, y1) = positions[s], positions[d]
            curve = curvature(sends, s, d)
            ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle=f"arc3,rad={curve}",
                                         arrowstyle="-|>", mutation_scale=9, lw=1.1, color="tab:red",
                                         shrinkA=shrink, shrinkB=shrink, zorder=2))
            # The label sits beside the arrow's middle, pushed to the side it bends towards.
            mx, my = (x0 + x1) / 2, (y0 + y1) / 2
            dx, dy = x1 - x0, y1 - y0
            norm = math.hypot(dx, dy) or 1.0
            off = curve * norm * 0.5  # on the arc itself, over a white box
            if not label:
                continue
            ax.text(mx + dy / norm * off, my - dx / norm * off, label, ha="center", va="center", fontsize=9,
                    color="tab:red", zorder=5,
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.85))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
