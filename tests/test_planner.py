"""The 3D-parallelism planner: memory model on hand-computed cases, time-model terms, search, the CLI,
the widget's pure helpers, and the check against published layouts (Megatron-LM SC'21 Table 1, Llama 3)."""

import math
import time

import pytest

from commlab.__main__ import main
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner import (AUTO, DEFAULT_ACHIEVABLE_FRACTION, KERNELS, TIMELINE_TOP_K,
                                      activation_bytes_per_layer, compute_model, divisors, dp_all_reduce_seconds,
                                      dp_gradient_nbytes, korthikanti_eq7_flops, layer_params, Layout, list_models,
                                      load_model, load_published, loss_seconds, make_cluster, megatron_eq3_flops,
                                      memory_breakdown, ModelConfig, parameter_count, search, stage_params,
                                      step_time, tp_all_reduce_nbytes, validate_published, validation_table)

TINY = ModelConfig(name="tiny", layers=2, hidden=8, heads=2, ffn=32, vocab=16, seq=4)


# ----------------------------------------------------------------------------------------- parameters

def test_gpt_layer_is_12h2_plus_13h():
    assert layer_params(TINY) == 12 * 8 * 8 + 13 * 8


@pytest.mark.parametrize("name", list_models())
def test_parameter_count_matches_the_source(name):
    m = load_model(name)
    # Megatron prints Eq. 2 rounded to one decimal of a billion (1.65 -> "1.7"); Llama "405B".
    assert m.params == pytest.approx(m.reported_params, rel=0.03), (name, m.params, m.reported_params)


def test_tiny_parameter_count_by_hand():
    # 2 layers x 872 + word embedding 16x8 + positions 4x8 + final LayerNorm 2x8; output layer tied.
    assert parameter_count(TINY) == 2 * 872 + 128 + 32 + 16 == 1920


# ----------------------------------------------------------------------------------------- memory

def test_memory_single_gpu_by_hand():
    mem = memory_breakdown(TINY, Layout(1, 1, 1, micro_batch=1, flash_attention=False, sequence_parallel=False))
    assert mem.params == 1920
    assert (mem.weights_bytes, mem.gradients_bytes, mem.optimizer_bytes) == (3840, 3840, 12 * 1920)
    # Korthikanti et al. 2022: s·b·h·(34 + 5·a·s/h) = 4·1·8·(34 + 5) = 1248 per layer; two layers, plus the
    # fp32 logits 4·s·b·V = 256.
    assert mem.activations_bytes == 2 * 1248 + 256
    assert mem.total_bytes == 3840 * 2 + 23040 + 2752
    assert mem.fits(mem.total_bytes) and not mem.fits(mem.total_bytes - 1)


def test_zero1_shards_only_the_optimizer_states():
    base = memory_breakdown(TINY, Layout(1, 1, 4), global_batch=4)
    z = memory_breakdown(TINY, Layout(1, 1, 4, zero1=True), global_batch=4)
    assert z.optimizer_bytes == base.optimizer_bytes / 4
    assert (z.weights_bytes, z.gradients_bytes, z.activations_bytes) == (
        base.weights_bytes, base.gradients_bytes, base.activations_bytes)
    fp32 = memory_breakdown(TINY, Layout(1, 1, 4), global_batch=4, grad_bytes=4)
    assert fp32.gradients_bytes == 2 * base.gradients_bytes


def test_activation_formulas():
    sbh = 4 * 1 * 8
    assert activation_bytes_per_layer(TINY, 1, 1, flash_attention=False) == sbh * 39
    # TP without sequence parallelism: s·b·h·(10 + 24/t + 5·a·s/(h·t)), t = 2.
    assert activation_bytes_per_layer(TINY, 1, 2, sequence_parallel=False, flash_attention=False) == sbh * (10 + 12 + 2.5)
    # With sequence parallelism everything is divided by t.
    assert activation_bytes_per_layer(TINY, 1, 2, sequence_parallel=True, flash_attention=False) == sbh * 39 / 2
    # Full recomputation keeps each layer's input: 2·s·b·h.
    assert activation_bytes_per_layer(TINY, 2, 1, recompute=True) == 2 * 2 * sbh
    assert activation_bytes_per_layer(TINY, 1, 1, flash_attention=True) == sbh * 34


def test_pipeline_first_stage_holds_pp_micro_batches():
    layout = Layout(1, 2, 1, flash_attention=False, sequence_parallel=False)
    mem = memory_breakdown(TINY, layout, global_batch=8)  # 8 micro-batches, 2 in flight on stage 0
    assert mem.stage == "first"
    assert mem.params == stage_params(TINY, 2, "first") == 872 + 128 + 32
    assert mem.activations_bytes == 2 * 1248
    # With only one micro-batch per step, only one is ever in flight.
    assert memory_breakdown(TINY, layout, global_batch=1).activations_bytes <= 1248 + 256


def test_recompute_saves_memory_and_keeps_one_layer_working_set():
    m = load_model("megatron-1t")
    full = memory_breakdown(m, Layout(8, 64, 6, recompute=False, flash_attention=False, sequence_parallel=False), 3072)
    rec = memory_breakdown(m, Layout(8, 64, 6, recompute=True, flash_attention=False, sequence_parallel=False), 3072)
    assert rec.activations_bytes < full.activations_bytes / 5
    assert rec.fits(80e9)  # Megatron trained exactly this layout on 80 GB A100s
    assert not full.fits(80e9)


# ----------------------------------------------------------------------------------------- time

def test_tp_bytes_are_not_divided_by_tp():
    m = load_model("megatron-18.4b")
    assert tp_all_reduce_nbytes(m, 2) == 2 * 2 * m.seq * m.hidden
    c = make_cluster("dgx-a100-hdr", 256)
    t2 = step_time(m, Layout(2, 1, 128, recompute=False), c, 1024)
    t8 = step_time(m, Layout(8, 1, 32, recompute=False), c, 1024)
    one8 = ring_all_reduce_seconds(tp_all_reduce_nbytes(m, 1), 8, c.intra.alpha_s, c.intra.beta_s_per_byte)
    assert t8.tp_s == pytest.approx(4 * m.layers * t8.micro_batches * one8)
    # Per micro-batch the TP time grows with tp (2(t-1)/t of the bytes per rank), where the article's
    # formula (bytes / bandwidth / tp) would shrink it fourfold.
    assert t8.tp_s / t8.micro_batches > t2.tp_s / t2.micro_batches
    rec = step_time(m, Layout(8, 1, 32, recompute=True), c, 1024)
    assert rec.tp_s == pytest.approx(t8.tp_s * 6 / 4)


def test_dp_bytes_and_link():
    m = load_model("megatron-1t")
    layout = Layout(8, 64, 6)
    nbytes = dp_gradient_nbytes(m, layout)
    assert nbytes == pytest.approx(max(stage_params(m, 64, "first"), stage_params(m, 64, "last")) / 8 * 2)
    assert nbytes == pytest.approx(m.params / (8 * 64) * 2, rel=0.1)
    c = make_cluster("dgx-a100-hdr", 3072)
    # tp·pp = 512 >= 8 devices per node: every DP peer is on another node; 8 NICs for 8 GPUs, no sharing.
    assert dp_all_reduce_seconds(nbytes, layout, c) == pytest.approx(
        ring_all_reduce_seconds(nbytes, 6, c.inter.alpha_s, c.inter.beta_s_per_byte))
    # pcie node: 2 NICs for 8 GPUs, each NIC carries 4 flows.
    p = make_cluster("pcie-gen4-node", 3072)
    assert dp_all_reduce_seconds(nbytes, layout, p) == pytest.approx(
        ring_all_reduce_seconds(nbytes, 6, p.inter.alpha_s, p.inter.beta_s_per_byte * 4))
    # dp inside one node: a ring on NVLink.
    small = Layout(1, 1, 8)
    assert dp_all_reduce_seconds(1e9, small, c) == pytest.approx(
        ring_all_reduce_seconds(1e9, 8, c.intra.alpha_s, c.intra.beta_s_per_byte))


def test_step_time_terms_and_errors():
    m = load_model("megatron-145.6b")
    c = make_cluster("dgx-a100-hdr", 1536)
    t = step_time(m, Layout(8, 8, 24, recompute=True), c, 2304)
    assert t.micro_batches == 96
    assert t.bubble_s == pytest.approx(7 / 96 * (t.compute_s + t.tp_s + t.pp_s + t.loss_s))
    # The default prices compute with the kernel model (A100 has it), which adds the optimizer step.
    assert t.optimizer_s > 0 and t.compute_fraction != 0.5
    assert t.total_s == pytest.approx(t.compute_s + t.loss_s + t.tp_s + t.pp_s + t.bubble_s + t.dp_exposed_s
                                      + t.optimizer_s + t.overlap_slowdown_s)
    assert t.total_s == pytest.approx(step_time(m, Layout(8, 8, 24, recompute=True), c, 2304, "kernels").total_s)
    flat = step_time(m, Layout(8, 8, 24, recompute=True), c, 2304, 0.5)
    assert flat.compute_fraction == 0.5 and flat.optimizer_s == 0
    # The loss on the last stage, every micro-batch: 52 bytes per logit of the rank's 51200/8 over A100's 2,039 GB/s.
    assert t.loss_s == pytest.approx(96 * 52 * 6400 * 1 * 2048 / 2.039e12)
    assert t.tokens_per_s == pytest.approx(2304 * 2048 / t.total_s)
    hidden = step_time(m, Layout(8, 8, 24, recompute=True), c, 2304, dp_overlap=1.0)
    assert hidden.dp_exposed_s <= t.dp_exposed_s
    with pytest.raises(ValueError, match="multiple of dp"):
        step_time(m, Layout(8, 8, 24), c, 100)
    with pytest.raises(ValueError, match="achievable_fraction"):
        step_time(m, Layout(8, 8, 24), c, 2304, achievable_fraction=0)


def test_megatron_eq3_flops():
    m = load_model("megatron-1t")
    # 502 PFLOP/s aggregate at 163 TFLOP/s per GPU on 3072 GPUs: Eq. 3 is what they divide by time.
    f = megatron_eq3_flops(m, 3072)
    assert f == pytest.approx(96 * 3072 * 2048 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)))


# ----------------------------------------------------------------------------------------- search

def test_search_returns_only_fitting_layouts_with_tp_inside_a_node():
    res = search("megatron-39.1b", "dgx-a100-hdr", 512, 1536)
    assert res.plans and res.rejected_for_memory > 0
    for p in res.plans:  # the default reserve keeps 10 % of the 80 GB free
        assert p.memory.fits(80e9, 0.9)
        assert 8 % p.layout.tp == 0
        assert p.layout.gpus == 512
    # Every plan is ranked by its step time, the replayed timeline's where it has one, and the first
    # TIMELINE_TOP_K places are all replayed plans.
    assert [p.step_s for p in res.plans] == sorted(p.step_s for p in res.plans)
    assert all(p.timeline_step_s is not None for p in res.plans[:TIMELINE_TOP_K])
    for r in res.rejected:
        if r.kind == "memory":
            assert "GB per GPU" in r.reason
            assert not memory_breakdown(load_model("megatron-39.1b"), r.layout, 1536).fits(80e9, 0.9)


def test_search_even_stages_and_errors():
    res = search("megatron-1.7b", "dgx-a100-hdr", 32, 512, even_stages=True)
    assert all(24 % p.layout.pp == 0 for p in res.plans)
    with pytest.raises(ValueError, match="multiple of devices_per_node"):
        search("megatron-1.7b", "dgx-a100-hdr", 30, 512)
    with pytest.raises(ValueError, match="inside a node"):
        search("megatron-1.7b", "dgx-a100-hdr", 32, 512, tp_values=[16])
    with pytest.raises(KeyError, match="known models"):
        search("gpt-9", "dgx-a100-hdr", 32, 512)
    with pytest.raises(KeyError, match="known presets"):
        search("megatron-1.7b", "dgx-z", 32, 512)


@pytest.mark.timing
def test_search_16k_gpus_is_fast():
    started = time.perf_counter()
    res = search("llama3-405b", "dgx-h100-ndr", 16384, 2048)
    elapsed = time.perf_counter() - started
    print(f"\n16,384-GPU search: {res.candidates} candidates, {len(res.plans)} fit, "
          f"{res.rejected_for_memory} rejected for memory, {elapsed:.3f} s")
    assert elapsed < 20
    assert res.best.layout.tp == 8 and res.best.memory.fits(80e9)


# ----------------------------------------------------------------------------------------- published layouts

#: Every run the validation models (commlab/data/published_layouts.json without context parallelism), Table 1's ten
#: first: with the default compute model (the kernel model) each lands within ±25 % of its reported per-GPU
#: throughput (test_prediction_within_25_percent).
HOLDS = [k for k, e in load_published().items() if e.get("cp", 1) == 1]
#: Korthikanti et al. 2022, Table 5: four models, full recomputation and the paper's sequence parallelism with
#: selective recomputation, and section 6.3's 530B run on 2240 GPUs.
KORTHIKANTI = {"22b": (1.42, 1.10, 41.5), "175b": (18.13, 13.75, 51.4), "530b": (49.05, 37.83, 56.0),
               "1t": (94.42, 71.49, 56.3)}  # full, present work (s), the present work's MFU (%)
#: Megatron-Core's weak-scaling runs on H100 (Megatron-LM's README, 2024), over-predicted by the kernel model
#: (test_the_kernel_model_against_the_published_runs).
MCORE = ["mcore-h100-1.7b", "mcore-h100-7.1b", "mcore-h100-16b", "mcore-h100-32b", "mcore-h100-70b",
         "mcore-h100-119b", "mcore-h100-177b", "mcore-h100-314b", "mcore-h100-462b"]


@pytest.fixture(scope="module")
def validation():
    rows = validate_published()  # the default compute model: the kernel model, which every row's GPU has
    print("\n" + validation_table(rows))
    return {r.config: r for r in rows}


@pytest.fixture(scope="module")
def constant_validation():
    rows = validate_published(DEFAULT_ACHIEVABLE_FRACTION)  # one share of peak, 0.5, for every matmul
    print("\n" + validation_table(rows))
    return {r.config: r for r in rows}


def test_every_top_layout_keeps_tp_inside_a_node(validation):
    assert len(validation) == len(HOLDS) == 31
    for r in validation.values():
        assert r.top_tp_within_node, r
        # The search ranks by the sum of terms and replays only its TIMELINE_TOP_K best as timelines: the
        # published plan, replayed as the best of its own search, must not beat the planner's top.
        assert r.top_step_s <= r.published_step_s * (1 + 1e-9)


@pytest.mark.parametrize("config", HOLDS)
def test_prediction_within_25_percent(validation, config):
    r = validation[config]
    assert r.within, f"{config}: predicted {r.predicted_tflops:.0f} vs reported {r.reported_tflops:.0f} TFLOP/s"


def test_table_1_runs_use_the_knobs_of_megatrons_own_script(validation):
    # examples/sc21/run_table_1.sh gives each run's micro-batch, interleaving and DDP implementation; the
    # prediction must use them rather than the planner's best guess.
    rows = load_published()
    for key in HOLDS[:10]:
        e, r = rows[key], validation[key]
        assert "run_table_1.sh" in e["knobs_source"]
        assert f" b{e['micro_batch']} " in r.published + " "
        assert (f" v{e['interleave']} " in r.published + " ") == (e["interleave"] > 1)
    assert validation["megatron-76.1b"].published.startswith("tp8 pp4 dp32 b2 v3")  # 60 layers / 4 / 5 per chunk
    assert {validation[k].software for k in HOLDS[:4]} == {"megatron-lm-2021-torch-ddp"}  # --DDP-impl torch
    assert {validation[k].software for k in HOLDS[4:10]} == {"megatron-lm-2021"}  # --DDP-impl local


def test_bloom_176b_runs_on_its_own_stack_with_the_knobs_of_its_script(validation):
    # bigscience's tr11-176B-ml.slurm: TP 4, PP 12, MBS 2, full recomputation, the BF16_Optimizer's ZeRO-1,
    # priced with the megatron-deepspeed profile; the TFLOPs of its log are Megatron's Eq. 3
    e, r = load_published()["bloom-176b"], validation["bloom-176b"]
    assert "tr11-176B-ml.slurm" in e["knobs_source"] and e["flop_accounting"] == "megatron-eq3"
    assert r.software == "megatron-deepspeed" and r.published.startswith("tp4 pp12 dp8 b2 zero1 recompute")
    assert r.within and r.published_rank <= 5, r


def test_published_ranks_count_each_split_once_and_match_the_fixed_knobs():
    from types import SimpleNamespace

    from commlab.parallel.planner.validation import _published_ranks
    rows = [(4, 2, 1, 4, "none", 1.0), (4, 2, 2, 4, "none", 1.1), (4, 2, 1, 2, "full", 1.2),
            (8, 1, 1, 1, "none", 1.3), (8, 1, 2, 1, "full", 1.4), (8, 1, 8, 1, "full", 1.4), (2, 4, 1, 1, "none", 1.5)]
    plans = [SimpleNamespace(layout=Layout(tp=t, pp=p, dp=1, micro_batch=b, interleave=v, recompute=r), step_s=sec)
             for t, p, b, v, r, sec in rows]
    # tp8 pp1 is the second split though its first plan is the fourth; b8 with full recomputation is the
    # sixth plan but ties with the fifth, so it shares its position
    assert _published_ranks(plans, 8, 1, {"micro_batches": (8,), "recompute": ("full",)}) == (2, 4, 5)
    assert _published_ranks(plans, 4, 2, {}) == (1, 1, 1)
    assert _published_ranks(plans, 4, 2, {"interleave": (2,)}) == (1, 1, 3)
    assert _published_ranks(plans, 4, 2, {"zero1": (True,)}) == (1, 1, None)
    assert _published_ranks(plans, 2, 4, {"micro_batches": (4,)}) == (3, 7, None)
    assert _published_ranks(plans, 1, 8, {}) == (None, None, None)


def test_published_labels_star_the_knobs_the_planner_chose(validation):
    assert validation["llama3-405b-8k-16384gpus"].published == "tp8 pp16 dp128 b1* v4* zero1* recompute*"
    assert validation["megatron-76.1b"].published == "tp8 pp4 dp32 b2 v3 recompute"
    table = validation_table(list(validation.values()))
    assert " n/a " in table and "each split counted once" in table


@pytest.mark.parametrize("change, message", [
    ({"micro_batch": 3}, r"'megatron-1\.7b': micro_batch = 3 is not one of the values the validation searches"),
    ({"micro_batch": 0}, r"micro_batch = 0 is not one of"),
    ({"interleave": 2}, r"'megatron-1\.7b': interleave = 2 needs pp > 1"),
    ({"zero1": True}, r"zero1 is true but software 'megatron-lm-2021-torch-ddp' offers ZeRO stages \[0\]"),
    ({"recompute": "every-k"}, r"recompute 'every-k' is not tried with software"),
    ({"recompute": False}, r"published row 'megatron-1\.7b'.*needs .* GB per GPU"),
])
def test_a_bad_published_row_is_named_with_its_knob(tmp_path, change, message):
    import json
    row = dict(load_published()["megatron-1.7b"], **change)
    if change.get("recompute") is False:  # without recomputation b16 does not fit on 80 GB
        row["global_batch"], row["micro_batch"] = 512, 16
    path = tmp_path / "published.json"
    path.write_text(json.dumps({"megatron-1.7b": row}))
    with pytest.raises(ValueError, match=message):
        validate_published(path=path)


def test_the_h100_weak_scaling_runs_are_priced_in_megatrons_2024_flop(validation):
    rows = load_published()
    for key in MCORE:
        e, r = rows[key], validation[key]
        assert e["flop_accounting"] == "megatron-2024" and r.software == "megatron-core-2024"
        assert e["tp"] * e["pp"] * e["dp"] == e["gpus"] and e["dp"] == 48
        m = load_model(e["model"])
        assert parameter_count(m) == pytest.approx(m.reported_params, rel=0.03)  # the table's model size
        assert abs(e["percent_of_peak"] - e["tflops_per_gpu"] / 989.4 * 100) < 0.6  # its MFU, against bf16 peak
        assert r.published_rank is not None and r.published_rank <= 5


def test_the_smallest_h100_run_is_over_predicted_with_one_fraction(constant_validation):
    # h = 2048 with 4096-token sequences: the loss over 131,072 logits per token and the exposed last bucket
    # are priced, but the attention core and the layers' memory-bound work run at the one fraction of peak
    r = constant_validation["mcore-h100-1.7b"]
    assert 10 < r.error_pct <= 25


def test_the_kernel_model_against_the_published_runs(validation):
    # GEMMs by shape, memory-bound bytes and the attention core, at the stack's share of the microbenchmark
    # rates measured on one layer (Korthikanti et al. 2022, Table 4), compute slowed beside the communication
    # that hides (Lee et al. 2025): no constant fitted to any of these runs.
    rows = validation
    # The default is the kernel model on every row's GPU, and one share of peak where a GPU lacks its data.
    assert compute_model(AUTO, "A100-SXM") == compute_model(AUTO, "H100-SXM") == KERNELS
    assert compute_model(AUTO, "A100-PCIe") == DEFAULT_ACHIEVABLE_FRACTION and compute_model(0.3, "H100-SXM") == 0.3
    errors = sorted(abs(r.error_pct) for r in rows.values())
    assert len(errors) == 31 and errors[15] <= 10  # the median
    # Every A100 run (Megatron-LM 2021 and 2022, BLOOM on Megatron-DeepSpeed) and both Llama 3 runs on H100
    # within 12 %. Korthikanti et al.'s nine runs share the paper, cluster and stack of the measured layer;
    # Table 1's ten, BLOOM and Llama 3 do not.
    not_mcore = [k for k in rows if k not in MCORE]
    assert len(not_mcore) == 22
    assert all(abs(rows[k].error_pct) <= 12 for k in not_mcore), {k: round(rows[k].error_pct, 1) for k in not_mcore}
    # Megatron-Core's H100 runs, with DP, TP and PP all overlapped, are still over-predicted, by 12 % at the
    # median: H100's share of its microbenchmark rates is A100's by assumption. Reported, not tuned away.
    mcore = sorted(rows[k].error_pct for k in MCORE)
    assert mcore[len(mcore) // 2] > 10 and mcore[0] > -5, mcore
    assert all(r.within for r in rows.values())
    # The published split among the planner's top five splits in every row.
    assert all(r.published_rank is not None and r.published_rank <= 5 for r in rows.values())


def test_the_loss_is_priced_at_memory_bandwidth_and_only_where_it_is_known():
    m = load_model("mcore-gpt-1.7b")
    lay = Layout(2, 1, 4, micro_batch=2)
    f, b = loss_seconds(m, 2, 2, "H100-SXM")
    tokens, logits = 2 * 4096, 131072 // 2
    assert (f, b) == pytest.approx((38 * logits * tokens / 3.35e12, 14 * logits * tokens / 3.35e12))
    t = step_time(m, lay, make_cluster("dgx-h100-ndr", 8), 16)
    assert t.loss_s == pytest.approx(t.micro_batches * (f + b))
    # A100 PCIe has no memory bandwidth in commlab/data/hardware.json: no loss term, rather than a guessed one
    assert loss_seconds(m, 2, 2, "A100-PCIe") == (0.0, 0.0)
    assert step_time(m, lay, make_cluster("pcie-gen4-node", 8), 16).loss_s == 0.0
    with pytest.raises(ValueError, match="tp must be"):
        loss_seconds(m, 2, 0, "H100-SXM")


def test_megatron_2024_flop_by_hand():
    from commlab.parallel.planner import megatron_2024_flops, model_flops_per_step
    m = load_model("mcore-gpt-1.7b")  # h 2048, 24 layers, 16 heads, 4h GeLU MLP, vocabulary 131072, s 4096
    L, h, s, V = 24, 2048, 4096, 131072
    per_token = 6 * (4 * h * h + 2 * 4 * h * h) * L + 12 * s * h * L + 6 * V * h  # weights, attention, logits
    assert megatron_2024_flops(m, 1) == pytest.approx(per_token * s)
    assert model_flops_per_step(m, 192, "megatron-2024") == pytest.approx(192 * per_token * s)
    llama = load_model("llama3-405b")  # grouped-query attention (8 of 128 heads) and SwiGLU
    h, L, F, s, V = 16384, 126, 53248, 8192, 128256
    per_token = (6 * (2 * h * h + 2 * h * h * 8 / 128) + 6 * 3 * h * F) * L + 12 * s * h * L + 6 * V * h
    assert megatron_2024_flops(llama, 1) == pytest.approx(per_token * s)


def test_korthikanti_rows_are_table_5(validation, constant_validation):
    # Each row is a Table 5 iteration time; the TFLOP/s it reports is Eq. 7's model FLOP / time / GPUs, which
    # for the present-work rows must give back the table's own MFU against the A100's 312 TFLOP/s.
    rows = load_published()
    for size, (full_s, present_s, mfu) in KORTHIKANTI.items():
        for policy, seconds in (("full", full_s), ("selective", present_s)):
            key = f"korthikanti-{size}-{policy}"
            e, r = rows[key], validation[key]
            assert e["iteration_s"] == seconds and e["flop_accounting"] == "korthikanti-eq7" and e["dp"] == 1
            assert r.software == ("megatron-lm-2022-sp-selective" if policy == "selective"
                                  else "megatron-lm-2022-full-recompute")
            assert r.reported_tflops == pytest.approx(
                korthikanti_eq7_flops(load_model(e["model"]), e["global_batch"]) / seconds / e["gpus"] / 1e12)
            if policy == "selective":
                assert e["percent_of_peak"] == mfu
                assert r.reported_tflops / 312 * 100 == pytest.approx(mfu, abs=0.3)
            assert r.published_rank is not None and r.published_rank <= 5
        # Section 6.3: 29 to 32 % more throughput with the paper's method. The planner's gain, from the
        # recomputation it no longer runs: with one fraction of peak within 2.5 points of it for every model; the
        # kernel model over-predicts it by 1 to 7 points, the most on the smallest model (chapter 11 prints
        # both)
        assert 1.25 < full_s / present_s < 1.35
        for found, low, high in ((constant_validation, -0.025, 0.025), (validation, 0.0, 0.07)):
            full, present = found[f"korthikanti-{size}-full"], found[f"korthikanti-{size}-selective"]
            assert low < present.predicted_tflops / full.predicted_tflops - full_s / present_s < high, size
    wide = rows["korthikanti-530b-selective-2240gpus"]
    assert (wide["dp"], wide["global_batch"], wide["iteration_s"], wide["percent_of_peak"]) == (8, 2240, 39.15, 54.2)


def test_one_fraction_of_peak_misses_the_widest_models(constant_validation):
    # Why the constant is not the default: one achievable fraction (0.5) for every matmul, whatever its shape,
    # misses by more than 10 % at the median, and the widest models most. The 1T model at 56 % MFU cannot be
    # reached once the recomputation and the bubble are added; the same gap, smaller, is in the 2021 row of
    # that model (megatron-1t), and Llama 3 405B (h = 16384, pp = 16) is under-predicted by about a fifth.
    rows = constant_validation
    assert sorted(abs(r.error_pct) for r in rows.values())[15] > 10
    for key in ("korthikanti-1t-full", "korthikanti-1t-selective"):
        r = rows[key]
        assert not r.within and -35 < r.error_pct < -25, r
    assert rows["megatron-1t"].error_pct < -15
    for key in ("llama3-405b-8k-8192gpus", "llama3-405b-8k-16384gpus"):
        r = rows[key]
        assert r.error_pct < -15 and r.published.startswith("tp8 pp16")


# ----------------------------------------------------------------------------------------- CLI and widget

def test_cli_plan(capsys):
    assert main(["plan", "--model", "megatron-1t", "--preset", "dgx-a100-hdr", "--gpus", "3072",
                 "--global-batch", "3072", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "rejected for memory" in out and "tp8" in out
    for argv, msg in ((["--model", "nope"], "unknown model"), (["--preset", "nope"], "unknown preset"),
                      (["--gpus", "3071"], "multiple of devices_per_node")):
        base = {"--model": "megatron-1t", "--preset": "dgx-a100-hdr", "--gpus": "3072", "--global-batch": "3072"}
        base[argv[0]] = argv[1]
        with pytest.raises(SystemExit):
            main(["plan"] + [x for kv in base.items() for x in kv])
        assert msg in capsys.readouterr().err


def test_widget_helpers():
    from commlab.widgets.planner import plan_rows, static_figure, table_html, table_text
    rows, summary = plan_rows("megatron-18.4b", "dgx-a100-hdr", 256, 1024, top_k=3)
    assert len(rows) == 3 and summary["fit"] >= 3
    assert rows[0]["step_s"] <= rows[1]["step_s"]
    assert "TFLOP/s/GPU" in table_text(rows) and "<table>" in table_html(rows)
    fig = static_figure("megatron-18.4b", "dgx-a100-hdr", 256, 1024, top_k=3)
    assert len(fig.axes) == 1
    import matplotlib.pyplot as plt
    plt.close(fig)
