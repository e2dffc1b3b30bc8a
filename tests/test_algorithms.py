"""Beyond the ring: halving-doubling, recursive doubling, binomial tree and hierarchical AllReduce against
torch's own all_reduce on real gloo ranks; their schedules and α-β cost functions; topology-aware rings."""

import math
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import WORLD_SIZES_1_TO_8
from commlab import launch
from commlab.collectives import (CollectiveMismatchError, binomial_tree_all_reduce_seconds,
                                 double_binary_tree_all_reduce_seconds, hierarchical_all_reduce,
                                 hierarchical_all_reduce_seconds, make_hierarchy_groups,
                                 optimal_pipeline_chunks, pipelined_binary_tree_all_reduce_seconds,
                                 recursive_doubling_all_reduce, recursive_doubling_all_reduce_seconds,
                                 rhd_all_reduce, rhd_all_reduce_seconds, ring_all_reduce,
                                 ring_all_reduce_seconds, ring_all_reduce_seconds_on, tree_all_reduce)
from commlab.collectives.halving_doubling import (doubling_steps, halving_steps, power_of_two_layout,
                                                  real_rank, virtual_rank)
from commlab.collectives.hierarchical import hierarchy_layout
from commlab.collectives.tree import binomial_tree
from commlab.topology import EmulatedTopology, Link, crossings, topology_aware_ring

COUNTS = [0, 1, 2, 3, 5, 7, 8, 17, 1000, 4099]
EXACT_DTYPES = [torch.float32, torch.float64, torch.int64]

# Placements for the hierarchical AllReduce, per world size: placement[rank] = node.
PLACEMENTS = {
    1: [[0]],
    2: [[0, 1], [0, 0]],
    3: [[0, 0, 0], [0, 1, 2]],
    4: [[0, 0, 1, 1], [0, 1, 0, 1]],  # 2x2 contiguous, and interleaved
    5: [[0, 0, 0, 0, 0]],
    6: [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]],  # 2x3, 3x2
    7: [list(range(7))],
    8: [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3]],  # 2x4, 4x2
}


def _data(numel, dtype, rank, integer_valued=True):
    g = torch.Generator().manual_seed(2000 + rank)
    if integer_valued:
        # Small integers: every partial sum is exact in every dtype, so the result must match exactly.
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _algorithms(placements):
    n = dist.get_world_size()
    algos = {
        "rhd": rhd_all_reduce,
        "recursive_doubling": recursive_doubling_all_reduce,
        "tree": tree_all_reduce,
        "tree_root_last": lambda t, **kw: tree_all_reduce(t, root=n - 1, **kw),
    }
    for placement in placements:
        groups = make_hierarchy_groups(placement)
        algos[f"hierarchical{placement}"] = (lambda g: lambda t, **kw: hierarchical_all_reduce(t, g, **kw))(groups)
    return algos


def _compare_all(placements):
    rank = dist.get_rank()
    algos = _algorithms(placements)
    failures = []
    for dtype in EXACT_DTYPES:
        for numel in COUNTS:
            x = _data(numel, dtype, rank)
            before = x.clone()
            ref = x.clone()
            dist.all_reduce(ref)
            for name, fn in algos.items():
                out = fn(x)
                if not (torch.equal(out, ref) and out.dtype == dtype and torch.equal(x, before)):
                    failures.append((name, str(dtype), numel, "out-of-place"))
    # Non-contiguous and 2-D inputs, out of place and in place (written back through the view).
    for numel in [0, 7, 1000]:
        for name, fn in algos.items():
            base = _data(2 * numel, torch.float32, rank).view(-1, 2) if numel else torch.empty(0, 2)
            view = base[:, 1]  # stride 2
            ref = view.contiguous()
            dist.all_reduce(ref)
            out = fn(view)
            ok = torch.equal(out, ref) and out.shape == view.shape
            target = base.t()  # 2 x numel, non-contiguous
            ref2 = target.contiguous()
            dist.all_reduce(ref2)
            returned = fn(target, inplace=True)
            ok = ok and returned is target and torch.equal(base.t(), ref2)
            flat = _data(numel, torch.int64, rank)
            ref3 = flat.clone()
            dist.all_reduce(ref3)
            ok = ok and fn(flat, inplace=True) is flat and torch.equal(flat, ref3)
            if not ok:
                failures.append((name, "float32/int64", numel, "non-contiguous or in place"))
    return failures


@pytest.mark.parametrize("world_size", WORLD_SIZES_1_TO_8)
def test_every_algorithm_equals_torch_exactly_on_integer_valued_data(world_size):
    results = launch(_compare_all, world_size, PLACEMENTS[world_size], timeout=120)
    assert results == [[]] * world_size


def _random_floats(dtype, placement):
    rank = dist.get_rank()
    x = _data(2 * 1001, dtype, rank, integer_valued=False)[::2]  # non-contiguous
    ref = x.to(torch.float64)
    dist.all_reduce(ref)
    outs = {name: fn(x) for name, fn in _algorithms([placement]).items()}
    return ref, {name: (out.dtype, out.to(torch.float64)) for name, out in outs.items()}


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2), (torch.float16, 5e-3)])
def test_random_low_precision_data_is_allclose_to_a_float64_reference(dtype, rtol):
    for ref, outs in launch(_random_floats, 6, dtype, [0, 0, 0, 1, 1, 1], timeout=60):
        # Low-precision sums are rounded once per addition: bounded by a few ulps of the largest partial sum.
        atol = rtol * ref.abs().max().item()
        for name, (got_dtype, out) in outs.items():
            assert got_dtype == dtype, name
            torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, msg=name)


def _misuse():
    rank = dist.get_rank()
    x = torch.ones(10 + (rank == 2))
    messages = {}
    for name, fn in _algorithms([[0, 0, 1, 1]]).items():
        try:
            fn(x)
            messages[name] = "no error"
        except CollectiveMismatchError as e:
            messages[name] = str(e)
    for name, placement in [("uneven", [0, 0, 0, 1]), ("short", [0, 0, 1])]:
        try:
            make_hierarchy_groups(placement)
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    try:
        tree_all_reduce(torch.ones(3), root=4)
        messages["root"] = "no error"
    except ValueError as e:
        messages["root"] = str(e)
    return messages


def test_mismatches_and_bad_placements_give_the_same_clear_error_on_every_rank():
    out = launch(_misuse, 4, timeout=30)
    assert all(m == out[0] for m in out)
    for name in ["rhd", "recursive_doubling", "tree", "tree_root_last", "hierarchical[0, 0, 1, 1]"]:
        assert "rank 2: 11 elements of float32" in out[0][name], (name, out[0][name])
    assert "node 0: 3, node 1: 1" in out[0]["uneven"]
    assert "each of the 4 ranks, got 3" in out[0]["short"]
    assert "tree_all_reduce: root must be a group rank in 0..3, got 4" == out[0]["root"]


def test_hierarchy_layout_groups_ranks_by_node_and_rejects_uneven_nodes():
    assert hierarchy_layout([0, 1, 0, 1]) == [[0, 2], [1, 3]]
    assert hierarchy_layout([5, 5, 2, 2]) == [[2, 3], [0, 1]]
    with pytest.raises(ValueError, match="node 0: 2, node 1: 1"):
        hierarchy_layout([0, 0, 1])
    with pytest.raises(ValueError, match="placement is empty"):
        hierarchy_layout([])


def _subgroup():
    # The non-hierarchical algorithms take a group; partners are computed in group ranks.
    rank = dist.get_rank()
    evens, odds = dist.new_group([0, 2, 4]), dist.new_group([1, 3])
    group = evens if rank % 2 == 0 else odds
    x = torch.tensor([float(rank), 1.0])
    return [fn(x, group).tolist() for fn in (rhd_all_reduce, recursive_doubling_all_reduce, tree_all_reduce)]


def test_algorithms_run_on_a_subgroup():
    out = launch(_subgroup, 5, timeout=30)
    for rank, results in enumerate(out):
        expected = [6.0, 3.0] if rank % 2 == 0 else [4.0, 2.0]
        assert results == [expected] * 3


# ---------------------------------------------------------------- the schedules

@pytest.mark.parametrize("n", range(1, 13))
def test_virtual_ranks_fold_the_extra_ranks_into_a_power_of_two(n):
    p, r = power_of_two_layout(n)
    assert p & (p - 1) == 0 and p <= n < 2 * p and r == n - p
    active = [g for g in range(n) if virtual_rank(g, n) is not None]
    assert len(active) == p and sorted(virtual_rank(g, n) for g in active) == list(range(p))
    assert all(real_rank(virtual_rank(g, n), n) == g for g in active)
    assert all(virtual_rank(g, n) is None for g in range(0, 2 * r, 2))


@pytest.mark.parametrize("p", [1, 2, 4, 8, 16])
def test_halving_leaves_each_rank_its_own_block_and_doubling_mirrors_it(p):
    for v in range(p):
        steps = halving_steps(v, p)
        assert len(steps) == p.bit_length() - 1
        assert (steps[-1][1] if steps else (0, 1)) == (v, v + 1)
        for partner, keep, send in steps:
            # The partner, in the same step, keeps what this rank sends and sends what it keeps.
            mirror = {s[0]: s for s in halving_steps(partner, p)}[v]
            assert mirror[1] == send and mirror[2] == keep
        for (partner, send, recv), (hp, keep, hsend) in zip(doubling_steps(v, p), reversed(steps)):
            assert (partner, send, recv) == (hp, keep, hsend)


@pytest.mark.parametrize("n", range(1, 11))
@pytest.mark.parametrize("root", [0, 3])
def test_binomial_tree_is_a_spanning_tree_of_depth_ceil_log2_n(n, root):
    root = root % n
    parents = {}
    for rank in range(n):
        parent, children = binomial_tree(rank, n, root)
        for c in children:
            assert binomial_tree(c, n, root)[0] == rank
        parents[rank] = parent
    assert parents[root] is None and sum(p is None for p in parents.values()) == 1
    for rank in range(n):
        depth, node = 0, rank
        while parents[node] is not None:
            node, depth = parents[node], depth + 1
        assert depth <= math.ceil(math.log2(n)) if n > 1 else depth == 0
    assert len(binomial_tree(root, n, root)[1]) == (math.ceil(math.log2(n)) if n > 1 else 0)


# ---------------------------------------------------------------- cost functions, by hand

A, B, G, NB = 1e-5, 1e-9, 2e-10, 8e6  # α (s), β (s/byte), γ (s/byte), bytes


def test_halving_doubling_and_recursive_doubling_costs():
    # N = 8: 3 halving + 3 doubling steps moving 7/8 of the vector each way.
    assert rhd_all_reduce_seconds(NB, 8, A, B, G) == pytest.approx(6 * A + 2 * 7 / 8 * NB * B + 7 / 8 * NB * G)
    # N = 6: p = 4; pre-step (α + nβ + nγ) and post-step (α + nβ) around the 4-rank algorithm.
    assert rhd_all_reduce_seconds(NB, 6, A, B, G) == pytest.approx(
        (A + NB * B + NB * G) + (4 * A + 2 * 3 / 4 * NB * B + 3 / 4 * NB * G) + (A + NB * B))
    assert recursive_doubling_all_reduce_seconds(NB, 8, A, B, G) == pytest.approx(3 * (A + NB * B + NB * G))
    assert recursive_doubling_all_reduce_seconds(NB, 6, A, B, G) == pytest.approx(
        3 * (A + NB * B + NB * G) + A + NB * B)
    assert rhd_all_reduce_seconds(NB, 1, A, B) == 0 == recursive_doubling_all_reduce_seconds(NB, 1, A, B)
    # Small messages: recursive doubling's 3 latencies beat halving-doubling's 6; large ones: the reverse.
    assert recursive_doubling_all_reduce_seconds(8, 8, A, B) < rhd_all_reduce_seconds(8, 8, A, B)
    assert rhd_all_reduce_seconds(NB, 8, A, B) < recursive_doubling_all_reduce_seconds(NB, 8, A, B)
    with pytest.raises(ValueError):
        rhd_all_reduce_seconds(-1, 4, A, B)


def test_tree_costs():
    assert binomial_tree_all_reduce_seconds(NB, 8, A, B, G) == pytest.approx(6 * (A + NB * B) + 3 * NB * G)
    assert binomial_tree_all_reduce_seconds(NB, 6, A, B) == pytest.approx(6 * (A + NB * B))
    # Double binary tree, k = 4 chunks, N = 8 (depth 3): 6 steps per phase, n/k bytes per step.
    assert double_binary_tree_all_reduce_seconds(NB, 8, A, B, G, chunks=4) == pytest.approx(
        6 * (2 * A + NB / 4 * (2 * B + G)))
    assert pipelined_binary_tree_all_reduce_seconds(NB, 8, A, B, chunks=4) == pytest.approx(
        6 * (2 * A + 2 * NB / 4 * 2 * B))
    # Best k: sqrt((D-1)·n·2β / 2α) = sqrt(2 · 8e6 · 1e-9 / 1e-5) = 40.
    assert optimal_pipeline_chunks(NB, 8, A, B) == 40
    best = double_binary_tree_all_reduce_seconds(NB, 8, A, B)
    assert best == pytest.approx(42 * (2 * A + NB / 40 * 2 * B))
    assert best == pytest.approx((math.sqrt(2 * 2 * A) + math.sqrt(2 * NB * B)) ** 2)
    # The double tree reaches the ring's bandwidth (2nβ) as α → 0; one binary tree only half of it.
    assert double_binary_tree_all_reduce_seconds(NB, 8, 0.0, B) == pytest.approx(2 * NB * B)
    assert pipelined_binary_tree_all_reduce_seconds(NB, 8, 0.0, B) == pytest.approx(4 * NB * B)
    assert double_binary_tree_all_reduce_seconds(NB, 1, A, B) == 0.0
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        double_binary_tree_all_reduce_seconds(NB, 8, A, B, chunks=0)


INTRA, INTER = Link(1e-6, 1e-10, "intra"), Link(1e-5, 1e-9, "inter")


def test_hierarchical_and_placed_ring_costs():
    # 2 nodes x 4: intra 2·3·(α + n/4·β); inter ring of n/4 bytes over 2 nodes, 4 rings on one NIC.
    expected = 6 * (1e-6 + 2e6 * 1e-10) + (2 * 1e-5 + 2e6 * 1e-9 * 4)
    assert hierarchical_all_reduce_seconds(NB, 2, 4, INTRA, INTER) == pytest.approx(expected)
    assert hierarchical_all_reduce_seconds(NB, 2, 4, INTRA, INTER, nics_per_node=4) == pytest.approx(
        6 * (1e-6 + 2e6 * 1e-10) + 2 * 1e-5 + 2e6 * 1e-9)
    with pytest.raises(ValueError, match="nics_per_node must be an int >= 1"):
        hierarchical_all_reduce_seconds(NB, 2, 4, INTRA, INTER, nics_per_node=0)
    placement = [0, 0, 0, 0, 1, 1, 1, 1]
    # Topology-aware ring: one hop leaves each node per step, 14 steps of n/8 bytes through the NIC; the ring
    # is pipelined, so only 2(nodes-1) = 2 of its 14 steps pay the network latency, the other 12 the intra one.
    assert ring_all_reduce_seconds_on(NB, range(8), placement, INTRA, INTER) == pytest.approx(
        12 * 1e-6 + 2 * 1e-5 + 14 * 1e6 * 1e-9)
    # Multi-rail: 4 channels of n/4 each leave the node through 4 NICs: a quarter of the network time per
    # step (bandwidth = channels x link); more channels than NICs share them and gain nothing more.
    four = ring_all_reduce_seconds_on(NB, range(8), placement, INTRA, INTER, nics_per_node=4, channels=4)
    assert four == pytest.approx(12 * 1e-6 + 2 * 1e-5 + 14 * 1e6 / 4 * 1e-9)
    assert ring_all_reduce_seconds_on(NB, range(8), placement, INTRA, INTER, nics_per_node=4, channels=8) == \
        pytest.approx(four)
    with pytest.raises(ValueError, match="channels must be an int >= 1"):
        ring_all_reduce_seconds_on(NB, range(8), placement, INTRA, INTER, channels=0)
    # Alternating ring: every hop crosses, four leave each node per step through one NIC.
    alternating = [0, 4, 1, 5, 2, 6, 3, 7]
    assert ring_all_reduce_seconds_on(NB, alternating, placement, INTRA, INTER) == pytest.approx(
        14 * (1e-5 + 4e6 * 1e-9))
    assert ring_all_reduce_seconds_on(NB, alternating, placement, INTRA, INTER, nics_per_node=4) == \
        pytest.approx(14 * (1e-5 + 1e6 * 1e-9))
    # On one node the placed ring is the plain ring over the intra link.
    assert ring_all_reduce_seconds_on(NB, range(4), [0] * 4, INTRA, INTER) == pytest.approx(
        ring_all_reduce_seconds(NB, 4, 1e-6, 1e-10))
    with pytest.raises(ValueError, match="permutation"):
        ring_all_reduce_seconds_on(NB, [0, 0, 1, 2], [0, 0, 1, 1], INTRA, INTER)


def test_topology_aware_ring_crosses_each_node_boundary_once():
    assert topology_aware_ring([0, 1, 0, 1]) == [0, 2, 1, 3]
    assert topology_aware_ring([1, 1, 0, 0, 2, 2]) == [2, 3, 0, 1, 4, 5]
    assert crossings([0, 2, 1, 3], [0, 1, 0, 1]) == 2
    assert crossings([0, 1, 2, 3], [0, 1, 0, 1]) == 4
    assert crossings([0, 1, 2], [0, 0, 0]) == 0 and crossings([0], [0]) == 0
    placement = [r % 4 for r in range(16)]
    assert crossings(topology_aware_ring(placement), placement) == 4
    with pytest.raises(ValueError, match="permutation"):
        crossings([0, 1], [0, 0, 1])


# ---------------------------------------------------------------- the emulated topology feels the difference

_TOPO = EmulatedTopology(2, 2, Link.from_bandwidth(50e6, 1e-3, "slow"))


def _timed_pair():
    x = torch.arange(2**20, dtype=torch.float32) + dist.get_rank()
    ref = x.clone()
    dist.all_reduce(ref)
    groups = make_hierarchy_groups(_TOPO.placement)
    unaware = [0, 2, 1, 3]  # every hop crosses nodes: two messages per NIC per step
    hierarchical_all_reduce(x, groups)  # warm-up, not emulated
    ring_all_reduce(x, ring=unaware)
    times, ok = [], True
    for run in (lambda: hierarchical_all_reduce(x, groups, emulate=_TOPO),
                lambda: ring_all_reduce(x, ring=unaware, emulate=_TOPO)):
        dist.barrier()
        if dist.get_rank() == 0:
            _TOPO.reset()
        dist.barrier()
        t = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t)
        ok = ok and torch.equal(out, ref)
    return times, ok


@pytest.mark.timing
def test_hierarchical_beats_the_topology_unaware_ring_on_a_slow_emulated_link():
    out = launch(_timed_pair, 4, timeout=60)
    assert all(ok for _, ok in out)
    t_hier = max(times[0] for times, _ in out)
    t_ring = max(times[1] for times, _ in out)
    # 4 MiB: each NIC carries n bytes for the hierarchical AllReduce, 3n for the unaware ring (the model
    # below says the same); at 50 MB/s that is about 0.09 s against 0.26 s.
    inter = _TOPO.inter
    model_hier = hierarchical_all_reduce_seconds(4 * 2**20, 2, 2, Link(0, 0), inter)
    model_ring = ring_all_reduce_seconds_on(4 * 2**20, [0, 2, 1, 3], _TOPO.placement, Link(0, 0), inter)
    assert model_ring > 2.5 * model_hier
    assert t_ring > 1.5 * t_hier, (t_hier, t_ring)


def _one_bad_placement(bad):
    from commlab.collectives import make_hierarchy_groups
    placement = bad if dist.get_rank() == 3 else [0, 0, 1, 1]
    try:
        make_hierarchy_groups(placement)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("bad", [[0, 0, 0, 1], [0, 0, 1], [0, 0.5, 1, 1]])
def test_a_bad_placement_on_one_rank_fails_on_every_rank_instead_of_hanging(bad):
    out = launch(_one_bad_placement, 4, bad, timeout=30)
    assert len(set(out)) == 1 and "rank 3 passed" in out[0], out


def _huge_root():
    try:
        tree_all_reduce(torch.ones(3), root=2**70 if dist.get_rank() == 0 else 0)
    except ValueError as e:
        return str(e)


def test_a_root_too_large_for_int64_is_reported_on_every_rank():
    out = launch(_huge_root, 2, timeout=20)
    assert out[0] == out[1] and "root must be a group rank in 0..1" in out[0]
