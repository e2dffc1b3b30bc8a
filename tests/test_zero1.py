"""ZeRO-1 (ZeroOneOptimizer) as a real torch.optim.Optimizer, composed with the one data-parallel path without
reducing twice, against torch's unsharded optimizers after DDP, on real gloo ranks."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab import RankError, launch
from commlab.overlap import BucketedDataParallel
from commlab.parallel import ZeroOneOptimizer
from commlab.train.data import load_digits_split


def deep_mlp(hidden=17, depth=2, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers, width = [], 64
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)


def _shard_batch(steps, rank, n, rows=24):
    d = load_digits_split(seed=0)
    out = []
    for s in range(steps):
        lo = (s * n + rank) * rows % (len(d.y_train) - rows)
        out.append((d.x_train[lo:lo + rows], d.y_train[lo:lo + rows]))
    return out


def _groups(model, lr):
    """Two param groups with different options: weights and biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "lr": lr}, {"params": biases, "lr": lr / 4, "weight_decay": 0.01}]


OPTIMIZERS = {"adam": (torch.optim.Adam, dict(lr=1e-2)), "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


def _zero_vs_ddp(opt_name, mode, steps=3):
    """ZeroOneOptimizer over two param groups (with an LR scheduler), against torch's unsharded optimizer on DDP.

    mode "local": no DP wrapper, the step reduce-scatters; "wrapped": a BucketedDataParallel averages in backward
    and the step must not reduce again; "no_sync": the wrapper's backward inside no_sync, so the step reduces.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    cls, kwargs = OPTIMIZERS[opt_name]
    ref, sharded = deep_mlp(), deep_mlp()
    ddp = DDP(ref)
    ref_opt = cls(_groups(ref, kwargs["lr"]), **kwargs)
    zero = ZeroOneOptimizer(_groups(sharded, kwargs["lr"]), None, cls, **kwargs)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ref_opt, zero)]
    wrapped = BucketedDataParallel(sharded, bucket_cap_bytes=1024) if mode != "local" else sharded
    stats = []
    for x, y in _shard_batch(steps, rank, n):
        ref_opt.zero_grad()
        zero.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if mode == "no_sync":
            with wrapped.no_sync():
                nn.functional.cross_entropy(wrapped(x), y).backward()
        else:
            nn.functional.cross_entropy(wrapped(x), y).backward()
        ref_opt.step()
        zero.step()
        stats.append(zero.last_step)
        for s in schedulers:
            s.step()
    ref_state = sum(t.numel() * t.element_size() for st in ref_opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    return ([q.detach() for q in ref.parameters()], [q.detach() for q in sharded.parameters()], stats,
            zero.state_nbytes(), ref_state, zero.numel, zero.padded_numel, isinstance(zero, torch.optim.Optimizer),
            [g["lr"] for g in zero.param_groups], [g["lr"] for g in zero.inner.param_groups])


CASES = [(opt_name, mode) for mode in ("local", "wrapped", "no_sync") for opt_name in ("adam", "sgd")]
WORLD = 3


def _each_zero_vs_ddp(cases):
    """:func:`_zero_vs_ddp` for each (optimizer, mode) of ``cases`` in turn, in one launched world (each case
    builds its own models, DDP, wrapper and optimizers): the list of their results."""
    return [_zero_vs_ddp(opt_name, mode) for opt_name, mode in cases]


@pytest.fixture(scope="module")
def zero_vs_ddp():
    """Every rank's :func:`_zero_vs_ddp` result for each of CASES, keyed by it, from one launch of WORLD ranks
    (a launch costs seconds; six of them were most of this file's time)."""
    per_rank = launch(_each_zero_vs_ddp, WORLD, CASES, timeout=180)
    return {case: [results[i] for results in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("mode", ["local", "wrapped", "no_sync"])
def test_zero1_equals_the_unsharded_optimizer_after_ddp(zero_vs_ddp, opt_name, mode):
    n = WORLD
    results = zero_vs_ddp[opt_name, mode]
    for ref_params, zero_params, stats, state_nbytes, ref_state, numel, padded, is_optim, lrs, inner_lrs in results:
        assert is_optim
        for a, b in zip(ref_params, zero_params):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert numel == 64 * 17 + 17 + 17 * 17 + 17 + 17 * 10 + 10 and padded % n == 0 and padded >= numel
        # The scheduler halves the outer groups' lr after every step (lr / 2**3 now, a quarter of it for the biases);
        # the step copies the options into the shards' optimizer, which last stepped with lr / 2**2.
        lr = OPTIMIZERS[opt_name][1]["lr"]
        assert lrs == pytest.approx([lr / 8, lr / 32]) and inner_lrs == pytest.approx([lr / 4, lr / 16])
        ag = 2 * (n - 1) / n * padded * 4 / 2  # (N-1)/N of the padded parameters, over both groups
        for s in stats:
            assert s.all_gather_nbytes == pytest.approx(ag)
            if mode == "wrapped":  # averaged by the wrapper: nothing reduced a second time
                assert s.gradients_averaged and s.reduce_scatter_nbytes == 0
            else:                  # local gradients: the ReduceScatter half of ZeRO-1's one-AllReduce volume
                assert not s.gradients_averaged and s.reduce_scatter_nbytes == pytest.approx(ag)
        per_param = 2 if opt_name == "adam" else 1
        assert ref_state == per_param * numel * 4
        # Optimizer state of 1/N of the parameters (ignoring Adam's scalar step counters, one per group).
        assert state_nbytes - (2 * 8 if opt_name == "adam" else 0) <= per_param * padded // n * 4
    for r in results[1:]:  # all ranks end with identical parameters
        for a, b in zip(results[0][1], r[1]):
            assert torch.equal(a, b)


def _state_dict_round_trip():
    rank, n = dist.get_rank(), dist.get_world_size()
    batches = _shard_batch(5, rank, n)
    a, b = deep_mlp(), deep_mlp()
    opt_a = ZeroOneOptimizer(_groups(a, 1e-2), None, torch.optim.Adam, lr=1e-2)
    for x, y in batches[:3]:
        opt_a.zero_grad()
        nn.functional.cross_entropy(a(x), y).backward()
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    b.load_state_dict(a.state_dict())
    opt_b = ZeroOneOptimizer(_groups(b, 1e-3), None, torch.optim.Adam, lr=1e-3)  # other options: loaded over
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf))
    for x, y in batches[3:]:
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    errors = []
    sd = opt_a.state_dict()
    wrong_rank = {**sd, "zero": {**sd["zero"], "group_rank": (rank + 1) % n}}
    plain = torch.optim.Adam(deep_mlp().parameters()).state_dict()
    other_layout = ZeroOneOptimizer(deep_mlp(hidden=5).parameters(), None)
    for bad, target in ((wrong_rank, opt_b), (plain, opt_b), (sd, other_layout)):
        try:
            target.load_state_dict(bad)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return same, [g["lr"] for g in opt_b.param_groups], sd["zero"], errors


def test_state_dict_round_trip_continues_bitwise_and_refuses_another_shard():
    for rank, (same, lrs, zero, errors) in enumerate(launch(_state_dict_round_trip, 2, timeout=60)):
        assert same and lrs == [1e-2, 1e-2 / 4]
        assert zero["world_size"] == 2 and zero["group_rank"] == rank
        assert errors[0] is not None and f"loaded on group rank {rank} of 2" in errors[0]
        assert errors[1] is not None and "not a ZeroOneOptimizer state dict" in errors[1]
        assert errors[2] is not None and "same parameter groups" in errors[2]


def _full_state_round_trip():
    """ZeRO-1 over 3 ranks after DDP-averaged gradients, its full_state against the unsharded Adam's state, and
    load_full_state into a fresh ZeroOneOptimizer (bitwise continuation) and into torch's Adam."""
    rank, n = dist.get_rank(), dist.get_world_size()
    batches = _shard_batch(5, rank, n)
    ref, a = deep_mlp(), deep_mlp()
    ddp, wrapped = DDP(ref), BucketedDataParallel(a, bucket_cap_bytes=1024)
    ref_opt = torch.optim.Adam(_groups(ref, 1e-2), lr=1e-2)
    opt_a = ZeroOneOptimizer(_groups(a, 1e-2), None, torch.optim.Adam, lr=1e-2)
    empty = opt_a.full_state()
    for x, y in batches[:3]:
        for model, opt in ((ddp, ref_opt), (wrapped, opt_a)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    full = opt_a.full_state()
    gaps = [max(float((full[q][k] - ref_opt.state[p][k]).abs().max()) for k in ("exp_avg", "exp_avg_sq"))
            for p, q in zip(ref.parameters(), a.parameters())]
    steps = {float(st["step"]) for st in full.values()}
    b, c = deep_mlp(), deep_mlp()
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    opt_b = ZeroOneOptimizer(_groups(b, 1e-2), None, torch.optim.Adam, lr=1e-2)
    opt_b.load_full_state({q: full[p] for p, q in zip(a.parameters(), b.parameters())})
    opt_c = torch.optim.Adam(_groups(c, 1e-2), lr=1e-2)
    for p, q in zip(a.parameters(), c.parameters()):
        opt_c.state[q] = full[p]
    wb, wc = BucketedDataParallel(b, bucket_cap_bytes=1024), BucketedDataParallel(c, bucket_cap_bytes=1024)
    for x, y in batches[3:]:
        for model, opt in ((wrapped, opt_a), (wb, opt_b), (wc, opt_c)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    close = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), c.parameters()))
    errors = []
    first, second = list(b.parameters())[:2]
    for bad in ({first: {**full[list(a.parameters())[0]], "step": torch.tensor(7.0)}},           # steps differ
                {first: {k: v for k, v in full[list(a.parameters())[0]].items() if k != "exp_avg"}},  # keys differ
                {first: {**full[list(a.parameters())[0]], "exp_avg": torch.zeros(3)}}):          # wrong shape
        states = {q: full[p] for p, q in zip(a.parameters(), b.parameters())}
        states.update(bad)
        try:
            opt_b.load_full_state(states)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return list(empty.values()), max(gaps), steps, same, close, errors


def test_full_state_is_the_unsharded_state_and_loads_back():
    for empty, gap, steps, same, close, errors in launch(_full_state_round_trip, 3, timeout=90):
        assert all(st == {} for st in empty)
        assert gap < 1e-6 and steps == {3.0}   # the unsharded Adam's moments, up to the summation order
        assert same                            # gathered and re-sharded: the run goes on bitwise
        assert close < 1e-6                    # loaded into torch's Adam: the same run (element-wise arithmetic)
        assert "different 'step'" in errors[0]
        assert "parameter 1 (shape [17, 17]) has state ['exp_avg', 'exp_avg_sq', 'step'] but parameter 0 has ['exp_avg_sq', 'step']" in errors[1]
        assert "has shape [3], the parameter [17, 64]" in errors[2]


def _wrapper_over_another_group():
    singles = [dist.new_group([0]), dist.new_group([1])]
    model = deep_mlp()
    wrapped = BucketedDataParallel(model, process_group=singles[dist.get_rank()])
    zero = ZeroOneOptimizer(model.parameters(), None, torch.optim.SGD, lr=0.1)  # over both ranks
    x, y = _shard_batch(1, dist.get_rank(), 2)[0]
    nn.functional.cross_entropy(wrapped(x), y).backward()
    zero.step()


def test_gradients_averaged_over_another_group_are_refused():
    with pytest.raises(RankError, match=r"shards over ranks \[0, 1\], but the gradients were averaged by a "
                                        r"BucketedDataParallel over ranks \[[01]\]"):
        launch(_wrapper_over_another_group, 2, timeout=60)


def test_bad_optimizer_class_is_named():
    def run():
        ZeroOneOptimizer(deep_mlp().parameters(), None, optimizer_cls=lambda ps, **kw: None)
    with pytest.raises(RankError, match="optimizer_cls must be a torch.optim.Optimizer subclass"):
        launch(run, 1, timeout=30)
