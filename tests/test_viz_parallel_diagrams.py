"""The diagrams of chapters 7-11 read back equal to the functions they are drawn from."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from commlab import launch  # noqa: E402
from commlab.collectives import ring_all_reduce_seconds  # noqa: E402
from commlab.overlap import assign_buckets  # noqa: E402
from commlab.overlap.model import bucketed_allreduce_schedule  # noqa: E402
from commlab.parallel.mesh import ParallelLayout, cross_node_groups  # noqa: E402
from commlab.viz.buckets import bucket_bars, plot_bucket_overlap  # noqa: E402
from commlab.viz.parallel import TP_BLOCK, plot_mesh_on_nodes, plot_tp_block, tp_block_steps  # noqa: E402
from commlab.viz.powersgd import plot_powersgd_round, powersgd_steps  # noqa: E402


def _gids(fig, prefix):
    return [p.get_gid() for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)]


@pytest.mark.parametrize("layout,order", [(ParallelLayout(2, 2, 2, 4), ("dp", "pp", "tp")),
                                          (ParallelLayout(2, 2, 2, 4), ("tp", "pp", "dp")),
                                          (ParallelLayout(2, 2, 4, 8), ("dp", "pp", "tp"))])
def test_mesh_diagram_boxes_are_the_mesh_groups(layout, order):
    fig = plot_mesh_on_nodes(layout, order)
    for dim in ("tp", "pp", "dp"):
        drawn: dict[str, set] = {}
        for gid in _gids(fig, dim + ":"):
            _, rank, group = gid.split(":")
            drawn.setdefault(group, set()).add(int(rank.removeprefix("rank")))
        assert sorted(sorted(g) for g in drawn.values()) == layout.groups(dim, order)
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    crossing = cross_node_groups(layout, order)
    for dim in ("tp", "pp", "dp"):
        n = len(crossing[dim])
        assert (f"{n} of {len(layout.groups(dim, order))} groups cross nodes" in texts) == (n > 0)
    plt.close(fig)


def test_bucket_bars_replay_the_schedule():
    cost = lambda b: ring_all_reduce_seconds(b, 8, 5e-6, 1 / 25e9)  # noqa: E731
    for cap in (2**20, 3 * 2**20, 2**30):
        total = bucketed_allreduce_schedule(10 * 2**20, 0.01, cap, cost)
        bars = bucket_bars(10 * 2**20, 0.01, cap, cost)
        assert len(bars) == total.buckets
        assert bars[-1]["end_s"] == pytest.approx(total.end_s)
        assert sum(b["end_s"] - b["start_s"] for b in bars) == pytest.approx(total.comm_s)
        for a, b in zip(bars, bars[1:]):  # one link: a bucket starts after it is ready and the previous one ends
            assert b["start_s"] >= max(a["end_s"], b["ready_s"]) - 1e-12


def test_bucket_diagram_bars_match_the_schedule_and_the_assignment():
    sizes = [4096, 2**22] * 4  # bias, weight of four equal layers, backward order
    names = ["b", "W"] * 4
    cap = 2**22 + 4096
    cost = lambda b: ring_all_reduce_seconds(b, 8, 5e-6, 1 / 25e9)  # noqa: E731
    fig = plot_bucket_overlap(sizes, names, cap, 2e-3, cost, compare_cap_bytes=2**40)
    for c in (cap, 2**40):
        bars = bucket_bars(sum(sizes), 2e-3, c, cost)
        drawn = sorted((p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(f"allreduce:{c}:")),
                       key=lambda p: int(p.get_gid().rsplit(":", 1)[1]))
        assert len(drawn) == len(bars)
        for p, b in zip(drawn, bars):
            assert p.get_x() == pytest.approx(b["start_s"] * 1e3)
            assert p.get_width() == pytest.approx((b["end_s"] - b["start_s"]) * 1e3)
    assert len(assign_buckets(sizes, cap)) == len(bucket_bars(sum(sizes), 2e-3, cap, cost))
    plt.close(fig)


def test_powersgd_diagram_bytes_are_the_compressors():
    steps = powersgd_steps((128, 64), 4)
    reduces = [s for s in steps if s["all_reduce"]]
    assert [s["label"] for s in reduces] == ["AllReduce P", "AllReduce Q"]
    assert [s["nbytes"] for s in reduces] == [128 * 4 * 4, 64 * 4 * 4]
    with pytest.raises(ValueError, match="uncompressed"):
        powersgd_steps((512,), 2)
    plt.close(plot_powersgd_round((128, 128), 2, 4))


def test_tp_block_puts_f_before_column_and_g_after_row():
    steps = tp_block_steps(1, 2048, 12288, 2, 8)
    kinds = [s["kind"] for s in steps]
    assert kinds == ["f", "column", "local", "row", "g"] * 2
    assert all(s["nbytes"] == 2048 * 12288 * 2 for s in steps if s["kind"] in "fg")
    assert all(s["nbytes"] == 0 for s in tp_block_steps(1, 8, 8, 2, 1) if s["kind"] in "fg")
    plt.close(plot_tp_block())


def _children():
    from commlab.parallel import ParallelMLP, ParallelSelfAttention
    out = {}
    for cls, kwargs in ((ParallelSelfAttention, dict(hidden=8, heads=2)), (ParallelMLP, dict(hidden=8, ffn_hidden=16))):
        block = cls.from_seed(group=dist.group.WORLD, seed=0, **kwargs)
        out[cls.__name__] = [(name, type(child).__name__) for name, child in block.named_children()]
    return out


def test_tp_block_description_matches_the_real_modules():
    (children,) = launch(_children, 1, timeout=60)
    for cls, layers in TP_BLOCK:
        described = [(attr, layer.__name__) for attr, layer in layers if attr is not None]
        assert children[cls.__name__] == described
