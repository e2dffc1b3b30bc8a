"""The lab's real data and model, data-parallel training, and the ring figure's replay."""

import pytest
import torch

from commlab import launch
from commlab.collectives import ring_all_reduce
from commlab.train import DigitsMLP, flat_grad, load_digits_split, set_flat_grad, shard, train_data_parallel
from commlab.viz import plot_bench, plot_ring_schedule, ring_states


def test_digits_split_is_real_and_deterministic():
    a, b = load_digits_split(seed=0), load_digits_split(seed=0)
    assert a.x_train.shape[1] == 64 and len(a.y_train) + len(a.y_test) == 1797
    assert torch.equal(a.y_test, b.y_test) and 0 <= a.x_train.min() and a.x_train.max() <= 1
    with pytest.raises(ValueError):
        load_digits_split(test_fraction=1.5)


def test_shards_cover_the_data_once():
    x = torch.arange(10)
    assert torch.equal(torch.cat([shard(x, r, 3) for r in range(3)]), x)
    with pytest.raises(ValueError):
        shard(x, 3, 3)


def test_flat_grad_round_trip():
    model = DigitsMLP()
    assert sum(p.numel() for p in model.parameters()) == 26122
    g = torch.arange(26122, dtype=torch.float32)
    set_flat_grad(model, g)
    assert torch.equal(flat_grad(model), g)
    with pytest.raises(ValueError, match="26122 parameters"):
        set_flat_grad(model, g[:-1])


def test_data_parallel_training_with_the_ring_learns_and_keeps_replicas_equal():
    results = launch(train_data_parallel, 4, ring_all_reduce, steps=40, timeout=60)
    assert len({r.test_accuracy for r in results}) == 1
    assert results[0].losses[-1] < 0.6 * results[0].losses[0]
    assert results[0].test_accuracy > 0.7


def test_ring_replay_sums_each_contribution_once():
    for n in range(1, 9):
        states = ring_states(n)
        assert len(states) == 1 + 2 * (n - 1)
        assert (states[-1]["contrib"] == n).all()
        if n > 1:  # after ReduceScatter, rank r holds chunk r complete
            assert all(states[n - 1]["contrib"][r, r] == n for r in range(n))
    with pytest.raises(ValueError):
        ring_states(0)


@pytest.mark.slow
def test_figures_draw():
    fig = plot_ring_schedule(3)
    assert len(fig.axes) == 5
    from commlab.bench import BenchRow
    rows = [BenchRow(2**k, 2**k // 4, "float32", 4, 1e-3 * k, 2e-3 * k, 0) for k in (10, 12)]
    assert len(plot_bench(rows).axes) == 2
