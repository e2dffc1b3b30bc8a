"""Jobs that fail on purpose, one per common failure of a distributed job, to see what each one prints.

Run under torchrun::

    torchrun --standalone --nproc-per-node 2 -m commlab.launch.failures shape     # ranks disagree on a size
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 -m commlab.launch.failures order
    torchrun --standalone --nproc-per-node 2 -m commlab.launch.failures timeout --timeout 3

``shape``: rank 0 all-reduces 4 elements, the others 5. ``order``: rank 0 calls AllReduce then Broadcast, the
others the reverse; ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names both at the first wrong call. ``timeout``: the last
rank sleeps twice ``--timeout`` before its AllReduce, and the others give up after the group's timeout. A rank
whose collective fails prints ``rank R: ErrorType: message`` on stderr and exits 1 :data:`GRACE_S` s later
(torchrun stops the other workers at the first failure, which could cut their messages short). Every job
initialises through :func:`commlab.launch.init_from_env`. Chapter 14, section 14.4.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from commlab.launch.device import group_device
from commlab.launch.env import init_from_env

__all__ = ["JOBS", "GRACE_S", "main"]

#: Seconds a failed rank waits before it exits, so that its peers' messages get out too.
GRACE_S = 2.0

#: The failures this module can make, with what each one does wrong.
JOBS = {
    "shape": "rank 0 all-reduces 4 elements, the other ranks 5",
    "order": "rank 0 calls AllReduce then Broadcast, the other ranks Broadcast then AllReduce",
    "timeout": "the last rank sleeps for twice the timeout before its AllReduce",
}


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


def main(argv: list[str] | None = None) -> int:
    """``python -m commlab.launch.failures JOB [--timeout S]``, one process per rank under torchrun."""
    p = argparse.ArgumentParser(prog="python -m commlab.launch.failures", description=__doc__.split("\n\n")[0])
    p.add_argument("job", choices=sorted(JOBS), help="; ".join(f"{k}: {v}" for k, v in JOBS.items()))
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds every rank waits for its peers in a collective (default 10)")
    args = p.parse_args(argv)
    ctx = init_from_env(timeout=args.timeout)
    device = group_device()
    try:
        if args.job == "shape":
            _shape(ctx.rank, device)
        elif args.job == "order":
            _order(ctx.rank, device)
        else:
            if ctx.rank == ctx.world_size - 1:
                time.sleep(2 * args.timeout)
            dist.all_reduce(torch.ones(1, device=device))
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
