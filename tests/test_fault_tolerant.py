"""Fault-tolerant data parallelism on real processes: a replica SIGKILLed at step k and back later, a scale-down,
a fixed quorum against plain AllReduce and a single-process replay, and the errors of bad input."""

import hashlib
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commlab.launch import Fault, ReplicaContext, ReplicaError, ReplicaTimeout, run_replicas
from commlab.sync import FaultTolerantDP
from commlab.sync.fault_tolerant import _DECISION
from commlab.train.data import load_digits_split, shard
from commlab.train.model import DigitsMLP

DATA = load_digits_split()  # loaded once here; forked replicas inherit it
BATCH, LR, MOMENTUM, HIDDEN = 16, 0.1, 0.9, 32


def _batch(replica, replicas, step):
    x, y = shard(DATA.x_train, replica, replicas), shard(DATA.y_train, replica, replicas)
    i = (step * BATCH) % (len(y) - BATCH)
    return x[i:i + BATCH], y[i:i + BATCH]


def _model_and_opt():
    model = DigitsMLP(hidden=HIDDEN, seed=0)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _state_hash(model, opt):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        h.update(opt.state[p]["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()


def _job(ctx, steps, until_full=False, compare=False, late=None, join_timeout_s=2.0):
    """The loop the chapter shows. until_full: keep going past ``steps`` until every replica is back (so a
    replacement slow to start still finds survivors); compare: check each average against dist.all_reduce;
    late: ``(replica, seconds)``, that replica sleeps before its first step."""
    model, opt = _model_and_opt()
    ft = FaultTolerantDP(ctx, model, opt, join_timeout_s=join_timeout_s, op_timeout_s=5.0, quorum_timeout_s=20.0)
    if late is not None and late[0] == ctx.replica:
        time.sleep(late[1])
    worst = 0.0
    q = None
    while ft.step < steps or (until_full and len(q.members) < ctx.replicas):  # bounded by timeout_s
        q = ft.start_step()
        x, y = _batch(ctx.replica, ctx.replicas, ft.step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        ctx.maybe_fail(ft.step)
        before = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) if compare else None
        ft.average_gradients()
        if compare:
            dist.all_reduce(before)
            after = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            worst = max(worst, (before / dist.get_world_size() - after).abs().max().item())
        if ft.should_commit():
            opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "hash": _state_hash(model, opt),
            "history": ft.history, "step": ft.step, "worst": worst}


def _replay(history, replicas, divisor=None):
    """Single-process reference: for each committed step, the mean of the members' gradients on their batches."""
    model, opt = _model_and_opt()
    for rec in history:
        if not rec.committed:
            continue
        grads = None
        for m in rec.quorum.members:
            model.zero_grad()
            x, y = _batch(m, replicas, rec.quorum.step)
            F.cross_entropy(model(x), y).backward()
            g = [p.grad.clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        n = divisor if divisor is not None else len(rec.quorum.members)
        for p, g in zip(model.parameters(), grads):
            p.grad = g / n
        opt.step()
    return [p.detach() for p in model.parameters()]


def _close(a, b):
    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b))


def test_fixed_quorum_equals_all_reduce_and_a_single_process_replay():
    run = run_replicas(_job, 3, 6, compare=True, timeout_s=60, print_output=False)
    res = run.results
    assert sorted(res) == [0, 1, 2] and run.incarnations == {0: 1, 1: 1, 2: 1}
    assert len({r["hash"] for r in res.values()}) == 1
    hist = res[0]["history"]
    assert [rec.quorum.members for rec in hist] == [(0, 1, 2)] * 6 and all(rec.committed for rec in hist)
    assert res[0]["worst"] < 1e-6  # each step's average equals dist.all_reduce / 3 over the same group
    assert _close(res[0]["params"], _replay(hist, 3))
    assert not _close(res[0]["params"], _replay(hist, 3, divisor=2))  # the comparison can fail


def test_killed_replica_survivors_go_on_and_it_heals_bit_identical():
    k, back = 2, 4
    run = run_replicas(_job, 3, 8, until_full=True, faults=[Fault(1, k, rejoin_step=back)], timeout_s=90,
                       print_output=False)
    res = run.results
    assert run.incarnations == {0: 1, 1: 2, 2: 1}
    kinds = [(r, kind) for _, r, kind in run.events if r == 1]
    assert kinds[:3] == [(1, "start"), (1, "killed"), (1, "rejoin")]
    for s in (0, 2):  # survivors
        hist = res[s]["history"]
        committed = [rec.quorum.step for rec in hist if rec.committed]
        assert committed == list(range(res[s]["step"]))  # the step count never stalls for good
        in_flight = [rec for rec in hist if rec.quorum.step == k and 1 in rec.quorum.members and not rec.committed]
        assert len(in_flight) == 1 and in_flight[0].error is not None  # the failed step: nobody commits it
        assert not any(rec.committed and rec.quorum.step == k and 1 in rec.quorum.members for rec in hist)
        gap = [rec for rec in hist if rec.committed and rec.quorum.members == (0, 2)]
        assert len(gap) >= back - k  # went on with two while replica 1 was away
        assert hist[-1].quorum.members == (0, 1, 2)
    first = res[1]["history"][0]
    assert first.healed_from == 0 and first.quorum.joining == (1,) and first.committed
    assert len({r["hash"] for r in res.values()}) == 1  # parameters and momentum, bit for bit
    for r in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[r]["params"]))
    hist = res[0]["history"]
    assert _close(res[0]["params"], _replay(hist, 3))  # the divisor followed the quorum (2 in the gap)
    assert not _close(res[0]["params"], _replay(hist, 3, divisor=3))


def test_scale_down_goes_on_to_the_end():
    run = run_replicas(_job, 3, 7, faults=[Fault(2, 3)], timeout_s=60, print_output=False)
    res = run.results
    assert sorted(res) == [0, 1] and run.incarnations == {0: 1, 1: 1, 2: 1}
    assert (2, "killed") in [(r, kind) for _, r, kind in run.events]
    assert res[0]["step"] == res[1]["step"] == 7 and res[0]["hash"] == res[1]["hash"]
    hist = res[0]["history"]
    assert [rec.quorum.members for rec in hist if rec.committed] == [(0, 1, 2)] * 3 + [(0, 1)] * 4
    assert _close(res[0]["params"], _replay(hist, 3))


def test_a_replica_late_for_the_quorum_joins_the_next_one_and_heals():
    run = run_replicas(_job, 3, 4, until_full=True, late=(2, 1.5), join_timeout_s=0.5, timeout_s=60,
                       print_output=False)
    res = run.results
    assert run.incarnations == {0: 1, 1: 1, 2: 1}
    assert res[0]["history"][0].quorum.members == (0, 1)  # formed without it after join_timeout_s
    first = res[2]["history"][0]
    assert first.quorum.id > 0 and first.quorum.joining == (2,) and first.healed_from == 0 and first.committed
    assert len({r["hash"] for r in res.values()}) == 1
    assert _close(res[0]["params"], _replay(res[0]["history"], 3))


@pytest.mark.parametrize("kwargs, word", [
    (dict(replicas=0), "replicas"),
    (dict(replicas=3, faults=[Fault(3, 1)]), "Fault.replica"),
    (dict(replicas=3, faults=[Fault(0, -1)]), "Fault.step"),
    (dict(replicas=3, faults=[Fault(0, 2, rejoin_step=2)]), "Fault.rejoin_step"),
    (dict(replicas=2, faults=[Fault(0, 1), Fault(1, 2)]), "all 2 replicas"),
    (dict(replicas=2, faults=[Fault(0, 1), Fault(0, 2)]), "two faults"),
    (dict(replicas=2, timeout_s=0), "timeout_s"),
])
def test_bad_arguments_are_named(kwargs, word):
    replicas = kwargs.pop("replicas")
    with pytest.raises(ValueError, match=word):
        run_replicas(_job, replicas, 3, **kwargs)


def test_min_replicas_above_replicas_is_refused():
    ctx = ReplicaContext(0, 2, 0, store=None, fault=None, op_timeout_s=1.0)
    model, opt = _model_and_opt()
    with pytest.raises(ValueError, match="min_replicas must be an int in 1..2"):
        FaultTolerantDP(ctx, model, opt, min_replicas=3)


def _raises_on_one(ctx):
    if ctx.replica == 1:
        raise KeyError("no such shard")
    return ctx.replica


def _exits_on_one(ctx):
    if ctx.replica == 1:
        os._exit(3)
    return ctx.replica


def _hangs_on_one(ctx):
    if ctx.replica == 1:
        time.sleep(3600)
    return ctx.replica


def test_a_replica_that_raises_or_exits_is_named():
    with pytest.raises(ReplicaError, match="replica 1 of 2 .* KeyError: 'no such shard'") as e:
        run_replicas(_raises_on_one, 2, timeout_s=30, print_output=False)
    assert e.value.replica == 1 and "_raises_on_one" in e.value.remote_traceback
    with pytest.raises(ReplicaError, match="replica 1 of 2 .*exit code 3"):
        run_replicas(_exits_on_one, 2, timeout_s=30, print_output=False)


def test_a_replica_that_hangs_meets_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(ReplicaTimeout, match=r"replicas \[1\] were still running \(finished: \[0\]\)"):
        run_replicas(_hangs_on_one, 2, timeout_s=3, print_output=False)
    assert time.monotonic() - t0 < 15


def test_too_few_replicas_for_a_quorum_times_out_with_a_named_error():
    def job(ctx):
        model, opt = _model_and_opt()
        ft = FaultTolerantDP(ctx, model, opt, min_replicas=2, join_timeout_s=0.5, quorum_timeout_s=2.0)
        while ft.step < 4:
            ft.start_step()
            opt.zero_grad()
            F.cross_entropy(model(DATA.x_train[:8]), DATA.y_train[:8]).backward()
            ctx.maybe_fail(ft.step)
            ft.average_gradients()
            if ft.should_commit():
                opt.step()
    with pytest.raises(ReplicaError, match="TimeoutError: replica 0: no quorum of at least min_replicas=2"):
        run_replicas(job, 2, faults=[Fault(1, 1)], timeout_s=30, print_output=False)


def _stalled_job(ctx, steps, stall_s, when):
    """2 replicas, join_timeout_s 0.2 s. when="in_round": replica 1 comes late to step 1 and replica 0,
    alone, holds that round open for ``stall_s``; when="between": the first process of a replica spends
    ``stall_s`` between its steps (an evaluation, a log), longer than join_timeout_s."""
    model, opt = _model_and_opt()
    ft = FaultTolerantDP(ctx, model, opt, join_timeout_s=0.2, op_timeout_s=5.0, quorum_timeout_s=20.0)
    q = None
    while ft.step < steps or len(q.members) < ctx.replicas:  # bounded by timeout_s
        if when == "in_round" and ctx.replica == 1 and len(ft.history) == 1:
            while not ctx.store.check([_DECISION.format(round=1)]):  # come after round 1 formed without it
                time.sleep(0.01)
        q = ft.start_step()
        x, y = _batch(ctx.replica, ctx.replicas, ft.step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if when == "in_round" and q.members == (0,):
            time.sleep(stall_s)
        ctx.maybe_fail(ft.step)
        ft.average_gradients()
        if ft.should_commit():
            opt.step()
        if when == "between" and ctx.incarnation == 0:
            time.sleep(stall_s)
    return {"hash": _state_hash(model, opt), "history": ft.history}


def test_no_round_is_decided_while_the_previous_one_is_in_flight():
    # Replica 1, left out of round 1, must not form round 2 on its own while replica 0 still computes round 1:
    # two quorums at once would commit two different step-1 updates and the replicas would silently diverge.
    run = run_replicas(_stalled_job, 2, 3, 1.0, "in_round", timeout_s=60, print_output=False)
    res = run.results
    assert res[0]["history"][1].quorum.members == (0,)  # the setup happened: replica 1 was left out
    for r in (0, 1):
        steps = [rec.quorum.step for rec in res[r]["history"] if rec.committed]
        assert steps == sorted(set(steps)), steps
    assert res[0]["hash"] == res[1]["hash"]
    assert any(rec.healed_from == 0 for rec in res[1]["history"])


def test_a_replacement_waits_for_survivors_slower_than_join_timeout():
    # The survivor spends 0.6 s between steps; the replacement must wait for it (the only holder of the state),
    # not form a quorum of its own after join_timeout_s and fail for want of anyone to heal from.
    run = run_replicas(_stalled_job, 2, 4, 0.6, "between", faults=[Fault(1, 1, rejoin_step=2)], timeout_s=60,
                       print_output=False)
    res = run.results
    assert run.incarnations == {0: 1, 1: 2}
    assert res[1]["history"][0].healed_from == 0 and res[0]["hash"] == res[1]["hash"]


class _NormNet(torch.nn.Module):
    def __init__(self, hidden=HIDDEN, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(hidden, 10)).to(dtype)

    def forward(self, x):
        return self.body(x.to(self.body[0].weight.dtype)).float()


def _full_hash(model, opt):
    h = hashlib.sha256()
    for k, v in model.state_dict().items():  # parameters and buffers (BatchNorm's running statistics)
        h.update(k.encode() + v.numpy().tobytes())
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            h.update(f"{i}{k}".encode() + torch.as_tensor(v).numpy().tobytes())
    return h.hexdigest()


def _norm_job(ctx, steps, misuse=None):
    hidden = HIDDEN + 1 if misuse == "shape" and ctx.replica == 1 else HIDDEN
    dtype = torch.float64 if misuse == "dtype" and ctx.replica == 1 else torch.float32
    model = _NormNet(hidden, dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ft = FaultTolerantDP(ctx, model, opt, op_timeout_s=5.0, quorum_timeout_s=20.0)
    q = None
    while ft.step < steps or len(q.members) < ctx.replicas:  # bounded by timeout_s
        q = ft.start_step()
        if misuse == "twice" and ctx.replica == 0:
            ft.start_step()
        x, y = _batch(ctx.replica, ctx.replicas, ft.step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        ctx.maybe_fail(ft.step)
        ft.average_gradients()
        if ft.should_commit():
            opt.step()
    return _full_hash(model, opt)


def test_buffers_and_adam_state_end_bit_identical_after_a_heal():
    run = run_replicas(_norm_job, 3, 4, faults=[Fault(2, 1, rejoin_step=2)], timeout_s=60, print_output=False)
    assert run.incarnations == {0: 1, 1: 1, 2: 2} and len(set(run.results.values())) == 1


@pytest.mark.parametrize("misuse, match", [
    ("shape", r"replica 1 has 2551 gradient elements \(float32\).*replicas \[0\] have 2474"),
    ("dtype", r"replica 1 has 2474 gradient elements \(float64\).*replicas \[0\] have 2474 gradient el"),
    ("twice", r"replica 0: start_step\(\) twice in one step"),
])
def test_misuse_fails_fast_with_a_named_error(misuse, match):
    # Before: a shape mismatch averaged garbage and then hung, a dtype mismatch crashed gloo (SIGABRT), and a
    # second start_step hung the peer until the deadline.
    t0 = time.monotonic()
    with pytest.raises(ReplicaError, match=match):
        run_replicas(_norm_job, 2, 3, misuse, timeout_s=30, print_output=False)
    assert time.monotonic() - t0 < 15
