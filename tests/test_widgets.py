"""The chapter 3 calculator: its table equals the cost functions, the widget reacts, the static figure draws."""

import math

import matplotlib
import pytest

from commlab.collectives.cost import FLAT_ALGORITHMS, predict_flat, predict_on_cluster
from commlab.topology import Link, load_preset
from commlab.widgets import calculator, static_figure
from commlab.widgets.calculator import (CUSTOM, allreduce_table, format_bytes, table_for_preset, table_html,
                                        table_text, time_curves)

matplotlib.use("Agg")


@pytest.mark.parametrize("preset", ["dgx-a100-hdr", "dgx-h100-ndr", "pcie-gen4-node"])
@pytest.mark.parametrize("nbytes", [2**10, 3 * 2**20 + 7, 2**32])
@pytest.mark.parametrize("nodes", [1, 4, 64])
def test_table_equals_the_cost_functions(preset, nbytes, nodes):
    c = load_preset(preset, nodes=nodes)
    n = c.world_size
    rows = table_for_preset(nbytes, preset, nodes, switch_alpha_s=1e-6)
    flat = predict_flat(nbytes, n, c.inter)
    cluster = predict_on_cluster(nbytes, nodes, c.devices_per_node, c.intra, c.inter, c.nics_per_node,
                                 switch_alpha_s=1e-6)
    assert [r.name for r in rows] == list(flat) + list(cluster)
    assert [r.kind for r in rows] == ["flat"] * len(flat) + ["cluster"] * len(cluster)
    expected = {**flat, **cluster}
    for r in rows:
        assert r.seconds == expected[r.name]
        assert r.algbw_bytes_per_s == pytest.approx(nbytes / r.seconds, rel=1e-12)
        assert r.busbw_bytes_per_s == pytest.approx(nbytes / r.seconds * 2 * (n - 1) / n, rel=1e-12)


def test_table_options_and_errors():
    link = Link(1e-6, 1e-10)
    rows = allreduce_table(2**20, 2, 4, link, link, switch_alpha_s=None, algorithms=["ring"])
    assert [r.name for r in rows] == ["ring", "ring, topology order", "ring, round-robin ranks", "hierarchical"]
    with pytest.raises(ValueError, match="at least 2 ranks"):
        allreduce_table(2**20, 1, 1, link, link)
    with pytest.raises(ValueError, match="nodes"):
        allreduce_table(2**20, 0, 4, link, link)
    with pytest.raises(ValueError, match="nbytes"):
        allreduce_table(0, 2, 4, link, link)
    with pytest.raises(KeyError, match="known"):
        allreduce_table(2**20, 2, 4, link, link, algorithms=["magic"])
    with pytest.raises(KeyError, match="known presets"):
        table_for_preset(2**20, "no-such-cluster", 2)


def test_curves_and_formatting():
    c = load_preset("dgx-h100-ndr", nodes=8)
    sizes = [2**10, 2**20, 2**30]
    curves = time_curves(sizes, 8, 8, c.intra, c.inter, 8)
    for i, s in enumerate(sizes):
        for r in allreduce_table(s, 8, 8, c.intra, c.inter, 8):
            assert curves[r.name][i] == r.seconds
    rows = allreduce_table(2**26, 8, 8, c.intra, c.inter, 8)
    best = min(rows, key=lambda r: r.seconds)
    text = table_text(rows)
    assert [line for line in text.splitlines() if line.startswith("*")] == \
        [line for line in text.splitlines() if best.name in line and line.startswith("*")]
    html = table_html(rows)
    assert html.count("font-weight:bold") == 1 and best.name in html
    assert format_bytes(2**10) == "1 KiB" and format_bytes(4 * 2**30) == "4 GiB"


def test_widget_builds_and_reacts():
    pytest.importorskip("ipywidgets")
    box = calculator("dgx-h100-ndr", nodes=8, nbytes=2**26)
    size = box.controls["nbytes"]
    assert size.min == 10 and size.max == 32 and size.base == 2  # 1 KiB .. 4 GiB
    before_table, before_plot = box.table.value, box.plot.value
    assert "64 MiB" in before_table and before_plot[:4] == b"\x89PNG"
    c = load_preset("dgx-h100-ndr", nodes=8)
    # The widget's fields hold α in µs, so its links equal the preset's up to float rounding.
    assert [r.seconds for r in box.rows()] == pytest.approx([r.seconds for r in allreduce_table(
        2**26, 8, 8, c.intra, c.inter, 8, switch_alpha_s=box.controls["switch_alpha_us"].value * 1e-6)], rel=1e-12)

    size.value = 2**12
    assert box.table.value != before_table and "4 KiB" in box.table.value
    assert box.plot.value != before_plot

    box.controls["nodes"].value = 2
    assert "N = 16 ranks" in box.table.value

    assert box.controls["inter_gb_per_s"].disabled
    box.controls["preset"].value = CUSTOM
    assert not box.controls["inter_gb_per_s"].disabled
    slow = box.table.value
    box.controls["inter_gb_per_s"].value = 1.0
    assert box.table.value != slow
    assert box.rows()[0].seconds == pytest.approx(predict_flat(2**12, 16, Link.from_bandwidth(1e9, c.inter.alpha_s))
                                                  ["ring"])

    box.controls["preset"].value = "pcie-gen4-node"
    assert box.controls["nics_per_node"].value == 2 and box.controls["inter_gb_per_s"].disabled

    box.controls["nodes"].value = 1
    box.controls["devices_per_node"].value = 1
    assert "at least 2 ranks" in box.table.value and box.rows() == []


def test_static_figure_axes():
    fig = static_figure("dgx-a100-hdr", nodes=4, nbytes=2**20)
    try:
        ax_t, ax_b = fig.axes
        assert ax_t.get_xscale() == "log" and ax_t.get_yscale() == "log"
        assert "size" in ax_t.get_xlabel() and "time" in ax_t.get_ylabel()
        lo, hi = ax_t.get_xlim()
        assert lo <= 2**10 and hi >= 2**32
        n_rows = len(FLAT_ALGORITHMS) + 4
        assert len([l for l in ax_t.get_lines() if l.get_linestyle() in ("-", "--")]) == n_rows
        assert len(ax_b.patches) == n_rows and "busbw" in ax_b.get_xlabel()
        assert "1 MiB" in ax_b.get_title() and "dgx-a100-hdr" in ax_t.get_title()
        assert len(ax_b.get_yticklabels()) == n_rows
        assert all(math.isfinite(p.get_width()) for p in ax_b.patches)
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
