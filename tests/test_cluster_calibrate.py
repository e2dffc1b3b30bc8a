"""Cluster presets (commlab/data/clusters.json) and the α-β calibration (commlab.bench.calibrate).

The calibration tests run real ranks on tiny sizes and check only the shape and sign of what comes back:
this machine is shared, so no timing threshold is asserted.
"""

import json
import math

import numpy as np
import pytest

from commlab import hardware
from commlab.bench import calibrate as cal
from commlab.topology import Cluster, Link, list_presets, load_preset
from commlab.topology import cluster as cluster_mod

# ------------------------------------------------------------------------------------------ presets


def test_presets_load_with_figures_from_the_hardware_table():
    assert {"dgx-a100-hdr", "dgx-h100-ndr", "pcie-gen4-node"} <= set(list_presets())
    h = load_preset("dgx-h100-ndr", nodes=4)
    assert (h.nodes, h.devices_per_node, h.nics_per_node, h.world_size) == (4, 8, 8, 32)
    assert h.intra.bytes_per_s == pytest.approx(hardware.value("H100-SXM", "nvlink_per_direction_bytes_per_s"))
    # NDR is 400 Gb/s per port: 50 GB/s per direction
    assert h.inter.bytes_per_s == pytest.approx(50e9)
    assert h.node_inter_bytes_per_s == pytest.approx(400e9)
    assert h.device_memory_bytes == 80e9
    assert h.peak_flop_per_s["bf16"] == hardware.value("H100-SXM", "bf16_dense_flop_per_s")
    assert h.peak_flop_per_s["fp8"] == hardware.value("H100-SXM", "fp8_dense_flop_per_s")
    a = load_preset("dgx-a100-hdr")
    assert a.nodes == 1 and a.intra.bytes_per_s == pytest.approx(300e9) and a.inter.bytes_per_s == pytest.approx(25e9)
    assert "fp8" not in a.peak_flop_per_s  # the A100 has no FP8 tensor cores
    p = load_preset("pcie-gen4-node", nodes=2)
    assert p.intra.bytes_per_s == pytest.approx(16e9 * 16 * 128 / 130 / 8, rel=1e-9)


@pytest.mark.parametrize("name", ["dgx-a100-hdr", "dgx-h100-ndr", "pcie-gen4-node"])
def test_every_figure_has_a_source_and_sane_units(name):
    c = load_preset(name)
    expected = {"devices_per_node", "nics_per_node", "intra.bytes_per_s", "intra.alpha_s", "inter.bytes_per_s",
                "inter.alpha_s", "device_memory_bytes"} | {f"peak_flop_per_s.{d}" for d in c.peak_flop_per_s}
    assert set(c.sources) == expected
    assert all(s.strip() for s in c.sources.values())
    # latencies are microseconds, the intra link is faster than one NIC
    assert 0 < c.intra.alpha_s < 1e-4 and 0 < c.inter.alpha_s < 1e-4
    assert c.intra.bytes_per_s > c.inter.bytes_per_s
    assert isinstance(c.intra, Link) and isinstance(c.inter, Link)


def test_nodes_is_settable_and_checked():
    c = load_preset("dgx-a100-hdr", nodes=2)
    c.nodes = 16
    assert c.world_size == 128
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="nodes"):
            c.nodes = bad
    with pytest.raises(ValueError, match="'dgx-a100-hdr'.*nodes"):
        load_preset("dgx-a100-hdr", nodes=0)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(KeyError, match="dgx-a100-hdr.*dgx-h100-ndr"):
        load_preset("dgx-b200")


def _write_presets(tmp_path, mutate):
    data = json.loads(cluster_mod.DEFAULT_PATH.read_text())
    mutate(data["dgx-a100-hdr"])
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("mutate, field", [
    (lambda p: p["inter"]["alpha_s"].update(value=-1e-6), "inter.alpha_s"),
    (lambda p: p["intra"].update(alpha_s={"value": "fast", "source": "x"}), "intra.alpha_s"),
    (lambda p: p["inter"]["alpha_s"].pop("source"), "inter.alpha_s"),
    (lambda p: p.update(nics_per_node={"value": 0, "source": "x"}), "nics_per_node"),
    (lambda p: p.update(devices_per_node={"value": 2.5, "source": "x"}), "devices_per_node"),
    (lambda p: p.pop("device_memory_bytes"), "device_memory_bytes"),
    (lambda p: p["intra"].update(bytes_per_s={"ref": "A100-SXM.no_such_figure"}), "intra.bytes_per_s"),
    (lambda p: p["intra"].update(bytes_per_s={"ref": "A100-SXM.hbm_bytes"}), "intra.bytes_per_s"),
    (lambda p: p["peak_flop_per_s"].update(bf16={"value": 0, "source": "x"}), "peak_flop_per_s.bf16"),
])
def test_malformed_preset_names_preset_and_field(tmp_path, mutate, field):
    path = _write_presets(tmp_path, mutate)
    with pytest.raises(ValueError, match=rf"'dgx-a100-hdr'.*'{field}'"):
        load_preset("dgx-a100-hdr", path=path)


def test_cluster_constructor_checks_its_fields():
    link = Link(1e-6, 1e-10)
    good = dict(name="toy", nodes=1, devices_per_node=2, nics_per_node=1, intra=link, inter=link,
                device_memory_bytes=1e9, peak_flop_per_s={"bf16": 1e12})
    assert Cluster(**good).world_size == 2
    for key, bad in [("devices_per_node", 0), ("device_memory_bytes", -1.0), ("peak_flop_per_s", {"bf16": math.nan}),
                     ("intra", 3.0)]:
        with pytest.raises(ValueError, match=key.split("_flop")[0]):
            Cluster(**{**good, key: bad})


# ------------------------------------------------------------------------------------------ the fit


def test_fit_recovers_alpha_and_beta_exactly():
    sizes = [2**k for k in range(10, 25, 2)]
    alpha, beta = 25e-6, 1 / 3e9
    seconds = [alpha + n * beta for n in sizes]
    for weighting in ("relative", "uniform"):
        fit = cal.fit_alpha_beta(sizes, seconds, weighting=weighting)
        assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
        assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
        assert fit.alpha_se_s == pytest.approx(0, abs=1e-12) and fit.r2 == pytest.approx(1.0)
        assert fit.predict(1 << 20) == pytest.approx(alpha + (1 << 20) * beta)
        np.testing.assert_allclose(fit.predict(np.array(sizes)), seconds, rtol=1e-9)
        link = fit.as_link()
        assert link.alpha_s == pytest.approx(alpha) and link.bytes_per_s == pytest.approx(3e9)


def test_fit_standard_errors_are_sensible_with_noise():
    rng = np.random.default_rng(0)
    sizes = np.repeat([2**k for k in range(10, 25, 2)], 4)
    alpha, beta = 50e-6, 1 / 1e9
    # 5 % multiplicative noise, as on a shared machine
    fits = [cal.fit_alpha_beta(sizes, (alpha + sizes * beta) * (1 + 0.05 * rng.standard_normal(sizes.size)))
            for _ in range(200)]
    a = np.array([f.alpha_s for f in fits])
    b = np.array([f.beta_s_per_byte for f in fits])
    # Weights from the measured times bias the fit a little (of the order of the squared relative noise):
    # small next to the scatter of a single fit. The reported SE matches that scatter.
    assert abs(a.mean() - alpha) < 0.5 * a.std() and abs(a.mean() - alpha) < 0.02 * alpha
    assert abs(b.mean() - beta) < 0.5 * b.std() and abs(b.mean() - beta) < 0.02 * beta
    assert np.median([f.alpha_se_s for f in fits]) == pytest.approx(a.std(), rel=0.3)
    assert np.median([f.beta_se_s_per_byte for f in fits]) == pytest.approx(b.std(), rel=0.3)
    assert all(0.9 < f.r2 <= 1 for f in fits)


def test_relative_weighting_keeps_alpha_when_sizes_span_decades():
    # One large-message outlier of +3 % would swamp alpha under plain OLS; relative weighting keeps it.
    sizes = [2**k for k in range(10, 25, 2)]
    alpha, beta = 20e-6, 1e-9
    seconds = [alpha + n * beta for n in sizes]
    seconds[-1] *= 1.03
    rel = cal.fit_alpha_beta(sizes, seconds)
    ols = cal.fit_alpha_beta(sizes, seconds, weighting="uniform")
    assert abs(rel.alpha_s - alpha) < abs(ols.alpha_s - alpha)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        cal.fit_alpha_beta([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="two distinct"):
        cal.fit_alpha_beta([8, 8], [1.0, 1.0])
    with pytest.raises(ValueError, match="> 0"):
        cal.fit_alpha_beta([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match="weighting"):
        cal.fit_alpha_beta([1, 2], [1.0, 2.0], weighting="huber")
    two = cal.fit_alpha_beta([1, 2], [1.0, 2.0])
    assert math.isnan(two.alpha_se_s)  # two points, two parameters: no degrees of freedom left


# ------------------------------------------------------------------------------------ measurements

TINY = [64, 1024]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_pingpong_returns_positive_times(world_size):
    t = cal.pingpong(TINY, world_size=world_size, rounds=2)
    assert len(t) == len(TINY) and all(x > 0 and math.isfinite(x) for x in t)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_exchange_returns_positive_times(world_size, capsys):
    t = cal.ring_exchange(TINY, world_size=world_size, rounds=2, progress=True)
    assert len(t) == len(TINY) and all(x > 0 and math.isfinite(x) for x in t)
    out = capsys.readouterr().out
    assert "round 2/2" in out and f"ring_exchange N={world_size}" in out


def test_calibrate_returns_a_fit():
    fit = cal.calibrate(2, sizes=TINY, rounds=1, progress=False)
    assert isinstance(fit, cal.AlphaBetaFit) and fit.sizes == tuple(TINY) and len(fit.seconds) == 2
    with pytest.raises(ValueError, match="method"):
        cal.calibrate(2, sizes=TINY, method="allreduce")


def test_measurements_reject_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        cal.ring_exchange(TINY, world_size=1)
    with pytest.raises(ValueError, match="rounds"):
        cal.pingpong(TINY, rounds=0)
    with pytest.raises(ValueError, match="sizes"):
        cal.pingpong([])
    with pytest.raises(ValueError, match=">= 4 bytes"):
        cal.ring_model_error((2,), sizes=[2])


@pytest.mark.slow
def test_ring_model_error_rows_are_well_formed():
    report = cal.ring_model_error(world_sizes=(2, 3), sizes=[256, 4096], calibration_sizes=TINY, rounds=1,
                                  progress=False)
    assert [(r.world_size, r.nbytes) for r in report.rows] == [(2, 256), (2, 4096), (3, 256), (3, 4096)]
    for r in report.rows:
        assert r.measured_s > 0 and r.reduce_s > 0 and math.isfinite(r.error)
        assert r.predicted_s == pytest.approx(r.comm_s + r.reduce_s)
        link = report.fits[r.world_size].as_link()  # the model uses α, β clamped at 0
        assert r.comm_s == pytest.approx(2 * (r.world_size - 1) * link.alpha_s
                                         + 2 * (r.world_size - 1) / r.world_size * r.nbytes * link.beta_s_per_byte)
    assert report.mape == pytest.approx(np.mean([abs(r.error) for r in report.rows]))
    assert "MAPE" in report.format()


def test_ring_model_error_uses_given_fits_without_calibrating():
    given = cal.fit_alpha_beta([1, 2, 3], [1e-3, 2e-3, 3e-3])
    report = cal.ring_model_error(world_sizes=(2,), sizes=[1024], fits={2: given}, gamma=False, rounds=1,
                                  progress=False)
    assert report.fits[2] is given
    (row,) = report.rows
    assert row.reduce_s == 0 and row.alpha_s == given.alpha_s
