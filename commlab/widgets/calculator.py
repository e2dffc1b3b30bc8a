"""An AllReduce cost calculator: predicted time, algbw and busbw of every algorithm (chapter 3).

Three layers, so that the numbers can be tested without a browser and shown where no kernel runs:

* :func:`allreduce_table` -- pure: one :class:`Row` per algorithm for a size and a cluster, from
  :func:`~commlab.collectives.cost.predict_flat` and :func:`~commlab.collectives.cost.predict_on_cluster`;
  :func:`time_curves` over a range of sizes; :func:`table_text` and :func:`table_html` format the rows.
* :func:`calculator` -- the ipywidgets front end: a log slider for the size, nodes and devices per node, a
  preset dropdown (or custom α and bandwidth per link), the table with the fastest row highlighted, and a
  plot of time versus size with a marker at the chosen size.
* :func:`static_figure` -- the same information as a matplotlib Figure, for the online book.

Units: sizes in bytes, times in seconds, α in seconds, β in seconds per byte, bandwidths in bytes per
second per direction. algbw and busbw are defined as in nccl-tests (:mod:`commlab.bench.metrics`).
"""

from __future__ import annotations

import dataclasses
import html
import io
import math
from typing import Sequence

import numpy as np

from commlab import checks
from commlab.bench.metrics import algbw_bytes_per_s, busbw_bytes_per_s
from commlab.collectives.cost import predict_flat, predict_on_cluster
from commlab.collectives.in_network import HDR_SWITCH_PORTS
from commlab.topology import Link, list_presets, load_preset

__all__ = ["Row", "ASSUMED_SWITCH_ALPHA_S", "MIN_NBYTES", "MAX_NBYTES", "allreduce_table", "table_for_preset",
           "time_curves", "table_text", "table_html", "format_bytes", "format_seconds", "calculator",
           "static_figure", "CUSTOM"]

#: Added latency per switch level of an in-network (SHARP-style) reduction, seconds. An assumption of the
#: right order of magnitude (a switch hop plus its reduction unit), not a datasheet figure; every function
#: takes ``switch_alpha_s`` so that it can be changed.
ASSUMED_SWITCH_ALPHA_S = 0.5e-6

#: The calculator's size range, bytes: 1 KiB to 4 GiB.
MIN_NBYTES = 2**10
MAX_NBYTES = 2**32

#: The dropdown entry that enables the custom link fields.
CUSTOM = "custom"


@dataclasses.dataclass(frozen=True)
class Row:
    """One algorithm's prediction.

    Attributes:
        name: the algorithm or layout, as in :data:`~commlab.collectives.cost.FLAT_ALGORITHMS` or the keys
            of :func:`~commlab.collectives.cost.predict_on_cluster`.
        kind: ``"flat"`` (all ranks joined by the inter-node link) or ``"cluster"`` (ranks on nodes, intra-
            and inter-node links).
        seconds: predicted AllReduce time, s.
        algbw_bytes_per_s: nbytes / seconds, bytes/s.
        busbw_bytes_per_s: algbw · 2(N-1)/N, bytes/s (comparable with a link's per-direction bandwidth).
    """

    name: str
    kind: str
    seconds: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float


def _check(nbytes: float, nodes: int, devices_per_node: int, nics_per_node: int) -> int:
    for name, v in (("nodes", nodes), ("devices_per_node", devices_per_node), ("nics_per_node", nics_per_node)):
        checks.integer(name, v)
    world = int(nodes) * int(devices_per_node)
    if world < 2:
        raise ValueError(f"an AllReduce needs at least 2 ranks, got nodes={nodes} x "
                         f"devices_per_node={devices_per_node}; raise either")
    if not (isinstance(nbytes, (int, float, np.integer, np.floating)) and math.isfinite(nbytes) and nbytes > 0):
        raise ValueError(f"nbytes must be a finite number > 0, got {nbytes!r}")
    return world


def allreduce_table(nbytes: float, nodes: int, devices_per_node: int, intra: Link, inter: Link,
                    nics_per_node: int = 1, switch_alpha_s: float | None = ASSUMED_SWITCH_ALPHA_S,
                    radix: int = HDR_SWITCH_PORTS, algorithms: Sequence[str] | None = None) -> list[Row]:
    """Predicted AllReduce time, algbw and busbw of each algorithm, for ``nbytes`` bytes on
    ``nodes`` × ``devices_per_node`` ranks.

    The flat algorithms (``algorithms``, default all of
    :data:`~commlab.collectives.cost.FLAT_ALGORITHMS`) treat the N ranks as joined by ``inter`` alone; the
    cluster layouts are those of :func:`~commlab.collectives.cost.predict_on_cluster` (the in-network row
    only when ``switch_alpha_s`` is not None).

    Args:
        nbytes: buffer size per rank, bytes (> 0).
        nodes, devices_per_node: the cluster's shape; N = nodes · devices_per_node >= 2.
        intra, inter: the links (α in s, β in s/byte per direction).
        nics_per_node: NICs a node's inter-node traffic spreads over (>= 1).
        switch_alpha_s: added latency per switch level for the in-network row, s; None leaves it out.
        radix: ports per switch of the in-network row's fat tree (default the 40-port HDR switch).
        algorithms: which flat algorithms to include.

    Returns:
        Flat rows first (in ``algorithms`` order), then the cluster rows.

    Raises:
        ValueError: bad counts or size (the message says which). KeyError: unknown algorithm name.
    """
    n = _check(nbytes, nodes, devices_per_node, nics_per_node)
    rows = []
    flat = predict_flat(nbytes, n, inter, algorithms=algorithms)
    cluster = predict_on_cluster(nbytes, int(nodes), int(devices_per_node), intra, inter, int(nics_per_node),
                                 switch_alpha_s=switch_alpha_s, radix=radix)
    for kind, times in (("flat", flat), ("cluster", cluster)):
        for name, t in times.items():
            rows.append(Row(name, kind, t, algbw_bytes_per_s(nbytes, t), busbw_bytes_per_s(nbytes, t, n)))
    return rows


def table_for_preset(nbytes: float, preset: str, nodes: int, devices_per_node: int | None = None,
                     nics_per_node: int | None = None, **kwargs) -> list[Row]:
    """:func:`allreduce_table` for a cluster preset (see :func:`commlab.topology.list_presets`); the
    preset's devices and NICs per node unless given. Other keywords go to :func:`allreduce_table`.

    Raises:
        KeyError: unknown preset (the message lists the known ones). ValueError: as :func:`allreduce_table`.
    """
    c = load_preset(preset, nodes=nodes)
    return allreduce_table(nbytes, nodes, devices_per_node or c.devices_per_node, c.intra, c.inter,
                           nics_per_node or c.nics_per_node, **kwargs)


def time_curves(sizes: Sequence[float], nodes: int, devices_per_node: int, intra: Link, inter: Link,
                nics_per_node: int = 1, switch_alpha_s: float | None = ASSUMED_SWITCH_ALPHA_S,
                radix: int = HDR_SWITCH_PORTS, algorithms: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Predicted seconds of each row of :func:`allreduce_table` at every size of ``sizes`` (bytes).

    Returns:
        ``{name: array of seconds, one per size}``, names in the table's order.
    """
    tables = [allreduce_table(s, nodes, devices_per_node, intra, inter, nics_per_node, switch_alpha_s, radix,
                              algorithms) for s in sizes]
    return {row.name: np.array([t[i].seconds for t in tables]) for i, row in enumerate(tables[0])}


# ----------------------------------------------------------------------------------------- formatting

def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: binary units, as nccl-tests' size flags."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """``3.2e-5`` -> ``'32.0 us'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds / 1e-9:.0f} ns"


def _fastest(rows: Sequence[Row]) -> int:
    return min(range(len(rows)), key=lambda i: rows[i].seconds)


def table_text(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table (time, algbw and busbw in GB/s = 1e9 bytes/s); the fastest row is
    marked with ``*``."""
    best = _fastest(rows)
    width = max(len(r.name) for r in rows)
    lines = [f"  {'algorithm':{width}s}  {'kind':7s}  {'time':>9s}  {'algbw GB/s':>10s}  {'busbw GB/s':>10s}"]
    for i, r in enumerate(rows):
        lines.append(f"{'*' if i == best else ' '} {r.name:{width}s}  {r.kind:7s}  {format_seconds(r.seconds):>9s}  "
                     f"{r.algbw_bytes_per_s / 1e9:10.2f}  {r.busbw_bytes_per_s / 1e9:10.2f}")
    return "\n".join(lines)


def table_html(rows: Sequence[Row], caption: str = "") -> str:
    """The rows as an HTML table, the fastest row highlighted (bold, shaded)."""
    best = _fastest(rows)
    head = "".join(f"<th style='padding:2px 8px;text-align:{a}'>{h}</th>" for h, a in
                   (("algorithm", "left"), ("kind", "left"), ("time", "right"), ("algbw GB/s", "right"),
                    ("busbw GB/s", "right")))
    body = []
    for i, r in enumerate(rows):
        style = " style='font-weight:bold;background:#d9f2d9'" if i == best else ""
        cells = [html.escape(r.name), r.kind, format_seconds(r.seconds), f"{r.algbw_bytes_per_s / 1e9:.2f}",
                 f"{r.busbw_bytes_per_s / 1e9:.2f}"]
        tds = "".join(f"<td style='padding:2px 8px;text-align:{'left' if j < 2 else 'right'}'>{c}</td>"
                      for j, c in enumerate(cells))
        body.append(f"<tr{style}>{tds}</tr>")
    cap = f"<caption style='text-align:left'>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


# ----------------------------------------------------------------------------------------- plotting

_LINESTYLES = {"flat": "--", "cluster": "-"}


def _plot_curves(ax, nbytes, nodes, devices_per_node, intra, inter, nics_per_node, switch_alpha_s, radix,
                 points=49):
    sizes = np.logspace(math.log2(MIN_NBYTES), math.log2(MAX_NBYTES), points, base=2)
    curves = time_curves(sizes, nodes, devices_per_node, intra, inter, nics_per_node, switch_alpha_s, radix)
    rows = allreduce_table(nbytes, nodes, devices_per_node, intra, inter, nics_per_node, switch_alpha_s, radix)
    for i, row in enumerate(rows):
        color = f"C{i % 10}"
        ax.loglog(sizes, curves[row.name], _LINESTYLES[row.kind], color=color, lw=1.3,
                  label=f"{row.name} ({row.kind})")
        ax.plot([nbytes], [row.seconds], "o", color=color, ms=4)
    ax.axvline(nbytes, color="0.5", lw=0.8, ls=":")
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("predicted AllReduce time (s)")
    ax.grid(True, which="major", alpha=0.3)
    return rows


def static_figure(preset: str = "dgx-h100-ndr", nodes: int = 8, nbytes: float = 2**26,
                  devices_per_node: int | None = None, nics_per_node: int | None = None,
                  switch_alpha_s: float | None = ASSUMED_SWITCH_ALPHA_S, radix: int = HDR_SWITCH_PORTS):
    """The calculator's output as a matplotlib Figure, for pages where no kernel runs.

    Left axes: predicted time (s) against message size (1 KiB to 4 GiB, log-log) for every row of
    :func:`allreduce_table` (flat algorithms dashed, cluster layouts solid), a dot at ``nbytes``. Right
    axes: busbw (GB/s) of each row at ``nbytes``, the fastest bar highlighted and labelled with its time.

    Args:
        preset: a cluster preset name; nodes: number of nodes; nbytes: the highlighted size, bytes.
        devices_per_node, nics_per_node: override the preset's. switch_alpha_s, radix: as
            :func:`allreduce_table`.

    Raises:
        KeyError: unknown preset. ValueError: as :func:`allreduce_table`.
    """
    import matplotlib.pyplot as plt

    c = load_preset(preset, nodes=nodes)
    d = devices_per_node or c.devices_per_node
    nics = nics_per_node or c.nics_per_node
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.35, 1]})
    rows = _plot_curves(ax_t, nbytes, nodes, d, c.intra, c.inter, nics, switch_alpha_s, radix)
    ax_t.legend(fontsize=7, loc="upper left")
    ax_t.set_title(f"{preset}: {nodes} nodes x {d} devices, {nics} NIC(s) per node", fontsize=9)
    best = _fastest(rows)
    y = np.arange(len(rows))
    ax_b.barh(y, [r.busbw_bytes_per_s / 1e9 for r in rows],
              color=["C2" if i == best else "0.75" for i in range(len(rows))])
    ax_b.set_yticks(y, [f"{r.name} ({r.kind})" for r in rows], fontsize=7)
    ax_b.invert_yaxis()
    for i, r in enumerate(rows):
        ax_b.text(r.busbw_bytes_per_s / 1e9, i, " " + format_seconds(r.seconds), va="center", fontsize=7,
                  fontweight="bold" if i == best else "normal")
    ax_b.set_xlabel("busbw at the chosen size (GB/s)")
    ax_b.set_title(f"at {format_bytes(nbytes)}: fastest is {rows[best].name}", fontsize=9)
    ax_b.set_xlim(0, max(r.busbw_bytes_per_s for r in rows) / 1e9 * 1.35)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------- the widget

def _links_from_fields(f) -> tuple[Link, Link]:
    intra = Link.from_bandwidth(f["intra_gb_per_s"].value * 1e9, f["intra_alpha_us"].value * 1e-6, "custom intra")
    inter = Link.from_bandwidth(f["inter_gb_per_s"].value * 1e9, f["inter_alpha_us"].value * 1e-6, "custom inter")
    return intra, inter


def calculator(preset: str = "dgx-h100-ndr", nodes: int = 8, nbytes: float = 2**26):
    """An ipywidgets AllReduce calculator.

    Controls: message size (``controls["nbytes"]``, a log slider from 1 KiB to 4 GiB in steps of √2), nodes, devices per node, a cluster preset or
    ``custom`` (then α in µs and bandwidth in GB/s per direction for each link, and NICs per node are
    editable), and the switch latency per level of the in-network row (µs). Output: the
    :func:`table_html` table (fastest row highlighted) and a plot of time against size with a dot at the
    chosen size, redrawn on every change.

    Returns:
        An ``ipywidgets.VBox``. For scripts and tests it also carries ``controls`` (a dict of the input
        widgets by name), ``table`` (the HTML widget holding the table), ``plot`` (the Image widget) and
        ``rows()`` (the current :class:`Row` list).

    Raises:
        KeyError: unknown ``preset``. ImportError: ipywidgets is not installed.
    """
    import ipywidgets as w
    import matplotlib
    import matplotlib.pyplot as plt

    c0 = load_preset(preset, nodes=nodes)
    style = {"description_width": "150px"}
    layout = w.Layout(width="330px")
    controls = {
        "nbytes": w.FloatLogSlider(value=nbytes, base=2, min=math.log2(MIN_NBYTES), max=math.log2(MAX_NBYTES),
                                   step=0.5, description="message size", readout=False, continuous_update=False,
                                   style=style, layout=w.Layout(width="420px")),
        "nodes": w.BoundedIntText(value=nodes, min=1, max=100_000, description="nodes", style=style, layout=layout),
        "devices_per_node": w.BoundedIntText(value=c0.devices_per_node, min=1, max=64,
                                             description="devices per node", style=style, layout=layout),
        "preset": w.Dropdown(options=list_presets() + [CUSTOM], value=preset, description="cluster",
                             style=style, layout=layout),
        "nics_per_node": w.BoundedIntText(value=c0.nics_per_node, min=1, max=64, description="NICs per node",
                                          style=style, layout=layout),
        "intra_alpha_us": w.BoundedFloatText(value=c0.intra.alpha_s * 1e6, min=0, max=1e6,
                                             description="intra α (µs)", style=style, layout=layout),
        "intra_gb_per_s": w.BoundedFloatText(value=c0.intra.bytes_per_s / 1e9, min=1e-3, max=1e6,
                                             description="intra GB/s per dir.", style=style, layout=layout),
        "inter_alpha_us": w.BoundedFloatText(value=c0.inter.alpha_s * 1e6, min=0, max=1e6,
                                             description="inter α (µs)", style=style, layout=layout),
        "inter_gb_per_s": w.BoundedFloatText(value=c0.inter.bytes_per_s / 1e9, min=1e-3, max=1e6,
                                             description="inter GB/s per dir.", style=style, layout=layout),
        "switch_alpha_us": w.BoundedFloatText(value=ASSUMED_SWITCH_ALPHA_S * 1e6, min=0, max=1e6,
                                              description="switch α per level (µs)", style=style, layout=layout),
    }
    link_fields = ("nics_per_node", "intra_alpha_us", "intra_gb_per_s", "inter_alpha_us", "inter_gb_per_s")
    size_label = w.Label()
    table = w.HTML()
    plot = w.Image(format="png")
    state = {"rows": [], "syncing": False}

    def fill_from_preset():
        name = controls["preset"].value
        custom = name == CUSTOM
        for f in link_fields:
            controls[f].disabled = not custom
        if custom:
            return
        c = load_preset(name, nodes=1)
        state["syncing"] = True  # one redraw for the whole preset, not one per field
        try:
            controls["devices_per_node"].value = c.devices_per_node
            controls["nics_per_node"].value = c.nics_per_node
            controls["intra_alpha_us"].value = c.intra.alpha_s * 1e6
            controls["intra_gb_per_s"].value = c.intra.bytes_per_s / 1e9
            controls["inter_alpha_us"].value = c.inter.alpha_s * 1e6
            controls["inter_gb_per_s"].value = c.inter.bytes_per_s / 1e9
        finally:
            state["syncing"] = False

    def redraw(*_):
        if state["syncing"]:
            return
        s = float(controls["nbytes"].value)
        size_label.value = f"= {format_bytes(s)} per rank"
        args = (controls["nodes"].value, controls["devices_per_node"].value, *_links_from_fields(controls),
                controls["nics_per_node"].value, controls["switch_alpha_us"].value * 1e-6)
        try:
            rows = allreduce_table(s, *args)
        except ValueError as e:
            state["rows"] = []
            table.value = f"<b>{html.escape(str(e))}</b>"
            return
        state["rows"] = rows
        n = controls["nodes"].value * controls["devices_per_node"].value
        table.value = table_html(rows, caption=f"AllReduce of {format_bytes(s)} on N = {n} ranks "
                                               f"(fastest highlighted)")
        with matplotlib.rc_context({"figure.dpi": 80}):
            fig, ax = plt.subplots(figsize=(7, 3.6))
            _plot_curves(ax, s, *args, HDR_SWITCH_PORTS)
            ax.legend(fontsize=7, loc="upper left")
            fig.tight_layout()
            buf = io.BytesIO()
            fig.savefig(buf, format="png")
            plt.close(fig)
        plot.value = buf.getvalue()

    def on_preset(_):
        fill_from_preset()
        redraw()

    controls["preset"].observe(on_preset, names="value")
    for name, widget in controls.items():
        if name != "preset":
            widget.observe(redraw, names="value")
    fill_from_preset()
    redraw()

    inputs = w.VBox([w.HBox([controls["nbytes"], size_label]),
                     w.HBox([w.VBox([controls[k] for k in ("preset", "nodes", "devices_per_node",
                                                           "nics_per_node", "switch_alpha_us")]),
                             w.VBox([controls[k] for k in ("intra_alpha_us", "intra_gb_per_s", "inter_alpha_us",
                                                           "inter_gb_per_s")])])])
    box = w.VBox([inputs, table, plot])
    box.controls = controls
    box.table = table
    box.plot = plot
    box.rows = lambda: list(state["rows"])
    return box
