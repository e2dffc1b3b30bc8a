"""Chapter 1's arithmetic, checked against numbers worked out by hand."""

import json
import math

import pytest

from commlab import arithmetic as ar
from commlab import hardware


def close(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel)


# --------------------------------------------------------------------------- units


def test_hdr_port_is_25_gigabytes_per_second():
    assert ar.gbit_per_s_to_bytes_per_s(200) == 25e9
    assert ar.gbit_per_s_to_bytes_per_s(400) == 50e9


def test_nvlink_total_is_twice_the_per_direction_figure():
    assert ar.per_direction_bytes_per_s(900e9) == 450e9
    assert ar.per_direction_bytes_per_s(600e9) == 300e9


def test_gb_and_gib_differ():
    assert ar.bytes_to_gb(80e9) == 80
    assert close(ar.bytes_to_gib(2**30), 1.0)
    # 80 GB is about 74.5 GiB: the gap that makes "80 GB" cards show less in nvidia-smi units.
    assert close(ar.bytes_to_gib(80e9), 80e9 / 1073741824)


# --------------------------------------------------------------------------- ring formulas


def test_allreduce_of_140_gb_over_64_ranks():
    assert close(ar.ring_allreduce_bytes_per_rank(140e9, 64), 2 * 63 / 64 * 140e9)
    assert close(ar.ring_allreduce_bytes_per_rank(140e9, 64), 275.625e9)


def test_source_article_drops_the_n_minus_one_over_n_factor():
    # 2 * 7/8 * 17.5 GB, not the 35 GB obtained by rounding (N-1)/N up to 1.
    assert close(ar.ring_allreduce_bytes_per_rank(17.5e9, 8), 30.625e9)


def test_reduce_scatter_and_all_gather_are_half_an_allreduce():
    rs = ar.ring_reduce_scatter_bytes_per_rank(1000, 4)
    ag = ar.ring_all_gather_bytes_per_rank(1000, 4)
    assert rs == ag == 750
    assert ar.ring_allreduce_bytes_per_rank(1000, 4) == rs + ag


def test_single_rank_sends_nothing():
    assert ar.ring_allreduce_bytes_per_rank(1e9, 1) == 0
    assert ar.gradient_sync_seconds(1e9, 1, 25e9, latency_s=1e-5) == 0


def test_gradient_sync_seconds_bandwidth_and_latency_terms():
    assert close(ar.gradient_sync_seconds(17.5e9, 8, 25e9), 1.225)
    # 2(n-1) = 14 latency steps on top.
    assert close(ar.gradient_sync_seconds(17.5e9, 8, 25e9, latency_s=1e-5), 1.225 + 14e-5)


def test_transfer_seconds():
    assert ar.transfer_seconds(50e9, 25e9) == 2.0
    assert ar.transfer_seconds(0, 25e9, latency_s=3e-6) == 3e-6


# --------------------------------------------------------------------------- compute and memory


def test_training_flops_is_six_p_t():
    assert ar.training_flops(70e9, 1e6) == 6 * 70e9 * 1e6


def test_compute_seconds():
    assert close(ar.compute_seconds(989e12, 989e12, 1.0), 1.0)
    assert close(ar.compute_seconds(6 * 70e9 * 1000, 989e12, 0.5), 6 * 70e9 * 1000 / (989e12 * 0.5))


def test_break_even_tokens_matches_compute_seconds():
    tokens = ar.break_even_tokens_per_gpu(1.225, 70e9, 989e12, 0.4)
    assert close(ar.compute_seconds(ar.training_flops(70e9, tokens), 989e12, 0.4), 1.225)


def test_exposed_comm_fraction():
    # The source article's 41 %: 1.4 s of communication after 2 s of compute, nothing overlapped.
    assert close(ar.exposed_comm_fraction(2.0, 1.4), 1.4 / 3.4)
    assert ar.exposed_comm_fraction(2.0, 1.4, overlap=1.0) == 0.0
    # Overlap can hide at most the compute time.
    assert close(ar.exposed_comm_fraction(1.0, 3.0, overlap=1.0), 2.0 / 3.0)
    assert ar.exposed_comm_fraction(0, 0) == 0.0


def test_llama3_405b_memory():
    weights = ar.weight_bytes(405e9, 2)
    assert weights == 810e9
    assert ar.gpus_to_hold(weights, 80e9) == 11
    states = ar.weight_bytes(405e9, ar.MIXED_PRECISION_ADAM_BYTES_PER_PARAM)
    assert states == 6480e9
    assert ar.gpus_to_hold(states, 80e9) == 81


def test_gpus_to_hold_exact_fit():
    assert ar.gpus_to_hold(160e9, 80e9) == 2
    assert ar.gpus_to_hold(0, 80e9) == 0


# --------------------------------------------------------------------------- the source example


@pytest.mark.parametrize(
    "layout, nics, bytes_per_gpu, per_node, seconds",
    [
        ("dp64", 1, 275.625e9, 275.625e9, 275.625e9 / 25e9),
        ("dp64", 8, 275.625e9, 275.625e9, 275.625e9 / 200e9),
        ("tp8xdp8", 1, 30.625e9, 245e9, 9.8),
        ("tp8xdp8", 8, 30.625e9, 245e9, 1.225),
    ],
)
def test_source_article_layouts(layout, nics, bytes_per_gpu, per_node, seconds):
    est = ar.source_article_example(layout, nics_per_node=nics)
    assert close(est.bytes_per_gpu, bytes_per_gpu)
    assert close(est.internode_bytes_per_node, per_node)
    assert close(est.seconds, seconds)
    assert est.dp * est.tp == 64


def test_source_layout_gradient_shards():
    assert ar.source_article_example("dp64").grad_bytes_per_gpu == 140e9
    assert ar.source_article_example("tp8xdp8").grad_bytes_per_gpu == 17.5e9


def test_dp64_nvlink_term():
    est = ar.source_article_example("dp64", nics_per_node=8)
    assert close(est.nvlink_seconds, 275.625e9 / 450e9)
    # With eight rail NICs the network is still slower than NVLink.
    assert est.seconds == est.internode_seconds
    assert ar.source_article_example("tp8xdp8").nvlink_seconds == 0.0


def test_zero_stages():
    base = ar.source_article_example("tp8xdp8", nics_per_node=8)
    for stage in (1, 2):
        assert ar.source_article_example("tp8xdp8", nics_per_node=8, zero_stage=stage).bytes_per_gpu == base.bytes_per_gpu
    z3 = ar.source_article_example("tp8xdp8", nics_per_node=8, zero_stage=3)
    assert close(z3.bytes_per_gpu, 1.5 * base.bytes_per_gpu)
    assert close(z3.seconds, 1.5 * base.seconds)


def test_single_node_has_no_network_traffic():
    est = ar.data_parallel_sync(
        1e9, tp=1, nodes=1, gpus_per_node=8, nics_per_node=1, nic_bytes_per_s=25e9, nvlink_bytes_per_s=450e9
    )
    assert est.internode_bytes_per_node == 0
    assert close(est.seconds, 2 * 7 / 8 * 2e9 / 450e9)


def test_as_dict_roundtrip():
    d = ar.source_article_example("tp8xdp8").as_dict()
    assert d["tp"] == 8 and d["dp"] == 8 and d["nics_per_node"] == 1


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("n", [0, -3, 2.0, True])
def test_bad_rank_count(n):
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        ar.ring_allreduce_bytes_per_rank(1e9, n)


@pytest.mark.parametrize("nbytes", [-1, float("nan"), float("inf"), "1e9"])
def test_bad_nbytes(nbytes):
    with pytest.raises(ValueError, match="nbytes"):
        ar.ring_allreduce_bytes_per_rank(nbytes, 8)


@pytest.mark.parametrize("mfu", [0, -0.1, 1.01, 40])
def test_bad_mfu(mfu):
    with pytest.raises(ValueError, match=r"mfu .* \(0, 1\]"):
        ar.compute_seconds(1e15, 989e12, mfu)


def test_mfu_of_exactly_one_is_allowed():
    assert ar.compute_seconds(989e12, 989e12, 1) == 1.0


def test_bad_bandwidth():
    with pytest.raises(ValueError, match="bytes_per_s must be a finite number > 0"):
        ar.gradient_sync_seconds(1e9, 8, 0)
    with pytest.raises(ValueError, match="gbit_per_s must be a finite number >= 0"):
        ar.gbit_per_s_to_bytes_per_s(-200)


def test_bad_overlap():
    with pytest.raises(ValueError, match="overlap"):
        ar.exposed_comm_fraction(1, 1, overlap=1.5)


def test_bad_layouts():
    with pytest.raises(ValueError, match="tp=3 must divide gpus_per_node=8"):
        ar.data_parallel_sync(
            1e9, tp=3, nodes=8, gpus_per_node=8, nics_per_node=1, nic_bytes_per_s=25e9, nvlink_bytes_per_s=450e9
        )
    with pytest.raises(ValueError, match="layout must be one of"):
        ar.source_article_example("pp8")
    with pytest.raises(ValueError, match="zero_stage"):
        ar.source_article_example("dp64", zero_stage=4)
    with pytest.raises(ValueError, match="nics_per_node must be an int >= 1"):
        ar.source_article_example("dp64", nics_per_node=0)


def test_gpus_to_hold_needs_memory():
    with pytest.raises(ValueError, match="gpu_memory_bytes must be a finite number > 0"):
        ar.gpus_to_hold(1e9, 0)


# --------------------------------------------------------------------------- hardware table


def test_hardware_figures():
    assert hardware.value("H100-SXM", "bf16_dense_flop_per_s") == 989e12
    assert hardware.value("H100-SXM", "fp8_dense_flop_per_s") == 1979e12
    assert hardware.value("H100-SXM", "hbm_bytes") == 80e9
    assert hardware.value("A100-SXM", "bf16_dense_flop_per_s") == 312e12
    assert hardware.value("InfiniBand-NDR", "port_per_direction_bit_per_s") == 400e9


def test_hardware_table_is_self_consistent():
    for gpu in ("H100-SXM", "A100-SXM"):
        total = hardware.value(gpu, "nvlink_bidirectional_bytes_per_s")
        assert hardware.value(gpu, "nvlink_per_direction_bytes_per_s") == ar.per_direction_bytes_per_s(total)
    hdr = hardware.value("InfiniBand-HDR", "port_per_direction_bit_per_s")
    assert ar.gbit_per_s_to_bytes_per_s(hdr / 1e9) == ar.SOURCE_EXAMPLE["nic_bytes_per_s"]
    assert (
        hardware.value("H100-SXM", "nvlink_per_direction_bytes_per_s") == ar.SOURCE_EXAMPLE["nvlink_bytes_per_s"]
    )


def test_every_figure_names_its_source():
    for device, figures in hardware.load().items():
        for name, entry in figures.items():
            assert entry["source"].strip(), (device, name)
    assert "_about" not in hardware.devices()


def test_hardware_unknown_names():
    with pytest.raises(KeyError, match="no device 'H200'.*known"):
        hardware.value("H200", "hbm_bytes")
    with pytest.raises(KeyError, match="has no figure 'fp4'"):
        hardware.value("H100-SXM", "fp4")


def test_load_returns_a_copy():
    table = hardware.load()
    table["H100-SXM"]["hbm_bytes"]["value"] = 1
    assert hardware.value("H100-SXM", "hbm_bytes") == 80e9


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"value": 1, "unit": "bytes"}, r"lacks field\(s\) \['source'\]"),
        ({"value": -1, "unit": "bytes", "source": "x"}, "value must be a finite number > 0, got -1"),
        ({"value": "80", "unit": "bytes", "source": "x"}, "finite number"),
        ({"value": 1, "unit": "GB", "source": "x"}, "unit must be one of"),
        ({"value": 1, "unit": "bytes", "source": " "}, "source must name"),
    ],
)
def test_hardware_malformed_entries(tmp_path, entry, message):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"GPU": {"mem": entry}}))
    with pytest.raises(ValueError, match=message):
        hardware.load(path)
