"""Lab graders: a correct solution passes, each typical mistake is caught with a message that says what."""

import dataclasses
import math

import pytest
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


def test_none_from_some_ranks_is_diagnosed():
    report = check_reduce_scatter(lambda x: x.clone() if dist.get_rank() else None, world_sizes=(2,), counts=(4,))
    assert "rank 0 returned None" in str(report) and not report.passed


def test_torch_collectives_are_refused():
    report = check_reduce_scatter(cheating_rs, world_sizes=(2,), counts=(4,))
    assert "off-limits" in str(report)


@pytest.fixture(scope="module")
def deadlock_report():
    """The deadlocking solution at 2 ranks (it hangs: the grader waits out its timeout, once for both tests
    below) and then at 3 ranks, which the grader does not run."""
    return check_reduce_scatter(deadlocking_rs, world_sizes=(2, 3), counts=(4,))


@pytest.mark.slow
def test_a_deadlock_is_reported_not_hung(deadlock_report):
    assert "a rank waits for a message nobody sends" in str(deadlock_report)


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




@pytest.mark.parametrize("fn, message", [
    (float64_rs, "dtype float64"), (two_d_rs, "shape (1, 6)"), (inplace_rs, "changed its input tensor in place"),
    (object_cheat_rs, "dist.all_gather_object is off-limits"), (c10d_cheat_rs, "dist.all_reduce is off-limits"),
    (commlab_cheat_rs, "commlab's ring_reduce_scatter is off-limits"),
])
def test_wrong_forms_and_shortcuts_fail(fn, message):
    report = check_reduce_scatter(fn, world_sizes=(2,), counts=(12,))
    assert not report.passed and message in str(report), str(report)


@pytest.mark.slow
def test_after_a_hang_the_remaining_cases_are_not_run(deadlock_report):
    assert [msg for _, _, msg in deadlock_report.cases][1] == "not run: an earlier case hung"


# ------------------------------------------------------------------ lab 14: the step's tokens and model FLOPs

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
    (lambda *a: 7, "return a pair"),
])
def test_each_step_budget_slip_is_named(slip, message):
    from commlab.exercises import check_step_budget
    report = check_step_budget(slip)
    assert not report.passed and message in str(report), str(report)


# ------------------------------------------------------------------ every grader: the unfilled stub, one line

def _stub_fn(*args):
    return None  # what every lab's stub returns before its TODO is filled in


class _StubErrorFeedback:
    def __init__(self, compressor):
        self.compressor = compressor

    def compress(self, x, key):
        return None

    def decompress(self, payload):
        return self.compressor.decompress(payload)


class _StubQSGD:
    linear = False

    def __init__(self, levels=7, seed=0):
        self.name = "stub"

    def compress(self, tensor):
        return None

    def decompress(self, payload):
        return None


def _graders():
    from commlab import exercises as ex
    return {
        "ring ReduceScatter": lambda: ex.check_reduce_scatter(_stub_fn),
        "ring AllGather": lambda: ex.check_all_gather(_stub_fn),
        "error feedback": lambda: ex.check_error_feedback(_StubErrorFeedback),
        "PowerSGD bytes": lambda: ex.check_bytes_per_step(_stub_fn, None),
        "step time": lambda: ex.check_step_time(_stub_fn),
        "buckets": lambda: ex.check_buckets(_stub_fn, None),
        "mesh": lambda: ex.check_coords_and_groups(_stub_fn),
        "step budget": lambda: ex.check_step_budget(_stub_fn),
        "QSGD": lambda: ex.check_qsgd(_StubQSGD),
        "memory per GPU": lambda: ex.check_memory_per_gpu(_stub_fn),
        "step seconds": lambda: ex.check_step_seconds(_stub_fn),
        "ring schedule": lambda: ex.check_ring_schedule(_stub_fn),
        "dispatch bytes": lambda: ex.check_dispatch_bytes(_stub_fn),
        "schedule bubbles": lambda: ex.check_schedule_bubbles(_stub_fn),
    }


@pytest.mark.parametrize("name", list(_graders()))
def test_an_unfilled_exercise_prints_exactly_one_line(name):
    report = _graders()[name]()
    text = str(report)
    assert not report.passed and report.cases == []
    assert "\n" not in text and "FAIL" not in text and "expected" not in text, text
    stub = {"error feedback": "_StubErrorFeedback.compress", "QSGD": "_StubQSGD.compress"}.get(name, "_stub_fn")
    assert text.endswith(f"not attempted yet: fill in `{stub}` in the cell above"), text


def test_a_report_lists_at_most_three_failures():
    from commlab.exercises.report import CheckReport
    r = CheckReport("x", [(f"case {i}", i == 0, "wrong") for i in range(7)])
    lines = str(r).splitlines()
    assert lines[0] == "x: 1 of 7 checks passed" and sum("FAIL" in l for l in lines) == 3
    assert lines[-1].startswith("  ... and 3 more failing cases")


# ------------------------------------------------------------------ lab 7: PowerSGD's bytes per step

def _psgd_right(shapes, r):
    total = 0
    for shape in shapes:
        numel = 1
        for s in shape:
            numel *= s
        if len(shape) <= 1:
            total += 4 * numel
            continue
        m, n = shape[0], numel // shape[0]
        rr = min(m, n, r)
        total += 4 * (m + n) * rr if (m + n) * rr * 2 < m * n else 4 * numel
    return total


def test_the_powersgd_bytes_solution_passes_and_the_answer_is_graded():
    from commlab.exercises import check_bytes_per_step
    report = check_bytes_per_step(_psgd_right, 4)
    assert report.passed, str(report)
    assert "too large" in str(check_bytes_per_step(_psgd_right, 5))
    assert "too small" in str(check_bytes_per_step(_psgd_right, 3))
    assert "not set yet" in str(check_bytes_per_step(_psgd_right, None))


@pytest.mark.parametrize("slip, message", [
    (lambda shapes, r: _psgd_right(shapes, r) // 4, "counts elements, not bytes"),
    (lambda shapes, r: sum(4 * math.prod(s) for s in shapes), "it should be compressed"),
    (lambda shapes, r: _psgd_right(shapes[:1], r), "the total is not the sum"),
])
def test_each_powersgd_bytes_slip_is_named_for_its_input_without_the_expected_bytes(slip, message):
    from commlab.exercises import check_bytes_per_step
    report = check_bytes_per_step(slip, 4)
    text = str(report)
    assert not report.passed and message in text, text
    assert "expected" not in text and "r=1" in text


# ------------------------------------------------------------------ lab 9: DDP's buckets

def _buckets_right(sizes, cap):
    buckets, current, total = [], [], 0
    for i, nbytes in enumerate(sizes):
        current.append(i)
        total += nbytes
        if total >= cap:
            buckets.append(current)
            current, total = [], 0
    return buckets + [current] if current else buckets


def _buckets_strict(sizes, cap):  # closes only once the bucket holds more than the cap
    buckets, current, total = [], [], 0
    for i, nbytes in enumerate(sizes):
        if current and total + nbytes > cap:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += nbytes
    return buckets + [current] if current else buckets


def test_the_bucket_solution_passes_and_slips_are_named_without_the_expected_buckets():
    from commlab.exercises import check_buckets
    assert check_buckets(_buckets_right, 264).passed
    text = str(check_buckets(lambda s, c: _buckets_right(s, c)[:-1], 264))
    assert "are in no bucket: a bucket still open at the end is the last bucket" in text, text
    text = str(check_buckets(_buckets_strict, 264))
    assert "only the last bucket may hold less than the cap" in text and "expected" not in text, text
    assert "with a cap of 8 KiB the MLP gets 4 buckets, not 3" in str(check_buckets(_buckets_right, 8))


# ------------------------------------------------------------------ lab 10: mesh coordinates and groups

def _mesh_right(rank, dp, pp, tp):
    t = rank % tp
    d, p = divmod(rank // tp, pp)
    return (d, p, t), {"tp": [(d * pp + p) * tp + i for i in range(tp)],
                       "pp": [(d * pp + i) * tp + t for i in range(pp)],
                       "dp": [(i * pp + p) * tp + t for i in range(dp)]}


def _mesh_swapped(rank, dp, pp, tp):
    (d, p, t), g = _mesh_right(rank, dp, pp, tp)
    return (t, p, d), g


def _mesh_bad_dp_stride(rank, dp, pp, tp):
    c, g = _mesh_right(rank, dp, pp, tp)
    d, p, t = c
    g["dp"] = sorted({(i * pp + p) + t for i in range(dp)} | {rank})[:dp]
    return c, g


def test_the_mesh_solution_passes_and_slips_are_named_without_the_expected_answer():
    from commlab.exercises import check_coords_and_groups
    assert check_coords_and_groups(_mesh_right).passed
    text = str(check_coords_and_groups(_mesh_swapped))
    assert "give back (d * pp + p) * tp + t" in text or "out of range" in text, text
    text = str(check_coords_and_groups(_mesh_bad_dp_stride))
    assert "dp group" in text and "should be" not in text, text


# ------------------------------------------------------------------ lab 5: QSGD

class _QSGDRight:
    linear = False

    def __init__(self, levels=7, seed=0):
        self.levels, self.name = levels, f"q{levels}"
        self.generator = torch.Generator().manual_seed(seed)

    def _levels(self, flat, norm):
        r = (self.levels * flat.abs() / norm).clamp(max=self.levels) if float(norm) > 0 else torch.zeros_like(flat)
        low = r.floor()
        return low + (torch.rand(flat.numel(), generator=self.generator, dtype=flat.dtype) < r - low).to(flat.dtype)

    def compress(self, tensor):
        from commlab.compress import Payload
        acc = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        flat = tensor.detach().reshape(-1).to(acc)
        norm = torch.linalg.vector_norm(flat.double()).float().reshape(1)
        xi = self._levels(flat, norm.to(acc)).to(torch.int8)
        return Payload({"codes": torch.where(flat < 0, -xi, xi), "norm": norm}, tensor.shape, tensor.dtype,
                       {"levels": self.levels, "bits": 8, "bucket_size": None})

    def decompress(self, p):
        acc = torch.float64 if p.dtype == torch.float64 else torch.float32
        out = p.tensors["codes"].to(acc) * (p.tensors["norm"].to(acc) / p.meta["levels"])
        return out.to(p.dtype).reshape(p.shape)


class _QSGDNearest(_QSGDRight):  # deterministic rounding to the nearest level: biased
    def _levels(self, flat, norm):
        return (self.levels * flat.abs() / norm).round()


class _QSGDInt32(_QSGDRight):
    def compress(self, tensor):
        p = super().compress(tensor)
        return dataclasses.replace(p, tensors={**p.tensors, "codes": p.tensors["codes"].to(torch.int32)})


def test_the_qsgd_solution_passes_and_commlab_s_qsgd_decodes_it():
    from commlab.exercises import check_qsgd
    report = check_qsgd(_QSGDRight)
    assert report.passed, str(report)


@pytest.mark.parametrize("cls, message", [
    (_QSGDNearest, "standard errors: round up with probability r - floor(r)"),
    (_QSGDInt32, "codes are int32: one int8 per element"),
])
def test_each_qsgd_slip_is_named(cls, message):
    from commlab.exercises import check_qsgd
    text = str(check_qsgd(cls))
    assert "checks passed" in text and message in text, text


# ------------------------------------------------------------------ lab 11: memory per GPU and step time

def _mem_right(p, tp, dp, zero1, act):
    return (4 + 12 / (dp if zero1 else 1)) * p / tp + act


def _step_right(c, tp, pp, dp, p, m, v):
    return (c + tp + pp) * (1 + (p - 1) / (v * m)) + dp


def test_the_planner_solutions_pass():
    from commlab.exercises import check_memory_per_gpu, check_step_seconds
    assert check_memory_per_gpu(_mem_right).passed and check_step_seconds(_step_right).passed


@pytest.mark.parametrize("slip, message", [
    (lambda p, tp, dp, z, a: _mem_right(p, 1, dp, z, a), "the parameters were not split by tp"),
    (lambda p, tp, dp, z, a: 16 * p / tp / (dp if z else 1) + a, "ZeRO-1 shards only the 12 bytes"),
    (lambda p, tp, dp, z, a: _mem_right(p, tp, dp, z, a) / 1e9, "that is GB; return bytes"),
])
def test_each_memory_slip_is_named_without_the_expected_bytes(slip, message):
    from commlab.exercises import check_memory_per_gpu
    text = str(check_memory_per_gpu(slip))
    assert message in text and "expected" not in text, text


@pytest.mark.parametrize("slip, message", [
    (lambda c, tp, pp, dp, p, m, v: (c + tp + pp) * (1 + (p - 1) / (v * m + p - 1)) + dp, "its share of the step"),
    (lambda c, tp, pp, dp, p, m, v: _step_right(c, tp, pp, dp, p, m, 1), "the interleaving was ignored"),
    (lambda c, tp, pp, dp, p, m, v: c + tp + pp + (p - 1) / (v * m) * c + dp, "not only the compute"),
])
def test_each_step_time_slip_is_named(slip, message):
    from commlab.exercises import check_step_seconds
    text = str(check_step_seconds(slip))
    assert message in text and "too" in text, text


# ------------------------------------------------------------------ lab 3: AllToAllV bytes

def _a2a_right(splits, row_nbytes):
    return [row_nbytes * (sum(row) - row[i]) for i, row in enumerate(splits)]


def test_the_all_to_all_bytes_solution_passes_and_the_step_is_graded():
    from commlab.exercises import check_all_to_all_bytes
    assert check_all_to_all_bytes(_a2a_right, 2).passed, str(check_all_to_all_bytes(_a2a_right, 2))
    assert "not the slowest: the largest message of step 1 is 8 rows" in str(check_all_to_all_bytes(_a2a_right, 1))
    assert "is not a step: give an int s in 1..3" in str(check_all_to_all_bytes(_a2a_right, 4))
    assert "not set yet" in str(check_all_to_all_bytes(_a2a_right, None))

    def bytes_sent(splits, row_nbytes):
        return None

    assert str(check_all_to_all_bytes(bytes_sent, None)).endswith("not attempted yet: fill in `bytes_sent` in the cell "
                                                                   "above")


@pytest.mark.parametrize("slip, message", [
    (lambda s, b: [b * sum(row) for row in s], "counts the block each rank keeps"),
    (lambda s, b: [sum(row) - row[i] for i, row in enumerate(s)], "counts rows, not bytes"),
    (lambda s, b: [b * (sum(s[i][j] for i in range(len(s))) - s[j][j]) for j in range(len(s))],
     "that is what each rank receives"),
    (lambda s, b: sum(_a2a_right(s, b)), "a single number"),
])
def test_each_all_to_all_bytes_slip_is_named_without_the_expected_bytes(slip, message):
    from commlab.exercises import check_all_to_all_bytes
    text = str(check_all_to_all_bytes(slip, 2))
    assert message in text and "FAIL  2 ranks, rows of 4096 B" in text, text
    assert "expected" not in text


# ------------------------------------------------------------------ lab 13: ring schedule and MoE dispatch bytes

def _ring_right(rank, step, n):
    src = (rank - step) % n
    return [(q, k) for q in (rank, 2 * n - 1 - rank) for k in (src, 2 * n - 1 - src) if k <= q]


def test_the_ring_schedule_solution_passes():
    from commlab.exercises import check_ring_schedule
    assert check_ring_schedule(_ring_right).passed


@pytest.mark.parametrize("slip, message", [
    # every pair of the held chunks, the causal mask forgotten
    (lambda r, t, n: [(q, k) for q in (r, 2 * n - 1 - r) for k in ((r - t) % n, 2 * n - 1 - (r - t) % n)],
     "is removed by the causal mask"),
    # the ring turned the wrong way: K/V of rank r + t
    (lambda r, t, n: _ring_right(r, -t % n, n), "is not in the K/V it holds at this step"),
    # the diagonal pairs forgotten (k < q instead of k <= q)
    (lambda r, t, n: [p for p in _ring_right(r, t, n) if p[0] != p[1]], "left out that the causal mask keeps"),
    (lambda r, t, n: [(0.5, 0)], "is not a pair of int chunk indices"),
])
def test_each_ring_schedule_slip_is_named_without_the_expected_pairs(slip, message):
    from commlab.exercises import check_ring_schedule
    text = str(check_ring_schedule(slip))
    assert message in text and "checks passed" in text and "expected" not in text, text


def _dispatch_right(tokens, hidden, e, k, cf, ep, nbytes):
    return e * math.ceil(round(cf * tokens * k / e, 9)) * hidden * nbytes * (ep - 1) // ep


def test_the_dispatch_bytes_solution_passes_and_equals_the_layer_s_count():
    from commlab.exercises import check_dispatch_bytes
    from commlab.exercises.moe_bytes import DISPATCH_CASES
    assert check_dispatch_bytes(_dispatch_right).passed
    assert len({args for _, args in DISPATCH_CASES}) == len(DISPATCH_CASES)


@pytest.mark.parametrize("slip, message", [
    (lambda t, h, e, k, cf, ep, b: e * math.ceil(cf * t * k / e) * h * b, "the row that stays on the rank"),
    (lambda t, h, e, k, cf, ep, b: e * (cf * t * k / e) * h * b * (ep - 1) / ep, "not rounded up"),
    (lambda t, h, e, k, cf, ep, b: e * math.ceil(cf * t / e) * h * b * (ep - 1) / ep, "k was left out"),
    (lambda t, h, e, k, cf, ep, b: _dispatch_right(t, h, e, k, cf, ep, b) / b, "elements, not bytes"),
])
def test_each_dispatch_slip_is_named_without_the_expected_bytes(slip, message):
    from commlab.exercises import check_dispatch_bytes
    text = str(check_dispatch_bytes(slip))
    assert message in text and "too" in text and "expected" not in text, text


# ------------------------------------------------------------------ the labs' stored pages

def _lab_cells():
    import json
    import pathlib
    for path in sorted((pathlib.Path(__file__).parents[1] / "labs").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                yield path.name, cell


def test_solutions_are_folded_and_no_stored_check_prints_a_wall_of_failures():
    for name, cell in _lab_cells():
        src = "".join(cell["source"])
        tags = set(cell.get("metadata", {}).get("tags", []))
        if "def solution_" in src or "class Solution" in src:
            assert tags & {"hide-input", "hide-cell", "remove-input"}, f"{name}: a solution cell is open"
        text = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                       for o in cell.get("outputs", []))
        assert text.count("FAIL ") <= 3, f"{name}: a stored output lists {text.count('FAIL ')} failures"
        assert "<matplotlib." not in text, f"{name}: a stored output shows an object's repr"


def _zero3_right(numel, n, param_bytes, grad_bytes, optimizer_bytes):
    return {"params": param_bytes * numel / n, "grads": grad_bytes * numel / n,
            "optimizer": optimizer_bytes * numel / n}


def _zero3_params_whole(numel, n, param_bytes, grad_bytes, optimizer_bytes):
    return {**_zero3_right(numel, n, param_bytes, grad_bytes, optimizer_bytes), "params": param_bytes * numel}


def _zero3_master_copy(numel, n, param_bytes, grad_bytes, optimizer_bytes):
    return {**_zero3_right(numel, n, param_bytes, grad_bytes, optimizer_bytes),
            "optimizer": (optimizer_bytes + param_bytes) * numel / n}


def test_the_zero3_bytes_solution_passes_and_each_slip_is_named():
    from commlab.exercises import check_zero3_bytes
    assert check_zero3_bytes(_zero3_right).passed, str(check_zero3_bytes(_zero3_right))
    text = str(check_zero3_bytes(_zero3_params_whole))
    assert "'params' is what a rank holds when that part is not sharded (as under ZeRO-0/1/2)" in text
    text = str(check_zero3_bytes(_zero3_master_copy))
    assert "'optimizer' is too high by" in text and "7.5e9" in text
    assert str(check_zero3_bytes(lambda *a: None)).endswith("not attempted yet: fill in `<lambda>` in the cell above")
    assert "return a dict with the keys" in str(check_zero3_bytes(lambda *a: 3.0))


def _sharded_linear_units(model, prefetch=True):
    from torch import nn

    from commlab.parallel import ShardedDataParallel
    return ShardedDataParallel(model, stage=3, units=[m for m in model.body if isinstance(m, nn.Linear)],
                               prefetch=prefetch)


def test_the_prefetch_solution_passes_and_an_unprefetched_or_one_unit_model_fails():
    """Four graded runs on 2 gloo ranks (about a second each): the checker reads the profile's order of bars."""
    import functools

    from commlab.exercises import check_prefetch
    from commlab.parallel import ShardedDataParallel
    right = check_prefetch(_sharded_linear_units, 6)
    assert right.passed, str(right)
    late = str(check_prefetch(functools.partial(_sharded_linear_units, prefetch=False), 0))
    assert "the AllGathers of units [1, 2, 3] were launched only when their unit was reached" in late
    assert "the AllGathers of units [0, 1, 2]" in late  # the backward pass
    one = check_prefetch(lambda model: ShardedDataParallel(model, stage=3), 0)
    assert not one.passed and "it is one unit" in str(one)
    assert "8 is too high by 33.3 % for the 4 units you made" in str(check_prefetch(_sharded_linear_units, 8))


# ------------------------------------------------------------------ lab 10: the three schedules' bubbles

def _bubble_right(schedule, p, m, v):
    return {"1f1b": (p - 1) / m, "interleaved": (p - 1) / (v * m), "zb-h1": (p - 1) / (3 * m)}[schedule]


def test_the_schedule_bubble_solution_passes():
    from commlab.exercises import check_schedule_bubbles
    report = check_schedule_bubbles(_bubble_right)
    assert report.passed and len(report.cases) == 12, str(report)


@pytest.mark.parametrize("slip, message", [
    (lambda s, p, m, v: (p - 1) / m, "the interleaving was left out"),
    (lambda s, p, m, v: (p - 1) / (m + p - 1) if s == "1f1b" else _bubble_right(s, p, m, v),
     "the bubble's share of the whole step"),
    (lambda s, p, m, v: 0.0 if s == "zb-h1" else _bubble_right(s, p, m, v), "ZB-H2 would remove it"),
])
def test_each_schedule_bubble_slip_is_named_without_the_answer(slip, message):
    from commlab.exercises import check_schedule_bubbles
    text = str(check_schedule_bubbles(slip))
    assert message in text and "FAIL" in text, text
    assert "expected" not in text
