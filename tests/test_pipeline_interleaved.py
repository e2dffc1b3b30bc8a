"""Interleaved 1F1B in the engine (v model chunks per rank) against the unpipelined model and the 1F1B engine,
its communication plan under the rendezvous simulator, and ZB-H1 (zero bubble) as data."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commlab import launch
from commlab.parallel.pipeline import (BACKWARD, FORWARD, WEIGHT, CommGroup, Op, bubble_time_ratio, check_schedule,
                                       communication_plan, compare_bubbles, ideal_timeline, idle_fraction,
                                       interleaved_bubble_time_ratio, interleaved_schedule, max_in_flight,
                                       one_f_one_b_schedule, pipeline_step, simulate_plan, split_interleaved,
                                       split_sequential, zb_h1_bubble_time_ratio, zb_h1_schedule)
from commlab.parallel.pipeline.communications import activation_nbytes

P, V, M, BATCH, WIDTH = 2, 2, 4, 8, 6
# Float64: the pipelined sum of micro-batch gradients differs from one backward over the batch in the last
# bits only.
RTOL, ATOL = 1e-12, 1e-14


def _model():
    """9 modules (4 x Linear+Tanh, then Linear): enough to cut into p·v = 8 virtual stages."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layers = [m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())] + [nn.Linear(WIDTH, 3)]
        return nn.Sequential(*layers).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)


def _grads(model, modules):
    names = {id(q): n for n, q in model.named_parameters()}
    return {names[id(q)]: q.grad.clone() for mod in modules for q in mod.parameters()}


def _attempt(*args, **kwargs):
    try:
        pipeline_step(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def _worker():
    # Four ranks: two 2-stage pipelines side by side in disjoint groups (ranks 0-1 and 2-3), then one 4-stage
    # interleaved pipeline over all four.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    world = dist.new_group([0, 1, 2, 3])
    group = pairs[dist.get_rank() // 2]
    rank = dist.get_rank(group)
    x, y = _batch()
    out = {}
    model = _model()
    four = split_interleaved(model, 4, 2)[dist.get_rank()]
    res = pipeline_step(four, x, y, nn.functional.cross_entropy, M, world, schedule="interleaved")
    out["interleaved p=4"] = (res.loss, _grads(model, four))
    model = _model()
    chunks = split_interleaved(model, P, V)[rank]
    res = pipeline_step(chunks, x, y, nn.functional.cross_entropy, M, group, schedule="interleaved")
    out["interleaved"] = (res.loss, _grads(model, chunks), res.timeline, res.nbytes_sent, res.v, res.bubble_fraction)
    model = _model()
    stage = split_sequential(model, P)[rank]
    res = pipeline_step(stage, x, y, nn.functional.cross_entropy, M, group, schedule="1f1b")
    out["1f1b"] = (res.loss, _grads(model, [stage]))
    x12, y12 = torch.cat([x, x[:4]]), torch.cat([y, y[:4]])
    loss = nn.functional.cross_entropy
    out["errors"] = {
        "m=3 not a multiple of p": _attempt(chunks, x12, y12, loss, 3, group, schedule="interleaved"),
        "one chunk": _attempt(chunks[:1], x, y, loss, M, group, schedule="interleaved"),
        "a module, not chunks": _attempt(chunks[0], x, y, loss, M, group, schedule="interleaved"),
        "different v": _attempt(split_interleaved(_model(), P, 2 + rank)[rank], x, y, loss, M, group,
                                schedule="interleaved"),
        "chunks to 1f1b": _attempt(chunks, x, y, loss, M, group, schedule="1f1b"),
    }
    return out


@pytest.fixture(scope="module")
def runs4():
    """One 4-rank job: p = 4, v = 2 over all ranks; then on two disjoint pairs each: the p = 2 interleaved
    step, the 1F1B step of the same model, and the bad calls."""
    return launch(_worker, 4, timeout=90)


@pytest.fixture(scope="module")
def runs(runs4):
    """The first pair's results (the second pair's are checked equal to them)."""
    return runs4[:2]


@pytest.fixture(scope="module")
def reference():
    model = _model()
    x, y = _batch()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: q.grad for n, q in model.named_parameters()}


def test_interleaved_step_equals_the_unpipelined_model_and_the_1f1b_engine(runs, reference):
    ref_loss, ref_grads = reference
    seen = {}
    for rank, out in enumerate(runs):
        loss, grads, *_ = out["interleaved"]
        assert loss == pytest.approx(ref_loss, rel=RTOL)
        assert loss == pytest.approx(out["1f1b"][0], rel=RTOL)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=RTOL, atol=ATOL, msg=f"rank {rank} {name}")
            torch.testing.assert_close(g, runs[0]["1f1b"][1].get(name, runs[1]["1f1b"][1].get(name)),
                                       rtol=RTOL, atol=ATOL, msg=f"rank {rank} {name} vs 1F1B")
        seen.update(grads)
    assert sorted(seen) == sorted(ref_grads)  # every parameter, each on one rank
    # Rank 0 holds virtual stages 0 and 2 (modules 0-2 and 5-6), rank 1 stages 1 and 3 (modules 3-4, 7-8).
    assert sorted(runs[0]["interleaved"][1]) == ["0.bias", "0.weight", "2.bias", "2.weight", "6.bias", "6.weight"]
    assert sorted(runs[1]["interleaved"][1]) == ["4.bias", "4.weight", "8.bias", "8.weight"]


def test_four_stage_interleaved_step_and_the_second_pair_agree(runs4, reference):
    ref_loss, ref_grads = reference
    seen = {}
    for rank, out in enumerate(runs4):
        loss, grads = out["interleaved p=4"]
        assert loss == pytest.approx(ref_loss, rel=RTOL)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=RTOL, atol=ATOL, msg=f"p=4 rank {rank} {name}")
        seen.update(grads)
    assert sorted(seen) == sorted(ref_grads)
    for a, b in ((runs4[0], runs4[2]), (runs4[1], runs4[3])):  # the pipelines side by side computed the same
        assert a["interleaved"][0] == b["interleaved"][0] and a["errors"] == b["errors"]
        for name, g in a["interleaved"][1].items():
            assert torch.equal(g, b["interleaved"][1][name])


def test_interleaved_step_runs_the_schedule_in_order_and_sends_what_the_plan_says(runs):
    schedule = interleaved_schedule(P, M, V)
    plan = communication_plan(schedule, V)
    per_message = activation_nbytes((BATCH // M, WIDTH), torch.float64)  # every boundary carries (2, 6)
    for rank, out in enumerate(runs):
        _, _, timeline, nbytes, v, bubble = out["interleaved"]
        assert v == V and bubble == pytest.approx((1 / 8) / (1 + 1 / 8))  # f = (p-1)/(v·m) = 1/8
        for s in range(P):
            mine = [t for t in timeline if t.stage == s]
            assert [(t.kind, t.microbatch, t.chunk) for t in mine] == [(o.kind, o.microbatch, o.chunk)
                                                                      for o in schedule[s]]
            assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))
        sends = sum(len(it.sends) for it in plan[rank] if isinstance(it, CommGroup))
        assert nbytes == sends * per_message


def test_bad_m_or_v_gets_the_same_clear_error_on_every_rank(runs):
    errors = [out["errors"] for out in runs]
    assert errors[0] == errors[1]
    e = errors[0]
    assert "interleaved 1F1B needs the m=3 micro-batches to be a multiple of p=2 (Megatron-LM asserts it)" in e[
        "m=3 not a multiple of p"]
    assert "interleaved 1F1B needs v >= 2 model chunks (nn.Module) on every stage, got 1" in e["one chunk"]
    assert "use schedule='1f1b'" in e["one chunk"]
    assert "needs this stage's v model chunks as a list" in e["a module, not chunks"]
    assert ("every stage must be called with the same schedule, m, batch size and number of model chunks v "
            "(stage 0: schedule 'interleaved', m=4, batch 8, v=2; stage 1: schedule 'interleaved', m=4, batch 8, "
            "v=3)") in e["different v"]
    assert "the stage must be one nn.Module for this schedule, got list" in e["chunks to 1f1b"]


def test_split_interleaved_deals_virtual_stage_c_p_plus_s_to_rank_s():
    model = _model()
    chunks = split_interleaved(model, 2, 2)
    assert [[len(c) for c in row] for row in chunks] == [[3, 2], [2, 2]]
    assert chunks[1][0][0] is model[3] and chunks[0][1][0] is model[5]
    x = torch.randn(3, WIDTH, dtype=torch.float64)
    assert torch.equal(nn.Sequential(*[chunks[k % 2][k // 2] for k in range(4)])(x), model(x))
    with pytest.raises(ValueError, match="non-empty stages"):
        split_interleaved(model, 4, 3)
    with pytest.raises(ValueError, match="split_interleaved: v must be an int >= 1, got 0"):
        split_interleaved(model, 2, 0)


# ------------------------------------------------------------------------------------ the plan (pure)

@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_the_interleaved_plan_cannot_deadlock(p, v):
    for m in (p, 2 * p, 3 * p, 4 * p):
        schedule = interleaved_schedule(p, m, v)
        check_schedule(schedule)
        plan = communication_plan(schedule, v)
        simulate_plan(plan)  # raises RendezvousDeadlock if stuck, ValueError if the two sides disagree
        for s, items in enumerate(plan):
            assert [it for it in items if isinstance(it, Op)] == schedule[s]
        # Virtual stage k = c·p + s sends its activation to k + 1: the last rank's chunk c feeds rank 0's c + 1.
        wrap = {(msg.src, msg.src_chunk, msg.dst, msg.dst_chunk) for items in plan for it in items
                if isinstance(it, CommGroup) for msg in it.sends if msg.kind == "activation" and msg.src == p - 1}
        assert wrap == {(p - 1, c, 0, c + 1) for c in range(v - 1)}


def _one_group_per_computation(schedule, p, v):
    """The v = 1 rule (a group between every two computations) applied to virtual stages."""
    from commlab.parallel.pipeline.plan import _needs, _produces
    plan = []
    for s, ops in enumerate(schedule):
        items = []
        for i, op in enumerate(ops + [None]):
            sends = () if i == 0 else tuple(x for x in [_produces(ops[i - 1], p, v)] if x)
            recvs = () if op is None else tuple(x for x in [_needs(op, p, v)] if x)
            if sends or recvs:
                items.append(CommGroup(s, sends, recvs))
            if op is not None:
                items.append(op)
        plan.append(items)
    return plan


def test_one_group_per_computation_deadlocks_where_megatrons_steps_do_not():
    from commlab.parallel.pipeline import RendezvousDeadlock
    with pytest.raises(RendezvousDeadlock, match="deadlocks under NCCL's rendezvous rules"):
        simulate_plan(_one_group_per_computation(interleaved_schedule(2, 4, 2), 2, 2))
    simulate_plan(communication_plan(interleaved_schedule(2, 4, 2), 2))


def test_the_plan_refuses_a_schedule_it_cannot_group():
    with pytest.raises(ValueError, match=r"v must be an int >= 1 \(model chunks per stage\), got 0"):
        communication_plan(one_f_one_b_schedule(2, 4), 0)
    with pytest.raises(ValueError, match="groups the steps of interleaved_schedule"):
        communication_plan([list(reversed(ops)) for ops in interleaved_schedule(2, 4, 2)], 2)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (3, 6, 2), (4, 8, 3), (4, 4, 2)])
def test_interleaved_ideal_timeline_has_megatrons_bubble(p, m, v):
    tl = ideal_timeline(interleaved_schedule(p, m, v))
    f = interleaved_bubble_time_ratio(p, m, v)
    assert idle_fraction(tl) == pytest.approx(f / (1 + f), rel=1e-12)


# ------------------------------------------------------------------------------------ ZB-H1 (pure)

@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 11))
def test_zb_h1_is_complete_and_its_timeline_respects_the_dependencies(p, m):
    schedule = zb_h1_schedule(p, m)
    check_schedule(schedule)
    assert all(len(ops) == 3 * m for ops in schedule)
    tl = ideal_timeline(schedule)  # T_F = T_B = T_W = 1
    end = {(t.stage, t.kind, t.microbatch): t.end_s for t in tl}
    for t in tl:
        assert t.duration_s == pytest.approx(1.0)
        if t.kind == FORWARD and t.stage > 0:
            assert t.start_s >= end[(t.stage - 1, FORWARD, t.microbatch)]
        if t.kind == BACKWARD:
            assert t.start_s >= end[(t.stage, FORWARD, t.microbatch)]
            if t.stage < p - 1:  # B waits for the next stage's B only, not for its W
                assert t.start_s >= end[(t.stage + 1, BACKWARD, t.microbatch)]
        if t.kind == WEIGHT:
            assert t.start_s >= end[(t.stage, BACKWARD, t.microbatch)]
    # Every stage reaches 1F1B's peak (stage 0's) and no more: min(p, m) micro-batches held until their W.
    assert max_in_flight(schedule) == [min(p, m)] * p
    if m >= p:
        # Qi et al. 2024 (the authors' table for T_F = T_B = T_W): bubble (p-1)/(3m), a third of 1F1B's.
        busy = 3 * m
        step = max(t.end_s for t in tl)
        assert (step - busy) / busy == pytest.approx(zb_h1_bubble_time_ratio(p, m), abs=1e-12)
        assert zb_h1_bubble_time_ratio(p, m) == pytest.approx(bubble_time_ratio(p, m) / 3)


def test_zb_h1_order_for_two_stages():
    got = [" ".join(f"{o.kind}{o.microbatch}" for o in ops) for ops in zb_h1_schedule(2, 3)]
    # Stage 0: one warm-up forward, W right after each B; stage 1 delays its W's by one step.
    assert got == ["F0 F1 B0 W0 F2 B1 W1 B2 W2", "F0 B0 F1 B1 W0 F2 B2 W1 W2"]
    with pytest.raises(ValueError, match="before the input-gradient backward"):
        check_schedule([[Op(0, FORWARD, 0), Op(0, WEIGHT, 0), Op(0, BACKWARD, 0)]])


def test_compare_bubbles_gives_each_schedules_bubble_beside_its_formula():
    rows = {r["name"]: r for r in compare_bubbles(4, 8, 2)}
    assert list(rows) == ["1F1B", "interleaved 1F1B, v = 2", "ZB-H1"]
    for r in rows.values():
        assert r["bubble_time_ratio"] == pytest.approx(r["formula"], rel=1e-12)
    assert [rows[n]["formula"] for n in rows] == [3 / 8, 3 / 16, 1 / 8]
    assert rows["1F1B"]["step"] == 33 and rows["ZB-H1"]["step"] == 27  # (m+p-1)·3 vs 3m + p - 1
    assert max(rows["ZB-H1"]["max_in_flight"]) == max(rows["1F1B"]["max_in_flight"]) == 4
    # Interleaving's memory price on stage 0: p·(1 + (p-1)/(p·v)) = 4·(1 + 3/8) = 5.5 stage micro-batches.
    assert rows["interleaved 1F1B, v = 2"]["peak_activations"] == 5.5


def test_plot_schedule_comparison_draws_three_panels_on_one_time_axis():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from commlab.viz import plot_schedule_comparison

    fig = plot_schedule_comparison(2, 4, 2)
    axes = fig.axes
    assert len(axes) == 3 and len({ax.get_xlim() for ax in axes}) == 1
    # A grey row per stage and one bar per op: 1F1B 2·2m, interleaved 2·2·m·v, ZB-H1 2·3m.
    assert [len(ax.collections) for ax in axes] == [2 + 16, 2 + 32, 2 + 24]
    assert "interleaved 1F1B, v = 2" in axes[1].get_title() and "formula 0.125" in axes[1].get_title()
    assert [t.get_text() for t in axes[2].get_legend().get_texts()] == [
        "forward", "input gradient (B)", "weight gradient (W)", "idle (bubble)"]
    assert "chunk 1" in [t.get_text() for t in axes[1].get_legend().get_texts()]
    plt.close(fig)
