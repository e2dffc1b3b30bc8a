"""Run a function on N ranks with ``torch.distributed`` initialised, from a notebook cell or a script.

:func:`launch` forks the ranks (so a function defined in a notebook cell works; ``start_method="spawn"`` where
fork does not exist), limits each one's threads before any user code (a forked child can hang in OpenMP state
it inherited), initialises its group on a fresh :class:`~torch.distributed.FileStore` (no port to choose, no
host-name look-up), runs the function and returns the results in rank order. Every rank reports its result, or
its exception with a time stamp, through a queue read with a short poll: the earliest failure that is not a
peer's reaction to it is raised as :class:`RankError` (``torch.multiprocessing``'s ``join`` names the first
process to exit, often such a peer), the other ranks are ended, and a launch past ``timeout`` raises
:class:`LaunchTimeout` naming the ranks that joined and finished. Each rank's file descriptors 1 and 2 go to a
file, printed afterwards in rank order with ``[rank r]``. Sends still in flight when the function returns are
delivered or named (:mod:`commlab.launch.inflight`). Under torchrun or srun the function runs in this process
instead (:mod:`commlab.launch.inprocess`). Chapter 2, section 2.4.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

from commlab.launch.device import nccl_gpu_problem, results_to_cpu
from commlab.launch.env import BACKENDS, CHILD_MARKER, TIMEOUT_MARGIN_S, check_timeout
from commlab.launch.errors import LaunchError, LaunchTimeout, RankError, is_peer_fallout
from commlab.launch.inflight import track_sends

__all__ = ["launch", "RankError", "LaunchTimeout", "LaunchError", "DEFAULT_TIMEOUT_S",
           # the fork-side plumbing, shared with commlab.launch.replicas
           "choose_start_method", "die_with_parent", "import_once_before_fork", "kill_group",
           "refuse_initialised_parent", "refuse_nested"]

#: Wall-clock limit (seconds) of a whole launch unless the caller passes ``timeout``.
DEFAULT_TIMEOUT_S = 30.0

_POLL_S = 0.05
# After the first failure, how long to keep listening for an earlier-timestamped one from another rank.
_GRACE_S = 0.3


@dataclasses.dataclass(frozen=True)
class _Config:
    world_size: int
    backend: str
    store_path: str
    out_dir: str
    collective_timeout_s: float
    threads_per_rank: int
    init_hook: Callable[[int], None] | None
    deadline: float  # time.monotonic() at which the parent gives up (CLOCK_MONOTONIC is system-wide)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           timeout: float = DEFAULT_TIMEOUT_S, start_method: str | None = None,
           threads_per_rank: int = 1, print_output: bool = True,
           init_hook: Callable[[int], None] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results in rank order.

    Each rank initialises the default process group and destroys it after ``fn``. Under torchrun or ``srun``,
    ``fn`` runs once here as this rank of the job (:mod:`commlab.launch.inprocess`); every rank gets all results.

    Args:
        fn: what each rank runs; with fork (Linux default) it may live in a notebook cell, with spawn it must
            be importable. *args, **kwargs: passed to ``fn`` (inherited under fork, not pickled).
        world_size: number of ranks, >= 1. backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU ``rank % device_count``).
        timeout: seconds for the whole launch and for each collective inside it (not torch's 30 minutes).
        start_method: ``"fork"`` (default where available) or ``"spawn"``; print_output: print each rank's
            captured output prefixed ``[rank r]`` (neither applies under torchrun/srun).
        threads_per_rank: ``torch.set_num_threads`` per rank; init_hook: ``hook(rank)`` run before init.

    Returns:
        ``[result_of_rank_0, ...]``, tensors moved to the CPU (:func:`commlab.launch.device.results_to_cpu`).
        Under torchrun/srun every rank holds all of them: return small summaries from a large job.

    Raises:
        ValueError: a bad argument (named); an unimportable ``fn`` under spawn; a ``world_size`` not the job's.
        RuntimeError: too few GPUs for NCCL, CUDA initialised before fork, a nested launch, fork after dist init.
        RankError: a rank raised or exited without returning (rank, exception, traceback; within about 1 s).
        LaunchTimeout: the launch outlived ``timeout`` (names ranks still running, finished, or with sends in flight).
        UnfinishedSendsError: under torchrun/srun, this rank's sends never completed.
    """
    _validate(fn, world_size, backend, timeout, threads_per_rank)
    from commlab.launch.inprocess import run_in_process, runs_in_process

    refuse_nested()
    if runs_in_process():
        return run_in_process(fn, world_size, args, kwargs, backend=backend, timeout=timeout,
                              threads_per_rank=threads_per_rank, init_hook=init_hook)
    refuse_initialised_parent()
    _check_gpus(backend, world_size)
    start_method = choose_start_method(fn, start_method, backend)
    if start_method == "fork":
        import_once_before_fork()
    ctx = mp.get_context(start_method)

    workdir = tempfile.mkdtemp(prefix="commlab-launch-")
    cfg = _Config(world_size=world_size, backend=backend,
                  store_path=os.path.join(workdir, "store"), out_dir=workdir,
                  collective_timeout_s=float(timeout) + TIMEOUT_MARGIN_S, threads_per_rank=threads_per_rank,
                  init_hook=init_hook, deadline=time.monotonic() + float(timeout))
    events = ctx.Queue()
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_child_main, args=(cfg, rank, events, fn, args, kwargs),
                            name=f"commlab-rank{rank}", daemon=False)
            # Not daemonic: a rank may start processes of its own (DataLoader workers); each rank leads
            # its own process group, so that _reap can end those too.
            p.start()
            procs.append(p)
        results, failure, timed_out, joined, finished, in_flight = _wait(procs, events, world_size, timeout)
    finally:
        _reap(procs)
        events.close()
        events.join_thread()
        outputs = _read_outputs(workdir, world_size)
        shutil.rmtree(workdir, ignore_errors=True)
    if print_output:
        _print_outputs(outputs)
    if failure is not None:
        rank, exc_type, message, tb = failure
        raise RankError(rank, world_size, exc_type, message, tb, outputs)
    if timed_out:
        raise LaunchTimeout(world_size, timeout, joined, finished, outputs, unfinished_sends=in_flight)
    return [results[r] for r in range(world_size)]


# ----------------------------------------------------------------------------------------- parent side

def _validate(fn, world_size, backend, timeout, threads_per_rank):
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_timeout(timeout)
    if isinstance(threads_per_rank, bool) or not (isinstance(threads_per_rank, int) and threads_per_rank >= 1):
        raise ValueError(f"threads_per_rank must be an int >= 1, got {threads_per_rank!r}")


def refuse_nested():
    """RuntimeError inside a launched rank: a launch there would fork ranks that inherit the rank's group."""
    # A rank of a launch already is one process of an initialised world: a launch inside it would fork ranks
    # that inherit that group (torch: "trying to initialize the default process group twice").
    rank = os.environ.get(CHILD_MARKER)
    if rank is not None:
        raise RuntimeError(f"launch() was called inside rank {rank} of a launch, whose process group is already "
                           "initialised: call the function directly there (every rank runs it), or call launch() "
                           "from the notebook or script that started the ranks")
    from commlab.launch.inprocess import launch_running
    if launch_running():
        raise RuntimeError("launch() was called inside a function that launch() runs under torchrun/srun: call "
                           "the inner function directly (this process already is one rank of the job)")


def refuse_initialised_parent():
    """RuntimeError if this process already has a default process group: forked ranks would inherit it."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialised in this process (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, backend {dist.get_backend()}), and the ranks launch() forks would inherit "
            "that group: call torch.distributed.destroy_process_group() first, or run the function directly "
            "on the group you have")


def _check_gpus(backend, world_size):
    if backend == "nccl":
        problem = nccl_gpu_problem(world_size)
        if problem is not None:
            raise RuntimeError(problem)


def import_once_before_fork() -> None:
    """Import in the parent what every forked rank would otherwise import again (torch._dynamo)."""
    # DDP and torch.optim import torch._dynamo when first built; in a forked rank that import is paid again
    # by every rank of every launch (seconds on a loaded 2-core machine). Imported once in the parent, the
    # children inherit it. It starts no threads, so forking after it is as safe as before.
    import torch._dynamo  # noqa: F401


def choose_start_method(fn, start_method, backend):
    """The multiprocessing start method for ``fn``: ``start_method`` checked, else fork where available; ValueError
    for one this platform lacks or that cannot start ``fn`` (spawn needs an importable function)."""
    available = mp.get_all_start_methods()
    if start_method is None:
        start_method = "fork" if "fork" in available else "spawn"
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
    if start_method not in available:
        raise ValueError(f"start_method {start_method!r} is not available on this platform "
                         f"(available: {available})")
    if start_method == "spawn":
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", "")
        if module in (None, "__main__") or "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(
                f"{getattr(fn, '__name__', fn)!r} is defined in {module or 'no module'} "
                f"({qualname or 'anonymous'}), which processes started with 'spawn' cannot import. "
                "Fork is not available here, so move the function into a .py file next to the "
                "notebook (or use %%writefile), import it, and launch the imported function.")
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - the reason is reported to the user verbatim
            raise ValueError(f"with start_method='spawn' the function must be picklable: {e}") from e
    if backend == "nccl" and start_method == "fork":
        import torch
        if torch.cuda.is_initialized():
            raise RuntimeError("CUDA is already initialised in this process, and a forked child cannot "
                               "use it; restart the kernel before using CUDA, or pass start_method='spawn' "
                               "with a function from an importable module")
    return start_method


def _wait(procs, events, world_size, timeout):
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    joined: set[int] = set()
    in_flight: dict[int, list] = {}  # rank -> unfinished sends it reported when its fn returned
    failures: list[tuple[float, int, str, str, str]] = []
    grace_end = None
    while True:
        now = time.monotonic()
        if len(results) == world_size:
            return results, None, False, joined, set(results), {}
        if grace_end is not None and now >= grace_end:
            break
        if now >= deadline:
            _drain(events, results, joined, failures, in_flight)
            return results, None, True, joined, set(results), in_flight
        try:
            msg = events.get(timeout=_POLL_S)
        except queue_mod.Empty:
            msg = None
        if msg is not None:
            _record(msg, results, joined, failures, in_flight)
        # A rank that died without reporting (os._exit, a signal, a crash in native code) is only
        # visible through its exit code.
        for rank, p in enumerate(procs):
            if p.exitcode is None or rank in results or any(f[1] == rank for f in failures):
                continue
            _drain(events, results, joined, failures, in_flight)  # its last message may still be in the pipe
            if rank in results or any(f[1] == rank for f in failures):
                continue
            code = p.exitcode
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            failures.append((time.time(), rank, how,
                             "the process ended without returning a result or raising "
                             "(os._exit, sys.exit, a crash in native code or the OOM killer)", ""))
        if failures and grace_end is None:
            grace_end = time.monotonic() + _GRACE_S
    # The root cause is the earliest failure that is not a peer's reaction to it: when one rank dies,
    # the others fail next with "connection closed by peer" and similar, sometimes before the parent
    # has noticed the death itself.
    primary = [f for f in failures if not is_peer_fallout(f[3])] or failures
    first = min(primary, key=lambda f: f[0])
    return results, first[1:], False, joined, set(results), {}


def _record(msg, results, joined, failures, in_flight):
    kind, rank = msg[0], msg[1]
    if kind == "joined":
        joined.add(rank)
    elif kind == "in_flight":
        in_flight[rank] = msg[2]
    elif kind == "ok":
        in_flight.pop(rank, None)
        try:
            results[rank] = pickle.loads(msg[2])
        except Exception as e:  # noqa: BLE001
            failures.append((time.time(), rank, type(e).__name__,
                             f"its return value could not be unpickled in the parent: {e}", ""))
    elif kind == "error":
        failures.append((msg[2], rank, msg[3], msg[4], msg[5]))


def _drain(events, results, joined, failures, in_flight):
    while True:
        try:
            _record(events.get_nowait(), results, joined, failures, in_flight)
        except queue_mod.Empty:
            return


def _reap(procs):
    # Every rank leads its own process group: SIGKILL to the group ends the rank (finished, failed or
    # stuck in a C++ collective, where a Python-level handler would never run) and anything it started.
    for p in procs:
        kill_group(p.pid)
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():  # it had not yet made its own group when the signal went out
            p.kill()
            p.join(timeout=2.0)
    for p in procs:
        try:
            p.close()
        except ValueError:
            pass


def kill_group(pgid):
    """SIGKILL the process group ``pgid`` (a rank and its children); nothing when it is None or already gone."""
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_outputs(workdir, world_size):
    outs = []
    for rank in range(world_size):
        path = os.path.join(workdir, f"rank{rank}.out")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                outs.append(f.read())
        except FileNotFoundError:
            outs.append("")
    return outs


def _print_outputs(outputs):
    for rank, text in enumerate(outputs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------ child side

_USE_PDEATHSIG = sys.platform.startswith("linux")  # else a watcher thread (see die_with_parent)


def die_with_parent(parent_pid: int) -> None:
    """End this rank when the process that started it dies.

    A rank leads its own process group, so a signal sent to the parent's group (``timeout`` around a script,
    a notebook kernel killed or restarted) no longer reaches it, and a parent that dies cannot reap it. Without
    this the ranks of a killed parent live on, blocked in the rendezvous or a collective, holding memory and
    cores. On Linux the kernel delivers SIGKILL when the parent exits (``prctl(PR_SET_PDEATHSIG)``); elsewhere a
    daemon thread polls the parent id (gloo's and NCCL's waits release the GIL, so the thread runs while the
    rank is blocked in one).
    """
    if _USE_PDEATHSIG:
        try:
            import ctypes
            pr_set_pdeathsig = 1  # <linux/prctl.h>
            if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent_pid:  # the parent died before the kernel was asked to watch it
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="commlab-parent-watch", daemon=True).start()


def _child_main(cfg: _Config, rank: int, events, fn, args, kwargs):
    # Everything this rank writes, from Python or from C++, goes to its own file.
    out_path = os.path.join(cfg.out_dir, f"rank{rank}.out")
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), encoding="utf-8",
                                  line_buffering=True, write_through=True)
    sys.stderr = sys.stdout
    if faulthandler.is_enabled():  # inherited from pytest or a kernel, still writing to the parent's stderr
        faulthandler.enable(file=sys.stderr)
    # SIGTERM keeps its default action: a Python handler would not run while the rank is blocked
    # inside a C++ collective. SIGINT (a notebook interrupt reaches the whole process group) is left
    # to the parent, which terminates the ranks itself.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgid(0, 0)  # this rank leads a process group: the parent ends it with everything it started
    die_with_parent(os.getppid())

    try:
        import torch
        torch.set_num_threads(cfg.threads_per_rank)
        import torch.distributed as dist

        if cfg.init_hook is not None:
            cfg.init_hook(rank)
        # The marker first: whatever else this process inherited (a notebook started under srun, say), it is
        # a rank of this launch, never a torchrun worker (commlab.launch.env.detect_launcher reads it).
        os.environ[CHILD_MARKER] = str(rank)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.world_size),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cfg.world_size))
        init_kwargs = {}
        if cfg.backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            init_kwargs["device_id"] = device
        store = dist.FileStore(cfg.store_path, cfg.world_size)
        # "joined" means "reached the rendezvous": init_process_group itself waits for every rank.
        events.put(("joined", rank))
        dist.init_process_group(cfg.backend, store=store, rank=rank, world_size=cfg.world_size,
                                timeout=datetime.timedelta(seconds=cfg.collective_timeout_s),
                                **init_kwargs)
        with track_sends() as tracker:
            result = fn(*args, **kwargs)
            payload = pickle.dumps(results_to_cpu(result))
            # Sends fn started and did not wait for: deliver them before leaving (their receivers may be
            # blocked on them), and tell the parent whom this rank is waiting for, in case they never complete.
            unfinished = tracker.unfinished()
            if unfinished:
                events.put(("in_flight", rank, unfinished))
                # A little past the parent's deadline, so that the parent, which names these sends in its
                # LaunchTimeout, is the one that reports them.
                left = tracker.finish(cfg.deadline + TIMEOUT_MARGIN_S)
                if left:
                    raise LaunchTimeout(cfg.world_size, cfg.collective_timeout_s, range(cfg.world_size), [],
                                        unfinished_sends={rank: left})
        events.put(("ok", rank, payload))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        tb = traceback.format_exc()
        try:
            message = str(e)
        except Exception:  # noqa: BLE001 - an exception whose __str__ itself fails
            message = f"<{type(e).__name__} whose str() raised>"
        try:
            events.put(("error", rank, time.time(), type(e).__name__, message, tb))
        finally:
            _flush_and_exit(events, 1)
    # Leave together: a rank whose fn was quick could otherwise close its sockets while a slower peer is
    # still completing gloo's connection mesh inside init_process_group, and that peer would fail with
    # "connection closed by peer". The result is already delivered; if a peer failed instead, the parent
    # ends this rank while it waits here. A crash report from the teardown would only be noise in the
    # rank's output, so the fault handler is off by then.
    faulthandler.disable()
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already delivered
        pass
    _flush_and_exit(events, 0)


def _flush_and_exit(events, code):
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    events.close()
    events.join_thread()  # the queue's feeder thread must hand the message over before we leave
    os._exit(code)
