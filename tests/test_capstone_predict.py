"""The planner beside the capstone's measurement (labs/capstone/predict.py): the cluster it calibrates, the
prediction for the layout that ran and the layout it recommends."""

import pytest
import torch

from commlab import launch
from commlab.bench.calibrate import ring_exchange_here
from commlab.parallel.planner import executed_flops_per_token
from labs.capstone import predict
from labs.capstone.model import check_layout
from labs.capstone.train import Options

CAL = predict.Calibration(alpha_s=50e-6, beta_s_per_byte=1e-9, flop_per_s=20e9, world_size=8, local_world_size=8)


def test_one_rank_is_predicted_as_its_compute_at_the_measured_rate():
    opts = Options(micro_batch=2, micro_batches=2)
    one = predict.Calibration(0.0, 0.0, 20e9, 1, 1)
    t = predict.predict(opts, predict.measured_cluster(one, opts.dtype, torch.device("cpu")))
    tokens = opts.global_batch * opts.model.seq
    assert t.total_s == pytest.approx(executed_flops_per_token(opts.model.planner_config(), False, flash_attention=False)
                                    * tokens / 20e9)
    assert t.tp_s == t.pp_s == t.bubble_s == t.dp_exposed_s == 0


def test_the_layout_that_ran_pays_for_its_communication_on_the_measured_link():
    opts = Options(tp=2, pp=2, dp=2)
    cluster = predict.measured_cluster(CAL, opts.dtype, torch.device("cpu"))
    t = predict.predict(opts, cluster)
    assert t.tp_s > 0 and t.pp_s > 0 and t.bubble_s > 0 and t.dp_s > 0
    slower = predict.predict(opts, predict.measured_cluster(
        predict.Calibration(500e-6, 1e-8, 20e9, 8, 8), opts.dtype, torch.device("cpu")))
    assert slower.tp_s > t.tp_s and slower.compute_s == t.compute_s


def test_the_recommended_layout_is_one_the_capstone_can_run():
    opts = Options(tp=2, pp=2, dp=2)
    best = predict.recommend(opts, predict.measured_cluster(CAL, opts.dtype, torch.device("cpu")))
    L = best.layout
    check_layout(opts.model, L.tp, L.pp, L.dp, 8)
    assert opts.global_batch % (L.dp * L.micro_batch) == 0
    text = predict.report(opts, CAL, 0.1, predict.predict(opts, predict.measured_cluster(CAL, opts.dtype,
                                                                                          torch.device("cpu"))), best)
    assert "measured / predicted" in text and "recommended for 8 rank(s) and 8 sequences" in text


def _exchange_here():
    return ring_exchange_here([1024, 65536], rounds=2)


def test_ring_exchange_here_measures_in_the_running_group_and_needs_two_ranks():
    results = launch(_exchange_here, 2, timeout=60)
    assert results[0] == results[1] and all(t > 0 for t in results[0])
    with pytest.raises(Exception, match="needs a process group of >= 2 ranks"):
        launch(_exchange_here, 1, timeout=60, print_output=False)


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=2), dict(dp=8), dict(pp=2, dp=4)])
def test_the_recommendation_is_never_slower_than_the_layout_that_ran(layout):
    """The search prices DP as the prediction does (overlapped with pp = 1, after the flush with pp > 1), so the
    layout that ran, which is in its search space, bounds the recommendation."""
    opts = Options(**layout)
    cluster = predict.measured_cluster(CAL, opts.dtype, torch.device("cpu"))
    assert predict.recommend(opts, cluster).step_s <= predict.predict(opts, cluster).total_s * (1 + 1e-12)

