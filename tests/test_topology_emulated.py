"""Links and the emulated topology: the α-β arithmetic, NIC queueing, and its effect on a real ring."""

import time

import pytest
import torch
import torch.distributed as dist

from commlab import launch
from commlab.collectives import ring_all_reduce
from commlab.topology import EmulatedTopology, Link


def test_link_arithmetic_and_validation():
    link = Link.from_bandwidth(25e9, 2e-6, "HDR")
    assert link.bytes_per_s == pytest.approx(25e9)
    assert link.seconds(25e9) == pytest.approx(1 + 2e-6)
    with pytest.raises(ValueError, match="beta_s_per_byte"):
        Link(1e-6, -1.0)
    with pytest.raises(ValueError, match="bytes_per_s must be a number > 0, got 0"):
        Link.from_bandwidth(0, 1e-6)


def test_placement_and_validation():
    topo = EmulatedTopology(2, 2, Link(0, 1e-9))
    assert [topo.node_of(r) for r in range(4)] == [0, 0, 1, 1] and topo.ranks_on(1) == [2, 3]
    assert topo.crosses_nodes(1, 2) and not topo.crosses_nodes(0, 1)
    with pytest.raises(ValueError, match="placement must put 2"):
        EmulatedTopology(2, 2, Link(0, 1e-9), placement=[0, 0, 0, 1])
    with pytest.raises(ValueError):
        EmulatedTopology(0, 2, Link(0, 0))


def test_messages_leaving_one_node_queue_on_its_nic():
    topo = EmulatedTopology(2, 2, Link(alpha_s=0.001, beta_s_per_byte=1e-6))
    first = topo.delay_s(0, 2, 10_000)   # 10 ms on the wire + 1 ms latency
    second = topo.delay_s(1, 3, 10_000)  # same NIC: queues behind the first
    other_node = topo.delay_s(2, 0, 10_000)
    assert first == pytest.approx(0.011, abs=1e-3)
    assert second == pytest.approx(0.021, abs=1e-3)
    assert other_node == pytest.approx(0.011, abs=1e-3)
    assert topo.delay_s(0, 1, 10_000) == 0.0
    topo.reset()
    assert topo.delay_s(1, 3, 10_000) == pytest.approx(0.011, abs=1e-3)


_TOPO = EmulatedTopology(2, 2, Link.from_bandwidth(50e6, 1e-3, "slow"))


def _timed(ring):
    x = torch.arange(2**20, dtype=torch.float32) + dist.get_rank()
    ref = x.clone()
    dist.all_reduce(ref)
    ring_all_reduce(x, ring=ring)  # warm-up, not emulated
    dist.barrier()
    t = time.perf_counter()
    out = ring_all_reduce(x, ring=ring, emulate=_TOPO)
    return time.perf_counter() - t, torch.equal(out, ref)


@pytest.mark.timing
def test_a_ring_ordered_against_the_topology_is_slower_on_the_emulated_link():
    _TOPO.reset()
    aware = launch(_timed, 4, None)
    _TOPO.reset()
    unaware = launch(_timed, 4, [0, 2, 1, 3])  # every hop crosses nodes: two messages per NIC per step
    assert all(ok for _, ok in aware + unaware)
    t_aware, t_unaware = max(t for t, _ in aware), max(t for t, _ in unaware)
    # 4 MiB on 4 ranks: 6 steps of 1 MiB; at 50 MB/s a message holds the NIC for ~21 ms, so the model
    # predicts about 6 x 22 ms for the aware ring and 6 x 43 ms for the unaware one.
    assert t_unaware > 1.4 * t_aware, (t_aware, t_unaware)
