""":func:`commlab.launch.launch` under torchrun or ``srun``: the ranks already exist, so run ``fn`` right here.

:func:`run_in_process` checks that the job has ``N`` ranks, initialises the default group through
:func:`commlab.launch.init_from_env` (kept for later launches and destroyed at exit: inside a torchrun worker
torch 2.13 does not re-create a default group reliably), runs ``fn`` once with the group's collective timeout
set to the launch's (:func:`collective_timeout`), and all-gathers the results, so that every rank returns them all.

What it adds to torchrun's summary, which names the first failure seen *on each node*: the failing rank posts
its error in the job's store, and a peer whose own error is a reaction to it ("Connection closed by peer", a
timeout) raises :class:`RankError` for that root cause, so that every node names the same rank. A rank that
returns waits in the store for the others (``timeout`` + 1 s at most): when a rank skips a collective, the
finished ranks raise :class:`LaunchTimeout` naming the ranks still running. Sends still in flight are waited
for until the deadline; those that never complete raise :class:`UnfinishedSendsError`. Under ``srun`` without
torchrun the store lives in rank 0: when rank 0 fails, its peers report their own errors.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import pickle
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from commlab.launch.device import results_to_cpu
from commlab.launch.env import TIMEOUT_MARGIN_S, detect_launcher, init_from_env, read_env
from commlab.launch.errors import LaunchError, LaunchTimeout, RankError, is_collective_timeout, is_peer_fallout
from commlab.launch.inflight import ADVICE, UnfinishedSends, describe_unfinished, track_sends


__all__ = ["run_in_process", "UnfinishedSendsError", "runs_in_process", "collective_timeout"]

# How long a rank whose error is a peer's fallout looks for the root cause in the store, and how long any
# store operation of this module may take (the store can be hosted by the rank that died).
_BOARD_WAIT_S = 2.0
_STORE_OP_S = 3.0
# Each in-process launch gets its own keys; every rank calls launch() in the same order, so the counts agree.
_launches = 0
_teardown_registered = False
_failed = False  # set once a launch failed in this process: its group is then not torn down at exit
_running = False  # True while fn of an in-process launch runs (a launch inside it is refused)


class UnfinishedSendsError(LaunchError, TimeoutError):
    """This rank's function returned with sends that had not completed by the launch's deadline.

    Attributes:
        rank: this rank. sends: the :class:`~commlab.launch.inflight.UnfinishedSends` per destination.
        timeout_s: the launch's timeout.
    """

    def __init__(self, rank: int, sends: list[UnfinishedSends], timeout_s: float):
        self.rank, self.sends, self.timeout_s = rank, list(sends), timeout_s
        super().__init__(f"{describe_unfinished(rank, sends)}, not completed {timeout_s:g} s after the launch "
                         f"began: {ADVICE}")


def runs_in_process() -> bool:
    """Whether :func:`commlab.launch.launch` would run ``fn`` in this process: under torchrun, or in an
    ``srun`` step of more than one task (see :func:`commlab.launch.env.detect_launcher`)."""
    door = detect_launcher()
    if door == "torchrun":
        return True
    return door == "slurm" and read_env().world_size > 1


def launch_running() -> bool:
    """Whether this process is inside the function of an in-process launch."""
    return _running


def run_in_process(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, *, backend: str,
                   timeout: float, threads_per_rank: int,
                   init_hook: Callable[[int], None] | None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as this rank of the launcher's job; every rank returns all results.

    Arguments as :func:`commlab.launch.launch`. ``timeout`` here bounds the wait for sends still in flight
    after ``fn``, and, 2 s longer, every collective of the default group while ``fn`` runs: the group's
    operation timeout is set for this launch and restored after it (:func:`collective_timeout`), so it is this
    launch's ``timeout`` whether the group was made by an earlier launch or by :func:`init_from_env` with
    another one. The launcher (torchrun, srun) owns the processes, so nothing here kills a rank that is
    merely slow.

    Raises:
        ValueError: ``world_size`` differs from the job's (the message gives both and how to start ``N``).
        RankError: ``fn`` raised in this rank, or in the rank whose failure this rank's error reacts to.
        UnfinishedSendsError: sends of this rank never completed.
        LaunchTimeout: not every rank finished: a rank skipped a collective, or worked alone past the
            timeout (names the ranks still running and those that finished).
    """
    global _launches, _teardown_registered, _failed, _running
    job = read_env()
    if job.world_size != world_size:
        raise ValueError(
            f"launch(fn, {world_size}) runs under {job.launcher}, whose job has {job.world_size} rank(s) "
            f"(this is rank {job.rank}): pass world_size={job.world_size}, or start {world_size} processes in all "
            "(torchrun: --nnodes x --nproc-per-node; srun: --ntasks), or call launch() outside the launcher "
            "to fork the ranks here")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank)
    start = time.monotonic()
    try:
        if init_hook is not None:
            init_hook(job.rank)
        # The ranks' collective timeout is the launch's, plus a margin: with no parent process to watch them,
        # it is what bounds a rank stuck in a collective whose peer never comes. The margin lets a peer that
        # gives up on its unfinished sends at the launch's deadline post its error before the ranks waiting
        # for it time out and would report their own timeout as the cause.
        created = not dist.is_initialized()
        ctx = init_from_env(backend, timeout=timeout + TIMEOUT_MARGIN_S)
        if created and not _teardown_registered:
            atexit.register(_destroy_at_exit)
            _teardown_registered = True
        if ctx.world_size != world_size:
            raise ValueError(f"launch(fn, {world_size}): the process group already initialised here has "
                             f"{ctx.world_size} ranks")
        _launches += 1
        board = _FailureBoard(f"commlab/launch/{_launches}", ctx.rank, world_size, timeout)
        with collective_timeout(timeout + TIMEOUT_MARGIN_S):
            with track_sends() as tracker:
                _running = True
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - reported as this rank's (or the root cause's) failure
                    raise board.fail(exc) from exc
                finally:
                    _running = False
                left = tracker.finish(start + timeout)
            if left:
                tracker.abandon()  # this process must be able to exit: nothing may stay blocked on those sends
                err = UnfinishedSendsError(ctx.rank, left, timeout)
                board.fail(err)  # posted, so that the peers waiting for this rank name it
                raise err
            board.finish()
            try:
                return _gather(results_to_cpu(result), world_size)
            except Exception as exc:  # noqa: BLE001 - a peer died before the gather
                raise board.fail(exc) from exc
    finally:
        torch.set_num_threads(old_threads)


@contextlib.contextmanager
def collective_timeout(seconds: float, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Within the block, every collective of ``group`` (default: the default group) times out after ``seconds``.

    The fork launcher gives each launch a new group with its own timeout; under torchrun the group outlives
    the launch, so its operation timeout (gloo's and NCCL's, fixed by ``init_process_group``) is set for the
    block and restored after it, through torch's ``_set_pg_timeout`` (``torch/distributed/distributed_c10d.py``),
    which sets each backend's default timeout for operations started afterwards. Groups made with
    ``dist.new_group`` keep the timeout they were made with.

    Warns (``RuntimeWarning``) and leaves the timeout as it is where this torch cannot set it.
    """
    pg = dist.group.WORLD if group is None else group
    try:
        before = [(dev, pg._get_backend(dev).options._timeout) for dev in pg._device_types]
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), pg)
    except Exception as e:  # noqa: BLE001 - a torch without these internals: say so, run anyway
        warnings.warn(f"this torch cannot change the timeout of an existing process group ({e}): the collectives "
                      f"of this launch keep the group's own timeout instead of {seconds:g} s", RuntimeWarning,
                      stacklevel=3)
        before = []
    try:
        yield
    finally:
        for dev, td in before:
            try:
                pg._get_backend(dev)._set_default_timeout(td)
            except Exception:  # noqa: BLE001 - the group broke inside the block; the error raised says why
                pass


def _destroy_at_exit() -> None:
    # Only a group that is healthy is torn down: after a failure its peers are gone or failing, and the
    # teardown could wait on them; the process is ending anyway.
    global _failed
    if dist.is_initialized() and not _failed:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting
            pass


def _gather(result: Any, world_size: int) -> list[Any]:
    # Plain bytes through all_gather_object: the results are pickled once, here, so a result that cannot be
    # pickled fails in its own rank with its own name.
    payload = pickle.dumps(result)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, payload)
    return [pickle.loads(p) for p in everyone]


class _FailureBoard:
    """The first failure of a launch and the ranks that have finished it, kept in the job's store so that every
    rank can name them.

    Keys (under ``commlab/launch/<n>/``): ``first_failure`` (the first failure posted, compare-and-set),
    ``finished`` (a counter), ``finished/<rank>`` (one per rank that returned from ``fn``) and ``over`` (set by
    the last rank to finish, or with the first failure: what the finished ranks wait for).
    """

    def __init__(self, prefix: str, rank: int, world_size: int, timeout_s: float):
        self.prefix, self.rank, self.world_size, self.timeout_s = prefix, rank, world_size, timeout_s
        self.key = f"{prefix}/first_failure"
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: every rank reports its own failure
            self.store = None

    def fail(self, exc: BaseException) -> LaunchError:
        """The error to raise for ``exc``: the root cause's if ``exc`` is a reaction to it, else this one.

        A peer's fallout ("connection closed by peer") and a collective that timed out look for the first
        failure posted; a timeout with no failure posted but with ranks that finished becomes the
        :class:`LaunchTimeout` naming the ranks still running (a rank skipped a collective its peers called).
        """
        global _failed
        _failed = True
        tb = "".join(traceback.format_exception(exc)) if exc.__traceback__ is not None else ""
        exc_type = type(exc).__name__
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001
            message = f"<{exc_type} whose str() raised>"
        if isinstance(exc, RankError):
            return exc
        fallout, timed_out = is_peer_fallout(message), is_collective_timeout(message)
        if fallout or timed_out:
            root = self._read()
            if root is not None and root["rank"] != self.rank:
                return self._error_of(root, f"{exc_type}: {message}")
        if timed_out:
            finished = self._finished()
            if finished:
                return self._verdict(finished)
        if not fallout:
            self._post({"rank": self.rank, "type": exc_type, "message": message, "traceback": tb[-20000:]})
        return RankError(self.rank, self.world_size, exc_type, message, tb)

    def finish(self) -> None:
        """Say that this rank returned from ``fn`` and wait (the launch's timeout + 1 s at most) until every rank has.

        The ranks agree through the store, not in a collective: a rank that returned while its peers still wait
        in a collective it skipped would otherwise enter the results' gather, a different collective, whose
        failure names nobody. Returns when every rank has finished (or without a store, leaving the gather to
        fail by itself).

        Raises:
            LaunchTimeout: not every rank finished within the timeout (names the ranks still running and the
                ones that finished), or a finished rank reported so.
            RankError: another rank failed (the root cause, as it posted it).
        """
        if self.store is None or self.world_size == 1:
            return
        if _bounded(lambda: self.store.set(f"{self.prefix}/finished/{self.rank}", "1") or True) is None:
            return  # the store is gone: the gather reports what happened
        done = _bounded(lambda: self.store.add(f"{self.prefix}/finished", 1))
        if done is None:
            return
        if done >= self.world_size:
            _bounded(lambda: self.store.set(f"{self.prefix}/over", "finished"))
            return
        # Longer than the launch's timeout, which is when a rank still waiting for its sends posts them, and
        # shorter than the collectives' (timeout + TIMEOUT_MARGIN_S), so that a finished rank names the ranks
        # stuck in a collective it skipped before their own timeouts say only that they waited.
        wait_s = self.timeout_s + TIMEOUT_MARGIN_S / 2
        _bounded(lambda: self.store.wait([f"{self.prefix}/over"], datetime.timedelta(seconds=wait_s)),
                 wait_s + _STORE_OP_S)
        if (_bounded(lambda: self.store.add(f"{self.prefix}/finished", 0)) or 0) >= self.world_size:
            return
        global _failed
        _failed = True
        root = self._read(wait_s=0.0)
        if root is not None:
            raise self._error_of(root, None)
        finished = self._finished()
        if finished is None:  # the store went away while this rank waited
            finished = [self.rank]
        raise self._verdict(finished)

    def _verdict(self, finished: list[int]) -> LaunchTimeout:
        err = LaunchTimeout(self.world_size, self.timeout_s, range(self.world_size), finished)
        self._post({"rank": self.rank, "type": "LaunchTimeout", "message": str(err), "traceback": "",
                    "finished": finished})
        return err

    def _error_of(self, root: dict, own: str | None) -> LaunchError:
        """The error this rank raises for the failure ``root`` that another rank posted."""
        if "finished" in root:  # a timeout: every rank names the same ranks
            return LaunchTimeout(self.world_size, self.timeout_s, range(self.world_size), root["finished"])
        note = f"\n\n(reported by rank {self.rank}" + (f", whose own error followed it: {own})" if own else
                                                         ", which had finished its function)")
        return RankError(root["rank"], self.world_size, root["type"], root["message"],
                         f"{root['traceback'].rstrip()}{note}")

    def _finished(self) -> list[int] | None:
        """The ranks that returned from ``fn`` (None if the store cannot say)."""
        keys = [f"{self.prefix}/finished/{r}" for r in range(self.world_size)]
        flags = _bounded(lambda: [self.store.check([k]) for k in keys]) if self.store is not None else None
        return None if flags is None else [r for r, f in enumerate(flags) if f]

    def _post(self, entry: dict) -> None:
        if self.store is not None:
            _bounded(lambda: self.store.compare_set(self.key, "", pickle.dumps(entry)))
            _bounded(lambda: self.store.set(f"{self.prefix}/over", "failed"))

    def _read(self, wait_s: float = _BOARD_WAIT_S) -> dict | None:
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            found = _bounded(lambda: self.store.check([self.key]))
            if found:
                raw = _bounded(lambda: self.store.get(self.key))
                try:
                    return pickle.loads(raw) if raw else None
                except Exception:  # noqa: BLE001
                    return None
            if found is None or time.monotonic() >= deadline:  # the store itself is gone or stuck, or nothing came
                return None
            time.sleep(0.05)


def _bounded(op: Callable[[], Any], limit_s: float = _STORE_OP_S) -> Any:
    """``op()`` in a daemon thread, given up after ``limit_s`` seconds (None then, or if it raised): the store
    may belong to a process that died."""
    out: list[Any] = []

    def run():
        try:
            out.append(op())
        except Exception:  # noqa: BLE001
            out.append(None)

    t = threading.Thread(target=run, daemon=True, name="commlab-failure-board")
    t.start()
    t.join(limit_s)
    return out[0] if out else None
