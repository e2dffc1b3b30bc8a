"""Aggregation of compressed tensors on real gloo ranks: the sum, the path, the bytes, the mismatch error."""

import pytest
import torch
import torch.distributed as dist

from commlab import RankError, launch
from commlab.collectives import CollectiveMismatchError
from commlab.compress import (QSGD, ErrorFeedback, RandomK, RoundingQuantizer, SignCompressor, TopK, aggregate)


def _factories(rank):
    return {
        "randomk": lambda: RandomK(k=16, seed=7),   # shared seed: linear
        "topk": lambda: TopK(k=10),
        "qsgd": lambda: QSGD(levels=7, seed=100 + rank),  # a different stream per rank
        "int8": lambda: RoundingQuantizer(8),
        "int4": lambda: RoundingQuantizer(4),
        "sign": lambda: SignCompressor(),
    }


def _reference_sum(decompressed, dtype):
    """Sum of every rank's decompressed tensor, gathered with torch's all_gather, in rank order."""
    n = dist.get_world_size()
    parts = [torch.empty_like(decompressed) for _ in range(n)]
    dist.all_gather(parts, decompressed)
    acc = torch.promote_types(dtype, torch.float32)
    total = torch.zeros(decompressed.shape, dtype=acc)
    for p in parts:
        total += p.to(acc)
    return total.to(dtype)


def _check_all():
    rank, n = dist.get_rank(), dist.get_world_size()
    problems = []
    g = torch.Generator().manual_seed(rank)
    for name, make in _factories(rank).items():
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ((8, 8), (0,), (3,)):
                # Integer-valued data: every partial sum is exact, so the ring's order of addition cannot
                # make the linear path differ from the reference.
                x = torch.randint(-20, 21, shape, generator=g).to(dtype)
                mine, ref_comp = make(), make()  # same settings and seed: the same payload
                agg = aggregate(x, mine)
                p = ref_comp.compress(x)
                ref = _reference_sum(ref_comp.decompress(p), dtype)
                path = "all_reduce" if mine.linear else "all_gather"
                expected_bytes = 2 * (n - 1) / n * p.nbytes if mine.linear else (n - 1) * p.nbytes
                ok = (agg.sum.shape == x.shape and agg.sum.dtype == dtype and torch.equal(agg.sum, ref)
                      and agg.path == path and agg.payload_nbytes == p.nbytes
                      and agg.bytes_sent_per_rank == expected_bytes)
                if not ok:
                    problems.append((name, str(dtype), shape, agg.path, agg.payload_nbytes, p.nbytes,
                                     agg.bytes_sent_per_rank, expected_bytes,
                                     float((agg.sum.double() - ref.double()).abs().max()) if x.numel() else 0))
    return problems


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_aggregate_equals_the_sum_of_decompressed_payloads_with_exact_bytes(world_size):
    assert launch(_check_all, world_size, timeout=120) == [[]] * world_size


def _integer_sums():
    """int64 values above 2**24 (where float32 stops holding every integer) through the lossless settings of
    each path: Top-K and Random-K keeping every entry."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([2 ** 24 + 1 + rank, -3, 2 ** 40 + 7, 2 ** 53 + rank], dtype=torch.int64)
    expected = torch.tensor([n * (2 ** 24 + 1) + n * (n - 1) // 2, -3 * n, n * (2 ** 40 + 7),
                             n * 2 ** 53 + n * (n - 1) // 2], dtype=torch.int64)
    got = {}
    for name, make, path in (("topk", lambda: TopK(k=4), "auto"), ("topk", lambda: TopK(k=4), "two_phase"),
                             ("randomk", lambda: RandomK(k=4, seed=1), "auto"),
                             ("randomk", lambda: RandomK(k=4, seed=1), "all_gather")):
        s = aggregate(x, make(), path=path).sum
        got[(name, path)] = (s.dtype == torch.int64 and torch.equal(s, expected), s.tolist())
    return got


def test_lossless_paths_sum_integer_tensors_exactly():
    for got in launch(_integer_sums, 3, timeout=60):
        assert all(ok for ok, _ in got.values()), got


def _randomk_linear_path_is_the_true_sum_of_sparsified_tensors():
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(64, dtype=torch.float32) * (rank + 1)
    comp = RandomK(k=16, seed=3)
    agg = aggregate(x, comp)
    idx = RandomK.indices(64, 16, 3, 0)
    expected = torch.zeros(64)
    expected[idx] = 4.0 * torch.arange(64, dtype=torch.float32)[idx] * sum(range(1, n + 1))
    return torch.equal(agg.sum, expected), agg.path, agg.bytes_sent_per_rank


def test_randomk_rides_the_ring():
    out = launch(_randomk_linear_path_is_the_true_sum_of_sparsified_tensors, 4, timeout=60)
    assert out == [(True, "all_reduce", 2 * 3 / 4 * 16 * 4)] * 4


def _with_error_feedback():
    rank = dist.get_rank()
    comp = SignCompressor()
    ef = ErrorFeedback(comp)
    x = torch.tensor([1.0, -3.0, 0.5]) * (rank + 1)
    agg = aggregate(x, comp, error_feedback=ef, key="w")
    sent = comp.decompress(comp.compress(x))
    residual_ok = torch.equal(ef.residual("w"), x - sent)
    errors = []
    try:
        aggregate(x, comp, error_feedback=ef)
    except ValueError as e:
        errors.append("key" in str(e))
    try:
        aggregate(x, TopK(k=1), error_feedback=ef, key="w")
    except ValueError as e:
        errors.append("same compressor" in str(e))
    return residual_ok, agg.path, errors


def test_aggregate_with_error_feedback_keeps_each_ranks_residual():
    assert launch(_with_error_feedback, 2, timeout=60) == [(True, "all_gather", [True, True])] * 2


def _mismatch(kind):
    rank = dist.get_rank()
    if kind == "shape":
        x = torch.ones(10 if rank == 0 else 12)
        comp = RoundingQuantizer(4)
    elif kind == "settings":
        x = torch.ones(10)
        comp = TopK(k=3 if rank == 0 else 4)
    else:  # a Random-K rank that is one step ahead: its indices differ, so the sum would be garbage
        x = torch.ones(10)
        comp = RandomK(k=3)
        if rank == 1:
            comp.compress(x)
    try:
        aggregate(x, comp)
    except CollectiveMismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind, needle", [("shape", "rank 1: int4 of shape [12]"),
                                          ("settings", "rank 0: topk(k=3)"),
                                          ("step", "step: 1")])
def test_mismatched_payloads_raise_the_same_clear_error_on_every_rank(kind, needle):
    messages = launch(_mismatch, 3, kind, timeout=60)
    assert messages[0] is not None and len(set(messages)) == 1
    assert needle in messages[0] and "payloads differ" in messages[0]


def _non_finite():
    x = torch.ones(4)
    if dist.get_rank() == 1:
        x[0] = float("nan")
    return aggregate(x, SignCompressor()).sum


def test_non_finite_input_fails_on_every_rank_naming_the_rank_that_holds_it():
    # Every rank raises (they agree before sending), so which one the launcher reports first is a race;
    # the message names the rank that held the NaN.
    with pytest.raises(RankError) as info:
        launch(_non_finite, 2, timeout=30)
    assert info.value.exc_type == "FloatingPointError" and "rank(s) [1] hold NaN" in str(info.value)


def _nan_on_rank_zero_skip_and_continue():
    import torch
    import torch.distributed as dist
    from commlab.compress import aggregate
    from commlab.compress.sparse import TopK

    rank = dist.get_rank()
    sums = []
    for step in range(3):
        g = torch.full((4,), float(step + 1))
        if step == 0 and rank == 0:
            g[0] = float("nan")
        try:
            sums.append(float(aggregate(g, TopK(k=4)).sum.sum()))
        except FloatingPointError as e:
            sums.append(str(e))
    return sums


def test_a_nan_on_one_rank_makes_every_rank_skip_the_same_step():
    from commlab import launch
    out = launch(_nan_on_rank_zero_skip_and_continue, 2, timeout=30)
    assert out[0] == out[1]  # same error at step 0, then the same sums: no rank drifted
    assert "rank(s) [0] hold NaN" in out[0][0] and out[0][1:] == [16.0, 24.0]
