"""Lost work, measured: one replica of a data-parallel job SIGKILLed at step k, recovered by a checkpoint restart
under torchrun or by per-step fault tolerance (``python -m commlab experiments lost-work``).

The job: :class:`commlab.train.model.DigitsMLP` on the digits, N replicas, the gradient summed by the course's
ring AllReduce. (a) uninterrupted; (b) torchrun ``--max-restarts 1``, a checkpoint (``torch.save``) every C steps,
the whole job restarted from the last one (:func:`run_restart`); (c) :func:`commlab.launch.run_replicas` and
:class:`commlab.sync.FaultTolerantDP`, the replica back at step k + j (:func:`run_ft`). Every replica logs each step
it computes and commits; from the logs: wall seconds, replica-steps computed, lost (discarded + not done),
committed steps, final loss and accuracy, beside :mod:`commlab.sync.recovery_cost`'s prediction.
:func:`measure` runs them, :func:`save`/:func:`load` keep ``experiments/lost_work.json``, :func:`format_table`
prints it and :func:`commlab.viz.fault.plot_lost_work` draws it (:func:`plot`).

Book: chapter "When it goes wrong" (book/ch13b_when_it_goes_wrong), section "Survive a failure".
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time
from typing import Sequence

from commlab import checks

__all__ = ["DEFAULT_INTERVALS", "MONITOR_INTERVAL_S", "JobConfig", "run_restart", "run_ft", "ft_replica",
           "state_nbytes", "measure", "break_even", "failure_seconds", "save", "load", "format_table", "plot"]

#: Checkpoint intervals C (steps) of the restart runs; with the default failure step 37: 2, 7, 17 and 37 steps
#: since the last checkpoint (C = 40: none written before the failure, the job starts over).
DEFAULT_INTERVALS = (5, 10, 20, 40)

#: torchrun's ``--monitor-interval`` default (torch 2.13): how often its agent looks for a failed worker, seconds.
MONITOR_INTERVAL_S = 0.1

_NAME = "experiments/lost_work.json"


class JobConfig(dict):
    """The job's settings (a dict, stored as is): replicas, steps, hidden width, batch per replica, lr, seed."""

    def __init__(self, replicas: int = 4, steps: int = 80, hidden: int = 512, batch: int = 128, lr: float = 0.05,
                 seed: int = 0):
        where = "JobConfig"
        super().__init__(replicas=checks.integer("replicas", replicas, least=2, where=where),
                         steps=checks.integer("steps", steps, least=2, where=where),
                         hidden=checks.integer("hidden", hidden, where=where),
                         batch=checks.integer("batch", batch, where=where),
                         lr=checks.number("lr", lr, above=0.0, where=where),
                         seed=checks.integer("seed", seed, least=0, where=where))


# ------------------------------------------------------------------------------------------ inside a replica

class _Log:
    """One process's event log: a JSON line per event, flushed at once (a SIGKILL loses nothing written)."""

    def __init__(self, folder: str, replica: int, incarnation: int):
        self.f = open(os.path.join(folder, f"log.r{replica}.i{incarnation}.jsonl"), "a", encoding="utf-8")

    def __call__(self, ev: str, **kw) -> None:
        self.f.write(json.dumps(dict(ev=ev, t=time.time(), **kw)) + "\n")
        self.f.flush()


def _process_start() -> float | None:
    """When this process was created (``time.time()`` seconds, to 10 ms), from /proc; None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _setup(cfg: dict, replica: int, d=None):
    """Model, optimizer, this replica's batch for a step, and the evaluation (``d``: the digits, else loaded)."""
    import torch

    from commlab.train.data import load_digits_split, shard
    from commlab.train.model import DigitsMLP

    torch.manual_seed(cfg["seed"])
    d = d if d is not None else load_digits_split(seed=cfg["seed"])
    x, y = shard(d.x_train, replica, cfg["replicas"]), shard(d.y_train, replica, cfg["replicas"])
    model = DigitsMLP(hidden=cfg["hidden"], seed=cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)

    def batch(step: int):   # the same batch for a (replica, step) in every run and attempt
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + replica * 10_007 + step)
        idx = torch.randint(len(y), (cfg["batch"],), generator=g)
        return x[idx], y[idx]

    def evaluate() -> dict:
        with torch.no_grad():
            logits = model(d.x_test)
            return dict(loss=torch.nn.functional.cross_entropy(logits, d.y_test).item(),
                        accuracy=(logits.argmax(1) == d.y_test).float().mean().item())
    return model, opt, batch, evaluate


def _restart_worker(argv: Sequence[str]) -> None:
    """One rank of a checkpoint-restart job under torchrun (``--restart-worker``)."""
    import torch
    import torch.distributed as dist

    from commlab.collectives import ring_all_reduce
    from commlab.launch import init_from_env
    from commlab.train.model import flat_grad, set_flat_grad

    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--interval", type=int, default=0)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-replica", type=int, default=1)
    a = p.parse_args(argv)
    cfg = json.loads(a.config)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ctx = init_from_env("gloo", timeout=60)
    rank, n = ctx.rank, ctx.world_size
    log = _Log(a.dir, rank, attempt)
    model, opt, batch, evaluate = _setup(cfg, rank)
    ckpt = os.path.join(a.dir, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt):
        t0 = time.perf_counter()
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        log("load", step=start, s=time.perf_counter() - t0)
    dist.barrier()
    log("ready", step=start, process_start=_process_start())
    for step in range(start, cfg["steps"]):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        log("backward", step=step)
        if attempt == 0 and rank == a.fail_replica and step == a.fail_step:
            log("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        g = ring_all_reduce(flat_grad(model), check=False)
        set_flat_grad(model, g / n)
        opt.step()
        log("commit", step=step, members=n)
        if a.interval and (step + 1) % a.interval == 0:
            if rank == 0:   # replicas are identical: one writes, atomically
                t0 = time.perf_counter()
                torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step + 1), ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
                log("save", step=step + 1, s=time.perf_counter() - t0)
            dist.barrier()   # no rank goes on before the checkpoint exists
    log("done", **evaluate())
    dist.destroy_process_group()


def ft_replica(ctx, cfg: dict, folder: str, digits) -> dict:
    """One replica of the fault-tolerant job, run by :func:`commlab.launch.run_replicas` (also lab 13b's): ``cfg``
    a :class:`JobConfig` as a dict plus optional ``fail_replica``/``fail_step``, ``folder`` where it logs, ``digits``
    the data loaded in the parent. Returns its rounds, incarnation and final evaluation, or ``{"late": True}``."""
    import torch

    from commlab.launch.replicas import PROGRESS_KEY
    from commlab.sync import FaultTolerantDP

    keys = [PROGRESS_KEY.format(replica=r) for r in range(ctx.replicas)]

    def ended() -> bool:   # a survivor has committed every step: the job is over
        return any(ctx.store.check([k]) and int(ctx.store.get(k)) >= cfg["steps"] for k in keys)

    if ctx.incarnation > 0 and ended():
        return dict(late=True)   # a replacement that came after the job ended: nothing to join
    log = _Log(folder, ctx.replica, ctx.incarnation)
    model, opt, batch, evaluate = _setup(cfg, ctx.replica, digits)
    ft = FaultTolerantDP(ctx, model, opt)
    log("ready", step=ft.step)
    while ft.step < cfg["steps"]:
        try:
            quorum = ft.start_step()
        except RuntimeError:
            if ctx.incarnation > 0 and ft.step == 0 and ended():
                return dict(late=True)   # the survivors finished while it joined
            raise
        step = ft.step
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        log("backward", step=step)
        if (ctx.incarnation, ctx.replica, step) == (0, cfg.get("fail_replica"), cfg.get("fail_step")):
            log("kill", step=step)
        ctx.maybe_fail(step)
        ft.average_gradients()
        if ft.should_commit():
            opt.step()
            log("commit", step=step, members=len(quorum.members))
        else:
            log("abort", step=step, members=len(quorum.members))
    final = evaluate()
    log("done", **final)
    rounds = [dict(members=list(r.quorum.members), step=r.quorum.step, committed=r.committed,
                   regrouped=r.reinitialised, healed_from=r.healed_from, seconds=dict(r.seconds)) for r in ft.history]
    return dict(rounds=rounds, incarnation=ctx.incarnation, **final)


# ------------------------------------------------------------------------------------------ reading the logs

def _read_logs(folder: str | pathlib.Path) -> list[dict]:
    """Every event of every process's log in ``folder``, each with its ``replica`` and ``incarnation``."""
    out = []
    for f in sorted(pathlib.Path(folder).glob("log.r*.i*.jsonl")):
        replica, inc = (int(s[1:]) for s in f.name.split(".")[1:3])
        for line in f.read_text().splitlines():
            if line.strip():
                out.append(dict(json.loads(line), replica=replica, incarnation=inc))
    return out


def _summarise(events: list[dict], cfg: dict, launched: float, wall_s: float, *, restart: bool) -> dict:
    """Counts and times of one run from its replicas' logs."""
    n, steps = cfg["replicas"], cfg["steps"]
    computed = sum(e["ev"] == "backward" for e in events)
    commits = [e for e in events if e["ev"] == "commit"]
    committed_steps = len({e["step"] for e in commits})
    # Useful work: the contributions in the final model's lineage. Under a restart the last attempt's commits and
    # those of earlier attempts before its starting checkpoint; under fault tolerance every commit.
    last = max(e["incarnation"] for e in events)
    resumed = min((e["step"] for e in events if e["ev"] == "ready" and e["incarnation"] == last), default=0)
    if restart:
        useful = sum(1 for e in commits if e["incarnation"] == last or e["step"] < resumed)
    else:
        useful = len(commits)
    done = [e for e in events if e["ev"] == "done"]
    commit_t = sorted(e["t"] for e in commits if e["replica"] == 0)
    gaps = [b - a for a, b in zip(commit_t, commit_t[1:])]
    kills = [e["t"] for e in events if e["ev"] == "kill"]
    ready = [e for e in events if e["ev"] == "ready"]
    first_ready = max(e["t"] for e in ready if e["incarnation"] == 0)
    spawned = [e["t"] - e["process_start"] for e in ready if e["incarnation"] == 0 and e.get("process_start")]
    out = dict(wall_s=wall_s, startup_s=first_ready - launched, worker_startup_s=max(spawned, default=None),
               computed_replica_steps=computed,
               useful_replica_steps=useful, discarded_replica_steps=computed - useful,
               not_done_replica_steps=n * steps - useful, lost_replica_steps=computed + n * steps - 2 * useful,
               committed_steps=committed_steps, step_s=statistics.median(gaps) if gaps else 0.0,
               loss=done[0]["loss"] if done else None, accuracy=done[0]["accuracy"] if done else None,
               losses_equal=len({d["loss"] for d in done}) <= 1)
    saves = [e["s"] for e in events if e["ev"] == "save"]
    loads = [e["s"] for e in events if e["ev"] == "load"]
    out.update(checkpoints=len(saves), checkpoint_s=statistics.median(saves) if saves else 0.0,
               load_s=statistics.median(loads) if loads else 0.0)
    if kills:
        back = [e["t"] for e in ready if e["incarnation"] > 0]
        out["recovery_s"] = max(back) - min(kills) if back else None   # the kill to the new attempt's ready
    return out


# ------------------------------------------------------------------------------------------------ the runs

def run_restart(cfg: JobConfig, *, interval_steps: int | None = None, fail_step: int | None = None,
                fail_replica: int = 1, timeout_s: float = 180.0) -> dict:
    """One torchrun job of ``cfg`` (a checkpoint every ``interval_steps`` steps; None: none), with replica
    ``fail_replica`` SIGKILLed after its backward of step ``fail_step`` in the first attempt (None: no failure;
    torchrun then has no restart to give).

    Returns:
        :func:`_summarise`'s dict (wall seconds, replica-steps computed, useful, discarded, not done and lost,
        committed steps, median step seconds, final loss and accuracy, checkpoint and load seconds).

    Raises:
        ValueError: a bad argument (named). RuntimeError: the job failed (torchrun's stderr).
    """
    from commlab.launch.torchrun import run_standalone

    where = "run_restart"
    if interval_steps is not None:
        checks.integer("interval_steps", interval_steps, least=1, where=where)
    if fail_step is not None:
        checks.integer("fail_step", fail_step, least=0, most=cfg["steps"] - 1, where=where)
    checks.integer("fail_replica", fail_replica, least=0, most=cfg["replicas"] - 1, where=where)
    with tempfile.TemporaryDirectory(prefix="commlab-lost-") as folder:
        job = ["-m", "commlab.experiments.lost_work", "--restart-worker", "--dir", folder,
               "--config", json.dumps(dict(cfg)), "--interval", str(interval_steps or 0),
               "--fail-step", str(-1 if fail_step is None else fail_step), "--fail-replica", str(fail_replica)]
        launched = time.time()
        res = run_standalone(job, cfg["replicas"], timeout_s=timeout_s,
                             torchrun_args=["--max-restarts", "1" if fail_step is not None else "0"])
        res.check()
        return _summarise(_read_logs(folder), cfg, launched, res.seconds, restart=True)


def run_ft(cfg: JobConfig, *, fail_step: int | None = None, rejoin_step: int | None = None, fail_replica: int = 1,
           timeout_s: float = 180.0) -> dict:
    """One fault-tolerant run of ``cfg`` (:func:`commlab.launch.run_replicas`, :class:`commlab.sync.FaultTolerantDP`),
    replica ``fail_replica`` SIGKILLed after its backward of step ``fail_step`` and a fresh one started once the
    survivors have committed ``rejoin_step`` (None: no failure).

    Returns:
        as :func:`run_restart`, plus ``missed_steps`` (committed steps the failed replica was not a member of),
        ``phases_s`` (replica 0's median seconds per phase of the protocol over its ordinary steps),
        ``first_group_s`` (building the first group) and ``changes`` (the rounds that aborted, regrouped or healed).

    Raises:
        ValueError: a bad argument (named). RuntimeError: a replica failed other than by the fault.
    """
    from commlab.launch import Fault, run_replicas
    from commlab.train.data import load_digits_split

    where = "run_ft"
    faults = ()
    if fail_step is not None:
        checks.integer("fail_step", fail_step, least=0, most=cfg["steps"] - 1, where=where)
        checks.integer("fail_replica", fail_replica, least=0, most=cfg["replicas"] - 1, where=where)
        if rejoin_step is not None:
            checks.integer("rejoin_step", rejoin_step, least=fail_step, most=cfg["steps"] - 1, where=where)
        faults = (Fault(fail_replica, fail_step, rejoin_step),)
    digits = load_digits_split(seed=cfg["seed"])   # once, here: a replacement forks without loading it
    with tempfile.TemporaryDirectory(prefix="commlab-lost-") as folder:
        job = dict(cfg, fail_step=fail_step, fail_replica=fail_replica)
        launched = time.time()
        run = run_replicas(ft_replica, cfg["replicas"], job, folder, digits, faults=faults, timeout_s=timeout_s,
                           print_output=False)
        wall_s = time.time() - launched
        events = _read_logs(folder)
    out = _summarise(events, cfg, launched, wall_s, restart=False)
    member = {e["step"] for e in events if e["ev"] == "commit" and e["replica"] == fail_replica}
    out["missed_steps"] = cfg["steps"] - len(member)
    rounds = run.results[0]["rounds"]
    steady = [r for r in rounds[1:] if r["committed"] and not r["regrouped"]]
    out["phases_s"] = {k: statistics.median(r["seconds"].get(k, 0.0) for r in steady)
                       for k in ("quorum", "group", "allreduce", "commit")} if steady else {}
    out["first_group_s"] = rounds[0]["seconds"].get("group", 0.0)
    # The rounds where something happened: an abort, a new group, a heal.
    out["changes"] = [dict(round=i, members=r["members"], step=r["step"], committed=r["committed"],
                           healed_from=r["healed_from"], seconds={k: round(v, 6) for k, v in r["seconds"].items()})
                      for i, r in enumerate(rounds) if i and (not r["committed"] or r["regrouped"] or
                                                              r["healed_from"] is not None or "heal" in r["seconds"])]
    return out


def state_nbytes(cfg: JobConfig) -> int:
    """Bytes of the state a joining replica copies: the model and the SGD momentum, as ``torch.save`` writes them
    (what :class:`commlab.sync.FaultTolerantDP` sends)."""
    import io

    import torch

    from commlab.train.model import DigitsMLP

    model = DigitsMLP(hidden=cfg["hidden"], seed=cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()   # the momentum buffers exist after a step
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 0}, buf)
    return len(buf.getvalue())


# ----------------------------------------------------------------------------------------- the experiment

def _beta_s_per_byte(cfg: dict, ft_base: dict) -> float:
    """β of the replicas' links from the uninterrupted FT run's ring AllReduce of the gradient (α neglected):
    ``allreduce_s / (2 (N-1)/N · gradient bytes)``."""
    from commlab.collectives import ring_bytes_sent_per_rank

    from commlab.train.model import DigitsMLP

    n = cfg["replicas"]
    grad = 4 * sum(p.numel() for p in DigitsMLP(hidden=cfg["hidden"]).parameters())
    return ft_base["phases_s"]["allreduce"] / ring_bytes_sent_per_rank(grad, n, "all_reduce")


def _predict(cfg: dict, base: dict, run: dict, *, kind: str, interval_steps=None, fail_step=None) -> dict:
    """The model's lost replica-steps and wall seconds for ``run``: the run's own start-up (launch to the first
    step: noisy on a shared machine, and no part of the failure), the uninterrupted ``base`` run's set-up and end
    (:func:`_fixed_s`), plus :mod:`commlab.sync.recovery_cost`'s job seconds at the run's own median step.
    Restart: ``R`` = one more worker start-up (process creation to ready, slowest rank, as the run's first attempt
    took it) + torchrun's monitor interval + the measured load; δ measured in the run. FT: ``j`` is the run's
    measured missed steps (the replica's downtime, an input); heal = β · state bytes (β from the base AllReduce),
    two group rebuilds priced as the base run's first."""
    from commlab.sync import recovery_cost as rc

    n, s, t = cfg["replicas"], cfg["steps"], run["step_s"]
    before = run["startup_s"] + _fixed_s(base, s)   # + the run's S steps, in the terms below
    if kind == "restart":
        # torchrun's agent stays up: a relaunch repeats the workers' start-up (not its own), then loads.
        restart_s = run["worker_startup_s"] + MONITOR_INTERVAL_S + run["load_s"]
        job_s = rc.restart_job_seconds(s, t, interval_steps=interval_steps, checkpoint_s=run["checkpoint_s"],
                                       fail_step=fail_step, restart_s=restart_s)
        return dict(lost_replica_steps=rc.restart_lost_replica_steps(fail_step, interval_steps, n),
                    wall_s=before + job_s, restart_s=restart_s)
    beta = _beta_s_per_byte(cfg, base)
    heal_s = rc.heal_seconds(state_nbytes(cfg), 0.0, beta)
    regroup_s = 2 * base["first_group_s"]
    job_s = rc.ft_job_seconds(s, t, failures=1, heal_s=heal_s, reconfigure_s=regroup_s)
    return dict(lost_replica_steps=rc.ft_lost_replica_steps(run["missed_steps"], n), wall_s=before + job_s,
                heal_s=heal_s, regroup_s=regroup_s, beta_s_per_byte=beta)


def measure(cfg: JobConfig | None = None, *, intervals: Sequence[int] = DEFAULT_INTERVALS, fail_step: int = 37,
            missed_steps: int = 10, fail_replica: int = 1, ft: bool = True, progress: bool = True) -> dict:
    """Every run: uninterrupted under torchrun, restarts for each C in ``intervals``, then (``ft``) uninterrupted
    and failed fault-tolerant runs (back at ``fail_step + missed_steps``).

    Returns:
        A JSON-serialisable dict: ``settings`` (the job, the failure, the intervals, cores, date, command) and
        ``runs``, each with ``kind`` (``"uninterrupted"``, ``"restart"``, ``"ft"``, ``"ft uninterrupted"``), its
        measured fields and ``predicted`` (:func:`_predict`).

    Raises:
        ValueError: a bad argument (named).
    """
    from tqdm.auto import tqdm

    cfg = cfg or JobConfig()
    where = "measure"
    checks.integer("fail_step", fail_step, least=0, most=cfg["steps"] - 1, where=where)
    checks.integer("missed_steps", missed_steps, least=0, most=cfg["steps"] - 1 - fail_step, where=where)
    cs = [checks.integer("intervals", c, least=1, where=where) for c in intervals]
    jobs = [("uninterrupted", None)] + [("restart", c) for c in cs] + \
        ([("ft uninterrupted", None), ("ft", None)] if ft else [])
    runs, base, ft_base = [], None, None
    bar = tqdm(jobs, desc="lost-work", unit="run", disable=not progress)
    for kind, c in bar:
        bar.set_postfix_str(kind if c is None else f"restart C={c}")
        if kind == "uninterrupted":
            r = base = run_restart(cfg)
        elif kind == "restart":
            r = run_restart(cfg, interval_steps=c, fail_step=fail_step, fail_replica=fail_replica)
            r["predicted"] = _predict(cfg, base, r, kind="restart", interval_steps=c, fail_step=fail_step)
        elif kind == "ft uninterrupted":
            r = ft_base = run_ft(cfg)
        else:
            r = run_ft(cfg, fail_step=fail_step, rejoin_step=fail_step + missed_steps, fail_replica=fail_replica)
            r["predicted"] = _predict(cfg, ft_base, r, kind="ft")
        runs.append(dict(kind=kind, interval_steps=c, **r))
    settings = dict(job=dict(cfg), fail_step=fail_step, fail_replica=fail_replica, missed_steps=missed_steps,
                    rejoin_step=fail_step + missed_steps, intervals=cs, usable_cores=len(os.sched_getaffinity(0)),
                    load_1min=os.getloadavg()[0], date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    command="python -m commlab experiments lost-work")
    return dict(settings=settings, runs=runs)


def break_even(result: dict) -> dict:
    """The rates model (:func:`commlab.sync.recovery_cost.break_even_failure_rate`) priced with the recording's
    measured terms: t (the plain DP step), q (the FT step's quorum and commit phases: an upper bound on its
    per-step overhead, as part of them is waiting for the slowest replica, which a plain step does inside its
    AllReduce), δ (a checkpoint), R (the kill to the restarted job's first step, median over the restart runs) and
    the FT run's cost per failure c (the aborted step, its regroups and heal, and the failed replica's downtime
    over N).

    Returns:
        A dict of those terms (seconds), ``failures_per_s`` and ``verdict`` (with q), ``step_overhead_s`` (the FT
        step less the plain one, the overhead as the job saw it, at least 0) and ``failures_per_s_at_step_overhead``
        and ``verdict_at_step_overhead`` (with q = that).

    Raises:
        ValueError: a recording without restart or FT runs.
    """
    from commlab.sync import recovery_cost as rc

    runs = result["runs"]
    base = next((r for r in runs if r["kind"] == "uninterrupted"), None)
    restarts = [r for r in runs if r["kind"] == "restart"]
    ft = next((r for r in runs if r["kind"] == "ft"), None)
    ft_base = next((r for r in runs if r["kind"] == "ft uninterrupted"), None)
    if not (base and restarts and ft and ft_base):
        checks.fail("result", sorted({r["kind"] for r in runs}), "a recording with uninterrupted, restart and ft runs",
                    where="break_even")
    n, t = result["settings"]["job"]["replicas"], base["step_s"]
    q = ft_base["phases_s"]["quorum"] + ft_base["phases_s"]["commit"]
    delta = statistics.median(r["checkpoint_s"] for r in restarts)
    restart_s = statistics.median(r["recovery_s"] for r in restarts)
    heal = sum(c["seconds"].get("heal", 0.0) for c in ft["changes"])
    regroup = sum(c["seconds"].get("group", 0.0) for c in ft["changes"])
    c = rc.ft_failure_seconds(t, n, heal_s=heal, reconfigure_s=regroup, out_s=ft["missed_steps"] * t)
    be = rc.break_even_failure_rate(t, checkpoint_s=delta, restart_s=restart_s, quorum_s=q, ft_failure_s=c)
    seen = max(0.0, ft_base["step_s"] - t)
    be2 = rc.break_even_failure_rate(t, checkpoint_s=delta, restart_s=restart_s, quorum_s=seen, ft_failure_s=c)
    return dict(step_s=t, quorum_s=q, checkpoint_s=delta, restart_s=restart_s, ft_failure_s=c, replicas=n,
                failures_per_s=list(be.failures_per_s), verdict=be.verdict, step_overhead_s=seen,
                failures_per_s_at_step_overhead=list(be2.failures_per_s), verdict_at_step_overhead=be2.verdict)


def save(result: dict, path: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write :func:`measure`'s result as JSON (default: ``experiments/lost_work.json`` of a checkout's package
    data, :func:`commlab.data.record_path`).

    Raises:
        ValueError: no ``path`` and commlab installed from a wheel; a non-finite number in ``result``.
    """
    from commlab.experiments.slow_link import write_result

    return write_result(result, path, _NAME)


def load(path: str | pathlib.Path | None = None) -> dict:
    """Read a result written by :func:`save`.

    Raises:
        FileNotFoundError: with the command that records it.
    """
    from commlab.experiments.slow_link import read_result

    return read_result(path, _NAME, "lost-work")


def _label(run: dict) -> str:
    return f"restart C={run['interval_steps']}" if run["kind"] == "restart" else run["kind"]


def _fixed_s(run: dict, steps: int) -> float:
    """A run's seconds after its start-up that are not its steps (``S`` median steps): the job's set-up and end."""
    return run["wall_s"] - run["startup_s"] - steps * run["step_s"]


def failure_seconds(result: dict, run: dict) -> tuple[float, float | None]:
    """What the failure cost ``run`` in wall seconds, measured and modelled: its seconds after its start-up that
    are not its ``S`` (median) steps, less the same of the uninterrupted run of its launcher (torchrun for a
    restart, :func:`commlab.launch.run_replicas` for FT). Each run is priced at its own step, so a machine whose
    load drifts between runs does not pass for a failure's cost. The model's is None for an uninterrupted run."""
    kind = "ft uninterrupted" if run["kind"].startswith("ft") else "uninterrupted"
    base = next(r for r in result["runs"] if r["kind"] == kind)
    steps = result["settings"]["job"]["steps"]
    measured = _fixed_s(run, steps) - _fixed_s(base, steps)
    p = run.get("predicted")
    return measured, (p["wall_s"] - run["startup_s"] - steps * run["step_s"] - _fixed_s(base, steps) if p else None)


def format_table(result: dict) -> str:
    """Per run: replica-steps computed and lost (measured beside the model), committed steps, wall seconds (and the
    model's relative error) and the failure's share of them (:func:`failure_seconds`; the model less the measured,
    in seconds), the median step, the final test loss and accuracy; then :func:`break_even`."""
    s, job = result["settings"], result["settings"]["job"]
    lines = [f"{job['replicas']} replicas x {job['steps']} steps (DigitsMLP {job['hidden']} wide, batch "
             f"{job['batch']} per replica); replica {s['fail_replica']} SIGKILLed in step {s['fail_step']}, "
             f"FT: back at step {s['rejoin_step']}; {s['usable_cores']} cores, load {s['load_1min']:.1f}, "
             f"recorded {s['date']}",
             f"{'':18s} {'replica-steps':>20s}  {'':7s} {'wall s':>20s} {'failure s':>20s}",
             f"{'run':18s} {'computed':>8s} {'lost':>5s} {'model':>5s} {'commits':>7s} {'meas':>6s} {'model':>6s} "
             f"{'error':>6s} {'meas':>6s} {'model':>6s} {'diff':>6s} {'step ms':>7s} {'loss':>7s} {'acc':>6s}"]
    pct = lambda m, x: f"{100 * (m - x) / x:+5.0f}%" if x else "     -"  # noqa: E731
    for r in result["runs"]:
        p = r.get("predicted")
        fm, fp = failure_seconds(result, r)
        lost_m = f"{p['lost_replica_steps']:5d}" if p else "    -"
        wall_m = f"{p['wall_s']:6.1f} {pct(p['wall_s'], r['wall_s'])}" if p else "     -      -"
        fail_m = f"{fp:6.2f} {fp - fm:+6.2f}" if p else "     -      -"
        lines.append(f"{_label(r):18s} {r['computed_replica_steps']:8d} {r['lost_replica_steps']:5d} {lost_m} "
                     f"{r['committed_steps']:7d} {r['wall_s']:6.1f} {wall_m} {fm:6.2f} {fail_m} "
                     f"{r['step_s'] * 1e3:7.1f} {r['loss']:7.4f} {r['accuracy']:6.3f}")
    try:
        be = break_even(result)
    except ValueError:
        return "\n".join(lines)
    rate = lambda xs: ", ".join(f"one failure per {1 / x:.3g} s" for x in xs)  # noqa: E731
    lines.append(f"rates model: t = {be['step_s'] * 1e3:.1f} ms, delta = {be['checkpoint_s'] * 1e3:.1f} ms, "
                 f"R = {be['restart_s']:.1f} s, FT per failure c = {be['ft_failure_s']:.2f} s; with q = the quorum "
                 f"and commit phases, {be['quorum_s'] * 1e3:.1f} ms/step: {be['verdict']} "
                 f"{rate(be['failures_per_s'])}; with q = the FT step less the plain one, "
                 f"{be['step_overhead_s'] * 1e3:.1f} ms: {be['verdict_at_step_overhead']} "
                 f"{rate(be['failures_per_s_at_step_overhead'])}")
    return "\n".join(lines)


def plot(result: dict):
    """:func:`commlab.viz.fault.plot_lost_work` of ``result``; returns the matplotlib figure."""
    from commlab.viz.fault import plot_lost_work

    return plot_lost_work(result)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--restart-worker"]:
        _restart_worker(sys.argv[2:])
    else:
        sys.exit("usage: python -m commlab experiments lost-work (this module's own entry is for torchrun's workers)")
