"""The capstone GPT (labs/capstone/model.py): its layout checks, and its TP and TP x PP forms against the
single-process model on real gloo ranks, in float64 on characters of the course's corpus."""

import copy

import pytest
import torch
import torch.distributed as dist

from commlab import launch
from commlab.experiments.corpus import load_corpus
from commlab.parallel.pipeline import pipeline_step
from labs.capstone.model import GPTConfig, apply_tp, build_gpt, check_layout, lm_loss, pipeline_stages

CONFIG = GPTConfig(seq=16, layers=4, hidden=32, heads=4, ffn=64)
SEED = 3
TOL = 1e-10  # float64: only the order of the sums differs between the layouts


def _batch(batch=4, seq=16):
    ids = load_corpus().train
    starts = torch.arange(batch) * 997
    x = torch.stack([ids[s:s + seq] for s in starts])
    y = torch.stack([ids[s + 1:s + seq + 1] for s in starts])
    return x, y


def _reference():
    model = build_gpt(CONFIG, SEED, torch.float64)
    x, y = _batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    return model, float(loss.detach())


def test_parameter_count_formula_matches_the_model_and_the_planner():
    model = build_gpt(CONFIG, SEED)
    assert CONFIG.params == sum(p.numel() for p in model.parameters())
    from commlab.parallel.planner import parameter_count
    assert parameter_count(CONFIG.planner_config()) == CONFIG.params


@pytest.mark.parametrize("tp, pp, dp, world, words", [
    (3, 1, 1, 3, ["heads (4) is not divisible by tp (3)", "ffn (64) is not divisible by tp (3)"]),
    (1, 3, 1, 3, ["layers (4) is not divisible by pp (3)"]),
    (2, 2, 2, 4, ["the world has 4 ranks but tp x pp x dp = 2 x 2 x 2 = 8"]),
    (0, 1, 1, None, ["--tp must be an int >= 1, got 0"]),
])
def test_a_layout_that_does_not_divide_is_refused_naming_the_numbers(tp, pp, dp, world, words):
    with pytest.raises(ValueError) as info:
        check_layout(CONFIG, tp, pp, dp, world)
    for w in words:
        assert w in str(info.value)


def test_a_good_layout_passes_and_bad_configs_are_refused():
    check_layout(CONFIG, 2, 2, 2, 8)
    with pytest.raises(ValueError, match="hidden \\(30\\) must be divisible by heads \\(4\\)"):
        GPTConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="GPTConfig.layers must be an int >= 1"):
        GPTConfig(layers=0)
    with pytest.raises(ValueError, match="longer than the model's seq"):
        build_gpt(GPTConfig(seq=4), 0)(torch.zeros(1, 5, dtype=torch.int64))


def _tensor_parallel():
    model = apply_tp(build_gpt(CONFIG, SEED, torch.float64), None)
    x, y = _batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    block = model.blocks[1]
    return (float(loss), model.embed.tok.weight.grad.clone(), model.head.out.weight.grad.clone(),
            block.attn.qkv.full_weight(grad=True), block.mlp.fc2.full_weight(grad=True))


def test_tensor_parallel_gpt_equals_the_single_process_model():
    ref, ref_loss = _reference()
    for loss, tok, out, qkv, fc2 in launch(_tensor_parallel, 2, timeout=120):
        assert abs(loss - ref_loss) < TOL
        torch.testing.assert_close(tok, ref.embed.tok.weight.grad, rtol=0, atol=TOL)
        torch.testing.assert_close(out, ref.head.out.weight.grad, rtol=0, atol=TOL)
        torch.testing.assert_close(qkv, ref.blocks[1].attn.qkv.weight.grad, rtol=0, atol=TOL)
        torch.testing.assert_close(fc2, ref.blocks[1].mlp.fc2.weight.grad, rtol=0, atol=TOL)


def _tp_times_pp(schedule):
    rank = dist.get_rank()
    stage, tp_rank = divmod(rank, 2)                         # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = apply_tp(build_gpt(CONFIG, SEED, torch.float64), tp_groups[stage])
    stages = pipeline_stages(model, 2)
    x, y = _batch()
    result = pipeline_step(stages[stage], x, y, lm_loss, 2, pp_groups[tp_rank], schedule)
    grads = {}
    if stage == 0:
        grads["tok"] = model.embed.tok.weight.grad.clone()
        grads["qkv0"] = model.blocks[0].attn.qkv.full_weight(grad=True)
    else:
        grads["out"] = model.head.out.weight.grad.clone()
        grads["fc1_3"] = model.blocks[3].mlp.fc1.full_weight(grad=True)
    return float(result.loss), stage, grads


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tp2_times_pp2_gpt_equals_the_single_process_model(schedule):
    ref, ref_loss = _reference()
    want = {"tok": ref.embed.tok.weight.grad, "qkv0": ref.blocks[0].attn.qkv.weight.grad,
            "out": ref.head.out.weight.grad, "fc1_3": ref.blocks[3].mlp.fc1.weight.grad}
    results = launch(_tp_times_pp, 4, schedule, timeout=120)
    assert [stage for _, stage, _ in results] == [0, 0, 1, 1]
    for loss, _, grads in results:
        assert abs(loss - ref_loss) < TOL
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=0, atol=TOL)


def test_pipeline_stages_share_the_model_and_cover_every_block():
    model = build_gpt(CONFIG, SEED)
    stages = pipeline_stages(model, 2)
    ids = {id(p) for s in stages for p in s.parameters()}
    assert ids == {id(p) for p in model.parameters()}
    x, _ = _batch(2, 8)
    out = x
    for s in stages:
        out = s(out)
    torch.testing.assert_close(out, model(x))
    with pytest.raises(ValueError, match="layers \\(4\\) must be divisible by pp \\(3\\)"):
        pipeline_stages(copy.deepcopy(model), 3)
