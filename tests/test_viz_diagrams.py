"""The book's diagrams show what the schedules do: one arrow per message, the labels the chunks sent.

Cheap (matplotlib Agg, no processes): each test draws one figure and counts what it drew against the
schedule functions of commlab.collectives and the byte formulas of commlab.compress.
"""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch

from commlab.collectives.halving_doubling import halving_steps
from commlab.collectives.ring import reduce_scatter_send_chunk
from commlab.collectives.tree import binomial_tree
from commlab.compress.two_phase import two_phase_bytes_sent_per_rank
from commlab.topology.cluster import load_preset
from commlab.viz import plot_ring_schedule
from commlab.viz.collectives import (circle_positions, halving_doubling_transfers, hierarchical_transfers,
                                     line_positions, node_grid_positions, plot_transfers, ring_transfers,
                                     tree_positions, tree_transfers)
from commlab.viz.compression import compressed_bytes_per_rank, compressed_path_transfers, plot_compressed_paths
from commlab.viz.topology import plot_node_rails, plot_switch_tree, switch_tree


def arrows(ax):
    return [p for p in ax.patches if isinstance(p, FancyArrowPatch)]


def red_labels(ax):
    return [t.get_text() for t in ax.texts if t.get_color() == "tab:red"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def check_panels(fig, steps):
    assert len(fig.axes) == len(steps)
    for ax, (title, sends) in zip(fig.axes, steps):
        assert ax.get_title() == title
        assert len(arrows(ax)) == len(sends)
        assert sorted(red_labels(ax)) == sorted(label for _, _, label in sends if label)


def test_ring_transfers_follow_the_ring_schedule():
    steps = ring_transfers(5)
    assert len(steps) == 2 * 4
    for s, (_, sends) in enumerate(steps[:4]):
        assert sends == [(p, (p + 1) % 5, f"c{reduce_scatter_send_chunk(p, s, 5)}") for p in range(5)]
    fig = plot_transfers(steps, circle_positions(5))
    check_panels(fig, steps)


def test_tree_transfers_use_every_edge_once_each_way():
    n = 6
    steps = tree_transfers(n)
    up = [(s, d) for name, sends in steps if name.startswith("reduce") for s, d, _ in sends]
    down = [(s, d) for name, sends in steps if name.startswith("broadcast") for s, d, _ in sends]
    edges = sorted((r, binomial_tree(r, n)[0]) for r in range(1, n))
    assert sorted(up) == edges and sorted((d, s) for s, d in down) == edges
    check_panels(plot_transfers(steps, tree_positions(n), ncols=3, bend=0.0), steps)


@pytest.mark.parametrize("n", [4, 6, 8])
def test_halving_doubling_transfers_match_halving_steps(n):
    steps = halving_doubling_transfers(n)
    p = 4 if n < 8 else 8
    folds = n - p
    assert len(steps) == 2 * (p.bit_length() - 1) + 2 * bool(folds)
    first_halving = steps[1 if folds else 0][1]
    assert len(first_halving) == p
    if n == 8:  # virtual = real ranks: the labels are the halving steps' send ranges
        for src, dst, label in first_halving:
            partner, _, (lo, hi) = halving_steps(src, p)[0]
            assert dst == partner and label == f"b{lo}-{hi - 1}"
    check_panels(plot_transfers(steps, line_positions(n), ncols=2, bend=0.2), steps)


def test_hierarchical_transfers_phases_and_counts():
    placement = [0, 0, 0, 1, 1, 1]
    steps = hierarchical_transfers(placement)
    assert len(steps) == 2 * 2 + 2 * 1  # (d-1) in node per half, (nodes-1) across nodes per half
    assert all(len(sends) == 6 for _, sends in steps)
    across = [sends for name, sends in steps if "across" in name]
    assert all(s // 3 != d // 3 for sends in across for s, d, _ in sends)
    check_panels(plot_transfers(steps, node_grid_positions(placement), ncols=3), steps)


def test_ring_schedule_is_a_readable_grid():
    fig = plot_ring_schedule(4)
    width, _ = fig.get_size_inches()
    assert width <= 6.9  # shown at the 688 px column without shrinking the 9 pt numbers
    visible = [ax for ax in fig.axes if ax.axison]
    assert len(visible) == 7
    assert min(t.get_fontsize() for ax in visible for t in ax.texts) >= 9


def test_node_rails_draws_every_link():
    c = load_preset("dgx-h100-ndr", nodes=2)
    fig = plot_node_rails(c)
    lines = [ln for ln in fig.axes[0].get_lines() if isinstance(ln, Line2D)]
    assert len(lines) == 2 * (2 * c.devices_per_node + c.nics_per_node)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("GPU ") for t in texts) == 2 * c.devices_per_node
    assert sum(t.startswith("rail ") for t in texts) == c.nics_per_node


def test_switch_tree_arrows_are_the_tree_edges_both_ways():
    parents = switch_tree(8, 4)
    assert parents[0] == [0, 0, 1, 1, 2, 2, 3, 3] and parents[1] == [0, 0, 0, 0] and parents[2] == [-1]
    edges = sum(len(level) for level in parents[:-1])
    fig = plot_switch_tree(8, 4)
    assert len(arrows(fig.axes[0])) == 2 * edges


def test_compressed_paths_bytes_are_the_formulas():
    n, payload = 4, 1e6
    per = compressed_bytes_per_rank(n, payload)
    assert per["all_reduce"] == pytest.approx(2 * (n - 1) / n * payload)
    assert per["all_gather"] == pytest.approx((n - 1) * payload)
    assert per["two_phase"] == two_phase_bytes_sent_per_rank(payload / n, payload / n, n)
    steps = compressed_path_transfers(n, payload)
    assert [len(sends) for _, sends in steps] == [n, n, n * (n - 1), n]
    check_panels(plot_compressed_paths(n, payload), steps)


def test_bad_rank_counts_are_refused():
    with pytest.raises(ValueError, match=r"n must be an int >= 2 \(the number of ranks N\), got 1"):
        ring_transfers(1)
    with pytest.raises(ValueError, match="same number of ranks"):
        hierarchical_transfers([0, 0, 1])
