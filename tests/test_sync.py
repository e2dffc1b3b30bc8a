"""commlab.sync (local SGD, DiLoCo, Streaming DiLoCo) against PyTorch and against references written with torch's
own primitives, on real gloo ranks.

Each launch runs several checks and returns their results (a launch costs about a second of start-up); every
comparison is on 2 ranks, where a sum of two terms rounds the same in any order, so "equal" means bitwise unless
a test says otherwise. The references are written here, step by step: ``dist.all_reduce`` of the pseudo-gradient,
``torch.optim.SGD`` (Nesterov) on a copy of the parameters, ``lerp`` to mix (as torchft's ``local_sgd.py`` does).
"""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab import launch
from commlab.collectives import CollectiveMismatchError
from commlab.sync import DiLoCo, FragmentSync, LocalSGD, fragment_schedule, split_fragments
from commlab.sync.cost import exposed_seconds, outer_sync_seconds
from commlab.topology import EmulatedTopology, Link

WORLD = 2


def _model(seed: int = 0) -> nn.Module:
    """Linear(4, 6) + Tanh + Linear(6, 3): four parameter tensors, 51 elements."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


def _inner(model, opt, step):
    x, y = _batch(step, dist.get_rank())
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------- references

def _reference_streaming(steps, *, H, F, tau, alpha, lr, momentum, nesterov, inner_lr=0.1):
    """Streaming DiLoCo written plainly (F = 1, tau = 0, alpha = 0: DiLoCo): the model's parameters cut in F explicit
    fragments; fragment p's Delta taken tau steps before step c H + (p + 1) H / F, summed by dist.all_reduce, divided
    by N, applied by torch.optim.SGD to the fragment's global copy, then mixed in with lerp."""
    model = _model()
    params = list(model.parameters())
    frags = [[params[i] for i in idx] for idx in split_fragments(params, F)]
    glob = [[nn.Parameter(p.detach().clone()) for p in frag] for frag in frags]
    outer = [torch.optim.SGD(g, lr=lr, momentum=momentum, nesterov=nesterov) for g in glob]
    inner = torch.optim.SGD(params, lr=inner_lr)
    period, pending = H // F, {}
    for step in range(1, steps + 1):
        _inner(model, inner, step)
        pos = (step - 1) % H + 1
        for f in range(F):
            land = (f + 1) * period
            if pos == land - tau:
                delta = torch.cat([(g.detach() - p.detach()).reshape(-1) for g, p in zip(glob[f], frags[f])])
                dist.all_reduce(delta)
                pending[f] = delta / dist.get_world_size()
            if pos == land:
                offset = 0
                for g in glob[f]:
                    g.grad = pending[f][offset:offset + g.numel()].view_as(g).clone()
                    offset += g.numel()
                outer[f].step()
                with torch.no_grad():
                    for g, p in zip(glob[f], frags[f]):
                        p.copy_(g.detach().lerp(p.detach(), alpha))
    return _params(model)


def _ours(steps, *, H, F, tau, alpha, lr, momentum, nesterov, inner_lr=0.1, explicit=True, **kw):
    model = _model()
    params = list(model.parameters())
    arg = [[params[i] for i in idx] for idx in split_fragments(params, F)] if explicit else params
    d = DiLoCo(arg, inner_steps=H, outer_lr=lr, outer_momentum=momentum, nesterov=nesterov,
               fragments=F, sync_delay=tau, mixing=alpha, **kw)
    inner = torch.optim.SGD(params, lr=inner_lr)
    applied = []
    for step in range(1, steps + 1):
        _inner(model, inner, step)
        if d.step():
            applied.append(step)
    d.close()
    return _params(model), applied, d


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _one_outer_step(**outer):
    """The parameters after 2 inner steps and one outer step of DiLoCo (H = 2), and the replicas' mean before it."""
    model = _model()
    d = DiLoCo(model.parameters(), inner_steps=2, **outer)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        _inner(model, inner, step)
        local = _params(model)
        d.step()
    for t in local:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return _params(model), local


# ------------------------------------------------------------------------------------------- torch equivalences

def _equivalences():
    out = {}
    # Local SGD against PeriodicModelAverager and PostLocalSGDOptimizer: same model, seed and data.
    for warmup in (0, 2):
        runs = []
        for kind in ("ours", "averager", "post_local"):
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if kind == "ours":
                avg = LocalSGD(model.parameters(), every=3, warmup_steps=warmup)
            elif kind == "averager":
                avg = PeriodicModelAverager(period=3, warmup_steps=warmup)
            else:
                opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=3, warmup_steps=warmup))
            done = []
            for step in range(8):
                _inner(model, opt, step)
                if kind == "ours":
                    done.append(avg.step())
                elif kind == "averager":
                    avg.average_parameters(model.parameters())
            runs.append((_params(model), done))
        out[f"local_sgd_vs_averager_w{warmup}"] = _same(runs[0][0], runs[1][0])
        out[f"local_sgd_vs_post_local_w{warmup}"] = _same(runs[0][0], runs[2][0])
        out[f"local_sgd_schedule_w{warmup}"] = runs[0][1]

    # DiLoCo with H = 1, inner SGD, outer SGD lr 1 without momentum = one synchronous DP step (DDP), per step.
    ddp_model = DDP(_model())
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    for step in range(1, 4):
        _inner(ddp_model, opt, step)
    ours, _, _ = _ours(3, H=1, F=1, tau=0, alpha=0.0, lr=1.0, momentum=0.0, nesterov=False)
    out["h1_vs_ddp"] = _max_diff(ours, _params(ddp_model.module))

    # DiLoCo with outer SGD lr 1 without momentum sets each replica to the mean of the replicas: local SGD every H
    # steps (LocalSGD's schedule averages after calls H-1, 2H-1, ... with warmup_steps = H - 1).
    ours, _, _ = _ours(6, H=3, F=1, tau=0, alpha=0.0, lr=1.0, momentum=0.0, nesterov=False)
    model = _model()
    avg, opt = LocalSGD(model.parameters(), every=3, warmup_steps=2), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 7):
        _inner(model, opt, step)
        avg.step()
    out["lr1_vs_local_sgd"] = _max_diff(ours, _params(model))

    # DiLoCo (F = 1, tau = 0, alpha = 0) and Streaming DiLoCo against the plain references, bitwise.
    cfg = dict(H=3, lr=0.7, momentum=0.9, nesterov=True)
    ref = _reference_streaming(7, F=1, tau=0, alpha=0.0, **cfg)
    ours, applied, _ = _ours(7, F=1, tau=0, alpha=0.0, **cfg)
    out["diloco_vs_reference"] = (_same(ours, ref), applied)
    cfg = dict(H=4, lr=0.7, momentum=0.9, nesterov=True)
    ref = _reference_streaming(9, F=2, tau=1, alpha=0.5, **cfg)
    ours, applied, d = _ours(9, F=2, tau=1, alpha=0.5, **cfg)
    out["streaming_vs_reference"] = (_same(ours, ref), applied, d.bytes_sent_per_rank)
    ours_split, _, _ = _ours(9, F=2, tau=1, alpha=0.5, explicit=False, **cfg)  # DiLoCo splits it the same way
    out["streaming_split_same"] = _same(ours_split, ref)

    # The sign of the pseudo-gradient: after H = 2 inner steps from theta0, an outer step of lr 2 without momentum
    # lands at avg + (avg - theta0), beyond the average in the direction the replicas moved (a flipped sign lands at
    # theta0 - (avg - theta0), behind the start); Nesterov momentum 0.9 at lr 0.7 (first step: lr (1 + 0.9) Delta)
    # lands at theta0 + 1.33 (avg - theta0), beyond it too.
    theta0 = _params(_model())
    new, avg = _one_outer_step(outer_lr=2.0, outer_momentum=0.0, nesterov=False)
    out["sign_formula"] = _max_diff(new, [a + (a - t0) for a, t0 in zip(avg, theta0)])
    out["sign_dot"] = sum(((n - a) * (a - t0)).sum().item() for n, a, t0 in zip(new, avg, theta0))
    new, avg = _one_outer_step(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    out["sign_nesterov"] = _max_diff(new, [t0 + 0.7 * 1.9 * (a - t0) for a, t0 in zip(avg, theta0)])
    return out


@pytest.fixture(scope="module")
def equivalences():
    return launch(_equivalences, WORLD, timeout=120)[0]


@pytest.mark.parametrize("warmup", [0, 2])
def test_local_sgd_equals_torch_periodic_model_averager(equivalences, warmup):
    assert equivalences[f"local_sgd_vs_averager_w{warmup}"]
    assert equivalences[f"local_sgd_vs_post_local_w{warmup}"]
    # Calls 0, 3, 6 average without warm-up; 2, 5 with warm-up 2 (torch's schedule: the first call after it).
    want = {0: [0, 3, 6], 2: [2, 5]}[warmup]
    assert [k for k, a in enumerate(equivalences[f"local_sgd_schedule_w{warmup}"]) if a] == want


def test_diloco_h1_outer_sgd_lr1_equals_one_synchronous_dp_step(equivalences):
    # The same update in exact arithmetic; DiLoCo computes theta - mean(theta - (theta - lr g)) and so rounds
    # differently from theta - lr mean(g): measured 1.8e-7 after 3 steps; allowed 1e-6.
    assert equivalences["h1_vs_ddp"] < 1e-6


def test_diloco_outer_lr1_without_momentum_is_local_sgd(equivalences):
    # theta_g - mean(theta_g - theta_i) against mean(theta_i): rounding only (measured 3e-8 after 6 steps).
    assert equivalences["lr1_vs_local_sgd"] < 1e-6


def test_streaming_with_one_fragment_no_delay_no_mixing_is_diloco(equivalences):
    # The streaming reference at F = 1, tau = 0, alpha = 0 is DiLoCo's algorithm (all_reduce of Delta, then
    # torch.optim.SGD with Nesterov on the global copy, every H = 3 steps); commlab's DiLoCo equals it bitwise.
    same, applied = equivalences["diloco_vs_reference"]
    assert same
    assert applied == [3, 6]


def test_streaming_diloco_equals_reference_with_overlap_and_mixing(equivalences):
    # F = 2, tau = 1, alpha = 0.5: the AllReduce runs on a background thread during the tau step.
    same, applied, sent = equivalences["streaming_vs_reference"]
    assert same
    assert applied == [2, 4, 6, 8]
    # Two fragments of 24 and 27 float32 values, each ring-all-reduced twice over 2 ranks: (24 + 27) * 4 * 2.
    assert sent == pytest.approx(2 * (24 + 27) * 4)
    assert equivalences["streaming_split_same"]


def test_pseudo_gradient_sign(equivalences):
    # theta_global - theta_local, not its negative (torchft's PR #233 fixed a flipped sign).
    assert equivalences["sign_formula"] < 1e-6
    assert equivalences["sign_dot"] > 0
    assert equivalences["sign_nesterov"] < 1e-6


# ------------------------------------------------------------------------------------------- schedule, by hand

def test_fragment_schedule_by_hand():
    assert fragment_schedule(6) == (FragmentSync(0, 6, 6),)
    # H = 8, F = 4, tau = 1: one fragment lands every 2 steps, each sent one step before.
    assert [(s.fragment, s.send_step, s.apply_step) for s in fragment_schedule(8, 4, 1)] == [
        (0, 1, 2), (1, 3, 4), (2, 5, 6), (3, 7, 8)]
    assert [(s.fragment, s.apply_step) for s in fragment_schedule(4, 2, 0, cycles=2)] == [
        (0, 2), (1, 4), (0, 6), (1, 8)]


def test_split_fragments_by_hand():
    sizes = [24, 6, 18, 3]  # the test model's weights and biases: 24 of 51 elements is nearest half of them
    assert split_fragments([torch.zeros(s) for s in sizes], 2) == [[0], [1, 2, 3]]
    assert split_fragments([torch.zeros(s) for s in [100, 1, 1]], 3) == [[0], [1], [2]]
    assert split_fragments([torch.zeros(s) for s in [10, 1, 10, 1, 10, 1]], 3) == [[0, 1], [2, 3], [4, 5]]


def test_split_fragments_refuses_no_tensors():
    # It used to return one empty fragment, against its own "each non-empty".
    with pytest.raises(ValueError, match="params"):
        split_fragments([], 1)


# ------------------------------------------------------------------------------------------- resume

def _round_trip(**kw):
    """7 steps straight against 3 steps, state_dict (a fragment's sync in flight), a fresh model, load, 4 steps."""
    cfg = dict(inner_steps=4, fragments=2, sync_delay=1, mixing=0.5, outer_momentum=0.9, **kw)

    def build(seed):
        model = _model(seed)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, inner, DiLoCo(model.parameters(), **cfg)

    model, inner, d = build(0)
    for step in range(1, 8):
        _inner(model, inner, step)
        d.step()
    straight = (_params(model), [g.clone() for g in d.global_params], d.bytes_sent_per_rank)
    d.close()

    model, inner, d = build(0)
    for step in range(1, 4):
        _inner(model, inner, step)
        d.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "sync": d.state_dict()}, buf)
    in_flight = d.state_dict()["in_flight"] is not None
    d.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, inner, d = build(7)
    model.load_state_dict(saved["model"])
    inner.load_state_dict(saved["inner"])
    d.load_state_dict(saved["sync"])
    for step in range(4, 8):
        _inner(model, inner, step)
        d.step()
    resumed = (_params(model), [g.clone() for g in d.global_params], d.bytes_sent_per_rank)
    d.close()
    return (in_flight, _same(straight[0], resumed[0]), _same(straight[1], resumed[1]),
            straight[2] == resumed[2], straight[2], d.payload_nbytes, d.path)


def _round_trips():
    out = {spec: _round_trip(compressor=spec, error_feedback=spec.startswith("topk"))
           for spec in ("topk:0.25", "qsgd:8", "int:8")}
    out["two_phase"] = _round_trip(compressor="int:8", error_feedback=True, aggregation="two_phase")
    out["dense"] = _round_trip()
    # Local SGD: the schedule's counter.
    model = _model()
    a = LocalSGD(model.parameters(), every=3, warmup_steps=1)
    for _ in range(4):
        a.step()
    b = LocalSGD(model.parameters(), every=3, warmup_steps=1)
    b.load_state_dict(a.state_dict())
    out["local_sgd"] = [a.step() for _ in range(4)] == [b.step() for _ in range(4)]
    return out


def test_state_dict_round_trip_resumes_bitwise():
    out = launch(_round_trips, WORLD, timeout=120)[0]
    for spec in ("topk:0.25", "qsgd:8", "int:8", "two_phase", "dense"):
        in_flight, params, glob, sent, total, _, _ = out[spec]
        assert in_flight, spec  # saved between a fragment's send (step 3) and its landing (step 4)
        assert params and glob and sent, spec
    # Compressed Delta sends fewer bytes than dense: INT8 about a quarter, Top-K 25% (values and indices) a half.
    assert out["int:8"][4] < 0.3 * out["dense"][4]
    assert out["topk:0.25"][4] < 0.6 * out["dense"][4]
    # The last payloads of the two fragments (24 and 27 values): dense float32; INT8 codes and a float32 scale.
    assert out["dense"][5:] == ([24 * 4, 27 * 4], "all_reduce")
    assert out["int:8"][5:] == ([24 + 4, 27 + 4], "all_gather")
    assert out["two_phase"][6] == "two_phase"
    assert out["local_sgd"]


# ------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw, name", [
    (dict(inner_steps=0), "inner_steps"),
    (dict(inner_steps=6, fragments=4), "inner_steps"),
    (dict(inner_steps=6, fragments=2, sync_delay=3), "sync_delay"),
    (dict(inner_steps=6, sync_delay=-1), "sync_delay"),
    (dict(inner_steps=6, mixing=1.5), "mixing"),
    (dict(inner_steps=6, mixing=-0.1), "mixing"),
    (dict(inner_steps=6, outer_momentum=0.0), "nesterov"),
    (dict(inner_steps=6, compressor="powersgd:2"), "compressor"),
    (dict(inner_steps=6, compressor="zip"), "compressor='zip'"),
    (dict(inner_steps=6, compressor="int:0"), "compressor='int:0'"),
    (dict(inner_steps=6, compressor="sign:tensor"), "compressor='sign:tensor'"),
    (dict(inner_steps=6, error_feedback=True), "error_feedback"),
    (dict(inner_steps=6, aggregation="two_phase"), "aggregation"),
    (dict(inner_steps=6, compressor="int:8", aggregation="ring"), "aggregation"),
])
def test_bad_settings_are_named(kw, name):
    # Checked before any collective, so no process group is needed.
    with pytest.raises(ValueError, match=name):
        DiLoCo(_model().parameters(), **kw)


def test_bad_local_sgd_settings_are_named():
    with pytest.raises(ValueError, match="every"):
        LocalSGD(_model().parameters(), every=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        LocalSGD(_model().parameters(), every=2, warmup_steps=-1)


def _four_ranks():
    """On 4 ranks: two DP groups {0, 2} and {1, 3} syncing apart (a fragment in flight while the caller runs its own
    world collective); then a NaN (or inf) on rank 1 and ranks that disagree on H."""
    out = {}
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = _model(rank)
    d = DiLoCo(model.parameters(), groups[rank % 2], inner_steps=4, fragments=2, sync_delay=1, compressor="int:8")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 9):
        _inner(model, inner, step)
        d.step()
        if step == 5:  # fragment 0 was sent after step 5 and lands after step 6
            dist.all_reduce(torch.ones(1))
    d.close()
    out["global"] = [g.clone() for g in d.global_params]
    # A NaN on one rank only: every rank raises at the send step, nothing is sent, nobody hangs.
    for tau in (0, 1):
        model = _model()
        d = DiLoCo(model.parameters(), inner_steps=2, sync_delay=tau)  # sent after step 2 - tau
        if rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        try:
            d.step()
            d.step()
            out[f"nan_tau{tau}"] = None
        except FloatingPointError as e:
            out[f"nan_tau{tau}"] = str(e)
        d.close()
    model = _model()
    avg = LocalSGD(model.parameters(), every=2)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("inf")
    try:
        avg.step()
        out["nan_local_sgd"] = None
    except FloatingPointError as e:
        out["nan_local_sgd"] = str(e)
    # Ranks that disagree on H: the same error on every rank, at construction.
    try:
        DiLoCo(_model().parameters(), inner_steps=2 + 2 * (rank % 2))
        out["mismatch"] = None
    except CollectiveMismatchError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return launch(_four_ranks, 4, timeout=60)


def test_data_parallel_subgroups_sync_apart(four_ranks):
    glob = [r["global"] for r in four_ranks]
    assert _same(glob[0], glob[2]) and _same(glob[1], glob[3])
    assert not _same(glob[0], glob[1])


def test_nan_pseudo_gradient_and_disagreeing_ranks_raise_on_every_rank(four_ranks):
    for out in four_ranks:
        for tau in (0, 1):
            assert out[f"nan_tau{tau}"] is not None and "rank(s) [1]" in out[f"nan_tau{tau}"]
            assert "pseudo-gradient" in out[f"nan_tau{tau}"]
        assert out["mismatch"] is not None and "inner_steps" in out["mismatch"]
        assert out["nan_local_sgd"] is not None and "rank(s) [1]" in out["nan_local_sgd"]


# ------------------------------------------------------------------------------------------- overlap

_SLOW = EmulatedTopology(2, 1, Link(0.04, 0.0, "slow"))


def _overlap():
    """A fragment's emulated AllReduce (2 steps of 40 ms latency on 2 ranks) against 30 ms inner steps."""
    import time
    out = {}
    for tau in (0, 3):
        _SLOW.reset()
        model = _model()
        d = DiLoCo(model.parameters(), inner_steps=8, fragments=2, sync_delay=tau, emulate=_SLOW)
        for _ in range(8):
            time.sleep(0.03)  # the compute of an inner step
            d.step()
        d.close()
        out[tau] = (d.wait_seconds, d.comm_seconds)
    return out


@pytest.mark.timing
def test_streaming_overlap_hides_the_emulated_all_reduce():
    out = launch(_overlap, WORLD, timeout=60)[0]
    (wait0, comm0), (wait3, comm3) = out[0], out[3]
    assert comm0 >= 2 * 2 * 0.04 * 0.9 and comm3 >= 2 * 2 * 0.04 * 0.9  # 2 syncs of 2 delayed ring steps each
    assert wait0 >= 0.9 * comm0  # tau = 0: all exposed
    assert wait3 < 0.5 * wait0   # tau = 3: 90 ms of inner steps cover the ~80 ms AllReduce
    # The α-β model of one sync (2 (n-1) α on a link without β) against the measured mean of the two.
    predicted = outer_sync_seconds(51 * 4 / 2, 2, 0.04, 0.0)
    assert predicted == pytest.approx(0.08)
    assert comm0 / 2 == pytest.approx(predicted, rel=0.5)
    assert exposed_seconds(predicted, 3, 0.03) == 0.0


# ------------------------------------------------------------------------------------------- misuse, on real ranks

def _misuse():
    """Mixed dtypes against torch and a plain reference; tensors DiLoCo must refuse; close() and what follows it."""
    import os
    out, rank = {}, dist.get_rank()

    def mixed():  # a bf16 layer beside an fp32 one, different on each rank
        m = _model(rank)
        m[0].to(torch.bfloat16)
        for p in m.parameters():  # torch's averager skips parameters without a gradient
            p.grad = torch.zeros_like(p)
        return m

    # Local SGD on mixed dtypes: torch's averager promotes to fp32 (torch.cat), sums, casts back; so must we.
    ours, theirs = mixed(), mixed()
    LocalSGD(ours.parameters(), every=1).step()
    PeriodicModelAverager(period=1).average_parameters(theirs.parameters())
    out["mixed_local_sgd"] = _same(_params(ours), _params(theirs))
    # DiLoCo at outer lr 1 without momentum: theta_g - mean(theta_g - theta_i), Delta in fp32, cast back per tensor.
    model = mixed()
    d = DiLoCo(model.parameters(), inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    glob = _params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25 * (rank + 1))
    deltas = [(g.float() - p.detach().float()) / WORLD for g, p in zip(glob, model.parameters())]
    for t in deltas:
        dist.all_reduce(t)
    d.step()
    out["mixed_diloco"] = _same(_params(model), [(g.float() - t).to(g.dtype) for g, t in zip(glob, deltas)])
    # Error feedback on a mixed-dtype fragment (Delta in fp32): the residual survives a state_dict round trip; the
    # two-phase owners' residuals are cut per rank count, so another world size is refused.
    for aggregation in ("auto", "two_phase"):
        ps = [torch.full((5,), 1.0 + rank, dtype=torch.bfloat16), torch.linspace(0, 1, 7) * (rank + 1)]
        cfg = dict(inner_steps=1, compressor="topk:0.3", error_feedback=True, aggregation=aggregation)
        a = DiLoCo(ps, **cfg)
        with torch.no_grad():
            ps[1].mul_(rank + 2)
        a.step()
        qs = [p.clone() for p in ps]
        b = DiLoCo(qs, **cfg)
        state = a.state_dict()
        b.load_state_dict(state)
        for d, ts in ((a, ps), (b, qs)):  # one more outer step each: the residual must be used, not dropped
            with torch.no_grad():
                ts[1].mul_(rank + 2)
            d.step()
        mine, saved = b.state_dict()["residuals"], a.state_dict()["residuals"]
        out[f"ef_mixed_{aggregation}"] = (len(saved) > 0 and _same(ps, qs),
                                          _same([r["residual"] for r in mine], [r["residual"] for r in saved]))
    try:
        b.load_state_dict(dict(state, world_size=3))
        out["ef_world_size"] = None
    except ValueError as e:
        out["ef_world_size"] = str(e)
    # A state loaded on rank 0 only: the global copies differ, and every rank says so at the next send (they used
    # to drift apart for good without a word).
    p = torch.ones(4)
    d = DiLoCo([p], inner_steps=1)
    state = d.state_dict()
    if rank == 0:
        d.load_state_dict(dict(state, global_params=[torch.full((4,), 5.0)]))
    try:
        d.step()
        out["one_rank_loaded"] = None
    except RuntimeError as e:
        out["one_rank_loaded"] = str(e)
    # Local SGD with a state loaded on rank 0 only: its schedule is two calls ahead; both average at this call (0
    # and 2 with every=2) and say that their step counts differ (they used to average different steps silently).
    avg = LocalSGD([p], every=2)
    if rank == 0:
        avg.load_state_dict(dict(avg.state_dict(), steps=2))
    try:
        avg.step()
        out["local_sgd_one_rank_loaded"] = None
    except RuntimeError as e:
        out["local_sgd_one_rank_loaded"] = str(e)
    # Another object's state: a named ValueError, not a KeyError.
    avg = LocalSGD([p], every=1)
    for name, load in (("diloco_loads_local_sgd", lambda: d.load_state_dict(avg.state_dict())),
                       ("local_sgd_loads_diloco", lambda: avg.load_state_dict(state))):
        try:
            load()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # An emulated topology of one rank for a group of two: named at construction (was an IndexError at the sync).
    small = EmulatedTopology(1, 1, Link(0.001, 0.0, "slow"))
    for name, build in (("emulate_diloco", lambda: DiLoCo([p], inner_steps=1, sync_delay=0, emulate=small)),
                        ("emulate_local_sgd", lambda: LocalSGD([p], every=1, emulate=small))):
        try:
            build()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # Tensors that cannot be averaged as parameters, named at construction (not at the first sync).
    p, q = torch.zeros(3), torch.zeros(3)
    for name, build in (("tied", lambda: DiLoCo([p, q, p], inner_steps=1, mixing=0.5)),
                        ("tied_fragments", lambda: DiLoCo([[p], [q, p]], inner_steps=2)),
                        ("int", lambda: DiLoCo([p, torch.zeros(3, dtype=torch.int64)], inner_steps=1)),
                        ("int_local_sgd", lambda: LocalSGD([torch.zeros(3, dtype=torch.int64)], every=1))):
        try:
            build()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # close() hands the in-flight group back: building and closing Streaming DiLoCo leaves no sockets behind.
    fds = []
    for _ in range(4):
        d = DiLoCo([torch.ones(4)], inner_steps=2, sync_delay=1)
        d.step()
        d.step()
        d.close()
        d.close()
        fds.append(len(os.listdir("/proc/self/fd")))
    out["fds"] = fds
    try:
        d.step()
        out["step_after_close"] = None
    except RuntimeError as e:
        out["step_after_close"] = str(e)
    # The DP group destroyed before close() (against the docstring's order): close still hands its group back.
    group = dist.new_group([0, 1])
    d = DiLoCo([torch.ones(4)], group, inner_steps=2, sync_delay=1)
    d.step()
    d.step()
    dist.destroy_process_group(group)
    d.close()
    out["closed_after_group_destroyed"] = d.closed
    return out


@pytest.fixture(scope="module")
def misuse():
    return launch(_misuse, WORLD, timeout=60)


def test_mixed_dtypes_are_averaged_in_the_promoted_dtype(misuse):
    for out in misuse:
        assert out["mixed_local_sgd"]  # bitwise equal to torch's PeriodicModelAverager
        assert out["mixed_diloco"]


def test_error_feedback_residuals_resume_on_mixed_dtypes_and_refuse_another_world_size(misuse):
    for out in misuse:
        assert out["ef_mixed_auto"] == (True, True)
        assert out["ef_mixed_two_phase"] == (True, True)
        assert "world_size=3" in out["ef_world_size"]


def test_a_state_loaded_on_one_rank_only_is_caught_on_every_rank(misuse):
    for out in misuse:
        assert out["one_rank_loaded"] is not None and "global copies" in out["one_rank_loaded"]
        assert out["local_sgd_one_rank_loaded"] is not None and "step counts differ: [2, 0]" in \
            out["local_sgd_one_rank_loaded"]


def test_another_objects_state_is_refused_by_name(misuse):
    for out in misuse:
        assert "lacks [" in out["diloco_loads_local_sgd"] and "'global_params'" in out["diloco_loads_local_sgd"]
        assert "lacks ['averages'" in out["local_sgd_loads_diloco"]


def test_an_emulated_topology_too_small_for_the_group_is_named(misuse):
    for out in misuse:
        for name in ("emulate_diloco", "emulate_local_sgd"):
            assert out[name] is not None and "emulate" in out[name] and "global ranks [0, 1]" in out[name]


def test_tied_and_integer_tensors_are_refused_at_construction(misuse):
    for out in misuse:
        assert "params" in out["tied"] and "repeats tensor 0" in out["tied"]
        assert "repeats tensor 0" in out["tied_fragments"]
        assert "params" in out["int"] and "int64" in out["int"]
        assert "int64" in out["int_local_sgd"]


def test_close_frees_the_sync_group_and_refuses_later_steps(misuse):
    for out in misuse:
        assert len(set(out["fds"])) == 1, out["fds"]  # the second DiLoCo on to the fourth reuse the first's group
        assert "after close()" in out["step_after_close"]
        assert out["closed_after_group_destroyed"]
