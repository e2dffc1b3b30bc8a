"""Run by tests/test_cluster.py under torchrun: each in-process launch() bounds its collectives by its own timeout.

``python inprocess_timeout_job.py MODE``:

* ``short_then_long``: launch(timeout=1), then a launch with timeout=20 in which rank 0 works alone for 5 s
  before an AllReduce: it must succeed (the second launch's collectives wait 22 s, not the first's 3 s).
* ``skip``: init_from_env(timeout=120) first, then launch(timeout=2) in which rank ``SKIP`` skips an
  AllReduce: the launch fails within seconds (its own timeout, not the group's 120 s), and every rank names
  the ranks still running and the one that finished.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from commlab import launch
from commlab.launch import LaunchError, init_from_env

SKIP = 1


def all_reduce_one():
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def rank0_alone_first():
    if dist.get_rank() == 0:
        time.sleep(5)
    return all_reduce_one()


def skip_an_all_reduce():
    x = torch.ones(4)
    if dist.get_rank() != SKIP:
        dist.all_reduce(x)
    return x.sum().item()


def say(line):
    # One write per line: ranks share the pipe, and print's separate writes of text and newline can interleave.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@record
def main():
    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "short_then_long":
        assert launch(all_reduce_one, world, timeout=1) == [float(world)] * world
        assert launch(rank0_alone_first, world, timeout=20) == [float(world)] * world
        say(f"rank {rank}: the second launch kept its own timeout")
    elif mode == "skip":
        init_from_env("gloo", timeout=120)
        start = time.monotonic()
        try:
            launch(skip_an_all_reduce, world, timeout=2)
        except LaunchError as e:
            say(f"rank {rank} after {time.monotonic() - start:.0f} s: {type(e).__name__}: {e}".splitlines()[0])
            raise
        raise AssertionError("a skipped collective went unnoticed")


if __name__ == "__main__":
    main()
