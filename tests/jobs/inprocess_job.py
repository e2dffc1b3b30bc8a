"""Run by tests/test_cluster.py under torchrun: launch() in-process, as every rank of the torchrun job."""

import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from commlab import RankError, launch
from commlab.collectives import ring_all_reduce
from commlab.launch import detect_launcher


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def ring(scale):
    return ring_all_reduce(torch.full((7,), scale * (dist.get_rank() + 1)))


def drop_a_send():
    # Rank 0 drops its send's handle and returns before rank 1 posts the receive: delivered all the same.
    if dist.get_rank() == 0:
        dist.isend(torch.arange(6, dtype=torch.float32), 1)
        dist.barrier()
        return "sent"
    dist.barrier()
    x = torch.empty(6)
    dist.recv(x, 0)
    return x.sum().item()


@record
def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert detect_launcher() == "torchrun"
    assert launch(rank_and_size, world) == [(r, world) for r in range(world)]
    assert dist.is_initialized()  # launch() set the group up; it stays for the next launches
    # Further launches in the same process reuse the group; sends work once each launch's tracker is removed.
    total = sum(range(1, world + 1))
    assert all(t.tolist() == [2.0 * total] * 7 for t in launch(ring, world, 2.0))
    assert launch(drop_a_send, world) == ["sent", 15.0]
    try:
        launch(rank_and_size, world + 1)
        raise AssertionError("a world-size mismatch was accepted")
    except ValueError as e:
        assert f"launch(fn, {world + 1}) runs under torchrun, whose job has {world} rank(s)" in str(e), e
    try:
        launch(launch, world, rank_and_size, world)  # a launch inside a launched function
        raise AssertionError("a nested launch was accepted")
    except RankError as e:
        assert "launch() was called inside a function that launch() runs under torchrun/srun" in str(e), e
    print(f"in-process checks passed on rank {rank}", flush=True)
    # Tear the group down while both ranks are alive: left to interpreter shutdown, gloo's threads can be
    # destroyed still joinable ("terminate called without an active exception", seen once under load).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
