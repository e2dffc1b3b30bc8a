"""The two-phase compressed AllReduce on real gloo ranks: against the dense sum, its byte formula, a hand-made
reference, error feedback's bookkeeping, its errors, and as a DDP comm hook against DDP's own averaging."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab import launch
from commlab.collectives import CollectiveMismatchError, all_to_all
from commlab.compress import (QSGD, ChunkedCompressor, CompressionHookState, ErrorFeedback, RoundingQuantizer,
                              SignCompressor, TopK, aggregate, chunk_numel, compression_hook)
from commlab.experiments.harness import RunConfig
from commlab.experiments.methods import make_method
from commlab.experiments.time_to_accuracy import StepCosts, comm_coefficients
from commlab.topology import EmulatedTopology, Link

NUMELS = (0, 1, 3, 37, 64)  # empty, fewer elements than ranks, not divisible, divisible


def _same_everywhere(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def _reference(x: torch.Tensor, comp) -> torch.Tensor:
    """Two-phase by hand, from every rank's whole tensor: chunk, compress, decompress, sum in rank order,
    zero the padding, recompress, decompress, join."""
    n = dist.get_world_size()
    xs = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(xs, x)
    m, numel = chunk_numel(x.numel(), n), x.numel()
    out = []
    for j in range(n):
        total = torch.zeros(m, dtype=torch.float32)
        for r in range(n):
            chunk = torch.zeros(m, dtype=x.dtype)
            piece = xs[r][j * m:(j + 1) * m]
            chunk[:piece.numel()] = piece
            total += comp.decompress(comp.compress(chunk)).float()
        total[max(0, min(m, numel - j * m)):] = 0
        out.append(comp.decompress(comp.compress(total.to(x.dtype))))
    return torch.cat(out)[:numel] if out else x.new_zeros(0)


def _checks(topology):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    problems = []
    # 1. The lossless setting (Top-K keeping everything) is the dense sum, bitwise (integer data: exact sums).
    for dtype in (torch.float32, torch.bfloat16):
        for numel in NUMELS:
            x = torch.randint(-20, 21, (numel,), generator=g).to(dtype)
            dense = x.clone()
            dist.all_reduce(dense)
            got = aggregate(x, TopK(ratio=1.0), path="two_phase")
            if not (got.path == "two_phase" and got.sum.dtype == dtype and torch.equal(got.sum, dense)):
                problems.append(("lossless", str(dtype), numel))
    # 2. Each compressor: the hand-made reference, the same result on every rank, the byte formula.
    for make in (lambda: TopK(ratio=0.25), SignCompressor, lambda: RoundingQuantizer(8), lambda: RoundingQuantizer(4),
                 lambda: QSGD(bits=4, seed=rank)):
        for numel in NUMELS:
            x = torch.randn(numel, generator=g)
            comp = make()
            got = aggregate(x, comp, path="two_phase")
            m = chunk_numel(numel, n)
            chunk = make().compress(torch.zeros(m)).nbytes  # a chunk payload's layout depends on m alone
            expected = (n - 1) * 2 * chunk
            if not isinstance(comp, QSGD) and not torch.equal(got.sum, _reference(x, make())):
                problems.append(("reference", comp.name, numel))
            if not _same_everywhere(got.sum):
                problems.append(("differs between ranks", comp.name, numel))
            if (got.payload_nbytes, got.server_payload_nbytes, got.bytes_sent_per_rank) != (n * chunk, n * chunk, expected):
                problems.append(("bytes", comp.name, numel, got.payload_nbytes, got.bytes_sent_per_rank, expected))
            if isinstance(comp, SignCompressor) and expected != (n - 1) * 2 * (math.ceil(m / 8) + 4 if m else 0):
                problems.append(("sign bytes", numel))
    # 3. Error feedback on workers and owners: over the steps, what came out plus what every rank and every owner
    #    still holds is exactly what went in (Top-K on integers: every quantity is an exact integer).
    for numel in (37, 64):
        comp = TopK(ratio=0.25)
        worker, server = ErrorFeedback(comp), ErrorFeedback(comp)
        inputs, outputs = torch.zeros(numel), torch.zeros(numel)
        for step in range(3):
            x = torch.randint(-9, 10, (numel,), generator=g).float()
            got = aggregate(x, comp, path="two_phase", error_feedback=worker, server_error_feedback=server, key="g")
            inputs += x
            outputs += got.sum
        dist.all_reduce(inputs)
        held = worker.residual("g").clone()
        dist.all_reduce(held)
        mine = server.residual(("g", rank))
        owned = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(owned, mine)
        if server.keys() != [("g", rank)] or not torch.equal(inputs, outputs + held + torch.cat(owned)[:numel]):
            problems.append(("error feedback does not add up", numel))
    # 4. commlab's all-to-all is dist.all_to_all_single; the emulated (point-to-point) path gives the same sums.
    blocks = torch.randint(0, 100, (n, 3), generator=g).to(torch.int32)
    ref = torch.empty_like(blocks)
    dist.all_to_all_single(ref, blocks)
    if not torch.equal(all_to_all(blocks), ref):
        problems.append("all_to_all")
    x = torch.randn(37, generator=g)
    plain = aggregate(x, SignCompressor(), path="two_phase")
    emulated = aggregate(x, SignCompressor(), path="two_phase", emulate=topology)
    if not (torch.equal(plain.sum, emulated.sum) and plain.bytes_sent_per_rank == emulated.bytes_sent_per_rank):
        problems.append("emulated")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_two_phase_is_the_dense_sum_when_lossless_matches_its_reference_and_byte_formula(world_size):
    topology = EmulatedTopology(world_size, 1, Link.from_bandwidth(1e12, 0.0, "fast"))
    assert launch(_checks, world_size, topology, timeout=120) == [[]] * world_size


def _errors():
    rank = dist.get_rank()
    caught = []

    def attempt(fn):
        try:
            fn()
            caught.append(None)
        except (CollectiveMismatchError, FloatingPointError, ValueError) as e:
            caught.append(f"{type(e).__name__}: {e}")

    attempt(lambda: aggregate(torch.ones(10 if rank == 0 else 12), SignCompressor(), path="two_phase"))
    nan = torch.ones(8)
    if rank == 1:
        nan[3] = math.nan
    attempt(lambda: aggregate(nan, TopK(ratio=0.5), path="two_phase"))
    # Each value fits float16, their sum (80000) does not: the owner cannot recompress it, and says so to all.
    attempt(lambda: aggregate(torch.full((4,), 40000.0, dtype=torch.float16), TopK(ratio=1.0), path="two_phase"))
    comp = TopK(k=1)
    attempt(lambda: aggregate(torch.ones(4), comp, path="all_gather", server_error_feedback=ErrorFeedback(comp)))
    attempt(lambda: aggregate(torch.ones(4), comp, path="two_phase", server_error_feedback=ErrorFeedback(comp)))
    attempt(lambda: aggregate(torch.ones(4), comp, path="all_reduce"))
    # After all that, the ranks are still in step.
    attempt(lambda: aggregate(torch.ones(4), comp, path="two_phase"))
    # Chapter 8's method with two-phase aggregation: the lossless Top-K averages as dense does.
    grads = [torch.randint(-5, 6, (3, 4)).float() * (rank + 1), torch.arange(5.0)]
    method = make_method("topk:1", error_feedback=True, aggregation="two_phase")
    avg, cost = method.average(grads)
    dense = [g.clone() for g in grads]
    for d in dense:
        dist.all_reduce(d)
    lossless = all(torch.equal(a, d / 2) for a, d in zip(avg, dense))
    return caught, (lossless, cost.path, cost.bytes_sent_per_rank, method.server_ef.keys())


def test_two_phase_errors_are_raised_on_every_rank_alike():
    out = launch(_errors, 2, timeout=60)
    caught = [c for c, _ in out]
    # The method: 17 entries in 2 chunks of 9, each chunk 9 values + 9 indices of 4 bytes; an owner's the same.
    assert [m for _, m in out] == [(True, "two_phase", 144.0, [("flat", r)]) for r in range(2)]
    assert caught[0] == caught[1]
    shape, nan, overflow, other_path, no_key, all_reduce, fine = caught[0]
    assert "payloads differ" in shape and "rank 1: sign in 2 chunks of shape [12]" in shape
    assert nan.startswith("FloatingPointError") and "rank(s) [1] hold NaN" in nan
    assert overflow.startswith("FloatingPointError") and "owner(s) of chunk(s) [0, 1]" in overflow
    assert "path='all_gather' has no owners" in other_path and "needs a key" in no_key
    assert "not linear" in all_reduce and fine is None


def test_chunked_compressor_pads_and_round_trips():
    x = torch.arange(1.0, 8.0)
    c = ChunkedCompressor(TopK(ratio=1.0), 3)
    p = c.compress(x)
    assert p.tensors["values"].shape == (3, 3) and p.meta["chunk_numel"] == 3 and p.nbytes == 3 * 3 * 8
    assert torch.equal(c.decompress(p), x) and torch.equal(p.tensors["values"][2], torch.tensor([7.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="parts must be an int >= 1"):
        ChunkedCompressor(TopK(), 0)


def _ddp_lossless():
    """DDP with the two-phase hook (Top-K keeping everything, both error feedbacks on, several buckets) against
    DDP's own averaging, step by step; then the hook state's state dict, restored into a fresh state."""
    from commlab.overlap import BucketedDataParallel
    rank = dist.get_rank()
    torch.manual_seed(0)
    dense_model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 3))
    hooked_model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 3))
    hooked_model.load_state_dict(dense_model.state_dict())
    dense, hooked = DDP(dense_model, bucket_cap_mb=0.0003), DDP(hooked_model, bucket_cap_mb=0.0003)
    state = CompressionHookState(TopK(ratio=1.0), error_feedback=True, aggregation="two_phase")
    hooked.register_comm_hook(state, compression_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (dense_model, hooked_model)]
    g = torch.Generator().manual_seed(rank)
    equal = []
    for _ in range(3):
        x, y = torch.randn(5, 7, generator=g), torch.randint(0, 3, (5,), generator=g)
        for ddp, opt in zip((dense, hooked), opts):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        # Two ranks: (a + b) / 2 is a/2 + b/2 exactly, so the averages agree bitwise.
        equal.append(all(torch.equal(p, q) for p, q in zip(dense_model.parameters(), hooked_model.parameters())))
    # State dict, through commlab's bucketed wrapper (whose buckets name their parameters): a step from the
    # restored state is the step the original state takes, bitwise; from a fresh state it is not.
    def build(state=None):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 3))
        wrapped = BucketedDataParallel(model, bucket_cap_bytes=100)
        state = state or CompressionHookState(SignCompressor(), error_feedback=True, aggregation="two_phase")
        wrapped.register_comm_hook(state, compression_hook)
        return model, wrapped, state

    def grads(parts, batch):
        model, wrapped, _ = parts
        model.zero_grad()
        nn.functional.cross_entropy(wrapped(batch[0]), batch[1]).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    batches = [(torch.randn(5, 7, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(2)]
    first = build()
    grads(first, batches[0])
    sd = first[2].state_dict()
    again = CompressionHookState(SignCompressor(), error_feedback=True, aggregation="two_phase")
    resumed = build(again)
    names = dict(resumed[0].named_parameters())
    buckets = {b.index: [names[m] for m in b.names] for b in resumed[1].buckets}
    again.load_state_dict(sd, buckets)
    after = grads(resumed, batches[1])
    restored = (sd["server_owner"] == rank, sorted(sd["server_residuals"]) == sorted(buckets), len(buckets) > 1,
                torch.equal(grads(first, batches[1]), after), not torch.equal(grads(build(), batches[1]), after))
    try:
        CompressionHookState(SignCompressor(), error_feedback=True).load_state_dict(sd, buckets)
        refused = None
    except ValueError as e:
        refused = str(e)
    return equal, restored, refused


def test_two_phase_ddp_hook_equals_ddp_averaging_and_its_state_dict_restores():
    for equal, restored, refused in launch(_ddp_lossless, 2, timeout=90):
        assert equal == [True, True, True] and restored == (True,) * 5
        assert "saved with aggregation='two_phase', server_error_feedback=True" in refused


def test_two_phase_in_chapter_8s_run_keys_labels_and_time_model():
    auto = RunConfig("charlm", "sign", True)
    # The default keeps the keys of the recorded runs (commlab/data/experiments/full.jsonl).
    assert auto.key == "charlm|sign|ef=1|warmup=0|seed=0|n=4|steps=300|bs=16|lr=0.003|eval=25"
    two = RunConfig("charlm", "sign", True, aggregation="two_phase")
    assert two.key == "charlm|sign|ef=1|warmup=0|agg=two_phase|seed=0|n=4|steps=300|bs=16|lr=0.003|eval=25"
    assert two.label == "sign (1-bit) + EF, two-phase"
    for spec, why in (("cast:fp16", "is linear"), ("powersgd:2", "own two AllReduces"), ("dense", "nothing compressed")):
        with pytest.raises(ValueError, match=why):
            RunConfig("digits", spec, aggregation="two_phase")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        RunConfig("digits", "sign", aggregation="all_gather")
    # An all-to-all and an AllGather of the owners' chunks: the AllReduce's coefficients, 2(n-1) and 2(n-1)/n P.
    tp = comm_coefficients(StepCosts("x", 0.0, 0.0, 1000.0, "two_phase", 4, 2))
    assert tp == comm_coefficients(StepCosts("x", 0.0, 0.0, 1000.0, "all_reduce", 4, 2)) == (12.0, 1500.0)
