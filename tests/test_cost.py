"""The side-by-side cost registry: predictions, the NCCL-style choice, crossovers, cluster layouts, SHARP."""

import pytest

from commlab.collectives import ring_all_reduce_seconds
from commlab.collectives.cost import (FLAT_ALGORITHMS, crossover_nbytes, fastest, interleaved_placement,
                                      predict_flat, predict_on_cluster)
from commlab.collectives.in_network import (fat_tree_down_ports, in_network_all_reduce_seconds,
                                            in_network_speedup_limit, switch_tree_levels)
from commlab.topology import Link

IB = Link.from_bandwidth(25e9, 5e-6)


def test_predict_flat_lists_every_algorithm_and_rejects_unknown_ones():
    t = predict_flat(1e6, 8, IB)
    assert set(t) == set(FLAT_ALGORITHMS) and all(v > 0 for v in t.values())
    assert t["ring"] == pytest.approx(14 * 5e-6 + 1.75e6 / 25e9)
    with pytest.raises(KeyError, match="known"):
        predict_flat(1e6, 8, IB, algorithms=["butterfly"])


def test_ring_gamma_term_counts_only_the_reduce_scatter_half():
    assert ring_all_reduce_seconds(8e6, 4, 0, 0, 1e-9) == pytest.approx(0.75 * 8e6 * 1e-9)


def test_small_messages_pick_a_tree_large_ones_the_ring():
    assert fastest(1e3, 64, IB) == "double binary tree"
    assert fastest(1e10, 64, IB) == "ring"


def test_crossover_is_where_the_curves_meet():
    def ring(s):
        return ring_all_reduce_seconds(s, 64, 5e-6, 1 / 25e9)

    def tree(s):
        return FLAT_ALGORITHMS["double binary tree"](s, 64, 5e-6, 1 / 25e9)

    x = crossover_nbytes(ring, tree)
    assert x is not None and ring(x) == pytest.approx(tree(x), rel=1e-6)
    assert crossover_nbytes(tree, ring) is None  # the tree is not the slower one at small sizes


def test_cluster_layouts():
    nv, ib = Link.from_bandwidth(450e9, 3.4e-6), Link.from_bandwidth(25e9, 14e-6)
    one_nic = predict_on_cluster(1e9, 8, 8, nv, ib, nics_per_node=1)
    # Round-robin ranks put 8 flows on each node's single NIC at every step: 8x the bandwidth term.
    assert one_nic["ring, round-robin ranks"] / one_nic["ring, topology order"] == pytest.approx(8, rel=0.01)
    eight = predict_on_cluster(1e9, 8, 8, nv, ib, nics_per_node=8, switch_alpha_s=0.2e-6)
    # One channel per NIC (the default): the flat ring uses every rail and overlaps NVLink with the network,
    # so at 1 GB it beats the hierarchical algorithm, whose intra-node phases come before and after ...
    assert eight["ring, topology order"] < eight["hierarchical"]
    # ... which wins when the flat ring has one channel (one NIC in use) or the message is small (latency).
    assert predict_on_cluster(1e9, 8, 8, nv, ib, nics_per_node=8, channels=1)["hierarchical"] < \
        predict_on_cluster(1e9, 8, 8, nv, ib, nics_per_node=8, channels=1)["ring, topology order"]
    small = predict_on_cluster(2**16, 8, 8, nv, ib, nics_per_node=8)
    assert small["hierarchical"] < small["ring, topology order"]
    # Fewer NICs than GPUs and few nodes: the hierarchical algorithm sends 2(M-1)/M of the buffer out of a
    # node instead of 2(N-1)/N, and the intra-node phases are cheap next to one NIC.
    two_nodes = predict_on_cluster(1e9, 2, 8, nv, ib, nics_per_node=1)
    assert two_nodes["hierarchical"] < 0.75 * two_nodes["ring, topology order"]
    assert eight["hierarchical + in-network"] < eight["hierarchical"]
    assert interleaved_placement(2, 3) == [0, 1, 0, 1, 0, 1]


def test_multi_rail_ring_is_chapter_1s_model():
    # Without latency the multi-rail ring is exactly chapter 1's estimate: the node's NICs together carry
    # 2(N-1)/N of the buffer, NVLink carries as much per GPU, the slower of the two sets the time.
    from commlab.arithmetic import data_parallel_sync
    nv, ib = Link.from_bandwidth(450e9, 0.0), Link.from_bandwidth(50e9, 0.0)
    ring = predict_on_cluster(2**30, 8, 8, nv, ib, nics_per_node=8)["ring, topology order"]
    ch1 = data_parallel_sync(2**29, tp=1, nodes=8, gpus_per_node=8, nics_per_node=8, nic_bytes_per_s=50e9,
                             nvlink_bytes_per_s=450e9)  # 2**29 bf16 gradients = 1 GiB
    assert ring == pytest.approx(ch1.seconds, rel=1e-12)


def test_in_network_reduction_is_at_most_twice_as_fast_and_its_latency_still_grows():
    assert in_network_speedup_limit(1) == 1.0 and in_network_speedup_limit(4096) == pytest.approx(2, abs=1e-3)
    assert [switch_tree_levels(n) for n in (8, 64, 2000, 100_000)] == [1, 2, 3, 4]
    # A 40-port switch faces 20 ports down below the top level: 40, 800, 16,000 endpoints for 1, 2, 3 levels.
    assert fat_tree_down_ports(40, 3) == (20, 20, 40)
    assert [switch_tree_levels(n, 40) for n in (40, 41, 800, 801, 16_000, 16_001)] == [1, 2, 2, 3, 3, 4]
    assert switch_tree_levels(2048, 64) == 2 and switch_tree_levels(2049, 64) == 3
    with pytest.raises(ValueError, match="even int"):
        switch_tree_levels(8, 41)
    small = [in_network_all_reduce_seconds(8, n, 1e-6, 1e-10, 0.5e-6) for n in (40, 1600, 64000)]
    assert small[0] < small[1] < small[2]
    assert in_network_all_reduce_seconds(0, 1, 1, 1, 1) == 0.0
    with pytest.raises(ValueError):
        switch_tree_levels(0)
    with pytest.raises(ValueError):
        in_network_all_reduce_seconds(-1, 4, 0, 0, 0)
