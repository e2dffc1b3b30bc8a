"""The planner's step timeline: replayed schedules by hand, Megatron-LM's interleaved order, dependencies,
agreement with the analytical step time, the search's re-ranking, the figure."""

import dataclasses

import matplotlib
import pytest
from hypothesis import given, settings, strategies as st

from commlab.parallel.pipeline import BACKWARD, FORWARD, interleaved_schedule, virtual_dependencies
from commlab.parallel.planner import (ZERO_STAGES, Layout, attention_flops_per_token, layer_params, list_software,
                                      load_model, search, step_time)
from commlab.parallel.planner.time_model import sum_of_terms
from commlab.parallel.planner.search import TIMELINE_TOP_K, make_cluster
from commlab.parallel.planner.timeline import (COMM_LANE, COMPUTE_LANE, KINDS, RERANK_MAX_FACTOR, StageCosts, StepCosts,
                                               chunk_layers, make_timeline_schedule, rerank_by_timeline, step_costs,
                                               step_timeline, timeline_from_costs)

matplotlib.use("Agg")


def _unit(p, m, f=1.0, b=2.0, c=0.5, v=1, **kw):
    st_ = StageCosts((f,) * v, (b,) * v)
    return StepCosts((st_,) * p, m, pp_message_s=c, **kw)


def _bars(tl, stage):
    return [(iv.kind, iv.start_s, iv.end_s, iv.microbatch) for iv in tl.stage_intervals(stage)]


# ----------------------------------------------------------------------------------------- by hand

def test_gpipe_two_stages_two_micro_batches_by_hand():
    # F = 1, B = 2, a message 0.5, the sender stalls while it sends (nothing overlapped).
    tl = timeline_from_costs(_unit(2, 2), "gpipe")
    assert _bars(tl, 0) == [("forward", 0, 1, 0), ("pp_send", 1, 1.5, 0), ("forward", 1.5, 2.5, 1),
                            ("pp_send", 2.5, 3, 1), ("bubble", 3, 6, None), ("pp_recv", 6, 6.5, None),
                            ("backward", 6.5, 8.5, 0), ("pp_recv", 8.5, 9, None), ("backward", 9, 11, 1)]
    assert _bars(tl, 1) == [("bubble", 0, 1, None), ("pp_recv", 1, 1.5, None), ("forward", 1.5, 2.5, 0),
                            ("pp_recv", 2.5, 3, None), ("forward", 3, 4, 1), ("backward", 4, 6, 0),
                            ("pp_send", 6, 6.5, 0), ("backward", 6.5, 8.5, 1), ("pp_send", 8.5, 9, 1),
                            ("idle", 9, 11, None)]
    assert tl.step_s == 11


def test_1f1b_two_stages_two_micro_batches_by_hand():
    tl = timeline_from_costs(_unit(2, 2), "1f1b")
    assert _bars(tl, 0) == [("forward", 0, 1, 0), ("pp_send", 1, 1.5, 0), ("forward", 1.5, 2.5, 1),
                            ("pp_send", 2.5, 3, 1), ("bubble", 3, 4.5, None), ("pp_recv", 4.5, 5, None),
                            ("backward", 5, 7, 0), ("bubble", 7, 8, None), ("pp_recv", 8, 8.5, None),
                            ("backward", 8.5, 10.5, 1)]
    assert _bars(tl, 1) == [("bubble", 0, 1, None), ("pp_recv", 1, 1.5, None), ("forward", 1.5, 2.5, 0),
                            ("backward", 2.5, 4.5, 0), ("pp_send", 4.5, 5, 0), ("forward", 5, 6, 1),
                            ("backward", 6, 8, 1), ("pp_send", 8, 8.5, 1), ("idle", 8.5, 10.5, None)]
    assert tl.step_s == 10.5
    for s in range(2):  # the compute lane of every stage covers the step exactly
        assert sum(tl.time_by_kind(s).values()) == pytest.approx(tl.step_s)


def test_overlap_hides_tp_and_the_send_but_not_the_message_latency():
    st_ = StageCosts((1.0,), (2.0,), tp_forward_s=(0.4,), tp_backward_s=(0.4,))
    tl = timeline_from_costs(StepCosts((st_, st_), 1, pp_message_s=0.5, overlap_tp=1.0, overlap_pp=1.0), "1f1b")
    assert tl.time_by_kind(None)["tp"] == 0 and tl.time_by_kind(None)["pp_send"] == 0
    assert tl.time_by_kind(None, COMM_LANE)["tp"] == pytest.approx(4 * 0.4)
    # F0 on stage 0 [0, 1], message [1, 1.5], F0+B0 on stage 1 [1.5, 4.5], gradient [4.5, 5], B0 on stage 0.
    assert tl.ops[(1, FORWARD, 0, 0)][0] == 1.5 and tl.step_s == 7.0


def test_dp_reduction_overlaps_the_last_backward_as_far_as_the_profile_says():
    st_ = StageCosts((1.0,), (2.0,))
    for overlap, expected in ((0.0, 3 + 1.5), (1.0, 3 + 0.0), (0.5, 3 + 0.75)):
        tl = timeline_from_costs(StepCosts((st_,), 1, dp_reduce=(("dp_reduce_scatter", 1.5),),
                                           overlap_dp_grad_reduce=overlap), "1f1b")
        assert tl.step_s == pytest.approx(expected)
    # Longer than the backward it hides behind: the rest is exposed (1.5 + 1.5 hidden from t = 1, ends at 4).
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_reduce=(("dp_reduce_scatter", 3.0),),
                                       overlap_dp_grad_reduce=1.0), "1f1b")
    assert tl.step_s == pytest.approx(4.0) and tl.time_by_kind(0)["dp_reduce_scatter"] == pytest.approx(1.0)


def test_compute_beside_communication_slows_by_the_profiles_factor():
    # compute_slowdown = 2: compute runs at half speed while communication runs beside it, so every hidden
    # second costs half a second more, drawn as a slowdown bar on the compute lane.
    st_ = StageCosts((1.0,), (2.0,))
    # The gradient reduction (1.5 s, launched as the backward starts at 1) beside the 2 s backward: 0.75 s more;
    # the reduction ended at 2.5, before the compute's 3.75.
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_reduce=(("dp_reduce_scatter", 1.5),),
                                       overlap_dp_grad_reduce=1.0, compute_slowdown=2.0), "1f1b")
    assert tl.step_s == pytest.approx(3.75) and tl.time_by_kind(0)["slowdown"] == pytest.approx(0.75)
    # Longer (3 s, to t = 4) than the backward: at half speed the backward does 1.5 s of its 2 s of work by then,
    # the last 0.5 s alone: it ends at 4.5, and nothing of the reduction is exposed.
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_reduce=(("dp_reduce_scatter", 3.0),),
                                       overlap_dp_grad_reduce=1.0, compute_slowdown=2.0), "1f1b")
    assert tl.step_s == pytest.approx(4.5) and tl.time_by_kind(0)["dp_reduce_scatter"] == pytest.approx(0.0)
    # Longer than the backward can last even slowed (5 s against 2 x 2 s): the backward runs at half speed
    # throughout, to t = 5, and the reduction's last second is exposed.
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_reduce=(("dp_reduce_scatter", 5.0),),
                                       overlap_dp_grad_reduce=1.0, compute_slowdown=2.0), "1f1b")
    assert tl.step_s == pytest.approx(6.0) and tl.time_by_kind(0)["dp_reduce_scatter"] == pytest.approx(1.0)
    # The last bucket (a fifth of 1.5 s) starts only once the slowed backward is over (3 + 0.6 for the 1.2 s
    # beside it), and is exposed.
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_reduce=(("dp_reduce_scatter", 1.5),), overlap_dp_grad_reduce=1.0,
                                       dp_reduce_tail=0.2, compute_slowdown=2.0), "1f1b")
    assert tl.step_s == pytest.approx(3.6 + 0.3)
    # The overlapped parameter AllGather (0.8 s from the step's start) beside the first forward: 0.4 s more,
    # charged as the stage opens (a stage that waits for its input there pays nothing).
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_gather_s=0.8, overlap_dp_param_gather=1.0,
                                       compute_slowdown=2.0), "1f1b")
    assert _bars(tl, 0) == [("slowdown", 0, 0.4, None), ("forward", 0.4, 1.4, 0), ("backward", 1.4, 3.4, 0)]
    # Hidden TP (0.4 s of each op's, overlap_tp = 1): 0.2 s more per op, after its compute.
    tl = timeline_from_costs(StepCosts((StageCosts((1.0,), (2.0,), tp_forward_s=(0.4,), tp_backward_s=(0.4,)),), 1,
                                       overlap_tp=1.0, compute_slowdown=2.0), "1f1b")
    assert tl.step_s == pytest.approx(3.4) and tl.time_by_kind(0)["slowdown"] == pytest.approx(0.4)
    # A hidden pipeline send (0.5 s) slows its sender by 0.25 s; the message itself is not delayed.
    tl = timeline_from_costs(StepCosts((st_, st_), 1, pp_message_s=0.5, overlap_pp=1.0, compute_slowdown=2.0),
                             "1f1b")
    assert tl.ops[(1, FORWARD, 0, 0)][0] == pytest.approx(1.5)
    assert tl.time_by_kind(0)["slowdown"] == pytest.approx(0.25) and tl.time_by_kind(1)["slowdown"] == 0.25
    # ZeRO-3: a chunk's 0.3 s AllGather hides behind its forward and costs 0.15 s more.
    tl = timeline_from_costs(StepCosts((st_,), 1, fsdp_gather_s=0.3, overlap_dp_param_gather=1.0,
                                       compute_slowdown=2.0), "1f1b")
    assert tl.step_s == pytest.approx(3.0 + 2 * 0.15)
    for t in (tl,):
        assert sum(t.time_by_kind(0).values()) == pytest.approx(t.step_s)


def test_the_slowdown_in_the_replay_matches_the_time_model_on_one_stage():
    # Megatron-Core on H100 (TP, DP gather and reduction all overlapped, compute 1/1.189 as fast beside them):
    # with one stage the replay and the time model price the same step, the slowdown included.
    m = load_model("mcore-gpt-32b")
    c = make_cluster("dgx-h100-ndr", 384)
    lay = Layout(8, 1, 48, micro_batch=4, zero1=True, recompute="none")
    tl = step_timeline(m, lay, c, 192, "megatron-core-2024")
    ana = step_time(m, lay, c, 192, software="megatron-core-2024")
    assert ana.overlap_slowdown_s > 0.05 * ana.total_s
    assert tl.step_s == pytest.approx(ana.total_s, rel=1e-9)
    assert tl.time_by_kind(0)["slowdown"] == pytest.approx(ana.overlap_slowdown_s, rel=1e-9)


def test_the_last_bucket_and_the_first_gathered_bucket_cannot_hide():
    st_ = StageCosts((1.0,), (2.0,))
    # A fifth of the 1.5 s reduction is the last bucket: launched when the backward ends at 3, after the
    # other 1.2 s (launched at 1, done at 2.2), so the step ends at 3 + 0.3.
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_reduce=(("dp_reduce_scatter", 1.5),), overlap_dp_grad_reduce=1.0,
                                       dp_reduce_tail=0.2), "1f1b")
    assert tl.step_s == pytest.approx(3.3) and tl.time_by_kind(0)["dp_reduce_scatter"] == pytest.approx(0.3)
    # The first gathered bucket, half of a 0.8 s overlapped AllGather, delays the first forward to 0.4; the
    # rest (done at 0.8) hides behind it; then the backward, and the non-overlapped nothing.
    tl = timeline_from_costs(StepCosts((st_,), 1, dp_gather_s=0.8, overlap_dp_param_gather=1.0,
                                       dp_gather_head=0.5), "1f1b")
    assert _bars(tl, 0) == [("dp_all_gather", 0, 0.4, None), ("forward", 0.4, 1.4, 0), ("backward", 1.4, 3.4, 0)]
    assert tl.step_s == pytest.approx(3.4)
    # Stage 1 waits for its input anyway (from 1.4 + message 0.5): its gathered bucket costs it nothing.
    tl = timeline_from_costs(StepCosts((st_, st_), 1, pp_message_s=0.5, dp_gather_s=0.8,
                                       overlap_dp_param_gather=1.0, dp_gather_head=0.5), "1f1b")
    assert tl.ops[(1, FORWARD, 0, 0)][0] == pytest.approx(1.9)
    for st in range(2):
        assert sum(tl.time_by_kind(st).values()) == pytest.approx(tl.step_s)
    with pytest.raises(ValueError, match="dp_reduce_tail"):
        StepCosts((st_,), 1, dp_reduce_tail=2.0)


# ----------------------------------------------------------------------------------------- interleaved order

def test_interleaved_order_p2_v2_m4_is_megatron_lms():
    # Megatron-LM forward_backward_pipelining_with_interleaving: warm-up 2(p-s-1) + (v-1)p forwards (4 on
    # stage 0, 2 on stage 1); k-th forward on chunk (k mod pv)//p, micro-batch (k//pv)p + k mod p; backwards
    # on the chunks in reverse.
    got = [[f"{o.kind}{o.microbatch}.{o.chunk}" for o in ops] for ops in interleaved_schedule(2, 4, 2)]
    assert got[0] == "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0".split()
    assert got[1] == "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0".split()
    # m == p: all forwards first (Megatron's all-warm-up case).
    assert [o.kind for o in interleaved_schedule(2, 2, 2)[1]] == [FORWARD] * 4 + [BACKWARD] * 4
    # Stage 0's chunk 1 waits for stage 1's chunk 0 (the model wraps around the pipeline).
    assert virtual_dependencies(interleaved_schedule(2, 4, 2)[0][2], 2, 2) == [(1, FORWARD, 0, 0)]


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="m=3 micro-batches to be a multiple of p=2"):
        make_timeline_schedule("interleaved", 2, 3, 2)
    with pytest.raises(ValueError, match="m=1 micro-batches to be a multiple of p=4"):
        interleaved_schedule(4, 1, 2)
    with pytest.raises(ValueError, match=r"v must be an int >= 1 \(interleave: model chunks per stage\), got 0"):
        make_timeline_schedule(None, 2, 4, 0)
    with pytest.raises(ValueError, match="v must be an int >= 1"):
        interleaved_schedule(2, 4, 0)
    with pytest.raises(ValueError, match="'zero-bubble'"):
        make_timeline_schedule("zero-bubble", 2, 4)
    with pytest.raises(ValueError, match="v=2; use 'interleaved'"):
        make_timeline_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="p >= 2"):
        interleaved_schedule(1, 4, 2)
    with pytest.raises(ValueError, match="forward_s must be finite seconds >= 0"):
        StageCosts((-1.0,), (1.0,))
    with pytest.raises(ValueError, match="overlap_pp must be a share"):
        _unit(2, 2, overlap_pp=1.5)
    with pytest.raises(ValueError, match="same number of chunks"):
        StepCosts((StageCosts((1.0,), (1.0,)), StageCosts((1.0, 1.0), (1.0, 1.0))), 2)
    with pytest.raises(ValueError, match="timeline_top must be an int >= 0"):
        search("megatron-1.7b", "dgx-a100-hdr", 32, 512, timeline_top=-1)


# ----------------------------------------------------------------------------------------- properties

@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 4), k=st.integers(1, 3), v=st.integers(1, 3), sched=st.sampled_from(["gpipe", "1f1b",
       "interleaved"]), f=st.floats(0.1, 3), b=st.floats(0.1, 3), c=st.floats(0, 1), ov=st.sampled_from([0, 0.5, 1]))
def test_dependencies_are_never_violated(p, k, v, sched, f, b, c, ov):
    if sched != "interleaved":
        v = 1
    elif p == 1:
        p = 2
    m = k * p
    stages = tuple(StageCosts(tuple(f * (1 + 0.1 * s) for _ in range(v)), tuple(b for _ in range(v)))
                   for s in range(p))
    tl = timeline_from_costs(StepCosts(stages, m, pp_message_s=c, overlap_pp=ov), sched)
    for s, ops in enumerate(make_timeline_schedule(sched, p, m, v)):
        prev_end = 0.0
        for op in ops:
            start, end = tl.ops[(s, op.kind, op.microbatch, op.chunk)]
            assert start >= prev_end - 1e-12  # the stage's own order
            for dep in virtual_dependencies(op, p, v):
                assert start >= tl.arrivals[dep][1] - 1e-12  # the input has arrived
                assert tl.arrivals[dep][1] == pytest.approx(tl.ops[dep][1] - (1 - ov) * c + c)
            prev_end = end
        bars = sorted((iv.start_s, iv.end_s) for iv in tl.stage_intervals(s))
        assert all(a[1] <= b_[0] + 1e-9 for a, b_ in zip(bars, bars[1:]))  # one stream: no two bars at once
        assert sum(e - a for a, e in bars) == pytest.approx(tl.step_s)
    assert tl.step_s >= max(m * v * (f * (1 + 0.1 * s) + b) for s in range(p)) - 1e-9


# ----------------------------------------------------------------------------------------- vs analytical

@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 8), (6, 12)])
def test_unit_timeline_against_the_analytical_bubble(p, m):
    f, b, c = 1.0, 2.0, 0.25
    analytical = (1 + (p - 1) / m) * m * (f + b + 2 * c)
    assert timeline_from_costs(_unit(p, m, f, b, c), "gpipe").step_s == pytest.approx(analytical - 2 * c)
    one = timeline_from_costs(_unit(p, m, f, b, c), "1f1b").step_s
    assert one == pytest.approx(analytical - ((m + 1) * c if p == 2 else 3 * c))
    # Without messages the replay is the analytical form exactly, interleaved included ((p-1)/(v·m)).
    for v in (1, 2):
        sched = "interleaved" if v > 1 else "1f1b"
        if v > 1 and m % p:
            continue
        tl = timeline_from_costs(_unit(p, m, f / v, b / v, 0.0, v=v), sched)
        assert tl.step_s == pytest.approx((1 + (p - 1) / (v * m)) * m * (f + b))


_UNIFORM_LAYOUTS = [(8, 1, 1, 1, "full"), (4, 1, 1, 2, "selective"), (4, 4, 1, 1, "full"), (8, 2, 1, 2, "none"),
                    (4, 4, 2, 1, "full"), (2, 8, 3, 1, "selective")]


@pytest.mark.parametrize("software", list_software())
def test_the_replay_is_the_step_time_on_uniform_stages(software):
    # Every stage as the heaviest (step_costs(uniform=True), what step_time sums), every ZeRO stage, pp = 1,
    # pp > 1 and interleaved, each profile's overlap settings: both read every op from chunk_ops and the DP
    # communication from dp_times, so with one stage they are one number; with several, exactly one too
    # when messages are free. A message's transit is the one thing only the replay has (the sum charges
    # each op its send on its stream, the replay also waits for its arrival in the fill and drain), so
    # with messages they differ by less than the messages of one stage.
    m, c = load_model("megatron-39.1b"), make_cluster("dgx-h100-ndr", 512)
    for z in ZERO_STAGES:
        for tp, pp, v, b, rec in _UNIFORM_LAYOUTS:
            lay = Layout(tp=tp, pp=pp, dp=512 // (tp * pp), micro_batch=b, zero_stage=z, recompute=rec, interleave=v)
            costs, bd = step_costs(m, lay, c, lay.dp * b * 16, software, uniform=True)
            assert bd == step_time(m, lay, c, lay.dp * b * 16, software=software)
            replayed = timeline_from_costs(costs, record=False).step_s
            if pp == 1:
                assert replayed == pytest.approx(bd.total_s, rel=1e-9), lay.short()
                continue
            free = dataclasses.replace(costs, pp_message_s=0.0)
            assert timeline_from_costs(free, record=False).step_s == pytest.approx(sum_of_terms(free).total_s,
                                                                                 rel=1e-9), lay.short()
            messages = 2 * (costs.micro_batches * v + pp - 1) * costs.pp_message_s
            assert 0 < abs(replayed - bd.total_s) < messages, lay.short()


def test_model_timeline_agrees_with_step_time_with_even_stages_and_no_overlap():
    # 24 layers over 4 stages; a 64-token vocabulary makes the output layer (placed on the last stage by
    # the timeline, spread by the analytical form) negligible, so only the messages differ: < 0.5 %.
    m = dataclasses.replace(load_model("megatron-1.7b"), vocab=64)
    c = make_cluster("dgx-a100-hdr", 64)
    for lay in (Layout(tp=2, pp=4, dp=8, micro_batch=2, recompute="full"),
                Layout(tp=1, pp=4, dp=16, micro_batch=1, recompute="none")):
        for sched in ("gpipe", "1f1b"):
            tl = step_timeline(m, lay, c, 512, "generic-no-overlap", sched)
            ana = step_time(m, lay, c, 512, software="generic-no-overlap").total_s
            assert tl.step_s == pytest.approx(ana, rel=5e-3), (lay.short(), sched)


def test_backward_tp_overlap_in_the_replay_matches_the_time_model():
    # Korthikanti et al.'s stack hides the backward's input-gradient reductions behind the weight-gradient
    # GEMMs (overlap_tp_backward): in the replay the hidden share runs on the comm lane of each backward, and
    # the step and its exposed TP agree with the analytical form (one stage: no messages, no bubble).
    # On PCIe the weight-gradient GEMMs bound what hides, and the replay must bound it the same way.
    m = load_model("korthikanti-22b")
    cases = [(Layout(8, 1, 1, micro_batch=4, recompute="full", sequence_parallel=False, flash_attention=False),
              "megatron-lm-2022-full-recompute"),
             (Layout(8, 1, 1, micro_batch=4, recompute="selective", sequence_parallel=True, flash_attention=False),
              "megatron-lm-2022-sp-selective")]
    for (lay, sw), preset in [(case, p) for case in cases for p in ("dgx-a100-hdr", "pcie-gen4-node")]:
        c = make_cluster(preset, 8)
        tl = step_timeline(m, lay, c, 4, sw, "1f1b")
        ana = step_time(m, lay, c, 4, software=sw)
        assert ana.tp_hidden_s > 0
        assert tl.step_s == pytest.approx(ana.total_s, rel=1e-9)
        assert tl.time_by_kind(0)["tp"] == pytest.approx(ana.tp_s, rel=1e-9)
        assert tl.time_by_kind(0, COMM_LANE)["tp"] == pytest.approx(ana.tp_hidden_s, rel=1e-9)


def test_stage_costs_add_up_to_the_time_models_compute():
    m = load_model("llama3-405b").with_seq(8192)
    lay = Layout(tp=8, pp=16, dp=128, micro_batch=1, zero1=True, recompute="selective", interleave=4)
    costs, bd = step_costs(m, lay, make_cluster("dgx-h100-ndr", 16384), 2048, "megatron-core")
    per_micro = sum(sum(s.forward_s) + sum(s.backward_s) + sum(s.recompute_s) for s in costs.stages)
    # The time model prices one GPU of the heaviest stage (8 of the 126 layers); the stages together hold 126,
    # and the last chunk of the last stage the loss too, split 38 : 14 between its forward and backward.
    assert per_micro * costs.micro_batches == pytest.approx(bd.compute_s * 126 / 8 + bd.loss_s)
    assert bd.loss_s > 0
    fwd = sum(sum(s.forward_s) for s in costs.stages) * costs.micro_batches - bd.loss_s * 38 / 52
    bwd = sum(sum(s.backward_s) for s in costs.stages) * costs.micro_batches - bd.loss_s * 14 / 52
    att_f, att_b = attention_flops_per_token(m, True, True)
    weights = m.layers * layer_params(m) + m.vocab * m.hidden
    assert fwd / bwd == pytest.approx((2 * weights + m.layers * att_f) / (4 * weights + m.layers * att_b))
    tp_total = sum(sum(s.tp_forward_s) + sum(s.tp_backward_s) + sum(s.tp_recompute_s) for s in costs.stages)
    assert tp_total * costs.micro_batches == pytest.approx((bd.tp_s + bd.tp_hidden_s) * 126 / 8)
    assert chunk_layers(126, 16) == [[7]] + [[8]] * 14 + [[7]]  # Llama 3: one layer fewer on first and last
    assert sum(map(sum, chunk_layers(126, 16, 4))) == 126 and max(map(sum, chunk_layers(126, 16, 4))) == 8


# ----------------------------------------------------------------------------------------- search, figure

def test_search_reranks_its_top_candidates_by_the_timeline():
    res = search("megatron-39.1b", "dgx-a100-hdr", 512, 1536, software="megatron-lm-2021")
    analytical = search("megatron-39.1b", "dgx-a100-hdr", 512, 1536, software="megatron-lm-2021", timeline_top=0).plans
    assert len(analytical) > RERANK_MAX_FACTOR * TIMELINE_TOP_K and all(p.timeline_step_s is None for p in analytical)
    replayed = [p for p in res.plans if p.timeline_step_s is not None]
    # The first TIMELINE_TOP_K by the sum of terms are replayed, then each next one while its sum is below
    # the TIMELINE_TOP_K-th best replay so far, at most RERANK_MAX_FACTOR times as many in all.
    n = len(replayed)
    assert TIMELINE_TOP_K <= n <= RERANK_MAX_FACTOR * TIMELINE_TOP_K
    assert {p.layout for p in replayed} == {p.layout for p in analytical[:n]}
    if n < RERANK_MAX_FACTOR * TIMELINE_TOP_K and n < len(analytical):
        kth = sorted(p.timeline_step_s for p in replayed)[TIMELINE_TOP_K - 1]
        assert analytical[n].step_s >= kth  # the first plan left unreplayed could not have entered the top
    # One ranking by step time (the replay's where there is one), the first places all replayed.
    assert [p.step_s for p in res.plans] == sorted(p.step_s for p in res.plans)
    assert all(p.timeline_step_s is not None for p in res.plans[:TIMELINE_TOP_K])
    assert res.plans[0].row()["step_s"] == res.plans[0].timeline_step_s


def _with_sum(plan, total):
    """The plan with its analytical step time set to ``total`` seconds (the change put on its compute)."""
    time = dataclasses.replace(plan.time, compute_s=plan.time.compute_s + total - plan.time.total_s)
    return dataclasses.replace(plan, time=time)


def test_rerank_replays_past_the_first_k_when_a_later_plan_could_enter_them():
    # Three real plans whose sums of terms are set by hand, k = 1: the first sum is the smallest; the
    # second lies just below the first plan's replay, so it could still replay into first place and is
    # replayed; the third lies above every replay and is left unreplayed, after both.
    m, c = load_model("megatron-76.1b"), make_cluster("dgx-a100-hdr", 1024)
    plans = search(m, c, 1024, 1024, software="megatron-lm-2021", timeline_top=0).plans[:3]
    replay = [step_timeline(m, p.layout, c, 1024, "megatron-lm-2021", record=False).step_s for p in plans]

    sums = [0.5 * replay[0], 0.999 * replay[0], 1.01 * max(replay)]
    given = [_with_sum(p, s) for p, s in zip(plans, sums)]
    assert [p.time.total_s for p in given] == pytest.approx(sums)
    out = rerank_by_timeline(given, 1, m, c, 1024, "megatron-lm-2021")
    assert [p.timeline_step_s for p in out[:2]] == pytest.approx(sorted(replay[:2]))
    assert out[2].layout == plans[2].layout and out[2].timeline_step_s is None
    # k = 1 and the second sum above the first replay: only the first is replayed.
    given[1] = _with_sum(plans[1], 1.001 * replay[0])
    out = rerank_by_timeline(given, 1, m, c, 1024, "megatron-lm-2021")
    assert [p.timeline_step_s is not None for p in out] == [True, False, False]
    assert rerank_by_timeline(given, 0, m, c, 1024, "megatron-lm-2021") == given  # k = 0: as given


def test_rerank_keeps_replayed_plans_first_under_its_cap_and_on_ties():
    m, c = load_model("megatron-39.1b"), make_cluster("dgx-a100-hdr", 512)
    plans = search(m, c, 512, 1536, software="megatron-lm-2021", timeline_top=0).plans[:6]
    replay = [step_timeline(m, p.layout, c, 1536, "megatron-lm-2021", record=False).step_s for p in plans]

    # Every sum far below every replay (and the first replay slower than its sum): each next plan could
    # still win, so the search replays until its cap, RERANK_MAX_FACTOR * k = 4 for k = 1, and the first
    # place is still a replayed plan, the fastest replay.
    tiny = [_with_sum(p, 1e-3 * (i + 1)) for i, p in enumerate(plans)]
    out = rerank_by_timeline(tiny, 1, m, c, 1536, "megatron-lm-2021")
    assert sum(p.timeline_step_s is not None for p in out) == RERANK_MAX_FACTOR
    assert out[0].timeline_step_s == pytest.approx(min(replay[:RERANK_MAX_FACTOR]))
    # A sum equal to the best replay (replays so far exactly their sums) is replayed: it could tie.
    tie = [_with_sum(plans[0], replay[0]), _with_sum(plans[1], replay[0])] + [_with_sum(p, 10 * max(replay))
                                                                           for p in plans[2:]]
    out = rerank_by_timeline(tie, 1, m, c, 1536, "megatron-lm-2021")
    assert [p.timeline_step_s is not None for p in out[:2]] == [True, True]
    assert all(p.timeline_step_s is None for p in out[2:])


def test_fsdp_is_replayed_per_op_and_agrees_with_the_time_model():
    # ZeRO-3 on torchtitan's profile, one pipeline stage: each micro-batch's forward gathers the parameters
    # and its backward gathers them again and reduce-scatters the gradients, hidden behind that op's compute
    # but for the heads no prefetch hides; the replay and the time model then give the same step.
    m, c = load_model("megatron-39.1b"), make_cluster("dgx-h100-ndr", 512)
    for lay in (Layout(tp=4, pp=1, dp=128, micro_batch=4, zero_stage=3),    # the windows hold everything
                Layout(tp=2, pp=1, dp=256, micro_batch=2, zero_stage=3)):   # the backward's window is full
        t = step_time(m, lay, c, 1536, software="torchtitan")
        tl = step_timeline(m, lay, c, 1536, "torchtitan")
        assert tl.step_s == pytest.approx(t.total_s, rel=1e-9), lay
        kinds = tl.time_by_kind(None)
        assert kinds["dp_all_gather"] + kinds["dp_reduce_scatter"] == pytest.approx(t.dp_exposed_s, rel=1e-9)
        assert t.dp_exposed_s > 0
        # every micro-batch's forward gathers on the comm lane (the hidden part), none waits for a whole-step gather
        gathers = [iv for iv in tl.intervals if iv.kind == "dp_all_gather" and iv.lane == COMM_LANE]
        assert len(gathers) == 2 * t.micro_batches
    costs, _ = step_costs(m, Layout(tp=4, pp=1, dp=128, micro_batch=4, zero_stage=3), c, 1536, "torchtitan")
    assert costs.dp_reduce == () and costs.dp_gather_s == 0 and costs.fsdp_gather_s > 0 and costs.fsdp_reduce_s > 0
    with pytest.raises(ValueError, match="fsdp_head_share"):
        dataclasses.replace(costs, fsdp_head_share=1.5)


def test_fsdp_with_pipeline_stages_keeps_each_stream_serial():
    # ZeRO-3 with 4 even stages: an op's exposed gather and ReduceScatter are part of it (its message leaves
    # after them), so the replay stays within a few per cent of the time model (the stages differ: the
    # first and last hold the embedding, the output layer and the loss) and every stage's compute stream
    # holds one bar at a time.
    m, c = load_model("megatron-39.1b"), make_cluster("dgx-h100-ndr", 512)
    lay = Layout(tp=4, pp=4, dp=32, micro_batch=2, zero_stage=3)
    t = step_time(m, lay, c, 1536, software="torchtitan")
    tl = step_timeline(m, lay, c, 1536, "torchtitan")
    assert tl.step_s == pytest.approx(t.total_s, rel=0.03)
    for s in range(lay.pp):
        bars = sorted((iv for iv in tl.intervals if iv.stage == s and iv.lane == COMPUTE_LANE),
                      key=lambda iv: (iv.start_s, iv.end_s))
        assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(bars, bars[1:])), s
        exposed = sum(iv.duration_s for iv in bars if iv.kind in ("dp_all_gather", "dp_reduce_scatter"))
        # (each stage's windows are its own chunks', the last stage's with the output layer and the loss; the
        # time model's are the heaviest stage's: they differ by a little)
        assert exposed == pytest.approx(t.dp_exposed_s, rel=0.03), s
    # a message leaves once the op's exposed ReduceScatter is over (the same stream)
    for key, (sent, _) in tl.arrivals.items():
        start, end = tl.ops[key]
        rs = [iv for iv in tl.intervals if iv.stage == key[0] and iv.kind == "dp_reduce_scatter"
              and iv.lane == COMPUTE_LANE and start <= iv.start_s < end]
        assert all(iv.end_s <= sent + 1e-9 for iv in rs)
    assert any(iv.kind == "dp_reduce_scatter" and iv.lane == COMPUTE_LANE for iv in tl.intervals)


def test_plot_step_timeline_llama3_405b():
    from commlab.viz import plot_step_timeline
    m = load_model("llama3-405b").with_seq(8192)
    lay = Layout(tp=8, pp=16, dp=128, micro_batch=1, recompute="full", interleave=4)
    tl = step_timeline(m, lay, make_cluster("dgx-h100-ndr", 16384), 2048, "megatron-core")
    assert set(tl.time_by_kind(None)) == set(KINDS)
    fig = plot_step_timeline(tl)
    ax = fig.axes[0]
    assert fig.get_size_inches()[0] <= 6.9 and len(ax.get_yticklabels()) == 16
    texts = [t for t in ax.get_yticklabels() + ax.get_xticklabels()] + list(fig.legends[0].get_texts())
    assert min(t.get_fontsize() for t in texts) >= 9
    with pytest.raises(ValueError, match="recorded timeline"):
        plot_step_timeline(step_timeline(m, lay, make_cluster("dgx-h100-ndr", 16384), 2048, "megatron-core",
                                         record=False))
