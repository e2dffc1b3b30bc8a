"""NCCL's per-protocol cost model (commlab.collectives.nccl_model): pure arithmetic, no processes."""

import pytest

from commlab.collectives import nccl_model as nm
from commlab.topology import load_preset

T = nm.load_tuning()["pinned"]


def _dgx(nodes, **kw):
    return nm.NcclSystem.from_cluster(load_preset("dgx-h100-ndr", nodes=nodes), **kw)


def test_multi_rail_bus_bandwidth_is_channels_times_the_link():
    s = _dgx(8)
    assert (s.channels, s.channel_bytes_per_s) == (8, 50e9)  # one channel per NIC, at the NIC's speed
    assert s.bus_bytes_per_s == 8 * 50e9
    ring = nm.pair_model(s, "Ring", "Simple")
    assert ring.bus_bytes_per_s == pytest.approx(400e9)
    assert ring.alg_bytes_per_s == pytest.approx(400e9 * 64 / (2 * 63))  # busbw -> algbw, as nccl-tests
    # One channel leaves through one NIC; sixteen share the eight NICs.
    assert _dgx(8, channels=1).bus_bytes_per_s == 50e9 and _dgx(8, channels=16).bus_bytes_per_s == 400e9
    # A node's channels cannot outrun its GPUs' NVLink: the PCIe node's 2 HDR NICs (50 GB/s) exceed one slot.
    pcie = nm.NcclSystem.from_cluster(load_preset("pcie-gen4-node", nodes=4))
    assert pcie.bus_bytes_per_s == pytest.approx(load_preset("pcie-gen4-node").intra.bytes_per_s)


def test_network_latency_is_paid_on_2_nodes_minus_1_ring_steps_only():
    nodes, ppn = 4, 8
    s = _dgx(nodes)
    n = nodes * ppn
    for p in nm.PROTOCOLS:
        net = T["hw_latency_us"]["NET"]["Ring"][p]
        overhead = T["net_overhead_us"]["Intel"] * (3 if p == "Simple" else 1)
        intra = max(T["hw_latency_us"]["NVLink"]["Ring"][p], overhead)
        expected = T["base_latency_us"]["Ring"][p] + (2 * (n - 1) - 2 * (nodes - 1)) * intra + 2 * (nodes - 1) * net
        assert nm.pair_model(s, "Ring", p).latency_s == pytest.approx(expected * 1e-6)
        # not 2(N-1) network latencies, which the one-α model charged
        assert nm.pair_model(s, "Ring", p).latency_s < 2 * (n - 1) * net * 1e-6
    # One node: no network step, no post overhead; the per-call base latency is still paid.
    one = nm.pair_model(_dgx(1), "Ring", "LL")
    assert one.latency_s == pytest.approx((6.6 + 14 * 0.6) * 1e-6)
    # Tree: 2((ppn-1)·intra + floor(log2 nodes)·net)
    assert nm.pair_model(s, "Tree", "LL").latency_s == pytest.approx((6.8 + 2 * (7 * 0.6 + 2 * 5.0)) * 1e-6)


def test_the_protocol_switches_from_ll_to_simple_as_the_message_grows():
    s = _dgx(8)
    fastest = {size: min(nm.PROTOCOLS, key=lambda p: nm.all_reduce_seconds(size, s, "Ring", p))
               for size in (2**12, 2**34)}
    assert fastest == {2**12: "LL", 2**34: "Simple"}
    switches = nm.protocol_switches(s, "Ring")
    assert [(a, b) for _, a, b in switches] == [("LL", "LL128"), ("LL128", "Simple")]
    x = switches[0][0]
    assert nm.all_reduce_seconds(x * 0.99, s, "Ring", "LL") < nm.all_reduce_seconds(x * 0.99, s, "Ring", "LL128")
    assert nm.all_reduce_seconds(x * 1.01, s, "Ring", "LL") > nm.all_reduce_seconds(x * 1.01, s, "Ring", "LL128")
    # LL runs at half the bus bandwidth, capped; Simple at all of it, with the larger latency.
    ll, simple = nm.pair_model(s, "Ring", "LL"), nm.pair_model(s, "Ring", "Simple")
    assert ll.bus_bytes_per_s <= 0.5 * simple.bus_bytes_per_s and ll.latency_s < simple.latency_s
    # NCCL's choice over both algorithms: a tree for small messages, the ring with Simple for large ones.
    assert nm.best(2**10, s)[:2] == ("Tree", "LL") and nm.best(2**30, s)[:2] == ("Ring", "Simple")


def test_time_is_latency_plus_bytes_over_algbw_with_nccls_corrections():
    s = _dgx(2)
    ring = nm.pair_model(s, "Ring", "Simple")
    # 64 bytes per channel and rank switch the ring/Simple plateau factor (1.4 from Ampere on) on.
    small, large = 8 * 16 * 63, 8 * 16 * 64
    assert nm.all_reduce_seconds(small, s) == pytest.approx(ring.latency_s + small / ring.alg_bytes_per_s)
    assert nm.all_reduce_seconds(large, s) == pytest.approx(1.4 * ring.latency_s + large / ring.alg_bytes_per_s)
    tree = nm.pair_model(s, "Tree", "Simple")
    mib = 2**20  # log2(2**20 / 64) = 14: the Simple tree's correction there is 0.5
    assert nm.all_reduce_seconds(mib, s, "Tree", "Simple") == pytest.approx(
        tree.latency_s + mib / (0.5 * tree.alg_bytes_per_s))
    assert nm.all_reduce_seconds(0, _dgx(1, gpus_per_node=1)) == 0.0


def test_bad_input_is_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match="LL128 is not enabled"):
        nm.pair_model(nm.NcclSystem.from_cluster(load_preset("pcie-gen4-node", nodes=2)), "Ring", "LL128")
    with pytest.raises(ValueError, match=r"gpu must be one of \['Volta', 'Ampere', 'Hopper'\]"):
        nm.NcclSystem(nodes=1, gpus_per_node=8, channels=8, channel_bytes_per_s=1e9, gpu="Kepler")
    with pytest.raises(ValueError, match="channels must be an int >= 1"):
        nm.NcclSystem(nodes=1, gpus_per_node=8, channels=0, channel_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        nm.all_reduce_seconds(1e6, _dgx(2), "CollNet")
    with pytest.raises(ValueError, match="nbytes must be"):
        nm.all_reduce_seconds(-1, _dgx(2))
    c = load_preset("dgx-h100-ndr")
    c.name = "my-cluster"
    with pytest.raises(KeyError, match="no NCCL description of cluster 'my-cluster'"):
        nm.NcclSystem.from_cluster(c)


def test_history_records_the_older_nvlink_ll_latency():
    rows = nm.load_tuning()["history"]["NVLink Ring LL hwLat (us)"]
    assert {"first": "v2.7.3-1", "last": "v2.17.1-1", "value": 0.47} in rows
    assert rows[-1]["value"] == T["hw_latency_us"]["NVLink"]["Ring"]["LL"] == 0.6
