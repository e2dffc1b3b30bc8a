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


NV = T["nvls"]


def _nvls(nodes):
    return _dgx(nodes, nvls=True)


def test_nvls_on_one_node_by_tuning_cc_formulas():
    s = _nvls(1)
    assert s.nvls == nm.NvlsGraph(8, 40e9, 60e9)
    assert nm.enabled_algorithms(s) == ("Ring", "Tree", "NVLS")  # NVLSTree is off on one node (line 502)
    m = nm.pair_model(s, "NVLS", "Simple")
    # per channel min(bwIntra * 0.85 * (C-1)/C * 2, bwInter) = min(40 * 0.85 * 7/8 * 2, 60) = 59.5 GB/s
    assert m.bus_bytes_per_s == pytest.approx(8 * 59.5e9)  # 476 GB/s; nccl-tests#212 measures about 480
    assert m.alg_bytes_per_s == pytest.approx(476e9 * 8 / 14)
    assert m.latency_s == pytest.approx(25e-6)  # the NVLink NVLS latency replaces the base latency (line 425)
    assert nm.all_reduce_seconds(2**30, s, "NVLS", "Simple") == pytest.approx(25e-6 + 2**30 / (476e9 * 8 / 14))
    # Ring LL for small messages, NVLS from between 1 and 2 MiB (what nccl-tests#309 reports on one node)
    assert nm.best(2**20, s)[:2] == ("Ring", "LL") and nm.best(2**21, s)[:2] == ("NVLS", "Simple")
    assert nm.best(2**30, s)[:2] == ("NVLS", "Simple")


def test_nvlstree_across_nodes_by_tuning_cc_formulas():
    two, eight = _nvls(2), _nvls(8)
    assert nm.enabled_algorithms(eight) == ("Ring", "Tree", "NVLSTree")  # NVLS across nodes needs CollNet
    # two nodes: bwInter counts twice (line 320), the per-channel cap is 57.7 (Hopper, N2)
    m2 = nm.pair_model(two, "NVLSTree", "Simple")
    assert m2.bus_bytes_per_s == pytest.approx(8 * min(59.5, 2 * 48, 57.7) * 1e9)  # 461.6; #309 measures ~470
    assert m2.alg_bytes_per_s == pytest.approx(461.6e9 * 16 / 30)
    assert m2.latency_s == pytest.approx((0 + 25 + 2 * 1 * 20.9) * 1e-6)
    # more nodes: min(59.5, 48, 45.5) per channel; latency 25 + 2 log2(nodes) x 20.9 us
    m8 = nm.pair_model(eight, "NVLSTree", "Simple")
    assert m8.bus_bytes_per_s == pytest.approx(8 * 45.5e9)  # 364; #309 measures 366 on 4 nodes
    assert m8.latency_s == pytest.approx((25 + 2 * 3 * 20.9) * 1e-6)
    # NVLSTree takes the large messages; among Ring and Tree alone the ring still wins at 1 GiB
    assert nm.best(2**30, eight)[:2] == ("NVLSTree", "Simple")
    assert nm.best(2**30, eight, nm.ALGORITHMS)[:2] == ("Ring", "Simple")
    assert nm.best(2**10, eight)[:2] == ("Tree", "LL")
    assert nm.protocol_switches(eight, "NVLSTree") == []
    assert ("NVLSTree", "LL") not in nm.all_reduce_table(2**20, eight)


def test_nvls_needs_two_gpus_per_node_and_two_channels():
    g = nm.NvlsGraph(8, 40e9, 48e9)
    s = nm.NcclSystem(nodes=4, gpus_per_node=1, channels=1, channel_bytes_per_s=50e9, nvls=g)
    assert nm.enabled_algorithms(s) == nm.ALGORITHMS  # src/transport/nvls.cc: fewer than 2 GPUs, no NVLS
    with pytest.raises(ValueError, match="2 or more GPUs per node"):
        nm.pair_model(s, "NVLSTree")
    one = nm.NcclSystem(nodes=1, gpus_per_node=8, channels=8, channel_bytes_per_s=50e9, nvls=nm.NvlsGraph(1, 40e9, 60e9))
    assert nm.enabled_algorithms(one) == nm.ALGORITHMS
    with pytest.raises(ValueError, match="needs 2"):
        nm.pair_model(one, "NVLS")


def test_nvls_bad_input_is_refused():
    with pytest.raises(ValueError, match="runs the Simple protocol only"):
        nm.pair_model(_nvls(1), "NVLS", "LL")
    with pytest.raises(ValueError, match="NVLS across nodes needs CollNet"):
        nm.pair_model(_nvls(2), "NVLS")
    with pytest.raises(ValueError, match="disables NVLSTree on one node"):
        nm.pair_model(_nvls(1), "NVLSTree")
    with pytest.raises(ValueError, match="no NVLS graph"):
        nm.all_reduce_seconds(1e6, _dgx(1), "NVLS")
    with pytest.raises(ValueError, match="nvls must be None off Hopper"):
        nm.NcclSystem(nodes=1, gpus_per_node=8, channels=8, channel_bytes_per_s=1e9, gpu="Ampere",
                      nvls=nm.NvlsGraph(8, 40e9, 60e9))
    with pytest.raises(ValueError, match="has no NVLS graph"):
        nm.NcclSystem.from_cluster(load_preset("dgx-a100-hdr", nodes=2), nvls=True)
    with pytest.raises(ValueError, match="gpus_per_node must be 8 with nvls=True"):
        _dgx(2, gpus_per_node=4, nvls=True)
    with pytest.raises(ValueError, match="channels must be an int >= 1"):
        nm.NvlsGraph(0, 40e9, 60e9)


def test_tree_uses_bw_intra_on_one_or_two_nodes_only():
    # tuning.cc line 306: bw = nNodes <= 2 ? bwIntra : bwInter
    kw = dict(gpus_per_node=8, channels=8, channel_bytes_per_s=24e9, gpu="Ampere", cpu="AMD", tree_intra_bytes_per_s=48e9)
    two, three = nm.NcclSystem(nodes=2, **kw), nm.NcclSystem(nodes=3, **kw)
    per_ch = T["tree_per_channel_max_gbps"]["Ampere"]
    assert nm.pair_model(two, "Tree", "Simple").bus_bytes_per_s == pytest.approx(min(0.92 * 8 * 48, 8 * per_ch[1]) * 1e9)
    assert nm.pair_model(three, "Tree", "Simple").bus_bytes_per_s == pytest.approx(min(0.92 * 8 * 24, 8 * per_ch[2]) * 1e9)
    # the ring's search keeps bwIntra = bwInter: the rule changes nothing for it
    assert nm.pair_model(two, "Ring", "Simple").bus_bytes_per_s == pytest.approx(8 * 24e9)
    # from_cluster leaves it unset: the tree's bwIntra is the channel bandwidth
    s = _dgx(2)
    assert s.tree_intra_bytes_per_s is None
    assert nm.pair_model(s, "Tree", "Simple").bus_bytes_per_s == pytest.approx(min(0.92 * 400, 8 * 41.4) * 1e9)
    with pytest.raises(ValueError, match="tree_intra_bytes_per_s must be"):
        nm.NcclSystem(nodes=2, gpus_per_node=8, channels=8, channel_bytes_per_s=1e9, tree_intra_bytes_per_s=0)
