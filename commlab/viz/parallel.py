"""Pictures of 3D parallelism: a DP×TP×PP mesh laid onto nodes, and Megatron's f and g in a transformer block.

Both are drawn from the code the chapters run, so that the picture cannot drift from it:

* :func:`plot_mesh_on_nodes` colours each rank's box by its group, one panel per dimension, with the groups
  taken from :meth:`commlab.parallel.mesh.ParallelLayout.groups` and the nodes from ``node_of``; a group
  whose ranks sit on two or more nodes (:func:`commlab.parallel.mesh.cross_node_groups`) is named under its
  panel.
* :func:`plot_tp_block` walks :data:`TP_BLOCK`, the layers of :class:`commlab.parallel.ParallelSelfAttention`
  and :class:`commlab.parallel.ParallelMLP` in forward order (the test suite compares it with the modules'
  children), and puts f at the input of every :class:`ColumnParallelLinear` and g at the output of every
  :class:`RowParallelLinear`, which is where those layers call them (Shoeybi et al. 2019, §3, Figure 3). The
  bytes of each AllReduce come from :func:`commlab.parallel.tensor.layers.block_allreduce_nbytes`.
"""

from __future__ import annotations

from typing import Sequence

from commlab.parallel.mesh import MESH_DIMS, ParallelLayout, cross_node_groups
from commlab.parallel.tensor.layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                                            RowParallelLinear, block_allreduce_nbytes)

__all__ = ["TP_BLOCK", "tp_block_steps", "plot_tp_block", "mesh_panels", "plot_mesh_on_nodes"]

_DIM_NAMES = {"tp": "TP groups (tensor parallel)", "pp": "PP groups (pipeline stages)",
              "dp": "DP groups (data parallel)"}

#: The layers of one tensor-parallel transformer block in forward order: (block class, [(attribute or
#: None, layer class or the name of a purely local step)]). A local step needs no communication because each
#: rank holds whole heads (attention) or whole columns (GeLU).
TP_BLOCK: list[tuple[type, list[tuple[str | None, object]]]] = [
    (ParallelSelfAttention, [("qkv", ColumnParallelLinear), (None, "attention\nper local head"),
                             ("proj", RowParallelLinear)]),
    (ParallelMLP, [("fc1", ColumnParallelLinear), (None, "GeLU"), ("fc2", RowParallelLinear)]),
]


def tp_block_steps(batch: int, seq: int, hidden: int, element_nbytes: int, tp: int) -> list[dict]:
    """The boxes of :func:`plot_tp_block`, in forward order, as plain data.

    Returns:
        One dict per box: ``{"block": "ParallelSelfAttention" | "ParallelMLP", "kind": "f" | "g" | "column" |
        "row" | "local", "label": str, "forward": str, "backward": str, "nbytes": int}``; ``nbytes`` is the
        AllReduce payload of an f or g box (0 for the others), from ``block_allreduce_nbytes``.

    Raises:
        ValueError: what ``block_allreduce_nbytes`` rejects (a size that is not an int >= 1).
    """
    payload = block_allreduce_nbytes(batch, seq, hidden, element_nbytes, tp)
    steps = []
    for block, layers in TP_BLOCK:
        for attr, layer in layers:
            if layer is ColumnParallelLinear:
                steps.append(dict(block=block.__name__, kind="f", label="f", forward="identity",
                                  backward="AllReduce", nbytes=payload["backward"]))
                steps.append(dict(block=block.__name__, kind="column", label=f"{attr}\ncolumn-parallel",
                                  forward="", backward="", nbytes=0))
            elif layer is RowParallelLinear:
                steps.append(dict(block=block.__name__, kind="row", label=f"{attr}\nrow-parallel",
                                  forward="", backward="", nbytes=0))
                steps.append(dict(block=block.__name__, kind="g", label="g", forward="AllReduce",
                                  backward="identity", nbytes=payload["forward"]))
            else:
                steps.append(dict(block=block.__name__, kind="local", label=str(layer), forward="", backward="",
                                  nbytes=0))
    return steps


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def plot_tp_block(batch: int = 1, seq: int = 2048, hidden: int = 12288, element_nbytes: int = 2, tp: int = 8):
    """Draw f and g around the column- and row-parallel layers of attention and MLP; returns the Figure.

    One row per block. Replicated activations (the same ``(batch, seq, hidden)`` tensor on every rank of the
    TP group) are drawn as single boxes; between f and g each rank holds its own shard, drawn as ``tp``
    stacked boxes (at most 4 shown). Under f and g: what each does forward and backward, and the AllReduce's
    payload in bytes for the given shape.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    steps = tp_block_steps(batch, seq, hidden, element_nbytes, tp)
    blocks = [b.__name__ for b, _ in TP_BLOCK]
    fig, axes = plt.subplots(len(blocks), 1, figsize=(7.2, 2.3 * len(blocks)))
    colours = {"f": "#fdd49e", "g": "#c6dbef", "column": "#e5e5e5", "row": "#e5e5e5", "local": "#f7f7f7"}
    shown = min(tp, 4)
    for ax, name in zip(axes, blocks):
        row = [s for s in steps if s["block"] == name]
        xs = [0.7 + 1.45 * i for i in range(len(row))]
        ax.set_xlim(-0.4, xs[-1] + 1.4)
        ax.set_ylim(-1.35, 1.0)
        ax.axis("off")
        ax.set_title(f"{name}: input and output replicated on the {tp} ranks of the TP group", fontsize=9,
                     loc="left")
        ax.text(-0.35, 0.25, "x", fontsize=10, ha="left", va="center")
        ax.text(xs[-1] + 1.35, 0.25, "out", fontsize=10, ha="right", va="center")
        sharded = False
        for x, s in zip(xs, row):
            if s["kind"] == "column":
                sharded = True
            n = shown if sharded else 1
            for k in range(n):
                off = 0.06 * k
                ax.add_patch(FancyBboxPatch((x - 0.5 + off, 0.0 - off), 1.0, 0.5, boxstyle="round,pad=0.02",
                                            facecolor=colours[s["kind"]], edgecolor="black", lw=0.8))
            ax.text(x + 0.06 * (n - 1), 0.25 - 0.06 * (n - 1), s["label"], ha="center", va="center",
                    fontsize=10 if s["kind"] in "fg" else 8, weight="bold" if s["kind"] in "fg" else None)
            if s["kind"] in ("f", "g"):
                ax.text(x, -0.12, f"fwd: {s['forward']}\nbwd: {s['backward']}", ha="center", va="top", fontsize=8.5)
                ax.text(x, -0.78, f"AllReduce of\n{_fmt_bytes(s['nbytes'])}", ha="center", va="top", fontsize=8.5,
                        color="tab:red")
            if s["kind"] == "row":
                sharded = False
        for a, b in zip([-0.2] + [x + 0.5 + 0.2 for x in xs], [x - 0.52 for x in xs] + [xs[-1] + 1.0]):
            ax.annotate("", xy=(b, 0.25), xytext=(a, 0.25),
                        arrowprops=dict(arrowstyle="->", lw=0.8, color="grey"))
        if shown < tp:
            ax.text((xs[1] + xs[-2]) / 2, -0.5, f"one box per rank's shard ({shown} of {tp} drawn)", ha="center",
                    fontsize=8.5)
    fig.tight_layout()
    return fig


def mesh_panels(layout: ParallelLayout, order: Sequence[str] = MESH_DIMS) -> dict[str, dict]:
    """What :func:`plot_mesh_on_nodes` colours, as plain data.

    Returns:
        ``{dim: {"groups": layout.groups(dim, order), "crossing": the groups of dim on more than one node}}``
        for ``dim`` in ``("tp", "pp", "dp")``.
    """
    crossing = cross_node_groups(layout, order)
    return {dim: {"groups": layout.groups(dim, order), "crossing": crossing[dim]} for dim in ("tp", "pp", "dp")}


def plot_mesh_on_nodes(layout: ParallelLayout, order: Sequence[str] = MESH_DIMS):
    """Draw every rank of ``layout`` in its node, once per dimension, coloured by its group; returns the Figure.

    Each panel shows the nodes side by side (``devices_per_node`` boxes each, ranks numbered as launchers
    number them); a box shows the global rank and its ``(d, p, t)`` coordinates, and boxes of one colour form
    one group of that panel's dimension. Under each panel: how many of its groups cross a node boundary. Every
    rank box carries the matplotlib gid ``"<dim>:rank<r>:group<g>"``, so tests can read the picture back.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    panels = mesh_panels(layout, order)
    per = layout.devices_per_node
    nodes = layout.num_nodes
    cols = per * nodes
    most = max(len(panels[d]["groups"]) for d in panels)
    cmap = plt.get_cmap("tab10" if most <= 10 else "tab20")
    fig, axes = plt.subplots(3, 1, figsize=(7.2, 1.45 * 3 + 0.3))
    gap = 0.6
    for ax, dim in zip(axes, ("tp", "pp", "dp")):
        groups, crossing = panels[dim]["groups"], panels[dim]["crossing"]
        group_of = {r: gi for gi, g in enumerate(groups) for r in g}
        width = cols + gap * (nodes - 1)
        ax.set_xlim(-0.3, width + 0.1)
        ax.set_ylim(-0.75, 1.45)
        ax.axis("off")
        for k in range(nodes):
            x0 = k * (per + gap)
            ax.add_patch(Rectangle((x0 - 0.12, -0.12), per + 0.04, 1.12, facecolor="none", edgecolor="black",
                                   lw=1.0, ls="--"))
            ax.text(x0 + per / 2 - 0.05, 1.08, f"node {k}", ha="center", va="bottom", fontsize=9)
        for r in range(layout.world_size):
            k, slot = divmod(r, per)
            x = k * (per + gap) + slot
            gi = group_of[r]
            patch = FancyBboxPatch((x + 0.06, 0.04), 0.68, 0.8, boxstyle="round,pad=0.02",
                                   facecolor=cmap(gi % cmap.N), edgecolor="black", lw=0.5)
            patch.set_gid(f"{dim}:rank{r}:group{gi}")
            ax.add_patch(patch)
            d, p, t = layout.coords(r, order)
            ax.text(x + 0.4, 0.58, str(r), ha="center", va="center", fontsize=9, weight="bold")
            ax.text(x + 0.4, 0.24, f"{d},{p},{t}", ha="center", va="center", fontsize=7 if cols > 12 else 8)
        size = layout.size(dim)
        note = (f"all {len(groups)} groups inside one node" if not crossing else
                f"{len(crossing)} of {len(groups)} groups cross nodes")
        ax.text(-0.25, -0.45, f"{_DIM_NAMES[dim]}: {len(groups)} groups of {size}; {note}", fontsize=9,
                ha="left", va="center")
    fig.suptitle(f"d={layout.dp}, p={layout.pp}, t={layout.tp} on {nodes} nodes of {per}; order {tuple(order)}; "
                 "box: rank and (d, p, t)", fontsize=9)
    fig.tight_layout()
    return fig
