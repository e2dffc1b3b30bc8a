"""AllToAll and AllToAllV on real gloo ranks against ``dist.all_to_all_single``; their errors; their α-β cost.

One 3-rank job (three ranks, so that every rank has two different peers and the pairwise schedule's steps
differ) runs every case and returns what the assertions need.
"""

import math

import pytest
import torch
import torch.distributed as dist

from commlab import launch
from commlab.collectives import (CollectiveMismatchError, all_to_all, all_to_all_seconds, all_to_all_v,
                                 all_to_all_v_seconds)
from commlab.collectives.all_to_all import all_to_all_v_bytes_sent, pairwise_step_nbytes
from commlab.topology import EmulatedTopology, Link

WORLD = 3
# Split matrices: SPLITS[i][j] rows go from rank i to rank j. Zeros off and on the diagonal, a rank that sends
# nothing at all (row 2 of the second), a rank that receives nothing (column 0 of the third).
SPLITS = ([[2, 0, 3], [1, 0, 4], [0, 2, 1]],
          [[1, 3, 0], [2, 2, 1], [0, 0, 0]],
          [[0, 1, 2], [0, 0, 3], [0, 5, 1]])
CASES = [(s, dtype, trailing) for s in SPLITS for dtype, trailing in
         ((torch.float32, ()), (torch.float64, (2, 3)), (torch.int64, (4,)))]


def _data(rows: int, trailing: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(rows, *trailing, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, (rows, *trailing), generator=g, dtype=dtype)


def _torch(x: torch.Tensor, outs, ins, group=None) -> torch.Tensor:
    ref = x.new_empty((sum(outs), *x.shape[1:]))
    dist.all_to_all_single(ref, x, outs, ins, group=group)
    return ref


def _attempt(fn):
    try:
        fn()
        return None
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e), isinstance(e, CollectiveMismatchError)


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {"equal": [], "errors": {}}
    # 1. Random uneven splits (with zeros), three dtypes, 1-D and multi-dimensional rows; checked and unchecked.
    for k, (splits, dtype, trailing) in enumerate(CASES):
        ins, outs = splits[rank], [row[rank] for row in splits]
        x = _data(sum(ins), trailing, dtype, 10 * k + rank)
        ref = _torch(x, outs, ins)
        for check in (True, False):
            got = all_to_all_v(x, outs, ins, check=check)
            out["equal"].append((k, check, torch.equal(got, ref) and got.dtype == dtype and got.shape == ref.shape))
    # 2. Random split matrices drawn here (same seed on every rank), with an emulated topology delaying the sends.
    g = torch.Generator().manual_seed(7)
    topology = EmulatedTopology(n, 1, Link.from_bandwidth(1e12, 0.0, "fast"))
    for k in range(3):
        m = torch.randint(0, 4, (n, n), generator=g)
        m[k % n, (k + 1) % n] = 0
        ins, outs = m[rank].tolist(), m[:, rank].tolist()
        x = _data(sum(ins), (3,), torch.float32, 100 + k * n + rank)
        out["equal"].append(("random", k, torch.equal(all_to_all_v(x, outs, ins, emulate=topology),
                                                      _torch(x, outs, ins))))
    # An output buffer of the caller's is filled and returned.
    splits = SPLITS[0]
    ins, outs = splits[rank], [row[rank] for row in splits]
    x = _data(sum(ins), (2,), torch.float32, 60 + rank)
    buf = torch.full((sum(outs), 2), math.nan)
    got = all_to_all_v(x, outs, ins, out=buf)
    out["equal"].append(("out", got is buf and torch.equal(buf, _torch(x, outs, ins))))
    # 3. None splits: equal blocks, as torch; and the equal-block all_to_all.
    x = _data(2 * n, (2,), torch.float64, rank)
    out["equal"].append(("none", torch.equal(all_to_all_v(x, None, None), _torch(x, [2] * n, [2] * n))))
    blocks = _data(n, (5,), torch.int64, rank)
    out["equal"].append(("all_to_all", torch.equal(all_to_all(blocks), _torch(blocks, [1] * n, [1] * n))))
    # 4. A subgroup of ranks 0 and 2: peers named by group rank, sent by global rank.
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        me = 0 if rank == 0 else 1
        ins, outs = ([1, 3], [1, 0]) if me == 0 else ([0, 2], [3, 2])
        x = _data(sum(ins), (), torch.float32, 50 + rank)
        out["equal"].append(("subgroup", torch.equal(all_to_all_v(x, outs, ins, group=sub),
                                                     _torch(x, outs, ins, group=sub))))
    # 5. Errors. Split matrix [[1, 1, 1], [1, 1, 1], [1, 1, 1]] unless a case changes it.
    ones = [1] * n
    x = _data(n, (2,), torch.float32, rank)
    errors = {
        # rank 1 swaps what it expects from ranks 0 and 2; its own arguments are fine (they sum to 3).
        "mismatch": lambda: all_to_all_v(x, [2, 1, 0] if rank == 1 else ones, ones),
        "sum": lambda: all_to_all_v(x, ones, [1, 1, 2] if rank == 2 else ones),
        "negative": lambda: all_to_all_v(x, ones, [2, -1, 2] if rank == 0 else ones),
        "not an int": lambda: all_to_all_v(x, ones, [1.5, 1, 0.5] if rank == 1 else ones),
        "length": lambda: all_to_all_v(x, ones[:2] if rank == 1 else ones, ones),
        "not a sequence": lambda: all_to_all_v(x, ones, 3 if rank == 0 else ones),
        "trailing": lambda: all_to_all_v(_data(n, (3,), torch.float32, 0) if rank == 2 else x, ones, ones),
        "ndim": lambda: all_to_all_v(_data(n, (2, 1), torch.float32, 0) if rank == 2 else x, ones, ones),
        "dtypes differ": lambda: all_to_all_v(x.double() if rank == 0 else x, ones, ones),
        "unsupported dtype": lambda: all_to_all_v(x > 0, ones, ones),
        "0-d": lambda: all_to_all_v(torch.tensor(1.0) if rank == 1 else x, ones, ones),
        "out": lambda: all_to_all_v(x, ones, ones, out=torch.empty(n, 3) if rank == 0 else torch.empty(n, 2)),
        "none indivisible": lambda: all_to_all_v(_data(4, (2,), torch.float32, 0), None, None),
        # Unchecked, every rank makes its own mistake (a rank that raised alone would leave the others waiting).
        "unchecked": lambda: all_to_all_v(x, ones, [3, 0, -3], check=False),
    }
    for name, fn in errors.items():
        out["errors"][name] = _attempt(fn)
    # 6. After every refusal the group still works: nothing was left half-sent.
    out["equal"].append(("after errors", torch.equal(all_to_all_v(x, ones, ones), _torch(x, ones, ones))))
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, WORLD, timeout=120)


def test_all_to_all_v_equals_torch_on_uneven_splits_dtypes_and_row_shapes(results):
    for r in results:
        assert all(case[-1] for case in r["equal"]), [case for case in r["equal"] if not case[-1]]
    assert len(results[0]["equal"]) == 2 * len(CASES) + 3 + 1 + 2 + 1 + 1 and len(results[1]["equal"]) == len(
        results[0]["equal"]) - 1  # rank 1 is outside the subgroup


def _same_error_everywhere(results, name):
    seen = [r["errors"][name] for r in results]
    assert seen[0] is not None and all(s == seen[0] for s in seen), seen
    return seen[0]


@pytest.mark.parametrize("name, kind, words", [
    ("mismatch", "CollectiveMismatchError", ["rank 0 sends 1 rows to rank 1 (its input_split_sizes[1]) but rank 1 "
                                             "expects 2 from rank 0 (its output_split_sizes[0])",
                                             "rank i's input_split_sizes[j] must equal rank j's output_split_sizes[i]"]),
    ("sum", "CollectiveMismatchError", ["rank 2's input_split_sizes [1, 1, 2] sum to 4, but its tensor's first "
                                        "dimension is 3"]),
    ("negative", "CollectiveMismatchError", ["rank 0's input_split_sizes [2, -1, 2]", "every split must be an int >= 0"]),
    ("not an int", "CollectiveMismatchError", ["rank 1's input_split_sizes [-1, 1, -1]", "not an int"]),
    ("length", "CollectiveMismatchError", ["rank 1's output_split_sizes has 2 entries, but needs one per rank of the "
                                           "group (3)"]),
    ("not a sequence", "CollectiveMismatchError", ["rank 0's input_split_sizes is not a sequence of ints"]),
    ("trailing", "CollectiveMismatchError", ["rank 0: [2]; rank 1: [2]; rank 2: [3]", "same trailing dimensions"]),
    ("ndim", "CollectiveMismatchError", ["rank 2: [2, 1]", "same trailing dimensions"]),
    ("dtypes differ", "CollectiveMismatchError", ["rank 0: float64; rank 1: float32", "same dtype"]),
    ("unsupported dtype", "TypeError", ["dtype torch.bool is not supported"]),
    ("0-d", "CollectiveMismatchError", ["rank 1 passed a 0-dimensional tensor"]),
    ("out", "CollectiveMismatchError", ["rank 0's out does not fit: it must be a contiguous tensor of 3 rows"]),
    ("none indivisible", "CollectiveMismatchError", ["input_split_sizes=None", "4 is not divisible by the group size 3"]),
])
def test_each_bad_call_raises_the_same_clear_error_on_every_rank(results, name, kind, words):
    err_kind, message, _ = _same_error_everywhere(results, name)
    assert err_kind == kind and message.startswith("all_to_all_v: ")
    for w in words:
        assert w in message, message


def test_unchecked_errors_are_local_value_errors(results):
    for rank, r in enumerate(results):
        kind, message, mismatch = r["errors"]["unchecked"]
        assert kind == "ValueError" and not mismatch and f"rank {rank}'s input_split_sizes [3, 0, -3]" in message


def test_cost_of_equal_splits_is_the_all_to_all_formula():
    n, nbytes, a, b = 4, 4096.0, 2e-6, 1e-9
    block = nbytes / n
    even = [[block] * n for _ in range(n)]
    assert all_to_all_v_seconds(even, a, b) == pytest.approx(all_to_all_seconds(nbytes, n, a, b))
    assert all_to_all_v_seconds([[5.0]], a, b) == 0.0  # one rank: nothing moves


def test_cost_of_uneven_splits_pays_each_steps_largest_message():
    # Step 1: 0->1 (10), 1->2 (1), 2->0 (3): 10 B. Step 2: 0->2 (0), 1->0 (7), 2->1 (2): 7 B. Diagonal ignored.
    m = [[99, 10, 0], [7, 99, 1], [3, 2, 99]]
    assert all_to_all_v_seconds(m, 1.0, 0.5) == pytest.approx((1 + 0.5 * 10) + (1 + 0.5 * 7))
    assert pairwise_step_nbytes(m) == [10, 7] and pairwise_step_nbytes([[4]]) == []
    assert all_to_all_v_bytes_sent(m) == [10, 8, 5]
    # Skew costs more than its mean: the same 23 bytes spread evenly would take 2 steps of ~23/6 B.
    assert all_to_all_v_seconds(m, 0.0, 1.0) > 2 * 23 / 6


@pytest.mark.parametrize("matrix, message", [
    ([], "square"), ([[1, 2], [3]], "square"), ([[1, -2], [3, 4]], "finite number >= 0"),
    ([[1, math.nan], [3, 4]], "finite number >= 0")])
def test_cost_rejects_bad_matrices(matrix, message):
    with pytest.raises(ValueError, match=message):
        all_to_all_v_seconds(matrix, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="alpha_s"):
        all_to_all_v_seconds([[0.0]], -1.0, 1e-9)
