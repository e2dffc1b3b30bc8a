"""Ring ReduceScatter / AllGather / AllReduce against torch's own collectives, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import WORLD_SIZES_1_TO_8
from commlab import RankError, launch
from commlab.collectives import (CollectiveMismatchError, chunk_bounds, ring_all_gather,
                                 ring_all_reduce, ring_all_reduce_seconds, ring_bytes_sent_per_rank,
                                 ring_reduce_scatter)
from commlab.collectives.common import all_gather_single, reduce_scatter_single
from commlab.collectives.ring import (all_gather_recv_chunk, all_gather_send_chunk,
                                      reduce_scatter_recv_chunk, reduce_scatter_send_chunk)

COUNTS = [0, 1, 2, 3, 5, 7, 8, 16, 17, 64, 1000, 4099]
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _data(numel, dtype, rank, integer_valued=True):
    g = torch.Generator().manual_seed(1000 + rank)
    if integer_valued:
        # Small integers: every partial sum is exact in every dtype, so the ring must match exactly.
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _compare_all(counts, dtypes, ring):
    rank, n = dist.get_rank(), dist.get_world_size()
    report = []
    for dtype in dtypes:
        for numel in counts:
            x = _data(numel, dtype, rank)
            ref = x.clone()
            dist.all_reduce(ref)
            ours = ring_all_reduce(x, ring=ring)
            ok_ar = torch.equal(ours, ref) and ours.dtype == dtype
            a, b = chunk_bounds(numel, n)[rank]
            rs = ring_reduce_scatter(x, ring=ring)
            ok_rs = torch.equal(rs, ref[a:b])
            if numel % n == 0 and numel > 0:
                out = torch.empty(numel // n, dtype=dtype)
                reduce_scatter_single(out, x.clone())
                ok_rs = ok_rs and torch.equal(rs, out)
            ag = ring_all_gather(x, ring=ring)
            ref_ag = torch.empty(n * numel, dtype=dtype)
            if numel > 0:
                all_gather_single(ref_ag, x.clone())
            ok_ag = torch.equal(ag, ref_ag) and ag.dtype == dtype
            if not (ok_ar and ok_rs and ok_ag):
                report.append((str(dtype), numel, ok_ar, ok_rs, ok_ag))
    return report


@pytest.mark.parametrize("world_size", WORLD_SIZES_1_TO_8)
def test_ring_collectives_equal_torch_exactly_on_integer_valued_data(world_size):
    results = launch(_compare_all, world_size, COUNTS, FLOATS + [torch.int64], None, timeout=120)
    assert results == [[]] * world_size


@pytest.mark.slow
@pytest.mark.parametrize("world_size, ring", [(4, [3, 1, 0, 2]), (5, [4, 3, 2, 1, 0]), (8, [0, 2, 4, 6, 1, 3, 5, 7])])
def test_a_custom_ring_order_gives_the_same_results(world_size, ring):
    results = launch(_compare_all, world_size, [0, 3, 17, 1000], [torch.float32, torch.int32], ring, timeout=60)
    assert results == [[]] * world_size


def _random_float_allreduce(numel, dtype, noncontiguous):
    rank = dist.get_rank()
    x = _data(numel * 2, dtype, rank, integer_valued=False)
    x = x[::2] if noncontiguous else x[:numel]
    assert x.is_contiguous() == (not noncontiguous) or numel <= 1
    before = x.clone()
    ref = x.to(torch.float64, copy=True)
    dist.all_reduce(ref)
    ours = ring_all_reduce(x)
    assert torch.equal(x, before), "the input must not be modified"
    ours_inplace = x.clone()
    ring_all_reduce(ours_inplace, inplace=True)
    return ours.dtype, ours.to(torch.float64), ours_inplace.to(torch.float64), ref


@pytest.mark.slow
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12),
                                          (torch.bfloat16, 4e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_random_data_is_allclose_to_a_float64_reference(dtype, rtol, noncontiguous):
    out = launch(_random_float_allreduce, 4, 1001, dtype, noncontiguous)
    for got_dtype, ours, ours_inplace, ref in out:
        assert got_dtype == dtype
        # Low-precision sums are rounded once per hop: bounded by a few ulps of the largest partial sum.
        atol = rtol * ref.abs().max().item()
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(ours_inplace, ours, rtol=0, atol=0)


def _multidim_and_views():
    rank = dist.get_rank()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
    view = base.t()  # non-contiguous, 6x4
    ours = ring_all_reduce(view)
    ref = view.contiguous()
    dist.all_reduce(ref)
    inplace_target = base.t()
    ring_all_reduce(inplace_target, inplace=True)
    return ours.shape, torch.equal(ours, ref), torch.equal(base.t(), ref)


def test_shape_is_kept_and_inplace_writes_through_a_noncontiguous_view():
    for shape, equal, inplace_equal in launch(_multidim_and_views, 3):
        assert shape == (6, 4) and equal and inplace_equal


def _on_subgroups():
    rank = dist.get_rank()
    evens = dist.new_group([0, 2])  # every rank creates every group, in the same order
    odds = dist.new_group([1, 3])
    group = evens if rank % 2 == 0 else odds
    x = torch.tensor([float(rank), 1.0, 2.0])
    ours = ring_all_reduce(x, group=group)
    rs = ring_reduce_scatter(torch.arange(4.0) + rank, group=group)
    ag = ring_all_gather(torch.tensor([float(rank)]), group=group)
    return ours.tolist(), rs.tolist(), ag.tolist()


def test_collectives_run_on_a_subgroup_with_group_ranks():
    out = launch(_on_subgroups, 4)
    assert out[0] == ([2.0, 2.0, 4.0], [2.0, 4.0], [0.0, 2.0])
    assert out[2] == ([2.0, 2.0, 4.0], [6.0, 8.0], [0.0, 2.0])
    assert out[1] == ([4.0, 2.0, 4.0], [4.0, 6.0], [1.0, 3.0])


def _mismatched(kind):
    rank = dist.get_rank()
    if kind == "size":
        x = torch.ones(10 + (rank == 2))
    elif kind == "dtype":
        x = torch.ones(10, dtype=torch.float64 if rank == 1 else torch.float32)
    elif kind == "device":
        # A tensor off the group's device (under NCCL: a CPU tensor) on one rank; gloo's device is the CPU,
        # so the meta device stands in for "not the group's device" here.
        x = torch.ones(10, device="meta" if rank == 1 else "cpu")
    else:
        x = torch.ones(10)
    ring = [0, 1, 2] if (kind != "ring" or rank != 0) else [0, 2, 1]
    try:
        ring_all_reduce(x, ring=ring)
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind, expected", [
    ("size", "rank 2: 11 elements of float32"),
    ("dtype", "rank 1: 10 elements of float64"),
    ("ring", "ranks passed different ring orders"),
    ("device", "every rank's tensor must be on its process group's device (cpu: the rank's own GPU under NCCL, "
     "the CPU under gloo), but rank 1: meta; move it there first"),
])
def test_a_mismatch_gives_the_same_clear_error_on_every_rank(kind, expected):
    messages = launch(_mismatched, 3, kind, timeout=20)
    assert len(set(messages)) == 1, messages
    assert expected in messages[0]


def _bad_ring():
    ring_all_reduce(torch.ones(3), ring=[0, 0, 1])


def test_a_ring_that_is_not_a_permutation_is_rejected():
    with pytest.raises(RankError, match="must be a permutation"):
        launch(_bad_ring, 3, timeout=20)


def _bool_tensor():
    ring_all_reduce(torch.ones(3, dtype=torch.bool))


def test_an_unsupported_dtype_is_rejected():
    with pytest.raises(RankError, match="dtype torch.bool is not supported"):
        launch(_bool_tensor, 2, timeout=20)


def test_calling_outside_a_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="not initialised"):
        ring_all_reduce(torch.ones(3))


# ---------------------------------------------------------------- property-based: any size, any ring

@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_any_world_size_count_and_ring(data):
    n = data.draw(st.integers(1, 6), label="world_size")
    numel = data.draw(st.integers(0, 70), label="numel")
    ring = data.draw(st.permutations(list(range(n))), label="ring")
    assert launch(_compare_all, n, [numel], [torch.float32], ring, timeout=60) == [[]] * n


# ---------------------------------------------------------------- the schedule and the cost functions

@pytest.mark.parametrize("n", range(2, 9))
def test_schedule_every_chunk_visits_every_rank_once_in_reduce_scatter(n):
    order = list(reversed(range(n)))
    for chunk in range(n):
        holders = set()
        for step in range(n - 1):
            for p in range(n):
                if reduce_scatter_send_chunk(p, step, n, order) == chunk:
                    holders.add(order[p])
                assert reduce_scatter_recv_chunk(p, step, n, order) == \
                    reduce_scatter_send_chunk((p - 1) % n, step, n, order)
                assert all_gather_recv_chunk(p, step, n, order) == \
                    all_gather_send_chunk((p - 1) % n, step, n, order)
        # sent by every rank except the one that ends up owning the total
        assert holders == set(range(n)) - {chunk}


def test_cost_functions():
    assert ring_bytes_sent_per_rank(140e9, 64) == pytest.approx(2 * 63 / 64 * 140e9)
    assert ring_bytes_sent_per_rank(8, 4, "all_gather") == 6
    assert ring_all_reduce_seconds(1e6, 4, 1e-5, 1e-9) == pytest.approx(6e-5 + 1.5e6 * 1e-9)
    with pytest.raises(ValueError, match="collective must be one of"):
        ring_bytes_sent_per_rank(1, 2, "broadcast")
    with pytest.raises(ValueError):
        ring_bytes_sent_per_rank(1, 0)


def test_chunk_bounds_follow_tensor_split():
    for numel in [0, 1, 3, 10, 17]:
        for parts in [1, 2, 3, 8]:
            expected = [len(t) for t in torch.tensor_split(torch.arange(numel), parts)]
            assert [b - a for a, b in chunk_bounds(numel, parts)] == expected


def _one_bad_ring(ring_on_rank_1):
    ring = ring_on_rank_1 if dist.get_rank() == 1 else [0, 1, 2]
    try:
        ring_all_reduce(torch.ones(4), ring=ring)
    except ValueError as e:
        return type(e).__name__, str(e)
    return "no error"


@pytest.mark.parametrize("bad", [[0, 0, 1], [0, 1], [0.0, 1.5, 2]])
def test_a_bad_ring_on_one_rank_raises_the_same_error_on_every_rank(bad):
    out = launch(_one_bad_ring, 3, bad, timeout=20)
    assert len(set(out)) == 1, out
    kind, message = out[0]
    assert kind == "CollectiveMismatchError" and "rank 1 passed" in message
    assert "must be a permutation of the group's ranks 0..2" in message


def _bool_on_one_rank():
    x = torch.ones(3, dtype=torch.bool if dist.get_rank() == 0 else torch.float32)
    try:
        ring_all_reduce(x)
    except TypeError as e:
        return str(e)


def test_an_unsupported_dtype_on_one_rank_raises_on_every_rank():
    out = launch(_bool_on_one_rank, 2, timeout=20)
    assert out[0] == out[1] and "rank 0: bool" in out[0]


def _different_orders():
    ring = [0, 1, 2] if dist.get_rank() else [0, 2, 1]
    try:
        ring_all_reduce(torch.ones(4), ring=ring)
    except CollectiveMismatchError as e:
        return str(e)


def test_different_ring_orders_are_listed_per_rank():
    out = launch(_different_orders, 3, timeout=20)
    assert len(set(out)) == 1
    assert "rank 0: [0, 2, 1]; rank 1: [0, 1, 2]" in out[0] and "incompatible tensors" not in out[0]
