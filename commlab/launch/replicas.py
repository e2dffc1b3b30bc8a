"""Data-parallel replicas that can be killed and brought back: the processes under fault-tolerant training.

:func:`run_replicas` forks N replica processes that share one store, a :class:`~torch.distributed.TCPStore`
served by a helper process on a port the kernel picks: the "lighthouse" of torchft, with no service to
install. Each process runs ``fn(ctx, ...)`` with a :class:`ReplicaContext`; a :class:`Fault` SIGKILLs replica r
where its job calls ``ctx.maybe_fail(step)``, and a fresh process for it starts once a survivor has published
(``ctx.publish_step``) ``rejoin_step`` committed steps. The parent marks ended processes in the store
(:data:`GONE_KEY`) so that the survivors need not wait for them. Any other failure fails the run naming the
replica (:class:`ReplicaError`); the run has one deadline (:class:`ReplicaTimeout`) and every process is killed
on error or expiry. Output is printed by the parent, replica by replica. The per-step protocol on top is
:class:`commlab.sync.FaultTolerantDP`. Chapter "When it goes wrong", section "Survive a failure".
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import gc
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from commlab import checks
from commlab.launch.device import results_to_cpu
from commlab.launch.env import CHILD_MARKER, TIMEOUT_MARGIN_S
from commlab.launch.errors import LaunchTimeout, RankError, is_peer_fallout
from commlab.launch.local import (choose_start_method, die_with_parent, import_once_before_fork, kill_group,
                                  refuse_initialised_parent, refuse_nested)

__all__ = ["run_replicas", "Fault", "ReplicaRun", "ReplicaContext", "ReplicaError", "ReplicaTimeout",
           "PROGRESS_KEY", "GONE_KEY", "DEFAULT_REPLICA_TIMEOUT_S"]

#: Wall-clock limit (seconds) of a whole :func:`run_replicas` unless the caller passes ``timeout_s``.
DEFAULT_REPLICA_TIMEOUT_S = 120.0

#: Store keys, the one place they are spelled. PROGRESS_KEY: committed steps of a replica (its job writes it
#: through :meth:`ReplicaContext.publish_step`; the parent reads it to time a rejoin). GONE_KEY: set by the
#: parent once a replica's current process has ended (killed or done), deleted when a new one starts.
#: _FAULT_KEY: written by a replica just before it kills itself, so the parent knows the kill was planned.
PROGRESS_KEY = "commlab/replicas/progress/{replica}"
GONE_KEY = "commlab/replicas/gone/{replica}"
_FAULT_KEY = "commlab/replicas/fault/{replica}"

_POLL_S = 0.02
_GRACE_S = 0.3  # after a first failure, how long to listen for an earlier one (as launch() does)


@dataclasses.dataclass(frozen=True)
class Fault:
    """Kill ``replica`` (SIGKILL to its process group) where its job calls ``ctx.maybe_fail(step)``.

    ``rejoin_step``: a fresh process for the replica starts once a survivor has committed this many steps
    (must be > ``step``); None: it never comes back (the run scales down from N to N - 1). Only the first
    process of a replica is killed. torchft's tests inject faults the same way (``fail_at(rank, step)``).
    """

    replica: int
    step: int
    rejoin_step: int | None = None


@dataclasses.dataclass
class ReplicaRun:
    """What :func:`run_replicas` returns.

    results: replica -> the value its last process returned (a replica that never came back is absent);
    incarnations: replica -> how many processes ran it; events: ``(seconds since start, replica, kind)`` with
    kind ``"start"``, ``"killed"``, ``"rejoin"`` or ``"done"``, in time order; wall_s: seconds of the run.
    """

    results: dict[int, Any]
    incarnations: dict[int, int]
    events: list[tuple[float, int, str]]
    wall_s: float


class ReplicaContext:
    """What a replica's ``fn`` receives: who it is, the shared store, and the fault hook.

    Attributes: replica (0..replicas-1), replicas, incarnation (0: first process of this replica, 1: its first
    replacement, ...), store (a :class:`~torch.distributed.TCPStore` client of the parent's store), and
    op_timeout_s (seconds a store wait may last: the deadline of the run, at most).
    """

    def __init__(self, replica: int, replicas: int, incarnation: int, store, fault: Fault | None,
                 op_timeout_s: float):
        self.replica = replica
        self.replicas = replicas
        self.incarnation = incarnation
        self.store = store
        self.op_timeout_s = op_timeout_s
        self._fault = fault

    def maybe_fail(self, step: int) -> None:
        """SIGKILL this process (and anything it started) if a :class:`Fault` names this replica and ``step``.

        Only in the replica's first process; a real kill, so no Python code of it runs afterwards.
        """
        f = self._fault
        if f is not None and self.incarnation == 0 and step == f.step:
            self.store.set(_FAULT_KEY.format(replica=self.replica), str(step))
            sys.stdout.flush()
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def publish_step(self, step: int) -> None:
        """Tell the parent (and peers) that this replica has committed ``step`` steps."""
        self.store.set(PROGRESS_KEY.format(replica=self.replica), str(int(step)))

    def is_gone(self, replica: int) -> bool:
        """Whether the parent has seen ``replica``'s current process end (killed, failed or done)."""
        return self.store.check([GONE_KEY.format(replica=replica)])


class ReplicaError(RankError):
    """A replica raised or its process ended unexpectedly (not by a :class:`Fault`).

    Attributes: those of :class:`~commlab.launch.errors.RankError` (``rank`` is the replica), plus ``replica``
    and ``incarnation`` (which process of it failed).
    """

    def __init__(self, replica: int, replicas: int, incarnation: int, exc_type: str, exc_message: str,
                 remote_traceback: str, outputs=()):
        super().__init__(replica, replicas, exc_type, exc_message, remote_traceback, outputs)
        self.replica = replica
        self.incarnation = incarnation
        text = f"replica {replica} of {replicas} (process {incarnation}) failed with {exc_type}: {exc_message}"
        if remote_traceback:
            text += f"\n\n--- traceback in replica {replica} ---\n{remote_traceback.rstrip()}"
        self.args = (text,)


class ReplicaTimeout(LaunchTimeout):
    """:func:`run_replicas` outlived its ``timeout_s``; ``running`` names the replicas still running."""

    def __init__(self, replicas: int, timeout_s: float, running, finished, outputs=()):
        super().__init__(replicas, timeout_s, range(replicas), finished, outputs)
        self.running = sorted(running)
        self.args = (f"run_replicas timed out after {timeout_s:g} s: replicas {self.running} were still running "
                     f"(finished: {self.finished}). A replica stuck in a loop or a wait, or a quorum that never "
                     "forms, looks like this; pass a larger timeout_s if the work is simply long",)


# ----------------------------------------------------------------------------------------- parent side

@dataclasses.dataclass(frozen=True)
class _Config:
    replicas: int
    port: int
    out_dir: str
    threads: int
    op_timeout_s: float


def run_replicas(fn: Callable[..., Any], replicas: int, *args: Any, faults=(),
                 timeout_s: float = DEFAULT_REPLICA_TIMEOUT_S, start_method: str | None = None,
                 threads_per_replica: int = 1, print_output: bool = True, **kwargs: Any) -> ReplicaRun:
    """Run ``fn(ctx, *args, **kwargs)`` in ``replicas`` processes, kill and restart them as ``faults`` say.

    Args:
        fn: what each replica runs; gets a :class:`ReplicaContext`, returns something picklable.
        replicas: number of replicas, >= 1. faults: :class:`Fault` s, at most one per replica, not all replicas.
        timeout_s: seconds for the whole run (store waits inside it get the same bound).
        start_method: ``"fork"`` (default where available) or ``"spawn"`` (``fn`` importable);
        threads_per_replica: ``torch.set_num_threads`` in each; print_output: print each process's output
            prefixed ``[replica r]`` (``[replica r.i]`` for its i-th replacement), in replica order.

    Returns:
        A :class:`ReplicaRun`.

    Raises:
        ValueError: a bad argument (named): replicas < 1, a fault naming a replica outside 0..replicas-1, a
            step < 0, ``rejoin_step <= step``, two faults for one replica, or every replica faulted.
        ReplicaError: a replica raised or ended other than by its fault (names it; earliest root cause).
        ReplicaTimeout: the run outlived ``timeout_s`` (names the replicas still running).
    """
    replicas = checks.integer("replicas", replicas, 1, where="run_replicas")
    faults = _check_faults(faults, replicas)
    timeout_s = checks.number("timeout_s", timeout_s, above=0, where="run_replicas", note="seconds")
    threads = checks.integer("threads_per_replica", threads_per_replica, 1, where="run_replicas")
    if not callable(fn):
        raise ValueError(f"run_replicas: fn must be callable, got {type(fn).__name__}")
    refuse_nested()
    refuse_initialised_parent()
    start_method = choose_start_method(fn, start_method, "gloo")
    if start_method == "fork":
        import_once_before_fork()
    import torch.distributed as dist

    mpctx = mp.get_context(start_method)
    host, port = _start_store_host(mpctx, timeout_s + TIMEOUT_MARGIN_S)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s + TIMEOUT_MARGIN_S))
        workdir = tempfile.mkdtemp(prefix="commlab-replicas-")
        cfg = _Config(replicas=replicas, port=port, out_dir=workdir, threads=threads,
                      op_timeout_s=timeout_s + TIMEOUT_MARGIN_S)
        run = _Run(cfg, mpctx, store, {f.replica: f for f in faults}, fn, args, kwargs)
        try:
            failure, timed_out = run.wait(timeout_s)
        finally:
            run.reap()
            outputs = _read_outputs(workdir, run.incarnations)
            shutil.rmtree(workdir, ignore_errors=True)
            run.store = store = None
    finally:
        _stop_store_host(host)
    if print_output:
        _print_outputs(outputs)
    flat = ["\n".join(text for _, text in sorted(outputs.get(r, {}).items())) for r in range(replicas)]
    if failure is not None:
        raise ReplicaError(*failure, outputs=flat)
    if timed_out:
        raise ReplicaTimeout(replicas, timeout_s, sorted(run.live), sorted(run.results), flat)
    return ReplicaRun(results=dict(sorted(run.results.items())), incarnations=dict(sorted(run.incarnations.items())),
                      events=run.events, wall_s=time.monotonic() - run.t0)


def _start_store_host(mpctx, timeout_s: float):
    """Start the process that hosts the run's TCPStore server (port chosen by the kernel); ``(process, port)``.

    Not this process: a server runs a thread, and a replica forked while that thread held a lock (it serves the
    other replicas meanwhile) would inherit the lock held and hang at its first store call. This process and the
    replicas are clients, which run no thread. RuntimeError if the host does not report its port in time.
    """
    ours, theirs = mpctx.Pipe()
    host = mpctx.Process(target=_host_store, args=(theirs, os.getpid(), timeout_s), daemon=True,
                         name="commlab-store-host")
    host.start()
    theirs.close()
    if not ours.poll(min(timeout_s, 60.0)):
        _stop_store_host((host, ours))
        raise RuntimeError("run_replicas: the store's host process did not start (no port within "
                           f"{min(timeout_s, 60.0):g} s)")
    return (host, ours), int(ours.recv_bytes())


def _stop_store_host(host) -> None:
    process, conn = host
    try:
        conn.send_bytes(b"stop")
    except OSError:
        pass
    conn.close()
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)


def _host_store(conn, parent_pid: int, timeout_s: float) -> None:
    """The store host's process: serve a TCPStore until the parent says stop (or dies)."""
    import torch.distributed as dist

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C in a notebook is the parent's to handle
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    conn.send_bytes(str(store.port).encode())
    try:
        conn.recv_bytes()
    except EOFError:
        pass
    os._exit(0)


def _check_faults(faults, replicas: int) -> tuple[Fault, ...]:
    faults = tuple(faults)
    seen = set()
    for f in faults:
        if not isinstance(f, Fault):
            raise ValueError(f"run_replicas: faults must be Fault objects, got {f!r}")
        checks.integer("Fault.replica", f.replica, 0, replicas - 1, where="run_replicas",
                       note=f"there are {replicas} replicas")
        checks.integer("Fault.step", f.step, 0, where="run_replicas")
        if f.rejoin_step is not None:
            checks.integer("Fault.rejoin_step", f.rejoin_step, f.step + 1, where="run_replicas",
                           note="a replica comes back after the step at which it was killed; None: never")
        if f.replica in seen:
            raise ValueError(f"run_replicas: two faults name replica {f.replica}; only its first process is "
                             "killed, so give it one Fault")
        seen.add(f.replica)
    if replicas and len(seen) == replicas:
        raise ValueError(f"run_replicas: faults kill all {replicas} replicas, so none would survive to carry "
                         "the state on (fault-tolerant DP needs a healthy replica); fault fewer replicas")
    return faults


class _Run:
    """The parent's bookkeeping: live processes, planned rejoins, results and events."""

    def __init__(self, cfg, mpctx, store, faults, fn, args, kwargs):
        self.cfg, self.mpctx, self.store, self.faults = cfg, mpctx, store, faults
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.t0 = time.monotonic()
        self.live: dict[int, Any] = {}       # replica -> its running process
        self.procs: list = []
        self.pending: dict[int, int] = {}    # replica -> rejoin_step
        self.results: dict[int, Any] = {}
        self.incarnations: dict[int, int] = {}
        self.events: list[tuple[float, int, str]] = []
        for r in range(cfg.replicas):
            self._start(r, "start")

    def _start(self, replica, kind):
        inc = self.incarnations.get(replica, 0)
        self.incarnations[replica] = inc + 1
        self.store.delete_key(GONE_KEY.format(replica=replica))
        p = self.mpctx.Process(target=_replica_main, name=f"commlab-replica{replica}.{inc}", daemon=False,
                               args=(self.cfg, replica, inc, self.faults.get(replica), self.fn, self.args,
                                     self.kwargs))
        p.start()
        self.procs.append(p)
        self.live[replica] = p
        self.events.append((time.monotonic() - self.t0, replica, kind))

    def wait(self, timeout_s):
        deadline = self.t0 + timeout_s
        failures: list[tuple] = []  # (time, replica, incarnation, exc_type, message, traceback)
        grace_end = None
        while self.live or self.pending:
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                break
            if now >= deadline:
                return None, True
            for r, p in list(self.live.items()):
                if p.exitcode is not None:
                    self._ended(r, p, failures)
            if failures:
                grace_end = grace_end or time.monotonic() + _GRACE_S
                time.sleep(_POLL_S)
                continue
            self._rejoin_due()
            time.sleep(_POLL_S)
        if not failures:
            return None, False
        primary = [f for f in failures if not is_peer_fallout(f[4])] or failures
        first = min(primary, key=lambda f: f[0])
        return (first[1], self.cfg.replicas, first[2], first[3], first[4], first[5]), False

    def _ended(self, replica, p, failures):
        inc = self.incarnations[replica] - 1
        del self.live[replica]
        self.store.set(GONE_KEY.format(replica=replica), str(inc))
        t = time.monotonic() - self.t0
        report = _read_report(self.cfg.out_dir, replica, inc)
        if report is not None and report[0] == "ok":
            try:
                self.results[replica] = pickle.loads(report[1])
                self.events.append((t, replica, "done"))
            except Exception as e:  # noqa: BLE001
                failures.append((time.time(), replica, inc, type(e).__name__,
                                 f"its return value could not be unpickled in the parent: {e}", ""))
            return
        if report is not None:
            failures.append((report[1], replica, inc) + tuple(report[2:]))
            return
        fault = self.faults.get(replica)
        planned = self.store.check([_FAULT_KEY.format(replica=replica)])
        if p.exitcode == -signal.SIGKILL and fault is not None and inc == 0 and planned:
            self.events.append((t, replica, "killed"))
            if fault.rejoin_step is not None:
                self.pending[replica] = fault.rejoin_step
            return
        code = p.exitcode
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        failures.append((time.time(), replica, inc, how, "the process ended without returning a result or "
                         "raising (os._exit, sys.exit, a crash in native code or the OOM killer)", ""))

    def _rejoin_due(self):
        if not self.pending:
            return
        if not self.live:  # the survivors finished before the rejoin step: nobody left to heal from
            self.pending.clear()
            return
        steps = []
        for r in self.live:
            key = PROGRESS_KEY.format(replica=r)
            if self.store.check([key]):
                steps.append(int(self.store.get(key)))
        done = max(steps, default=-1)
        for r, rejoin in sorted(self.pending.items()):
            if done >= rejoin:
                del self.pending[r]
                self._start(r, "rejoin")

    def reap(self):
        # Each replica leads its own process group: SIGKILL to the group ends it wherever it is blocked.
        for p in self.procs:
            kill_group(p.pid)
        for p in self.procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)


def _report_path(out_dir, replica, inc):
    return os.path.join(out_dir, f"replica{replica}.{inc}.report")


def _read_report(out_dir, replica, inc):
    try:
        with open(_report_path(out_dir, replica, inc), "rb") as f:
            return pickle.load(f)
    except (FileNotFoundError, EOFError, pickle.UnpicklingError):
        return None


def _read_outputs(out_dir, incarnations) -> dict[int, dict[int, str]]:
    outs: dict[int, dict[int, str]] = {}
    for r, count in sorted(incarnations.items()):
        for inc in range(count):
            try:
                with open(os.path.join(out_dir, f"replica{r}.{inc}.out"), encoding="utf-8", errors="replace") as f:
                    outs.setdefault(r, {})[inc] = f.read()
            except FileNotFoundError:
                outs.setdefault(r, {})[inc] = ""
    return outs


def _print_outputs(outputs) -> None:
    for r in sorted(outputs):
        for inc, text in sorted(outputs[r].items()):
            tag = f"replica {r}" if inc == 0 else f"replica {r}.{inc}"
            for line in text.splitlines():
                print(f"[{tag}] {line}")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------ child side

def _replica_main(cfg: _Config, replica: int, inc: int, fault, fn, args, kwargs):
    fd = os.open(os.path.join(cfg.out_dir, f"replica{replica}.{inc}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), encoding="utf-8", line_buffering=True,
                                  write_through=True)
    sys.stderr = sys.stdout
    if faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr)
    gc.freeze()  # never collect what came with the fork (an earlier run's objects: their destructors may hang)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgid(0, 0)  # a fault kills this group; the parent ends it with everything it started
    die_with_parent(os.getppid())
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg.threads)
        os.environ[CHILD_MARKER] = str(replica)  # a nested launch() refuses, as in a rank of launch()
        store = dist.TCPStore("127.0.0.1", cfg.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=cfg.op_timeout_s))
        ctx = ReplicaContext(replica, cfg.replicas, inc, store, fault, cfg.op_timeout_s)
        report = ("ok", pickle.dumps(results_to_cpu(fn(ctx, *args, **kwargs))))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        try:
            message = str(e)
        except Exception:  # noqa: BLE001
            message = f"<{type(e).__name__} whose str() raised>"
        report = ("error", time.time(), type(e).__name__, message, traceback.format_exc())
        code = 1
    tmp = _report_path(cfg.out_dir, replica, inc) + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(report, f)
    os.replace(tmp, _report_path(cfg.out_dir, replica, inc))  # the parent never reads half a report
    faulthandler.disable()
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    # No destroy_process_group: a peer may be gone, and the sockets close with the process anyway.
    os._exit(code)
