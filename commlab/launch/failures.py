"""Jobs that fail on purpose, one per common failure of a distributed job, to see what each one prints.

Run under torchrun::

    torchrun --standalone --nproc-per-node 2 -m commlab.launch.failures shape     # ranks disagree on a size
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 -m commlab.launch.failures order
    torchrun --standalone --nproc-per-node 2 -m commlab.launch.failures timeout --timeout 3

``shape``: rank 0 all-reduces 4 elements, the others 5. ``order``: rank 0 calls AllReduce then Broadcast, the
others the reverse (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names both). ``timeout``: the last rank sleeps past the
group's timeout. A failing rank prints ``rank R: ErrorType: message`` and exits 1 :data:`GRACE_S` s later. The
hang clinic (:mod:`commlab.launch.clinic`) adds ``dtype``, ``exit``, ``kill``, ``send-first`` and ``recv-first``
(:data:`JOBS`), runs a job through either door (:func:`clinic_rank`), and with ``--evidence DIR`` each rank leaves
its Flight Recorder dump and Python stacks there (:func:`evidence`). Chapter 14, section 14.4.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from typing import Iterator

import torch
import torch.distributed as dist

from commlab.launch.device import group_device
from commlab.launch.env import init_from_env

__all__ = ["JOBS", "GRACE_S", "main", "faulty_rank", "run_job", "evidence", "clinic_rank", "FR_PREFIX",
           "STACKS_PREFIX"]

#: Seconds a failed rank waits before it exits, so that its peers' messages get out too.
GRACE_S = 2.0

#: The failures this module can make, with what each one does wrong.
JOBS = {
    "shape": "rank 0 all-reduces 4 elements, the other ranks 5",
    "order": "rank 0 calls AllReduce then Broadcast, the other ranks Broadcast then AllReduce",
    "timeout": "the last rank sleeps for twice the timeout before its AllReduce",
    "dtype": "the last rank all-reduces float64, the other ranks float32",
    "exit": "the last rank ends with os._exit(3) before the AllReduce its peers call",
    "kill": "rank 1 is killed by SIGKILL before the AllReduce its peers call",
    "send-first": "a pipeline whose last stage sends its gradient before it receives the activation (blocking sends)",
    "recv-first": "a pipeline whose first stage waits for the gradient before it sends the activation",
}

#: File names (``PREFIX + str(rank)``) of each rank's Flight Recorder dump and Python stacks under ``--evidence``.
FR_PREFIX = "fr_trace_"
STACKS_PREFIX = "stacks_"


def faulty_rank(job: str, world_size: int) -> int:
    """The rank that ``job`` makes faulty in a job of ``world_size`` ranks (the others do what the job should)."""
    if job in ("shape", "order", "recv-first"):
        return 0
    if job == "kill":
        return 1
    return world_size - 1


def _shape(rank: int, device: torch.device) -> None:
    x = torch.ones(4 if rank == 0 else 5, device=device)
    dist.all_reduce(x)


def _order(rank: int, device: torch.device) -> None:
    x = torch.ones(4, device=device)
    if rank == 0:
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
    else:
        dist.broadcast(x, src=0)
        dist.all_reduce(x)


def _dtype(rank: int, world_size: int, device: torch.device) -> None:
    x = torch.ones(4, dtype=torch.float64 if rank == faulty_rank("dtype", world_size) else torch.float32,
                   device=device)
    dist.all_reduce(x)


def _absent(rank: int, world_size: int, device: torch.device, timeout: float) -> None:
    if rank == world_size - 1:
        time.sleep(2 * timeout)
    dist.all_reduce(torch.ones(1, device=device))


def _dies(job: str, rank: int, world_size: int, device: torch.device) -> None:
    if rank == faulty_rank(job, world_size):
        sys.stdout.flush()
        if job == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1, device=device))


def _pipeline(job: str, rank: int, world_size: int, device: torch.device) -> None:
    # Stage r receives the activation from r - 1 and sends it to r + 1, then the gradient goes back the same way.
    # gloo's send returns only once its receiver has posted the matching receive, whatever the size.
    act, grad = torch.ones(4, device=device), torch.ones(4, device=device)
    first, last = rank == 0, rank == world_size - 1
    bad = rank == faulty_rank(job, world_size)
    if bad and job == "send-first":
        dist.send(grad, dst=rank - 1)
    if bad and job == "recv-first":
        dist.recv(grad, src=rank + 1)
    if not first:
        dist.recv(act, src=rank - 1)
    if not last:
        dist.send(act, dst=rank + 1)
    if not last and not (bad and job == "recv-first"):
        dist.recv(grad, src=rank + 1)
    if not first and not (bad and job == "send-first"):
        dist.send(grad, dst=rank - 1)


def run_job(job: str, rank: int, world_size: int, device: torch.device, timeout: float) -> None:
    """Run ``job`` (a key of :data:`JOBS`) as ``rank`` of an initialised group of ``world_size`` ranks.

    Raises:
        ValueError: an unknown job, or a pipeline job on fewer than 2 ranks. Whatever the collectives raise.
    """
    if job not in JOBS:
        raise ValueError(f"job must be one of {sorted(JOBS)}, got {job!r}")
    if job in ("send-first", "recv-first", "kill") and world_size < 2:
        raise ValueError(f"job {job!r} needs world_size >= 2, got {world_size}")
    if job == "shape":
        _shape(rank, device)
    elif job == "order":
        _order(rank, device)
    elif job == "timeout":
        _absent(rank, world_size, device, timeout)
    elif job == "dtype":
        _dtype(rank, world_size, device)
    elif job in ("exit", "kill"):
        _dies(job, rank, world_size, device)
    else:
        _pipeline(job, rank, world_size, device)


def _dump_flight_recorder(path: str) -> None:
    from torch._C._distributed_c10d import _dump_fr_trace  # torch >= 2.6; the pickle fr_trace reads
    data = _dump_fr_trace()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def evidence(directory: str | None, rank: int, dump_after_s: float) -> Iterator[None]:
    """Within the block, leave this rank's evidence of a hang in ``directory`` (nothing if None).

    ``STACKS_PREFIX + rank``: the Python stacks of every thread ``dump_after_s`` s after entry if the block is
    still running (``faulthandler.dump_traceback`` from a thread: a collective's wait releases the GIL), the stack
    at a fatal signal or SIGTERM (``faulthandler.enable``, ``register``), or the traceback of the exception raised.
    ``FR_PREFIX + rank``: the Flight Recorder's pickle (``torch._C._distributed_c10d._dump_fr_trace``) at the same
    moment or at the exception; a rank killed by a signal leaves none.
    """
    if directory is None:
        yield
        return
    stacks = open(os.path.join(directory, f"{STACKS_PREFIX}{rank}"), "w", encoding="utf-8")  # noqa: SIM115
    fr_path = os.path.join(directory, f"{FR_PREFIX}{rank}")
    done = threading.Event()

    def later() -> None:
        # One thread does both, one after the other: faulthandler's own timer, dumping the threads while this one
        # ran the Flight Recorder's dump, crashed a rank now and then (SIGSEGV).
        if not done.wait(dump_after_s):
            try:
                _dump_flight_recorder(fr_path)
            except Exception as e:  # noqa: BLE001 - the stacks still tell
                stacks.write(f"flight recorder dump failed: {e}\n")
                stacks.flush()
            if not done.is_set():
                faulthandler.dump_traceback(file=stacks, all_threads=True)

    was_enabled = faulthandler.is_enabled()
    faulthandler.enable(file=stacks)
    # torchrun ends the other workers with SIGTERM when one fails: their stacks at that moment, then the default.
    faulthandler.register(signal.SIGTERM, file=stacks, chain=True)
    timer = threading.Thread(target=later, name="commlab-fr-dump", daemon=True)
    timer.start()
    try:
        yield
    except Exception as e:
        if not done.is_set():
            done.set()
            stacks.write(f"Exception {type(e).__name__} (most recent call first):\n")
            for fr in reversed(traceback.extract_tb(e.__traceback__)):
                stacks.write(f'  File "{fr.filename}", line {fr.lineno} in {fr.name}\n')
            stacks.flush()
            if not os.path.exists(fr_path):
                _dump_flight_recorder(fr_path)
        raise
    finally:
        done.set()
        faulthandler.unregister(signal.SIGTERM)
        if was_enabled:
            faulthandler.enable(file=sys.stderr)
        else:
            faulthandler.disable()
        stacks.close()


def clinic_rank(job: str, timeout: float, directory: str | None = None, dump_after_s: float | None = None) -> str:
    """One rank of ``job`` under :func:`commlab.launch.launch`: collectives time out after ``timeout`` s, and
    with ``directory`` the rank leaves its evidence there (:func:`evidence`, after ``dump_after_s``, default
    0.75 ``timeout``). A failure is printed ``rank R: ErrorType: message``, as under torchrun, and raised."""
    from commlab.launch.inprocess import collective_timeout
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        with collective_timeout(timeout), evidence(directory, rank, dump_after_s or 0.75 * timeout):
            run_job(job, rank, world_size, group_device(), timeout)
    except Exception as e:
        sys.stderr.write(f"rank {rank}: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        raise
    return f"rank {rank}: {job} went through"


def main(argv: list[str] | None = None) -> int:
    """``python -m commlab.launch.failures JOB [--timeout S]``, one process per rank under torchrun."""
    p = argparse.ArgumentParser(prog="python -m commlab.launch.failures", description=__doc__.split("\n\n")[0])
    p.add_argument("job", choices=sorted(JOBS), help="; ".join(f"{k}: {v}" for k, v in JOBS.items()))
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds every rank waits for its peers in a collective (default 10)")
    p.add_argument("--evidence", default=None, metavar="DIR",
                   help="leave each rank's Flight Recorder dump and Python stacks in DIR (the hang clinic)")
    args = p.parse_args(argv)
    ctx = init_from_env(timeout=args.timeout)
    device = group_device()
    try:
        with evidence(args.evidence, ctx.rank, 0.75 * args.timeout):
            run_job(args.job, ctx.rank, ctx.world_size, device, args.timeout)
    except Exception as e:  # noqa: BLE001 - what the collective raised is what this module is for
        # One write, so that two ranks' lines on the shared stderr cannot interleave mid-line.
        sys.stderr.write(f"rank {ctx.rank}: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        time.sleep(GRACE_S)
        return 1
    print(f"rank {ctx.rank}: {args.job} went through", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
