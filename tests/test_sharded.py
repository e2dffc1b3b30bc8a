"""ZeRO-2 against DDP and ZeRO-3 / FSDP against torch's FSDP2 (fully_shard), the memory each rank holds against
ZeRO's formulas, and the errors, on 2 real gloo ranks: one job for the whole module."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab import launch
from commlab.collectives import CollectiveMismatchError
from commlab.parallel import (ShardedDataParallel, ZeroOneOptimizer, held_memory_bytes, zero_memory_bytes)
from commlab.parallel.sharded import dim0_shard_rows, sharded_step_nbytes
from commlab.overlap.profile import intersection_of_unions
from commlab.parallel.sharded_profile import gathers_issued_ahead, profile_sharded

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane

STEPS = 3


def mlp(widths=(8, 6, 5, 4), seed=0):
    """Float64 MLP; with the default widths the weights have 6, 5 (odd: padded to 6 rows on 2 ranks) and 4 rows."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1]).double()


def _batches(rank, steps=STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(5, 8, dtype=torch.float64, generator=g) for _ in range(steps)]


def _loss(out):
    return out.pow(2).mean()


def _gap(xs, ys):
    return max(float((a - b).abs().max()) for a, b in zip(xs, ys))


def _rows(full, n, rank):
    """This rank's dim-0 rows of a whole tensor (FSDP2's shard of it)."""
    start, rows, _ = dim0_shard_rows(full.shape[0], n, rank)
    return full[start:start + rows]


def _against(stage, rank):
    """Our stage-2 (against DDP) or stage-3 (against FSDP2) run: per step the largest gap of gradients and params;
    the optimizer is built on the wrapped model's own parameters, as for fully_shard."""
    ref = mlp()
    if stage == 3:
        for layer in ref:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(ref)
        ref_model = ref
    else:
        ref_model = DDP(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    sdp = ShardedDataParallel(mlp(), stage=stage)
    opt = torch.optim.Adam(sdp.module.parameters(), lr=1e-2)
    n = dist.get_world_size()
    grad_gaps, param_gaps, stats, freed, module_grads = [], [], [], [], []
    for x in _batches(rank):
        _loss(ref_model(x)).backward()
        _loss(sdp(x)).backward()
        full = (lambda t: t.full_tensor()) if stage == 3 else (lambda t: t)
        module_grads.append([p.grad for p in sdp.unsharded_parameters()])
        grad_gaps.append(_gap(sdp.full_gradients(), [full(p.grad) for p in ref.parameters()]))
        # the module's own parameters are the shards, and their .grad the shards of the average
        grad_gaps[-1] = max(grad_gaps[-1], _gap([p.grad for p in sdp.module.parameters()],
                                                [_rows(full(p.grad), n, rank) for p in ref.parameters()]))
        ref_opt.step()
        opt.step()
        stats.append(sdp.last_step)
        ref_opt.zero_grad()
        opt.zero_grad()
        param_gaps.append(_gap(sdp.full_parameters(), [full(p.detach()) for p in ref.parameters()]))
        param_gaps[-1] = max(param_gaps[-1], _gap([p.detach() for p in sdp.module.parameters()],
                                                  [_rows(full(p.detach()), n, rank) for p in ref.parameters()]))
        freed.append([p.untyped_storage().nbytes() for p in sdp.unsharded_parameters()])
    with torch.no_grad():  # forward without autograd (evaluation): gathered and freed again, the same outputs
        x = _batches(rank)[0]
        eval_gap = float((sdp(x) - ref_model(x)).abs().max())
        if stage == 2:  # the forward gathered the stepped shards into the whole parameters it keeps
            eval_gap = max(eval_gap, _gap(sdp.unsharded_parameters(), [full(p.detach()) for p in ref.parameters()]))
    moved = _gap(sdp.full_parameters(), [p.detach() for p in mlp().parameters()])
    return dict(grad_gaps=grad_gaps, param_gaps=param_gaps, stats=stats, freed=freed, eval_gap=eval_gap, moved=moved,
                module_grads=module_grads, shard_sizes=[p.numel() for p in sdp.shard_parameters()],
                after_eval=[p.untyped_storage().nbytes() for p in sdp.unsharded_parameters()])


def _memory(rank, n):
    """Bytes held after a step (before zero_grad) under plain DP, ZeRO-1, ZeRO-2 and ZeRO-3; units of 72 and 36
    elements, so that N = 2 divides each and no shard is padded."""
    x = _batches(rank, 1)[0]
    out = {}
    model = mlp((8, 8, 4))
    numel = sum(p.numel() for p in model.parameters())
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    _loss(DDP(model)(x)).backward()
    adam.step()
    out[0] = held_memory_bytes(model.parameters(), adam)
    model = mlp((8, 8, 4))
    zero = ZeroOneOptimizer(model.parameters(), None, torch.optim.Adam, lr=1e-2)
    _loss(model(x)).backward()
    zero.step()
    out[1] = held_memory_bytes(model.parameters(), zero.inner)
    for stage in (2, 3):
        sdp = ShardedDataParallel(mlp((8, 8, 4)), stage=stage)
        opt = sdp.make_optimizer(torch.optim.Adam, lr=1e-2)
        _loss(sdp(x)).backward()
        opt.step()
        out[stage] = sdp.held_nbytes(opt)
    return numel, out


def _micro_batches(rank):
    """Stage 3, two micro-batches forwarded before either backward, one step; against the local model's summed
    gradients averaged with dist.all_reduce."""
    ref, sdp = mlp(), ShardedDataParallel(mlp(), stage=3)
    x1, x2 = _batches(rank, 2)
    out1, out2 = sdp(x1), sdp(x2)
    _loss(out1).backward()
    _loss(out2).backward()
    (_loss(ref(x1)) + _loss(ref(x2))).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    gap = _gap(sdp.full_gradients(), [p.grad for p in ref.parameters()])
    # A backward that raises half-way (after unit 2's ReduceScatter was launched) on both ranks; the next step
    # starts clean and its gradients are that step's alone.
    ref, sdp = mlp(), ShardedDataParallel(mlp(), stage=3)

    def boom(grad):
        raise RuntimeError("boom")
    handle = sdp.module[2].register_forward_hook(lambda m, a, out: out.register_hook(boom) and None)
    try:
        _loss(sdp(x1)).backward()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    handle.remove()
    _loss(sdp(x2)).backward()
    _loss(ref(x2)).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return gap, raised, _gap(sdp.full_gradients(), [p.grad for p in ref.parameters()])


def _errors(rank):
    errors = {}

    def catch(key, fn):
        try:
            fn()
            errors[key] = None
        except (ValueError, RuntimeError) as exc:
            errors[key] = (type(exc).__name__, str(exc))

    catch("mismatch", lambda: ShardedDataParallel(mlp((8, 6, 4) if rank == 0 else (8, 7, 4)), stage=3))
    catch("count", lambda: ShardedDataParallel(mlp((8, 6, 4) if rank == 0 else (8, 6, 6, 4)), stage=2))
    catch("empty", lambda: ShardedDataParallel(nn.Sequential(nn.ReLU())))
    catch("device", lambda: ShardedDataParallel(mlp().to("meta")))
    only_zero = dist.new_group([0])
    catch("wrong_group", lambda: ShardedDataParallel(mlp(), shard_group=only_zero))
    catch("same_groups", lambda: ShardedDataParallel(mlp(), replicate_group=dist.group.WORLD))
    catch("stage", lambda: ShardedDataParallel(mlp(), stage=1))
    catch("one_rank_bad", lambda: ShardedDataParallel(mlp(), stage=1 if rank == 1 else 3))
    model = mlp()
    catch("uncovered", lambda: ShardedDataParallel(model, units=[model[0]]))
    catch("foreign_unit", lambda: ShardedDataParallel(mlp(), units=[nn.Linear(2, 2)]))
    mixed = nn.Sequential(nn.Linear(2, 2).double())
    mixed[0].bias.data = mixed[0].bias.data.float()
    catch("mixed", lambda: ShardedDataParallel(mixed))
    catch("optimizer", lambda: ShardedDataParallel(mlp()).make_optimizer(lambda params: None))
    # NaN: rank 0's gradient of one weight element is NaN; reduced like any number, as by DDP.
    ref, ours = mlp(), mlp()
    ddp = DDP(ref)

    def poison(g):
        g = g.clone()
        if dist.get_rank() == 0:
            g[1, 2] = float("nan")
        return g
    list(ref.parameters())[0].register_hook(poison)
    # on the parameter before wrapping: it becomes the unsharded tensor that autograd computes the gradient of
    list(ours.parameters())[0].register_hook(poison)
    sdp = ShardedDataParallel(ours, stage=3)
    opt = sdp.make_optimizer(torch.optim.SGD, lr=0.1)
    x = _batches(rank, 1)[0]
    _loss(ddp(x)).backward()
    _loss(sdp(x)).backward()
    ours_grads, ref_grads = sdp.full_gradients(), [p.grad.clone() for p in ref.parameters()]
    opt.step()
    nan_params = [torch.isnan(p).nonzero().tolist() for p in sdp.full_parameters()]
    return errors, ours_grads, ref_grads, nan_params


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    sdp = ShardedDataParallel(mlp(), stage=3)
    profiled = profile_sharded(sdp, sdp.make_optimizer(torch.optim.SGD, lr=0.0), lambda out: _loss(out),
                               (_batches(rank, 1)[0],), steps=2, warmup=1)
    sdp = ShardedDataParallel(mlp(), stage=3, prefetch=False)
    unprefetched = profile_sharded(sdp, sdp.make_optimizer(torch.optim.SGD, lr=0.0), lambda out: _loss(out),
                                   (_batches(rank, 1)[0],), steps=1, warmup=0)
    sdp = ShardedDataParallel(mlp(), stage=2)
    zero2 = profile_sharded(sdp, sdp.make_optimizer(torch.optim.SGD, lr=0.0), lambda out: _loss(out),
                            (_batches(rank, 1)[0],), steps=1, warmup=0)
    return dict(zero2=_against(2, rank), zero3=_against(3, rank), memory=_memory(rank, n), errors=_errors(rank),
                profile=profiled, micro_batches=_micro_batches(rank), unprefetched=unprefetched, zero2_profile=zero2)


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=120)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_and_parameters_equal_the_reference_after_every_step(results, stage):
    """ZeRO-2 against DDP, ZeRO-3 against FSDP2 (fully_shard per Linear, then the root), Adam, float64."""
    for r in results:
        run = r[f"zero{stage}"]
        assert len(run["grad_gaps"]) == STEPS
        assert max(run["grad_gaps"]) < 1e-12 and max(run["param_gaps"]) < 1e-12
        assert run["eval_gap"] < 1e-12
        assert run["moved"] > 1e-3   # the steps changed the model: the equality is not that of two idle runs


def test_zero3_accumulates_micro_batches_forwarded_before_their_backward(results):
    """Each backward regathers the units the previous one freed, and the shards' gradients add up."""
    assert all(r["micro_batches"][0] < 1e-12 for r in results)


def test_a_backward_that_raised_leaves_the_next_step_clean(results):
    for r in results:
        _, raised, gap = r["micro_batches"]
        assert raised == "boom" and gap < 1e-12


SHAPES = [(6, 8), (6,), (5, 6), (5,), (4, 5), (4,)]


def test_zero2_frees_the_full_gradient_and_keeps_parameters_whole(results):
    """The shards are dim-0 rows: 3 + 3 of the 6-row weight, 3 + 2 of the 5-row one (its AllGather input padded to
    3 rows), 2 + 2 of the 4-row one. ZeRO-2 gathers each unit once per step, in the forward (units 1 and 2
    prefetched), after the optimizer stepped the shards; the bytes are dim-0 padded (6 + 6 + 4 rows of 8, 6 and 5
    elements and their biases), in float64."""
    for rank, r in enumerate(results):
        run = r["zero2"]
        assert all(g is None for step in run["module_grads"] for g in step)   # only the shard's gradient survives
        assert run["shard_sizes"] == [[24, 3, 18, 3, 10, 2], [24, 3, 12, 2, 10, 2]][rank]
        assert all(b > 0 for step in run["freed"] for b in step)
        want = sharded_step_nbytes(SHAPES, 2, stage=2, param_dtype=torch.float64)
        assert want["all_gather"] == want["reduce_scatter"] == (6 * 8 + 6 + 6 * 6 + 6 + 4 * 5 + 4) * 8 / 2
        for s in run["stats"]:  # one ReduceScatter per unit in backward, one AllGather per unit in the forward
            assert (s.reduce_scatters, s.all_gathers, s.prefetched) == (3, 3, 2)
            assert s.reduce_scatter_nbytes == want["reduce_scatter"] and s.all_gather_nbytes == want["all_gather"]


def test_zero3_gathers_twice_prefetches_and_frees_outside_the_windows(results):
    for r in results:
        run = r["zero3"]
        assert all(b == 0 for step in run["freed"] for b in step) and all(b == 0 for b in run["after_eval"])
        assert all(g is None for step in run["module_grads"] for g in step)
        for s in run["stats"]:
            # Forward gathers units 0, 1, 2 (1 and 2 prefetched), backward 2, 1, 0 (1 and 0 prefetched):
            # 3 (N-1)/N of the parameters' bytes per step, 1.5 times DDP's AllReduce.
            assert (s.all_gathers, s.prefetched, s.reduce_scatters) == (6, 4, 3)
            want = sharded_step_nbytes(SHAPES, 2, stage=3, param_dtype=torch.float64)
            assert s.all_gather_nbytes == 2 * s.reduce_scatter_nbytes == want["all_gather"] == 2 * 120 * 8 / 2


def test_memory_held_equals_zero_formulas(results):
    """Measured storage after a step against Rajbhandari et al. 2020 §5 in float64 (P = G = 8 bytes): K = 16
    (Adam's moments) where the parameters are the optimizer's own (DP, ZeRO-3), K = 8 + 16 where the optimizer
    keeps a master copy of the shard beside the whole model (ZeRO-1, ZeRO-2)."""
    for r in results:
        numel, held = r["memory"]
        assert numel == 8 * 8 + 8 + 8 * 4 + 4 == 108
        for stage, k in ((0, 16), (1, 24), (2, 24), (3, 16)):
            assert held[stage] == zero_memory_bytes(stage, numel, 2, 8, 8, k), stage
        assert held[3]["total"] == 108 * (8 + 8 + 16) / 2


def test_zero_memory_formula_is_the_papers():
    """Figure 1 of the ZeRO paper: Ψ = 7.5 B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    psi = 7.5e9
    totals = [zero_memory_bytes(s, int(psi), 64)["total"] / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.06)
    assert zero_memory_bytes(2, 10, 2, 2, 2, 12) == {"params": 20, "grads": 10, "optimizer": 60, "total": 90}
    for bad, match in (({"stage": 4}, r"stage must be one of \[0, 1, 2, 3\]"), ({"numel": -1}, "numel must be an int"),
                       ({"n": 0}, "n must be an int >= 1"), ({"grad_bytes": float("nan")}, "grad_bytes must be")):
        kwargs = {"stage": 1, "numel": 10, "n": 2, **bad}
        with pytest.raises(ValueError, match=match):
            zero_memory_bytes(**kwargs)


def test_every_rank_raises_the_same_error_for_different_models(results):
    mine = [r["errors"][0]["mismatch"] for r in results]
    assert mine[0] == mine[1] and mine[0][0] == "CollectiveMismatchError"
    assert "group rank 1 has ('unit 0 (0): 0.weight', (7, 8), 'float64') where group rank 0 has " \
           "('unit 0 (0): 0.weight', (6, 8), 'float64')" in mine[0][1]
    counts = [r["errors"][0]["count"] for r in results]
    assert counts[0] == counts[1] and "ranks hold different layouts: group rank 1 has ('units', 3) where group rank " \
        "0 has ('units', 2) (8 entries on group rank 1, 6 on group rank 0)" in counts[0][1]
    assert issubclass(CollectiveMismatchError, ValueError)
    # A bad argument on one rank only: that rank does not leave the other waiting, both raise the mismatch.
    bad = [r["errors"][0]["one_rank_bad"] for r in results]
    assert bad[0] == bad[1] and bad[0][0] == "CollectiveMismatchError"
    assert "group rank 1 has ('invalid arguments', 'stage must be one of [2, 3]" in bad[0][1]


def test_bad_arguments_are_named(results):
    for rank, r in enumerate(results):
        e = r["errors"][0]
        assert e["empty"] == ("ValueError", "ShardedDataParallel: the module has no parameter with "
                                            "requires_grad=True: nothing to shard")
        assert "the shard group's device is cpu, but 0.weight on meta, 0.bias on meta" in e["device"][1]
        if rank == 1:
            assert e["wrong_group"][0] == "RuntimeError" and "rank 1 is not a member of the process group passed " \
                "to ShardedDataParallel (shard_group)" in e["wrong_group"][1]
        else:  # rank 0 is the whole group: N = 1, nothing to shard over, and it works
            assert e["wrong_group"] is None
        assert "share ranks [0, 1]; HSDP needs groups that meet in this rank only" in e["same_groups"][1]
        assert "stage must be one of [2, 3]" in e["stage"][1]
        assert "parameters ['2.weight', '2.bias', '4.weight', '4.bias'] belong to no unit" in e["uncovered"][1]
        assert "units[0] (Linear) is not a submodule" in e["foreign_unit"][1]
        assert "unit '0' mixes dtypes or devices (['torch.float32@cpu', 'torch.float64@cpu'])" in e["mixed"][1]
        assert "optimizer_cls must be a torch.optim.Optimizer subclass" in e["optimizer"][1]


def test_nan_gradient_is_reduced_like_ddp(results):
    for r in results:
        _, ours, ref, nan_params = r["errors"]
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=1e-12)
        assert torch.isnan(ours[0]).nonzero().tolist() == [[1, 2]]           # the one element, on every rank
        assert all(torch.isfinite(g).all() for g in ours[1:])
        assert nan_params == [[[1, 2]], [], [], [], [], []]                   # the step writes it into that element


def test_profile_splits_the_step_into_compute_and_communication(results):
    """The profiler's figures are consistent (no assertion on how fast anything is)."""
    for rank, r in enumerate(results):
        p = r["profile"]
        assert (p.rank, p.stage, p.steps) == (rank, 3, 2)
        assert p.step_s > 0 and p.comm_s > 0 and p.compute_s > 0
        assert p.compute_s + p.exposed_comm_s == pytest.approx(p.step_s)
        assert 0 <= p.overlapped_s <= p.comm_s and 0 <= p.overlap_fraction <= 1


def test_the_timeline_says_which_gathers_were_issued_ahead(results):
    """Prefetch is read from the order of the bars, not their lengths: with it, units 1 and 2 are gathered while
    the unit before them computes (forward) and units 0 and 1 while the unit after them does (backward)."""
    for r in results:
        p, q = r["profile"], r["unprefetched"]
        labels = sorted(b.label for b in p.timeline if b.kind == "comm")
        assert labels == ["AG0", "AG0", "AG1", "AG1", "AG2", "AG2", "RS0", "RS1", "RS2"]
        assert {b.kind for b in p.timeline} == {"forward", "backward", "optimizer", "wait", "comm", "unit"}
        assert all(0 <= b.start_s <= b.end_s for b in p.timeline)
        assert gathers_issued_ahead(p.timeline) == {"forward": [1, 2], "backward": [0, 1]}
        assert gathers_issued_ahead(q.timeline) == {"forward": [], "backward": []}
        with pytest.raises(ValueError, match="two AllGathers per unit"):
            gathers_issued_ahead(r["zero2_profile"].timeline)


def test_intersection_of_unions():
    assert intersection_of_unions([(0, 2), (1, 3), (5, 6)], [(2.5, 5.5)]) == pytest.approx(1.0)
    assert intersection_of_unions([], [(0, 1)]) == 0 and intersection_of_unions([(0, 4)], [(1, 2), (1.5, 3)]) == 2
    with pytest.raises(ValueError, match="ends before it starts"):
        intersection_of_unions([(2, 1)], [(0, 3)])
