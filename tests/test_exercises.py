"""Lab graders: a correct solution passes, each typical mistake is caught with a message that says what."""

import torch
import torch.distributed as dist

from commlab.exercises import check_all_gather, check_reduce_scatter


def _exchange(send, recv, rank, n):
    reqs = []
    if recv.numel():
        reqs.append(dist.irecv(recv, (rank - 1) % n))
    if send.numel():
        reqs.append(dist.isend(send, (rank + 1) % n))
    for r in reqs:
        r.wait()


def _batched_exchange(send, recv, rank, n):
    # The form lab 2 teaches: one batch per ring step, as NCCL needs.
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, (rank + 1) % n))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, (rank - 1) % n))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def batched_rs(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(x.clone(), n))
    for step in range(n - 1):
        into = chunks[(rank - step - 2) % n]
        buf = torch.empty_like(into)
        _batched_exchange(chunks[(rank - step - 1) % n], buf, rank, n)
        into += buf
    return chunks[rank]


def empty_batch_rs(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(x.clone(), n))
    for step in range(n - 1):
        into = chunks[(rank - step - 2) % n]
        buf = torch.empty_like(into)
        send = chunks[(rank - step - 1) % n]
        ops = [dist.P2POp(op, t, peer) for op, t, peer in
               ((dist.isend, send, (rank + 1) % n), (dist.irecv, buf, (rank - 1) % n)) if t.numel()]
        for req in dist.batch_isend_irecv(ops):  # an empty list when both chunks are empty
            req.wait()
        into += buf
    return chunks[rank]


def good_rs(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(x.clone(), n))
    for step in range(n - 1):
        into = chunks[(rank - step - 2) % n]
        buf = torch.empty_like(into)
        _exchange(chunks[(rank - step - 1) % n], buf, rank, n)
        into += buf
    return chunks[rank]


def rotated_rs(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(x.clone(), n))
    for step in range(n - 1):
        into = chunks[(rank - step - 1) % n]
        buf = torch.empty_like(into)
        _exchange(chunks[(rank - step) % n], buf, rank, n)
        into += buf
    return chunks[(rank + 1) % n]


def lazy_rs(x):
    return torch.tensor_split(x, dist.get_world_size())[dist.get_rank()]


def cheating_rs(x):
    y = x.clone()
    dist.all_reduce(y)
    return torch.tensor_split(y, dist.get_world_size())[dist.get_rank()]


def deadlocking_rs(x):
    buf = torch.empty_like(x)
    dist.irecv(buf, (dist.get_rank() - 1) % dist.get_world_size()).wait()  # nobody sends
    return buf


def good_ag(chunk):
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    sizes[rank][0] = chunk.numel()
    for step in range(n - 1):
        _exchange(sizes[(rank - step) % n], sizes[(rank - step - 1) % n], rank, n)
    pieces = [torch.empty(int(s), dtype=chunk.dtype) for s in sizes]
    pieces[rank].copy_(chunk)
    for step in range(n - 1):
        _exchange(pieces[(rank - step) % n], pieces[(rank - step - 1) % n], rank, n)
    return torch.cat(pieces)


def repeating_ag(chunk):
    return torch.cat([chunk] * dist.get_world_size())


def test_a_correct_reduce_scatter_passes_every_case():
    report = check_reduce_scatter(good_rs)
    assert report.passed and len(report.cases) == 9
    assert "all checks passed" in str(report)


def test_a_batched_reduce_scatter_passes_as_well_as_a_plain_isend_irecv_one():
    assert check_reduce_scatter(batched_rs).passed


def test_an_empty_batch_is_explained():
    report = check_reduce_scatter(empty_batch_rs, world_sizes=(4,), counts=(2,))
    assert not report.passed and "dist.batch_isend_irecv needs at least one P2POp" in str(report), str(report)


def test_a_rotated_ring_is_diagnosed():
    report = check_reduce_scatter(rotated_rs, world_sizes=(3,), counts=(12,))
    assert not report.passed and "the ring is rotated" in str(report)


def test_no_reduction_is_diagnosed():
    report = check_reduce_scatter(lazy_rs, world_sizes=(2,), counts=(8,))
    assert "nothing was added" in str(report)


def test_none_is_diagnosed():
    report = check_reduce_scatter(lambda x: None, world_sizes=(2,), counts=(4,))
    assert "returned None" in str(report) and not report.passed


def test_torch_collectives_are_refused():
    report = check_reduce_scatter(cheating_rs, world_sizes=(2,), counts=(4,))
    assert "off-limits" in str(report)


def test_a_deadlock_is_reported_not_hung():
    report = check_reduce_scatter(deadlocking_rs, world_sizes=(2,), counts=(4,))
    assert "a rank waits for a message nobody sends" in str(report)


def test_a_correct_all_gather_passes_and_a_wrong_one_is_caught():
    assert check_all_gather(good_ag).passed
    report = check_all_gather(repeating_ag, world_sizes=(3,), counts=(10,))
    assert "returned 12 elements, expected 10" in str(report)


def float64_rs(x):
    return good_rs(x).to(torch.float64)


def two_d_rs(x):
    return good_rs(x).reshape(1, -1)


def inplace_rs(x):
    r = good_rs(x)
    x.zero_()
    return r


def object_cheat_rs(x):
    n, rank = dist.get_world_size(), dist.get_rank()
    objs = [None] * n
    dist.all_gather_object(objs, x)
    return torch.tensor_split(sum(objs), n)[rank]


def c10d_cheat_rs(x):
    from torch.distributed import distributed_c10d
    y = x.clone()
    distributed_c10d.all_reduce(y)
    return torch.tensor_split(y, dist.get_world_size())[dist.get_rank()]


def commlab_cheat_rs(x):
    import commlab.collectives
    return commlab.collectives.ring_reduce_scatter(x)


import pytest  # noqa: E402


@pytest.mark.parametrize("fn, message", [
    (float64_rs, "dtype float64"), (two_d_rs, "shape (1, 6)"), (inplace_rs, "changed its input tensor in place"),
    (object_cheat_rs, "dist.all_gather_object is off-limits"), (c10d_cheat_rs, "dist.all_reduce is off-limits"),
    (commlab_cheat_rs, "commlab's ring_reduce_scatter is off-limits"),
])
def test_wrong_forms_and_shortcuts_fail(fn, message):
    report = check_reduce_scatter(fn, world_sizes=(2,), counts=(12,))
    assert not report.passed and message in str(report), str(report)


def test_after_a_hang_the_remaining_cases_are_not_run():
    report = check_reduce_scatter(deadlocking_rs, world_sizes=(2, 3), counts=(4,))
    assert [msg for _, _, msg in report.cases][1] == "not run: an earlier case hung"


# ------------------------------------------------------------------ lab 12: the step's tokens and model FLOPs

def _tokens(model, dp, micro_batch, micro_batches):
    return micro_batch * micro_batches * dp * model.seq


def _per_token(model, forward_only=False, attention=True):
    from commlab.parallel.planner import parameter_count
    p, lhs = parameter_count(model), model.layers * model.hidden * model.seq
    return (2 * p + 4 * lhs * attention) if forward_only else (6 * p + 12 * lhs * attention)


def _budget_right(model, tp, pp, dp, b, m):
    tokens = _tokens(model, dp, b, m)
    return tokens, _per_token(model) * tokens


def test_a_correct_step_budget_passes_every_case():
    from commlab.exercises import check_step_budget
    report = check_step_budget(_budget_right)
    assert report.passed, str(report)
    assert len(report.cases) == 6


def test_the_graded_capstone_model_is_the_capstone_s():
    from commlab.exercises.capstone import step_budget_cases
    from labs.capstone.model import GPTConfig
    graded, ours = step_budget_cases()[0][0], GPTConfig().planner_config()
    fields = ("layers", "hidden", "heads", "ffn", "vocab", "seq", "tied_embeddings", "bias", "learned_positions")
    assert [getattr(graded, f) for f in fields] == [getattr(ours, f) for f in fields]


@pytest.mark.parametrize("slip, message", [
    (lambda m, tp, pp, dp, b, k: _budget_right(m, tp, pp, 1, b, k), "one DP replica's share"),
    (lambda m, tp, pp, dp, b, k: (tp * pp * _tokens(m, dp, b, k), tp * pp * _budget_right(m, tp, pp, dp, b, k)[1]),
     "counted once per rank"),
    (lambda m, tp, pp, dp, b, k: (_tokens(m, dp, b, k), _per_token(m, attention=False) * _tokens(m, dp, b, k)),
     "attention term 12 L h s per token is missing"),
    (lambda m, tp, pp, dp, b, k: (_tokens(m, dp, b, k), _per_token(m, forward_only=True) * _tokens(m, dp, b, k)),
     "forward pass only"),
    (lambda m, tp, pp, dp, b, k: (_tokens(m, dp, b, k), _per_token(m)), "that is per token"),
    (lambda m, tp, pp, dp, b, k: (b * dp * m.seq, _per_token(m) * b * dp * m.seq), "micro-batches were forgotten"),
    (lambda *a: None, "return a pair"),
])
def test_each_step_budget_slip_is_named(slip, message):
    from commlab.exercises import check_step_budget
    report = check_step_budget(slip)
    assert not report.passed and message in str(report), str(report)
