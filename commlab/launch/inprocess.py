""":func:`commlab.launch.launch` under torchrun or ``srun``: the ranks already exist, so run ``fn`` right here.

Under a cluster launcher every process is one rank of the job. ``launch(fn, N)`` then checks that the job
has ``N`` ranks, initialises the default process group through :func:`commlab.launch.init_from_env` (unless
it already is), runs ``fn`` once in this process, and all-gathers the results so that every rank returns the
same list in rank order, as the forked ranks' results come back to the notebook. The thread count, the
send tracker and the group's collective timeout (set to the launch's ``timeout`` for its duration) are
restored when it returns. The process group it initialises stays for the launches after it
and is destroyed when the process exits: inside a torchrun worker torch does not re-create the default group
reliably (measured with torch 2.13: the third ``init_process_group`` in one worker, each after a
``destroy_process_group``, failed to connect to an address left in the agent's store by an earlier one). A
group that existed before is left alone.

Failures follow the launcher's conventions: a rank whose ``fn`` raises raises :class:`RankError` and its
process ends with it, which is what torchrun's agent watches for: it stops the node's other workers and its
error file (``torch.distributed.elastic.multiprocessing.errors.record`` on the entry point) reports the root
cause with its traceback. Only the agent of the failing rank's node can see that root cause; on the other
nodes the first worker to fail is a peer whose connection to the dead rank closed ("Connection closed by
peer"). So the failing rank first writes its exception into the job's rendezvous store, and a peer whose own
error is such a reaction reads it and raises :class:`RankError` for the *root cause*, with its own error
appended: every node's summary then names the same rank. (Under torchrun the store lives in each node's
agent. Under ``srun`` without torchrun it lives in rank 0's process: when rank 0 itself fails, its peers
cannot read its error any more and report their own; rank 0's output has the root cause.)

Sends still in flight when ``fn`` returns are waited for until the launch's deadline (see
:mod:`commlab.launch.inflight`); those that never complete raise :class:`UnfinishedSendsError` naming this
rank, the destinations and the bytes.
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

from commlab.launch.env import detect_launcher, init_from_env, read_env
from commlab.launch.errors import LaunchError, RankError, is_peer_fallout
from commlab.launch.inflight import ADVICE, UnfinishedSends, describe_unfinished, track_sends


__all__ = ["run_in_process", "UnfinishedSendsError", "runs_in_process", "collective_timeout"]

# How long a rank whose error is a peer's fallout looks for the root cause in the store, and how long any
# store operation of this module may take (the store can be hosted by the rank that died).
_BOARD_WAIT_S = 2.0
_STORE_OP_S = 3.0
# Seconds the collectives of an in-process launch outlast its deadline (the fork launcher's children do the same).
_TIMEOUT_MARGIN_S = 2.0
# Each in-process launch gets its own keys; every rank calls launch() in the same order, so the counts agree.
_launches = 0
_teardown_registered = False
_failed = False  # set once a launch failed in this process: its group is then not torn down at exit


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
    """
    global _launches, _teardown_registered, _failed
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
        ctx = init_from_env(backend, timeout=timeout + _TIMEOUT_MARGIN_S)
        if created and not _teardown_registered:
            atexit.register(_destroy_at_exit)
            _teardown_registered = True
        if ctx.world_size != world_size:
            raise ValueError(f"launch(fn, {world_size}): the process group already initialised here has "
                             f"{ctx.world_size} ranks")
        _launches += 1
        board = _FailureBoard(f"commlab/launch/{_launches}/first_failure", ctx.rank, world_size)
        with collective_timeout(timeout + _TIMEOUT_MARGIN_S):
            with track_sends() as tracker:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - reported as this rank's (or the root cause's) failure
                    raise board.fail(exc) from exc
                left = tracker.finish(start + timeout)
            if left:
                tracker.abandon()  # this process must be able to exit: nothing may stay blocked on those sends
                err = UnfinishedSendsError(ctx.rank, left, timeout)
                board.fail(err)  # posted, so that the peers waiting for this rank name it
                raise err
            try:
                return _gather(_to_cpu(result), world_size)
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


def _to_cpu(obj: Any) -> Any:
    # A CUDA tensor pickled on rank r would unpickle onto GPU r on every other rank.
    if isinstance(obj, torch.Tensor):
        return obj.cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


class _FailureBoard:
    """The first failure of a launch, kept in the job's store so that every rank can name it."""

    def __init__(self, key: str, rank: int, world_size: int):
        self.key, self.rank, self.world_size = key, rank, world_size
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: every rank reports its own failure
            self.store = None

    def fail(self, exc: BaseException) -> RankError:
        """The RankError to raise for ``exc``: the root cause's if ``exc`` is a reaction to it, else this one."""
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
        if is_peer_fallout(message):
            root = self._read()
            if root is not None and root[0] != self.rank:
                r, t, m, rtb = root
                return RankError(r, self.world_size, t, m,
                                 f"{rtb.rstrip()}\n\n(reported by rank {self.rank}, whose own error followed it: "
                                 f"{exc_type}: {message})")
        else:
            self._post((self.rank, exc_type, message, tb[-20000:]))
        return RankError(self.rank, self.world_size, exc_type, message, tb)

    def _post(self, entry) -> None:
        if self.store is not None:
            _bounded(lambda: self.store.compare_set(self.key, "", pickle.dumps(entry)))

    def _read(self):
        if self.store is None:
            return None
        deadline = time.monotonic() + _BOARD_WAIT_S
        while time.monotonic() < deadline:
            found = _bounded(lambda: self.store.check([self.key]))
            if found:
                raw = _bounded(lambda: self.store.get(self.key))
                try:
                    return pickle.loads(raw) if raw else None
                except Exception:  # noqa: BLE001
                    return None
            if found is None:  # the store itself is gone or stuck
                return None
            time.sleep(0.05)
        return None


def _bounded(op: Callable[[], Any]) -> Any:
    """``op()`` in a daemon thread, given up after a few seconds: the store may belong to a process that died."""
    out: list[Any] = []

    def run():
        try:
            out.append(op())
        except Exception:  # noqa: BLE001
            out.append(None)

    t = threading.Thread(target=run, daemon=True, name="commlab-failure-board")
    t.start()
    t.join(_STORE_OP_S)
    return out[0] if out else None




