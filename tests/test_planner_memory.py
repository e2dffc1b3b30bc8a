"""The planner's memory model, each term against a value computed by hand from its source's formula:
activations by recompute policy (Korthikanti et al. 2022, §4-5, Table 2), the interleaved schedule's factor
(§4.2.3; Megatron-LM theoretical_memory_usage.py), bytes per parameter by optimizer dtype option (Megatron-LM
docs/user-guide/features/dist_optimizer.md), ZeRO-2/3 memory and the bytes ZeRO-3 moves (Rajbhandari et al.
2020, §5), the memory reserve and the fragile flag; bad input named in the error."""

import dataclasses

import pytest

from commlab import hardware
from commlab.__main__ import main
from commlab.parallel.planner import (OPTIMIZER_DTYPES, Layout, ModelConfig, activation_bytes_per_layer,
                                      dp_all_reduce_seconds, dp_gradient_nbytes, op_times,
                                      fsdp_units,
                                      fsdp_head_share, interleave_memory_factor, is_fragile, layer_params,
                                      load_model, load_software, make_cluster, memory_breakdown,
                                      model_state_bytes_per_param, search, stage_params, step_time,
                                      usable_memory_bytes)
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner import group_all_reduce_seconds
from commlab.parallel.planner.software import optimizer_dtypes

TINY = ModelConfig(name="tiny", layers=2, hidden=8, heads=2, ffn=32, vocab=16, seq=4)
DEEP = ModelConfig(name="deep", layers=8, hidden=8, heads=2, ffn=32, vocab=16, seq=4)
SBH = 4 * 1 * 8  # s·b·h of TINY at micro-batch 1


# ----------------------------------------------------------------------------------------- activations

def test_activation_bytes_per_policy_by_hand():
    kw = dict(flash_attention=False)
    # sbh(34 + 5as/h): 5·2·4/8 = 5 -> 39 per token-width; selective drops the 5as/h term; full keeps 2sbh.
    assert activation_bytes_per_layer(TINY, 1, 1, False, "none", **kw) == SBH * 39 == 1248
    assert activation_bytes_per_layer(TINY, 1, 1, False, "selective", **kw) == SBH * 34
    assert activation_bytes_per_layer(TINY, 1, 1, False, "full", **kw) == 2 * SBH
    # TP and SP: everything / t.
    assert activation_bytes_per_layer(TINY, 1, 2, True, "none", **kw) == SBH * 39 / 2
    assert activation_bytes_per_layer(TINY, 1, 2, True, "selective", **kw) == SBH * 34 / 2
    assert activation_bytes_per_layer(TINY, 1, 2, True, "full", **kw) == 2 * SBH / 2


def test_every_k_is_the_mix_of_whole_layers():
    # 2 layers, k = 2: one layer keeps only its input (2sbh), one keeps all (39 sbh), and one layer's full
    # activations are the working set while it is recomputed.
    lay = Layout(1, 1, 1, recompute="every-k", recompute_every=2, flash_attention=False, sequence_parallel=False)
    mem = memory_breakdown(TINY, lay)
    logits = 4 * 4 * 1 * 16
    assert mem.activations_bytes == 2 * SBH + 39 * SBH + 39 * SBH + logits


def test_interleaved_factor_and_in_flight_micro_batches():
    assert interleave_memory_factor(4, 1) == 1.0
    assert interleave_memory_factor(4, 2) == 1 + 3 / 8
    assert interleave_memory_factor(16, 4) == 1 + 15 / 64
    # DEEP: 8 layers, pp = 4, v = 2: the first stage holds 2 layers, 4 micro-batches × 1.375 in flight.
    lay = Layout(1, 4, 1, interleave=2, flash_attention=False, sequence_parallel=False)
    mem = memory_breakdown(DEEP, lay, global_batch=8)
    assert mem.stage == "first" and mem.in_flight == 4 * 1.375
    assert mem.activations_bytes == 2 * 1248 * 5.5
    # plain 1F1B with fewer micro-batches than stages holds only those.
    assert memory_breakdown(DEEP, Layout(1, 4, 1, flash_attention=False), global_batch=2).in_flight <= 2
    with pytest.raises(ValueError, match="interleave"):
        interleave_memory_factor(4, 0)


# ----------------------------------------------------------------------------------------- states

@pytest.mark.parametrize("option, grad_bytes, plain, dist", [
    ("bf16-fp32-adam", 4, 18, (6, 12)),   # dist_optimizer.md: bf16 params, fp32 grads: 18 | 6 + 12/d
    ("fp16-fp32-adam", 2, 20, (4, 16)),   # fp16 params, fp16 grads: 20 | 4 + 16/d
    ("fp32-adam", 4, 16, (8, 8)),         # fp32 params, fp32 grads: 16 | 8 + 8/d
])
def test_bytes_per_parameter_are_megatrons_table(option, grad_bytes, plain, dist):
    assert sum(model_state_bytes_per_param(option, grad_bytes, 0, 1)) == plain
    assert sum(model_state_bytes_per_param(option, grad_bytes, 1, 8)) == dist[0] + dist[1] / 8


def test_bf16_moments_and_the_profiles_options():
    assert sum(model_state_bytes_per_param("bf16-bf16-moments-adam", 4)) == 2 + 4 + 4 + 4
    assert load_software("megatron-core").optimizer_state_bytes == 12
    assert load_software("megatron-lm-2021").optimizer_dtypes == "fp16-fp32-adam"
    assert load_software("torchtitan").optimizer.param_bytes == 4
    assert set(OPTIMIZER_DTYPES) >= {"bf16-fp32-adam", "fp16-fp32-adam", "fp32-adam"}


def test_zero_stages_shard_states_then_grads_then_params():
    p = stage_params(TINY, 1, "only")
    by_stage = {z: memory_breakdown(TINY, Layout(1, 1, 4, zero_stage=z), 4, grad_bytes=4, optimizer="bf16-fp32-adam")
                for z in range(4)}
    assert (by_stage[0].weights_bytes, by_stage[0].gradients_bytes, by_stage[0].optimizer_bytes) == (2 * p, 4 * p, 12 * p)
    assert (by_stage[1].weights_bytes, by_stage[1].gradients_bytes, by_stage[1].optimizer_bytes) == (2 * p, 4 * p, 3 * p)
    assert (by_stage[2].weights_bytes, by_stage[2].gradients_bytes, by_stage[2].optimizer_bytes) == (2 * p, p, 3 * p)
    # ZeRO-3: 1/dp of everything, plus two gathered bf16 layers and one layer's unsharded gradients: bf16 as
    # autograd makes them (2 B) beside the fp32 ReduceScatter input they are copied into (4 B), FSDP2
    # _fsdp_collectives.py foreach_reduce frees the first only after the copy-in.
    lp = layer_params(TINY)
    assert by_stage[3].weights_bytes == 2 * p / 4 + 2 * 2 * lp
    assert by_stage[3].gradients_bytes == 4 * p / 4 + (2 + 4) * lp
    assert by_stage[3].optimizer_bytes == 3 * p
    assert Layout(1, 1, 4, zero1=True).zero_stage == 1 and Layout(1, 1, 4, zero_stage=3).zero1
    assert Layout(8, 16, 128, zero_stage=3).short().endswith("zero3")


def _ring_ag(nbytes, n, link):
    """A ring AllGather (or ReduceScatter) of ``nbytes`` over ``n`` ranks: (n-1)·α + (n-1)/n·nbytes·β."""
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes * link.beta_s_per_byte


def test_zero2_reduce_scatters_every_micro_batch_and_zero3_gathers_per_unit():
    # One node of 8 GPUs, dp = 8, two micro-batches. DEEP has 8 blocks: torchtitan's FSDP units are the
    # blocks, the embedding and the norm with the output layer, 10, each its own collective with its own
    # latency (N-1)·α (a ring; Thakur et al. 2005), the bytes split among them.
    m, c = DEEP, make_cluster("dgx-a100-hdr", 8)
    base = dict(tp=1, pp=1, dp=8, micro_batch=1, recompute="none")
    lay = Layout(**base, zero_stage=3)
    units, micro = 10, 2
    assert fsdp_units(m, lay) == units
    g4, g2 = dp_gradient_nbytes(m, lay, 4), dp_gradient_nbytes(m, lay, 2)
    rs, ag = units * _ring_ag(g4 / units, 8, c.intra), units * _ring_ag(g2 / units, 8, c.intra)
    # (the default profile reduces bf16 gradients, 2 bytes; torchtitan's fp32, 4)
    t1 = step_time(m, Layout(**base, zero_stage=1), c, 16)
    assert (t1.dp_reduce_scatter_s, t1.dp_all_gather_s) == pytest.approx((_ring_ag(g2, 8, c.intra),
                                                                           _ring_ag(g2, 8, c.intra)))
    # ZeRO-2 as DeepSpeed runs it (runtime/engine.py: stage >= 2 reduces at every micro-batch, not only at the
    # accumulation boundary): a ReduceScatter after each backward, the parameters gathered once per step.
    t2 = step_time(m, Layout(**base, zero_stage=2), c, 16)
    assert t2.dp_reduce_scatter_s == pytest.approx(micro * ag) and t2.dp_all_gather_s == t1.dp_all_gather_s
    # ZeRO-2 as FSDP2 runs it (reshard_after_forward=False; reshard_after_backward by default): gathered
    # again before each micro-batch's forward too.
    assert load_software("torchtitan").zero2_reshard_after_backward
    t2f = step_time(m, Layout(**base, zero_stage=2), c, 16, software="torchtitan")
    assert (t2f.dp_reduce_scatter_s, t2f.dp_all_gather_s) == pytest.approx((micro * rs, micro * ag))
    # ZeRO-3 (FSDP): per micro-batch each unit's AllGather before the forward and the backward, its
    # ReduceScatter after: the latency 3·units·(N-1)·α per micro-batch, not 3·(N-1)·α.
    t3 = step_time(m, lay, c, 16, software="torchtitan")
    assert t3.micro_batches == micro
    assert t3.dp_reduce_scatter_s == pytest.approx(micro * rs)
    assert t3.dp_all_gather_s == pytest.approx(2 * micro * ag)
    bandwidth = micro * 7 / 8 * (g4 + 2 * g2) * c.intra.beta_s_per_byte
    assert t3.dp_s - bandwidth == pytest.approx(3 * micro * units * 7 * c.intra.alpha_s)
    # By hand: AG 1 s, RS 2 s, forward 0.5 s, backward 1 s, both fully overlappable: hidden 0.5 + 1.
    assert _fsdp(1.0, 2.0, 0.5, 1.0, 1.0, 1.0) == (4.0 - 1.5, 1.5)
    assert _fsdp(1.0, 2.0, 5.0, 5.0, 0.0, 0.0) == (4.0, 0.0)
    with pytest.raises(ValueError, match="gather_hidable_s"):
        _fsdp(1.0, 1.0, 1.0, 1.0, 1.5, 0.0)
    # With a head share: 0.1 of the forward AllGather and of the ReduceScatter are exposed whatever the
    # windows: hidden 0.9 + (1 + 1.8), exposed 0.1 + 0.2.
    exposed, hidden = _fsdp(1.0, 2.0, 5.0, 5.0, 1.0, 1.0, 0.1)
    assert (exposed, hidden) == pytest.approx((0.3, 3.7))
    with pytest.raises(ValueError, match="hidable_s must be finite seconds >= 0"):
        _fsdp(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.2)


def _fsdp(gather_s, reduce_s, forward_s, backward_s, gather_overlap, reduce_overlap, head_share=0.0):
    """``(exposed, hidden)`` of one micro-batch's ZeRO-3 communication as the time model prices it: one
    forward and one backward op (:func:`op_times`), the head share exposed in the forward's AllGather and
    the ReduceScatter."""
    g, r, h = gather_s, reduce_s, head_share
    fwd = op_times(forward_s, gather_s=g, gather_hidable_s=gather_overlap * (1 - h) * g)
    bwd = op_times(backward_s, gather_s=g, gather_hidable_s=gather_overlap * g, reduce_s=r,
                   reduce_hidable_s=reduce_overlap * (1 - h) * r)
    hidden = fwd.gather_hidden_s + bwd.gather_hidden_s + bwd.reduce_hidden_s
    return fwd.wait_s + bwd.wait_s + bwd.reduce_exposed_s, hidden


def test_fsdp_head_share_by_hand():
    # torchtitan's units: the token embedding, every block, the norm with the output layer, the root. The
    # embedding's and the first block's AllGathers open each forward with nothing to hide behind, and their
    # ReduceScatters close the backward.
    m = load_model("megatron-39.1b")
    block = 12 * m.hidden ** 2 + 13 * m.hidden  # GPT block with biases (Narayanan et al. 2021's count)
    assert layer_params(m) == block
    embedding = m.vocab * m.hidden + m.seq * m.hidden  # learned positions
    head = 2 * m.hidden  # final norm; the output layer is tied to the embedding
    assert m.tied_embeddings and m.learned_positions
    total = m.layers * block + embedding + head
    assert fsdp_head_share(m, Layout(4, 1, 128, zero_stage=3)) == pytest.approx((embedding + block) / total)
    # With pipeline stages: the heavier of the first stage (the embedding and a block) and the last (a block).
    first = 12 * block + embedding
    last = 12 * block + head + m.vocab * m.hidden  # the last stage keeps its own copy of the tied embedding
    assert stage_params(m, 4, "first") == first and stage_params(m, 4, "last") == last
    want = (embedding + block) / first if first >= last else block / last
    assert fsdp_head_share(m, Layout(4, 4, 32, zero_stage=3)) == pytest.approx(want)


def test_torchtitan_is_priced_and_searched_with_fsdp():
    res = search(DEEP, "dgx-a100-hdr", 16, 32, software="torchtitan", pp_values=[1])
    assert any(p.layout.zero_stage == 3 for p in res.plans)


def test_hsdp_shards_inside_the_group_and_all_reduces_across_replicas():
    # HSDP: dp = 16 as 2 groups of 8 (a DGX node each): ZeRO-3 shards by 8, not 16.
    p = stage_params(TINY, 1, "only")
    lp = layer_params(TINY)
    lay = Layout(1, 1, 16, zero_stage=3, dp_shard=8)
    assert (lay.shard_ranks, lay.replicas) == (8, 2) and lay.short().endswith("zero3 hsdp8x2")
    mb = memory_breakdown(TINY, lay, 16, grad_bytes=4, optimizer="bf16-fp32-adam")
    assert mb.weights_bytes == 2 * p / 8 + 2 * 2 * lp
    assert mb.optimizer_bytes == 12 * p / 8
    # Time, by hand: per micro-batch and FSDP unit (10 of them) a ReduceScatter over the 8 GPUs of a node (half a
    # ring AllReduce on NVLink), then an AllReduce of the 1/8 shard across the 2 nodes (one GPU per node in each
    # replica group, all 8 GPUs of a node sending at once through its NICs).
    m, c = DEEP, make_cluster("dgx-a100-hdr", 16)
    t = step_time(m, Layout(1, 1, 16, zero_stage=3, dp_shard=8), c, 32, software="generic-no-overlap")
    g, u = dp_gradient_nbytes(m, lay, 2), 10
    intra = u * ring_all_reduce_seconds(g / u, 8, c.intra.alpha_s, c.intra.beta_s_per_byte) / 2
    across = u * ring_all_reduce_seconds(g / 8 / u, 2, c.inter.alpha_s, c.inter.beta_s_per_byte * 8 / c.nics_per_node)
    assert t.micro_batches == 2
    assert t.dp_reduce_scatter_s == pytest.approx(2 * (intra + across))
    assert t.dp_all_gather_s == pytest.approx(2 * 2 * intra)
    assert group_all_reduce_seconds(g, 16, 1, c) == dp_all_reduce_seconds(g, Layout(1, 1, 16), c)
    # the search tries the in-node shard group under ZeRO-3
    res = search(DEEP, "dgx-a100-hdr", 16, 32, software="torchtitan", pp_values=[1], tp_values=[1])
    assert any(pl.layout.dp_shard == 8 for pl in res.plans)
    with pytest.raises(ValueError, match="dp_shard=3 does not divide dp=16"):
        Layout(1, 1, 16, zero_stage=3, dp_shard=3)
    with pytest.raises(ValueError, match="needs a ZeRO stage"):
        Layout(1, 1, 16, dp_shard=8)
    assert Layout(1, 1, 16, zero_stage=3, dp_shard=16).dp_shard is None


def test_hsdp_shard_groups_span_1_2_4_nodes():
    # 8 nodes, dp = 64 (tp = pp = 1): the search shards over the 8 ranks of 1 node, 16 of 2, 32 of 4 (FSDP2's
    # 2-D mesh takes any shard degree; torchtitan's data_parallel_shard_degree).
    res = search(DEEP, "dgx-a100-hdr", 64, 128, software="torchtitan", pp_values=[1], tp_values=[1],
                 micro_batches=[1], recompute=["none"])
    assert sorted({pl.layout.dp_shard for pl in res.plans} - {None}) == [8, 16, 32]
    # A shard group of 2 nodes (16 ranks, stride 1): a ring ReduceScatter inside each node, then one of the
    # 1/8 slice across the 2 nodes, all 8 GPUs of a node sending through its NICs (hierarchical); then the
    # 1/16 shard all-reduced across the 4 replicas, 16 ranks apart: one GPU per node, a ring over 4 nodes.
    c = make_cluster("dgx-a100-hdr", 64)
    lay = Layout(1, 1, 64, zero_stage=3, dp_shard=16)
    g, u, share = dp_gradient_nbytes(DEEP, lay, 2), 10, 8 / c.nics_per_node
    inter = dataclasses.replace(c.inter, beta_s_per_byte=c.inter.beta_s_per_byte * share)
    rs = u * (_ring_ag(g / u, 8, c.intra) + _ring_ag(g / 8 / u, 2, inter))
    replicas = u * 2 * _ring_ag(g / 16 / u, 4, inter)
    t = step_time(DEEP, lay, c, 128, software="generic-no-overlap")
    assert t.dp_reduce_scatter_s == pytest.approx(t.micro_batches * (rs + replicas))
    assert t.dp_all_gather_s == pytest.approx(2 * t.micro_batches * rs)



def test_hsdp_optimizer_step_updates_the_shard_groups_share():
    # Under HSDP each GPU keeps 1/dp_shard of the optimizer state (memory above) and so updates that share:
    # Adam reads and writes the state, reads the gradient and writes the parameter, at the memory's bandwidth.
    c, sw = make_cluster("dgx-h100-ndr", 16), load_software("torchtitan")
    opt, hbm = sw.optimizer, hardware.value(c.device, "hbm_bytes_per_s")
    for shard in (8, None):
        lay = Layout(1, 1, 16, zero_stage=3, dp_shard=shard)
        t = step_time(DEEP, lay, c, 32, software=sw)
        params = stage_params(DEEP, 1, "only") / (shard or 16)
        assert t.optimizer_s == pytest.approx(params * (2 * opt.state_bytes + sw.grad_bytes + opt.param_bytes) / hbm)


# ----------------------------------------------------------------------------------------- reserve, fragile

def test_reserve_and_fragile_flag():
    assert usable_memory_bytes(80e9) == pytest.approx(72e9)
    assert usable_memory_bytes(80e9, 0.0) == 80e9
    assert is_fragile(69e9, 72e9) and not is_fragile(68e9, 72e9)  # within 5 %: above 68.4 GB
    res = search("megatron-39.1b", "dgx-a100-hdr", 512, 1536)
    cap = 0.9 * 80e9
    assert all(p.memory.total_bytes <= cap for p in res.plans)
    assert all(p.fragile == (p.memory.total_bytes > 0.95 * cap) for p in res.plans)
    assert any(p.fragile for p in res.plans)
    loose = search("megatron-39.1b", "dgx-a100-hdr", 512, 1536, memory_reserve=0.0)
    assert len(loose.plans) > len(res.plans)
    assert len(search("megatron-39.1b", "dgx-a100-hdr", 512, 1536, usable_fraction=1.0).plans) == len(loose.plans)


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match=r"'fp8-adam'.*bf16-fp32-adam"):
        optimizer_dtypes("fp8-adam")
    with pytest.raises(ValueError, match=r"'fp8-adam'"):
        memory_breakdown(TINY, Layout(1, 1, 1), optimizer="fp8-adam")
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"memory_reserve .*\[0, 1\).*{bad}"):
            usable_memory_bytes(80e9, bad)
    with pytest.raises(ValueError, match=r"memory_reserve .*1\.0"):
        search("megatron-1.7b", "dgx-a100-hdr", 32, 512, memory_reserve=1.0)
    with pytest.raises(ValueError, match=r"fragile margin .*1\.2"):
        is_fragile(1.0, 2.0, 1.2)
    for stage in (4, -1, True):
        with pytest.raises(ValueError, match=rf"zero_stage must be one of \[0, 1, 2, 3\].*got {stage!r}"):
            Layout(1, 1, 2, zero_stage=stage)
        with pytest.raises(ValueError, match=r"zero_stage must be one of"):
            model_state_bytes_per_param("bf16-fp32-adam", 4, stage, 2)
    with pytest.raises(ValueError, match="zero1=True contradicts zero_stage=0"):
        Layout(1, 1, 2, zero1=True, zero_stage=0)


def test_cli_plan_shows_the_reserve_and_fragile_plans(capsys):
    assert main(["plan", "--model", "megatron-39.1b", "--preset", "dgx-a100-hdr", "--gpus", "512",
                 "--global-batch", "1536", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "10% of device memory reserved" in out and "fragile" in out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "megatron-39.1b", "--preset", "dgx-a100-hdr", "--gpus", "512",
              "--global-batch", "1536", "--memory-reserve", "1.0"])
    assert "--memory-reserve must be in [0, 1), got 1.0" in capsys.readouterr().err
