"""The planner's software profiles and the terms they drive, each against a value computed by hand from its
source's formula: PP scatter/gather bytes (Narayanan et al. 2021, §4.1), the interleaved bubble (§2.2.2),
DP as ReduceScatter + AllGather with only the remainder exposed, selective recomputation (Korthikanti et
al. 2022, §5), causal FlashAttention FLOPs (FlashAttention-2's benchmark accounting), executed vs model FLOPs
(no embedding matmul, no recomputed output layer, Megatron's Eq. 3)."""

import dataclasses
import math

import pytest

from commlab.__main__ import main
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner import (FLOP_DEFINITIONS, RECOMPUTE_POLICIES, Layout, ModelConfig, SoftwareProfile,
                                      attention_flops_per_token, dp_exposed_seconds, dp_gradient_nbytes,
                                      dp_last_bucket_share,
                                      dp_all_reduce_seconds, executed_flops_per_token, layer_params, list_software,
                                      korthikanti_eq7_flops, load_model, load_software, make_cluster,
                                      megatron_eq3_flops,
                                      memory_breakdown, model_flops_per_step, model_flops_per_token,
                                      parameter_count, pp_message_nbytes, search, step_time)
from commlab.parallel.planner.communication import backward_tp_hidden_seconds, beside_seconds, slowdown_seconds
from commlab.parallel.planner.time_model import loss_seconds
from commlab.parallel.planner.counting import column_wgrad_flops_per_token, input_grad_share
from commlab.parallel.planner.validation import _reported_tflops
from commlab.parallel.planner.software import _FIELDS

TINY = ModelConfig(name="tiny", layers=2, hidden=8, heads=2, ffn=32, vocab=16, seq=4)


# ----------------------------------------------------------------------------------------- profiles

@pytest.mark.parametrize("name", list_software())
def test_every_profile_loads_and_every_field_has_a_source(name):
    p = load_software(name)
    assert set(p.sources) == set(_FIELDS)
    assert all(src.strip() for src in p.sources.values())
    assert p.recompute in RECOMPUTE_POLICIES


def test_the_published_stacks_are_there():
    assert {"megatron-lm-2021", "megatron-lm-2022-sp-selective", "megatron-core", "torchtitan",
            "megatron-deepspeed"} <= set(list_software())
    old, core = load_software("megatron-lm-2021"), load_software("megatron-core")
    assert old.pp_scatter_gather and not old.sequence_parallel and old.overlap_dp_grad_reduce == 0
    assert core.sequence_parallel and core.overlap_dp_grad_reduce == 1 and core.recompute == "selective"
    assert load_software(None).name == "generic-no-overlap"
    # Table 1's four smaller runs used PyTorch's DDP (run_table_1.sh): the same stack, the gradient AllReduce
    # overlapped with the last backward pass; nothing else differs
    torch_ddp = load_software("megatron-lm-2021-torch-ddp")
    assert torch_ddp.overlap_dp_grad_reduce == 1
    # ... and its 25 MiB buckets of fp16 gradients (PyTorch DDP's default), which the local DDP has no use for
    assert torch_ddp.bucket_params(32) == 25 * 2**20 / 2 and old.bucket_params(32) == 0
    assert dataclasses.replace(torch_ddp, name=old.name, description=old.description, sources=old.sources,
                               overlap_dp_grad_reduce=0.0, dp_bucket_params=0.0) == old


def test_each_stack_offers_only_its_zero_stages():
    # torchtitan's docs/fsdp.md maps FSDP2 to ZeRO-2, ZeRO-3, MiCS (HSDP) and hpZ: no ZeRO-1, which its
    # search therefore never tries; Megatron-LM of 2021 had no distributed optimizer.
    titan = load_software("torchtitan")
    assert titan.zero_stages == (0, 2, 3) and "docs/fsdp.md" in titan.sources["zero_stages"]
    res = search("megatron-39.1b", "dgx-h100-ndr", 512, 1536, software=titan, timeline_top=0)
    assert {p.layout.zero_stage for p in res.plans} | {r.layout.zero_stage for r in res.rejected} == {0, 2, 3}
    assert load_software("megatron-lm-2021").zero_stages == (0,)
    assert load_software("megatron-core").zero_stages == (0, 1)


def test_the_megatron_deepspeed_profile_states_bloom_176b_s_stack():
    # DeepSpeed's PipelineEngine (2022) splits the boundary activation over the tp ranks (PartitionedTensor),
    # reduces the gradients only after the last micro-batch and sends with blocking send/recv; the
    # BF16_Optimizer accumulates fp32 gradients and shards the fp32 master weights and Adam states (ZeRO-1)
    mds = load_software("megatron-deepspeed")
    assert mds.pp_scatter_gather and not mds.sequence_parallel and not mds.flash_attention
    assert (mds.overlap_dp_grad_reduce, mds.overlap_dp_param_gather, mds.overlap_tp, mds.overlap_pp) == (0, 0, 0, 0)
    assert mds.grad_bytes == 4 and mds.optimizer_dtypes == "bf16-fp32-adam" and mds.optimizer_state_bytes == 12
    assert (mds.recompute, mds.recompute_every, mds.zero_stages) == ("full", 1, (0, 1))
    assert "56c5223868" in mds.sources["pp_scatter_gather"] and "CUDA_LAUNCH_BLOCKING" in mds.sources[
        "overlap_dp_grad_reduce"]


def test_megatron_core_2024_overlaps_pipeline_sends_only_when_interleaving():
    sw = load_software("megatron-core-2024")
    assert sw.even_stages and sw.overlap_pp_needs_interleave and sw.overlap_pp == 1.0
    assert sw.pp_overlap(1) == 0.0 and sw.pp_overlap(2) == 1.0
    assert load_software("megatron-core").pp_overlap(1) == 1.0  # Meta's stack, which it stands in for
    m, c = load_model("mcore-gpt-462b"), make_cluster("dgx-h100-ndr", 6144)
    flat = Layout(tp=8, pp=16, dp=48, micro_batch=1, zero1=True)
    t = step_time(m, flat, c, 3072, software=sw)
    assert t.pp_hidden_s == 0 and t.pp_s > 0  # v = 1: every send exposed
    t2 = step_time(m, dataclasses.replace(flat, interleave=7), c, 3072, software=sw)
    assert t2.pp_s == 0 and t2.pp_hidden_s > 0  # 112 layers / 16 stages / 7 chunks: hidden


def test_even_stages_come_from_the_profile():
    # 112 layers: with even stages only divisors of 112 and v with pp * v dividing 112 are tried
    res = search("mcore-gpt-462b", "dgx-h100-ndr", 6144, 3072, software="megatron-core-2024", tp_values=[8],
                 micro_batches=(1,), timeline_top=0)
    layouts = [p.layout for p in res.plans] + [r.layout for r in res.rejected]
    assert layouts and all(112 % lay.pp == 0 and 112 % (lay.pp * lay.interleave) == 0 for lay in layouts)
    free = search("mcore-gpt-462b", "dgx-h100-ndr", 6144, 3072, software="megatron-core", tp_values=[8],
                  micro_batches=(1,), timeline_top=0)
    assert any(112 % p.layout.pp for p in free.plans + [r for r in free.rejected if hasattr(r, "layout")])
    with pytest.raises(ValueError, match="even_stages must be True or False, got 'yes'"):
        SoftwareProfile(name="x", even_stages="yes")


def test_bad_profiles_name_the_value_and_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'nope'.*megatron-core"):
        load_software("nope")
    with pytest.raises(ValueError, match=r"overlap_tp must be a share in \[0, 1\].*got 1.5"):
        SoftwareProfile(name="x", overlap_tp=1.5)
    with pytest.raises(ValueError, match=r"overlap_dp_grad_reduce must be a share in \[0, 1\].*got -0.1"):
        SoftwareProfile(name="x", overlap_dp_grad_reduce=-0.1)
    with pytest.raises(ValueError, match=r"'sometimes'.*'none', 'selective', 'full', 'every-k'"):
        SoftwareProfile(name="x", recompute="sometimes")
    with pytest.raises(ValueError, match=r"'sometimes'.*'selective'"):
        Layout(1, 1, 1, recompute="sometimes")
    with pytest.raises(ValueError, match="slowdown"):
        SoftwareProfile(name="x", overlap_compute_slowdown=0.5)
    with pytest.raises(ValueError, match=r"zero_stages = \(4,\) must list distinct ZeRO stages of \[0, 1, 2, 3\]"):
        SoftwareProfile(name="x", zero_stages=(4,))
    with pytest.raises(ValueError, match=r"zero_stages = \[2, 1\]"):
        SoftwareProfile(name="x", zero_stages=[2, 1])
    with pytest.raises(ValueError, match=r"optimizer_dtypes = 'fp8-adam' .*bf16-fp32-adam"):
        SoftwareProfile(name="x", optimizer_dtypes="fp8-adam")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dp_exposed_seconds(1.0, 1.0, 1.2)


def test_a_profile_file_without_a_source_is_refused(tmp_path):
    entry = {f: {"value": v, "source": "x"} for f, v in dataclasses.asdict(SoftwareProfile(name="a")).items()
             if f in _FIELDS}
    entry["overlap_tp"] = {"value": 0.0}
    import json
    path = tmp_path / "software.json"
    path.write_text(json.dumps({"a": entry}))
    with pytest.raises(ValueError, match="'overlap_tp' has no source"):
        load_software("a", path)


# ----------------------------------------------------------------------------------------- FLOP

def test_causal_flash_attention_flops_follow_flashattention2s_accounting():
    m = load_model("llama3-405b")
    s, h = m.seq, m.hidden
    # benchmark_flash_attention.py: fwd = 4·b·s²·heads·head_dim, / 2 when causal; bwd = 2.5·fwd. Per token:
    assert attention_flops_per_token(m, flash_attention=True, causal=True) == (4 * s * h / 2, 2.5 * 4 * s * h / 2)
    assert attention_flops_per_token(m, flash_attention=True, causal=False) == (4 * s * h, 10 * s * h)
    # Without FlashAttention the whole s x s score matrix is computed: PaLM's 12·s·h per layer, fwd + bwd.
    assert sum(attention_flops_per_token(m, flash_attention=False)) == 12 * s * h


def test_no_embedding_matmul_in_the_executed_flops():
    llama = load_model("llama3-405b")  # untied: P holds the input embedding and the output layer
    V, h, L, s = llama.vocab, llama.hidden, llama.layers, llama.seq
    ex = executed_flops_per_token(llama, "none", flash_attention=False)
    assert ex == 6 * (L * layer_params(llama) + V * h) + 12 * L * s * h
    # model FLOP (6P + 12Lhs) count the input-embedding lookup and the final norm as matmul work; executed not.
    assert model_flops_per_token(llama) - ex == 6 * (V * h + h)
    gpt = load_model("megatron-1.7b")  # tied embedding, learned positions
    assert model_flops_per_token(gpt) - executed_flops_per_token(gpt, "none", flash_attention=False) == \
        6 * (gpt.seq * gpt.hidden + 2 * gpt.hidden)


def test_recomputation_does_not_rerun_the_output_layer():
    m = load_model("megatron-18.4b")
    L, s, h = m.layers, m.seq, m.hidden
    none = executed_flops_per_token(m, "none", flash_attention=False)
    full = executed_flops_per_token(m, "full", flash_attention=False)
    assert full - none == L * (2 * layer_params(m) + 4 * s * h)  # no 2·V·h for the logits
    assert executed_flops_per_token(m, True, flash_attention=False) == full
    # every-k: the full forward of floor(L/k) layers.
    assert executed_flops_per_token(m, "every-k", flash_attention=False, recompute_every=3) - none == \
        (L // 3) * (2 * layer_params(m) + 4 * s * h)


def test_megatron_eq3_is_the_executed_count_of_full_recomputation_without_biases():
    # Eq. 3 per token: 96·L·h² + 16·L·s·h + 6·V·h. The executed count of a GPT layer (12h² + 13h weights,
    # full recomputation, no FlashAttention) has the same terms plus 8 FLOP for each of the 13h biases and
    # LayerNorm weights of every layer (2 forward, 4 backward, 2 recomputed forward).
    m = load_model("megatron-18.4b")
    tokens = 1024 * m.seq
    ex = executed_flops_per_token(m, "full", flash_attention=False)
    assert ex * tokens - megatron_eq3_flops(m, 1024) == pytest.approx(8 * 13 * m.layers * m.hidden * tokens,
                                                                      rel=1e-9)


def test_selective_recomputation_reruns_only_the_attention_core():
    m = load_model("megatron-18.4b")
    L, s, h = m.layers, m.seq, m.hidden
    none = executed_flops_per_token(m, "none", flash_attention=False)
    # Korthikanti et al. 2022, §5: QKᵀ and the attention over V, 2·s·h each per token and layer, forward.
    assert executed_flops_per_token(m, "selective", flash_attention=False) - none == L * 4 * s * h
    assert executed_flops_per_token(m, "selective", flash_attention=True) - \
        executed_flops_per_token(m, "none", flash_attention=True) == L * 2 * s * h
    # Selective recomputation also drops the 5·a·s/h score term from the stored activations.
    sel = memory_breakdown(m, Layout(8, 1, 4, recompute="selective", flash_attention=False), 32)
    none_mem = memory_breakdown(m, Layout(8, 1, 4, recompute="none", flash_attention=False), 32)
    fa = memory_breakdown(m, Layout(8, 1, 4, recompute="none", flash_attention=True), 32)
    assert sel.activations_bytes == fa.activations_bytes < none_mem.activations_bytes


def test_flop_converters():
    m = load_model("megatron-1t")
    B = 3072
    assert model_flops_per_step(m, B, "megatron-eq3") == megatron_eq3_flops(m, B)
    assert model_flops_per_step(m, B, "model") == model_flops_per_token(m) * B * m.seq
    assert model_flops_per_step(m, B, "6n") == 6 * parameter_count(m) * B * m.seq
    assert set(FLOP_DEFINITIONS) == {"megatron-eq3", "megatron-2024", "korthikanti-eq7", "model", "6n"}
    with pytest.raises(ValueError, match=r"'palm'.*megatron-eq3"):
        model_flops_per_step(m, B, "palm")


def test_korthikanti_eq7_by_hand():
    # Korthikanti et al. 2022, Appendix A, Eq. 7: 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)). Their 22B model
    # (L 48, h 6144, s 2048, V 51200) at B 4: the weight matmuls 72·4·2048·48·6144² = 1.0687e15, attention
    # s/(6h) = 2048/36864 = 0.05556, logits V/(12·L·h) = 51200/3538944 = 0.01447 of that.
    m = ModelConfig("22b", layers=48, hidden=6144, heads=64, ffn=4 * 6144, seq=2048, vocab=51200)
    weights = 72 * 4 * 2048 * 48 * 6144 ** 2
    assert weights == 1_068_725_302_198_272
    expected = weights * (1 + 2048 / 36864 + 51200 / 3538944)
    assert model_flops_per_step(m, 4, "korthikanti-eq7") == pytest.approx(expected, rel=1e-12)
    assert korthikanti_eq7_flops(m, 4) == pytest.approx(1.14356e15, rel=1e-5)
    # Eq. 3 of Narayanan et al. 2021 adds the layers' recomputed forward (96 = 72·4/3), not the logits'
    # (96/16 = 72/12).
    assert megatron_eq3_flops(m, 4) / korthikanti_eq7_flops(m, 4) == pytest.approx(
        4 / 3 * (1 + 2048 / 36864 + 51200 / (16 * 48 * 6144)) / (1 + 2048 / 36864 + 51200 / 3538944))


def test_reported_tflops_from_the_iteration_time():
    # A row gives the TFLOP/s per GPU its source prints, or its iteration time, from which the definition's
    # FLOP per step gives it; never both, never neither.
    assert _reported_tflops("r", {"tflops_per_gpu": 140.0, "gpus": 8}, 1e15) == 140.0
    assert _reported_tflops("r", {"iteration_s": 1.25, "gpus": 8}, 1e15) == pytest.approx(100.0)
    for bad in ({"gpus": 8}, {"gpus": 8, "tflops_per_gpu": 1.0, "iteration_s": 1.0}):
        with pytest.raises(ValueError, match="'r' must give exactly one of tflops_per_gpu and iteration_s"):
            _reported_tflops("r", bad, 1e15)


def test_time_breakdown_keeps_executed_and_model_flops_apart():
    m = load_model("llama3-405b")
    t = step_time(m, Layout(8, 16, 128, interleave=4, zero1=True, recompute=True), make_cluster("dgx-h100-ndr", 16384),
                  2048)
    tokens = 2048 * m.seq
    assert t.model_flop_per_step == model_flops_per_token(m) * tokens
    assert t.executed_flop_per_step == executed_flops_per_token(m, "full", flash_attention=True) * tokens
    assert t.executed_flop_per_step != t.model_flop_per_step


# ----------------------------------------------------------------------------------------- communication

def test_pp_bytes_per_rank_with_scatter_gather():
    assert pp_message_nbytes(TINY, 2) == 2 * 2 * 4 * 8
    assert pp_message_nbytes(TINY, 2, tp=4, split=True) == 2 * 2 * 4 * 8 / 4
    assert pp_message_nbytes(TINY, 2, tp=4, split=False) == 2 * 2 * 4 * 8
    with pytest.raises(ValueError, match="tp must be"):
        pp_message_nbytes(TINY, 1, tp=0)
    m = load_model("megatron-18.4b")
    c = make_cluster("dgx-a100-hdr", 8)
    layout = Layout(tp=4, pp=2, dp=1, micro_batch=1, sequence_parallel=False, recompute=True, flash_attention=False)
    # tp·pp = 8 GPUs of one node: NVLink. m = 8 micro-batches, one send each way per micro-batch.
    one_whole = c.intra.alpha_s + 2 * m.seq * m.hidden * c.intra.beta_s_per_byte
    one_split = c.intra.alpha_s + 2 * m.seq * m.hidden / 4 * c.intra.beta_s_per_byte
    assert step_time(m, layout, c, 8, software="generic-no-overlap").pp_s == pytest.approx(2 * one_whole * 8)
    assert step_time(m, layout, c, 8, software="megatron-lm-2021").pp_s == pytest.approx(2 * one_split * 8)
    # Sequence parallelism splits the boundary activation by itself.
    sp = dataclasses.replace(layout, sequence_parallel=True)
    assert step_time(m, sp, c, 8, software="generic-no-overlap").pp_s == pytest.approx(2 * one_split * 8)


def test_interleaved_bubble_is_p_minus_1_over_v_m():
    m = load_model("megatron-145.6b")
    c = make_cluster("dgx-a100-hdr", 1536)
    t = step_time(m, Layout(8, 8, 24, interleave=4, recompute=True), c, 2304, software="megatron-lm-2021")
    assert t.micro_batches == 96
    assert t.bubble_s == pytest.approx((8 - 1) / (4 * 96) * (t.compute_s + t.tp_s + t.pp_s + t.loss_s))


def test_dp_remainder_after_overlap_by_hand():
    assert dp_exposed_seconds(1.0, 0.4, 1.0) == pytest.approx((0.6, 0.4))
    assert dp_exposed_seconds(1.0, 2.0, 0.5) == pytest.approx((0.5, 0.5))
    assert dp_exposed_seconds(1.0, 2.0, 1.0, gather_s=0.3, gather_window_s=0.1, gather_overlap=1.0) == \
        pytest.approx((0.2, 1.1))
    assert dp_exposed_seconds(1.0, 2.0, 0.0, 0.3, 2.0, 0.0) == pytest.approx((1.3, 0.0))
    # The last bucket's share of the reduction and the first bucket's share of the gather cannot hide.
    assert dp_exposed_seconds(1.0, 2.0, 1.0, 0.3, 2.0, 1.0, reduce_tail=0.25, gather_head=0.5) == \
        pytest.approx((0.25 + 0.15, 0.75 + 0.15))
    assert dp_exposed_seconds(1.0, 0.5, 1.0, reduce_tail=0.25) == pytest.approx((0.5, 0.5))  # the window binds
    # Compute at half speed beside communication: the 0.5 s window lasts up to 1 s, and holds all of the 1 s
    # reduction; at 1/1.2 of its speed it lasts up to 0.6 s; a window longer than the reduction holds it all.
    assert dp_exposed_seconds(1.0, 0.5, 1.0, slowdown=2.0) == pytest.approx((0.0, 1.0))
    assert dp_exposed_seconds(1.0, 0.5, 1.0, slowdown=1.2) == pytest.approx((0.4, 0.6))
    assert dp_exposed_seconds(0.3, 1.0, 1.0, slowdown=2.0) == pytest.approx((0.0, 0.3))
    assert beside_seconds(1.0, 0.5, 1.2) == pytest.approx(0.6) and beside_seconds(0.3, 1.0, 2.0) == 0.3
    # A computation entirely beside communication takes slowdown times as long (Lee et al. 2025's definition).
    assert 0.5 + slowdown_seconds(beside_seconds(5.0, 0.5, 1.189), 1.189) == pytest.approx(0.5 * 1.189)
    for bad in (0.9, True, "2"):
        with pytest.raises(ValueError, match="slowdown"):
            dp_exposed_seconds(1.0, 0.5, 1.0, slowdown=bad)
    with pytest.raises(ValueError, match="reduce_tail"):
        dp_exposed_seconds(1.0, 2.0, 1.0, reduce_tail=1.5)


def test_buckets_and_the_last_bucket_by_hand():
    core = load_software("megatron-core-2024")
    assert core.bucket_params(8) == 40e6 and core.bucket_params(64) == 64e6  # max(40M, 1M per DP rank)
    with pytest.raises(ValueError, match="dp_bucket_params"):
        core.replace(dp_bucket_params=-1)
    m = load_model("mcore-gpt-1.7b")  # untied embeddings: V·h (and any position table) in, V·h out
    lay = Layout(1, 1, 48, zero1=True)
    emb = m.vocab * m.hidden + (m.seq * m.hidden if m.learned_positions else 0)
    layer, out = layer_params(m), m.vocab * m.hidden
    assert not m.tied_embeddings
    total = dp_gradient_nbytes(m, lay, 1)
    assert total == parameter_count(m)
    # Every layer (50M) fills a 48M bucket on its own: the last bucket is the input embedding alone.
    assert dp_last_bucket_share(m, lay, 48e6) == pytest.approx(emb / total)
    # 330M: the output layer and two layers close the first bucket, then seven layers each: 2 + 3·7 = 23,
    # and the 24th layer is left open, to be reduced with the embedding.
    assert 2 * layer + out >= 330e6 > layer + out and 7 * layer >= 330e6 > 6 * layer
    assert dp_last_bucket_share(m, lay, 330e6) == pytest.approx((layer + emb) / total)
    assert dp_last_bucket_share(m, lay, 0) == 0.0  # no buckets given: the overlap share alone decides
    # pp > 1: the first stage's first chunk, ceil(L/(pp·v)) layers, tp splits every matrix
    lay = Layout(2, 4, 6, interleave=3, zero1=True)
    assert dp_last_bucket_share(m, lay, 1e12) == pytest.approx((2 * layer + emb) / 2 / dp_gradient_nbytes(m, lay, 1))


def test_dp_is_reduce_scatter_plus_all_gather_hidden_behind_the_last_backward_and_first_forward():
    m = load_model("llama3-405b")
    c = make_cluster("dgx-h100-ndr", 16384)
    layout = Layout(8, 16, 128, micro_batch=1, interleave=4, zero1=True, recompute=True)
    core = load_software("megatron-core")
    t = step_time(m, layout, c, 2048, software=core)
    # ReduceScatter of the fp32 gradient shard, AllGather of the bf16 parameters: half a ring AllReduce each.
    rs = dp_all_reduce_seconds(dp_gradient_nbytes(m, layout, 4), layout, c) / 2
    ag = dp_all_reduce_seconds(dp_gradient_nbytes(m, layout, 2), layout, c) / 2
    assert (t.dp_reduce_scatter_s, t.dp_all_gather_s) == pytest.approx((rs, ag))
    assert t.dp_s == pytest.approx(rs + ag)
    # Windows: the last micro-batch's backward and the first one's forward (executed-FLOP shares, and the
    # loss over the vocabulary, split as its bytes are).
    L, s, h, V = m.layers, m.seq, m.hidden, m.vocab
    fwd_attn = 4 * s * h / 2
    forward = 2 * (L * layer_params(m) + V * h) + L * fwd_attn
    executed = executed_flops_per_token(m, "full", flash_attention=True)
    per_micro = t.compute_s / t.micro_batches
    loss_f, loss_b = loss_seconds(m, 1, 8, c.device)
    assert t.loss_s == pytest.approx(t.micro_batches * (loss_f + loss_b)) and loss_f > 0
    bwd_window = per_micro * (1 - forward / executed) + loss_b
    fwd_window = per_micro * forward / executed + loss_f
    # The bucket the backward completes last (and the first gathered): the first chunk's ceil(126/64) = 2
    # layers fill a 128M-element bucket each (400M elements per tp rank), so it holds the input embedding
    # alone; that share of each is exposed whatever the window.
    assert math.ceil(L / (16 * 4)) == 2 and layer_params(m) / 8 >= core.bucket_params(128)
    tail = V * h / 8 / dp_gradient_nbytes(m, layout, 1)
    assert dp_last_bucket_share(m, layout, core.bucket_params(128)) == pytest.approx(tail)
    # Compute beside communication runs 1/1.189 as fast (Lee et al. 2025): each window, slowed, lasts up to
    # 1.189 times its length, and holds that much communication.
    s = core.overlap_compute_slowdown
    assert s == 1.189
    hidden = min(rs * (1 - tail), s * bwd_window) + min(ag * (1 - tail), s * fwd_window)
    assert t.dp_exposed_s == pytest.approx(rs + ag - hidden)
    assert t.overlap_slowdown_s == pytest.approx((hidden + t.tp_hidden_s + t.pp_hidden_s) * (1 - 1 / s))
    # Nothing overlapped: all of it is exposed.
    none = step_time(m, layout, c, 2048, software=core.replace(overlap_dp_grad_reduce=0.0,
                                                               overlap_dp_param_gather=0.0))
    assert none.dp_exposed_s == pytest.approx(rs + ag)


def test_tp_overlap_and_the_compute_slowdown():
    m = load_model("megatron-18.4b")
    c = make_cluster("dgx-a100-hdr", 256)
    layout = Layout(8, 1, 32, micro_batch=1, recompute="selective")
    plain = step_time(m, layout, c, 1024, software="generic-no-overlap")
    core = load_software("megatron-core")
    half = step_time(m, layout, c, 1024, software=core.replace(overlap_tp=0.5, overlap_tp_backward=0.0,
                                                               overlap_dp_grad_reduce=0.0, overlap_dp_param_gather=0.0,
                                                               overlap_compute_slowdown=1.0))
    assert half.tp_hidden_s == pytest.approx(0.5 * plain.tp_s)
    assert half.tp_s == pytest.approx(0.5 * plain.tp_s)
    # With the asynchronous input-gradient ReduceScatters as well (half of the backward's 2 of 4), those hide
    # in full and the rest at 0.5: 0.5 * 2 + 1 + 0.5 * 1 = 2.5 of the 4.
    both = step_time(m, layout, c, 1024, software=core.replace(overlap_tp=0.5, overlap_dp_grad_reduce=0.0,
                                                               overlap_dp_param_gather=0.0))
    assert both.tp_hidden_s == pytest.approx(2.5 / 4 * plain.tp_s)
    slow = step_time(m, layout, c, 1024, software=core.replace(overlap_tp=0.5, overlap_tp_backward=0.0,
                                                               overlap_dp_grad_reduce=0.0, overlap_dp_param_gather=0.0,
                                                               overlap_compute_slowdown=2.0))
    # While the hidden half runs, compute goes at half speed: the step pays half of the hidden time.
    assert slow.overlap_slowdown_s == pytest.approx(0.5 * half.tp_hidden_s)
    assert slow.total_s == pytest.approx(half.total_s + 0.5 * half.tp_hidden_s)
    # Megatron overlaps TP communication (--tp-comm-overlap) only under sequence parallelism; without it only
    # the backward's input-gradient all-reduces hide (overlap_tp_backward), half of TP under selective
    # recomputation (2 of the 4 per layer), and nothing once that share is 0.
    no_sp = dataclasses.replace(layout, sequence_parallel=False)
    async_only = step_time(m, no_sp, c, 1024, software=core)
    assert async_only.tp_hidden_s == pytest.approx(async_only.tp_s) and async_only.tp_s > 0
    serial = step_time(m, no_sp, c, 1024, software=core.replace(overlap_tp_backward=0.0))
    assert serial.tp_hidden_s == 0 and serial.tp_s > 0


def test_backward_tp_hides_behind_the_column_parallel_weight_gradients_by_hand():
    # Korthikanti et al. 2022, section 6.2; Megatron-LM megatron/mpu/layers.py at cfd2e21607: the input
    # gradient of QKV and of the MLP's first linear is reduced asynchronously beside their weight gradient.
    h = 6144
    gpt = ModelConfig(name="g", layers=48, hidden=h, heads=64, ffn=4 * h, vocab=51200, seq=2048)
    assert column_wgrad_flops_per_token(gpt) == (2 * h * 3 * h, 2 * h * 4 * h)  # QKV 6 h^2, MLP 8 h^2
    llama = load_model("llama3-405b")
    kv = llama.kv_heads * llama.hidden // llama.heads
    assert column_wgrad_flops_per_token(llama) == (2 * llama.hidden * (llama.hidden + 2 * kv),
                                                   4 * llama.hidden * llama.ffn)  # gate and up projection
    assert (input_grad_share(False), input_grad_share(True)) == (1.0, 0.5)

    c = make_cluster("dgx-a100-hdr", 8)
    link = c.intra
    one = ring_all_reduce_seconds(4 * 2048 * h * 2, 8, link.alpha_s, link.beta_s_per_byte)
    # Full recomputation without SP: 6 all-reduces per layer and micro-batch, the 2 of the backward hidden.
    full = step_time(gpt, Layout(8, 1, 1, micro_batch=4, recompute="full", sequence_parallel=False,
                                 flash_attention=False), c, 4, software="megatron-lm-2022-full-recompute")
    assert full.tp_s + full.tp_hidden_s == pytest.approx(6 * 48 * one)
    assert full.tp_hidden_s == pytest.approx(2 * 48 * one)
    # SP with selective recomputation: 4 per layer, of which the 2 input-gradient ReduceScatters are half a
    # backward's bytes: one of the four hidden.
    sel = step_time(gpt, Layout(8, 1, 1, micro_batch=4, recompute="selective", sequence_parallel=True,
                                flash_attention=False), c, 4, software="megatron-lm-2022-sp-selective")
    assert sel.tp_hidden_s == pytest.approx(1 * 48 * one)
    assert sel.tp_s == pytest.approx(3 * 48 * one)
    # The 2021 stack of SC'21 reduced in series.
    old = step_time(gpt, Layout(8, 1, 1, micro_batch=4, recompute="full", sequence_parallel=False,
                                flash_attention=False), c, 4, software="megatron-lm-2021")
    assert old.tp_hidden_s == 0


def test_each_input_gradient_hides_behind_its_own_weight_gradient():
    # By hand, one layer and micro-batch with AllReduces of 10 ms: without SP each linear's reduction is one
    # of them; behind QKV's 4 ms weight gradient only 4 ms hide, behind the MLP's 23 ms all 10 -- not the 20
    # that the sum of the two GEMMs would allow.
    assert backward_tp_hidden_seconds(0.010, False, 0.0, 1.0, (0.004, 0.023)) == pytest.approx(0.004 + 0.010)
    # With SP each is a ReduceScatter, half of one: 5 ms, of which QKV's GEMM covers 4; the AllGathers of the
    # other half hide only under --tp-comm-overlap: with overlap_tp 0.5 half of their 10 ms, and each
    # ReduceScatter the larger of 0.5 x 5 and what the asynchronous launch hides.
    assert backward_tp_hidden_seconds(0.010, True, 0.0, 1.0, (0.004, 0.023)) == pytest.approx(0.004 + 0.005)
    assert backward_tp_hidden_seconds(0.010, True, 0.5, 1.0, (0.004, 0.023)) == pytest.approx(
        0.004 + 0.005 + 0.5 * 0.010)
    assert backward_tp_hidden_seconds(0.010, True, 0.5, 0.0, (0.004, 0.023)) == pytest.approx(0.5 * 0.020)
    with pytest.raises(ValueError, match="two times"):
        backward_tp_hidden_seconds(0.010, False, 0.0, 1.0, (0.004,))
    with pytest.raises(ValueError, match="overlap_tp_backward"):
        backward_tp_hidden_seconds(0.010, False, 0.0, 1.5, (0.004, 0.023))


def test_backward_tp_hides_at_most_the_weight_gradient_time():
    # Llama 3 405B's layers on PCIe at tp 8, one achievable fraction: one AllReduce outlasts QKV's weight
    # gradient (grouped-query attention keeps it small) but not the MLP's. Priced by hand: a GEMM of F FLOP per
    # token takes F*b*s/(tp*peak*fraction), one ring AllReduce of the b*s*h*2-byte activation on the link.
    m = load_model("llama3-405b")
    c = make_cluster("pcie-gen4-node", 8)
    lay = Layout(8, 1, 1, micro_batch=1, recompute="none", sequence_parallel=False, flash_attention=True)
    t = step_time(m, lay, c, 1, software="megatron-lm-2022-full-recompute")
    b, s, tp, rate = 1, m.seq, 8, c.peak_flop_per_s["bf16"] * 0.5
    link = c.intra
    one = ring_all_reduce_seconds(b * s * m.hidden * 2, tp, link.alpha_s, link.beta_s_per_byte)
    h, kv, f = m.hidden, m.kv_heads * m.hidden // m.heads, m.ffn
    w_qkv, w_mlp = (2 * h * (h + 2 * kv) * b * s / (tp * rate), 4 * h * f * b * s / (tp * rate))
    assert w_qkv < one < w_mlp
    # QKV's weight gradient, slowed by the reduction beside it (1.189, Lee et al. 2025), lasts 1.189 times as
    # long and hides that much of it.
    slow = load_software("megatron-lm-2022-full-recompute").overlap_compute_slowdown
    assert slow == 1.189 and slow * w_qkv < one
    assert t.tp_hidden_s == pytest.approx(m.layers * (slow * w_qkv + one))
    assert t.tp_s == pytest.approx(m.layers * (4 * one - slow * w_qkv - one))

def test_search_takes_its_knobs_from_the_profile():
    res = search("megatron-18.4b", "dgx-a100-hdr", 256, 1024, software="megatron-lm-2021", micro_batches=(1,),
                 interleave=(1,))
    layouts = [p.layout for p in res.plans] + [r.layout for r in res.rejected]
    assert {lay.recompute for lay in layouts} == {"none", "full"}
    assert not any(lay.zero1 or lay.sequence_parallel or lay.flash_attention for lay in layouts)
    res = search("megatron-18.4b", "dgx-a100-hdr", 256, 1024, software="megatron-core", micro_batches=(1,),
                 interleave=(1,))
    assert {p.layout.recompute for p in res.plans} >= {"selective"}


@pytest.mark.slow
def test_cli_validate_prints_rows_ranks_and_the_median(capsys):
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "median |error|" in out and "rank" in out and "megatron-lm-2021" in out and "llama3-405b-8k-16384gpus" in out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "megatron-1t", "--preset", "dgx-a100-hdr", "--gpus", "3072", "--global-batch",
              "3072", "--software", "nope"])
    assert "unknown software profile 'nope'" in capsys.readouterr().err
