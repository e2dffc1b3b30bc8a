"""The launcher: results in rank order, output in rank order, and every failure fast and clean."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from commlab import LaunchTimeout, RankError, launch
from tests.helpers import child_pids


def _rank_and_size():
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_results_come_back_in_rank_order(world_size):
    assert launch(_rank_and_size, world_size) == [(r, world_size) for r in range(world_size)]


def test_function_defined_locally_with_args_and_kwargs_works_under_fork():
    scale = 3

    def fn(a, *, b):
        return dist.get_rank() * scale + a + b

    assert launch(fn, 3, 1, b=10) == [11, 14, 17]


def test_tensors_round_trip_after_the_rank_exits():
    def fn():
        return torch.full((1000,), float(dist.get_rank()))

    out = launch(fn, 2)
    assert [t.sum().item() for t in out] == [0.0, 1000.0]


def test_output_is_printed_by_the_parent_in_rank_order(capsys):
    def fn():
        # Higher ranks print first: the parent must still print rank 0 first.
        time.sleep(0.05 * (3 - dist.get_rank()))
        print(f"hello from {dist.get_rank()}")
        os.write(1, f"raw fd write {dist.get_rank()}\n".encode())

    launch(fn, 3)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[rank")]
    assert lines == [f"[rank {r}] {text} {r}" for r in range(3) for text in ("hello from", "raw fd write")]


def test_launches_repeat_in_one_process_without_leftovers():
    for _ in range(5):
        assert launch(_rank_and_size, 2) == [(0, 2), (1, 2)]
    assert child_pids() == []


@pytest.mark.timing
def test_a_rank_that_raises_is_named_with_its_traceback_and_peers_are_stopped():
    def fn():
        if dist.get_rank() == 2:
            raise ValueError("bad value in rank two")
        dist.barrier()  # the peers block here until the launcher stops them
        return "unreachable"

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fn, 4, timeout=20)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError"
    assert "bad value in rank two" in str(err)
    assert "rank 2 of 4" in str(err)
    assert 'raise ValueError("bad value in rank two")' in err.remote_traceback
    assert elapsed < 10, f"failure took {elapsed:.1f} s to surface"
    assert child_pids() == []


@pytest.mark.timing
def test_a_rank_that_exits_without_raising_is_reported():
    def fn():
        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fn, 3, timeout=20)
    assert info.value.rank == 1 and info.value.exc_type == "exit code 3"
    assert time.monotonic() - start < 10
    assert child_pids() == []


def test_a_rank_killed_by_a_signal_is_reported():
    def fn():
        if dist.get_rank() == 0:
            os.kill(os.getpid(), 9)
        dist.barrier()

    with pytest.raises(RankError) as info:
        launch(fn, 2, timeout=20)
    assert info.value.rank == 0 and info.value.exc_type == "killed by signal SIGKILL"
    assert child_pids() == []


@pytest.mark.timing
def test_a_rank_that_never_joins_times_out_naming_the_ranks_that_did():
    def never_joins(rank):
        if rank == 3:
            time.sleep(60)

    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_rank_and_size, 4, timeout=2, init_hook=never_joins)
    err = info.value
    assert time.monotonic() - start < 10
    assert err.joined == [0, 1, 2] and err.world_size == 4
    assert "never joined: [3]" in str(err)
    assert child_pids() == []


@pytest.mark.timing
def test_a_rank_that_skips_a_collective_fails_within_the_timeout():
    def fn():
        if dist.get_rank() != 1:
            dist.all_reduce(torch.ones(4))
        return dist.get_rank()

    start = time.monotonic()
    with pytest.raises((RankError, LaunchTimeout)):
        launch(fn, 3, timeout=3)
    assert time.monotonic() - start < 12
    assert child_pids() == []


def test_output_of_a_failed_launch_is_still_printed_in_rank_order(capsys):
    def fn():
        print("before")
        if dist.get_rank() == 0:
            raise RuntimeError("stop")
        dist.barrier()

    with pytest.raises(RankError):
        launch(fn, 2, timeout=10)
    out = capsys.readouterr().out
    assert out.index("[rank 0] before") < out.index("[rank 1] before")


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be an int >= 1"),
    (dict(world_size=2, backend="mpi"), "backend must be one of"),
    (dict(world_size=2, timeout=0), "timeout must be a positive"),
    (dict(world_size=2, threads_per_rank=0), "threads_per_rank"),
    (dict(world_size=2, start_method="forkserver"), "start_method must be"),
])
def test_bad_arguments_are_rejected_before_any_process_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch(_rank_and_size, **kwargs)
    assert child_pids() == []


def test_spawn_refuses_a_function_it_cannot_import():
    def local_fn():
        return 1

    with pytest.raises(ValueError, match="cannot import"):
        launch(local_fn, 2, start_method="spawn")
    assert child_pids() == []


@pytest.mark.slow
def test_spawn_runs_an_importable_function():
    assert launch(dist.get_world_size, 2, start_method="spawn", timeout=60) == [2, 2]


def test_nccl_without_gpus_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(RuntimeError, match="needs CUDA GPUs"):
        launch(_rank_and_size, 2, backend="nccl")


def _process_count_named(marker):
    import subprocess
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return len(out.split())


def test_processes_started_by_a_rank_are_ended_with_it():
    import subprocess

    marker = "sleep 7331"

    def fn():
        subprocess.Popen(marker.split())
        time.sleep(60)

    with pytest.raises(LaunchTimeout):
        launch(fn, 2, timeout=2)
    time.sleep(0.2)
    assert _process_count_named(marker) == 0


def test_a_rank_may_start_worker_processes():
    def fn():
        from torch.utils.data import DataLoader
        return sum(int(b.sum()) for b in DataLoader(list(range(8)), num_workers=2, batch_size=2))

    assert launch(fn, 2) == [28, 28]
    assert child_pids() == []


@pytest.mark.parametrize("timeout", [float("inf"), True, -1.0])
def test_timeouts_that_are_not_positive_finite_numbers_are_rejected(timeout):
    with pytest.raises(ValueError, match="positive, finite"):
        launch(_rank_and_size, 2, timeout=timeout)


def test_an_exception_whose_str_fails_is_still_reported():
    class Weird(Exception):
        def __str__(self):
            raise RuntimeError("no")

    def fn():
        raise Weird()

    with pytest.raises(RankError) as info:
        launch(fn, 1)
    assert info.value.exc_type == "Weird"


_KILLED_PARENT = """
import os, sys, time
from commlab.launch import launch
def body(path):
    with open(f"{path}.{os.getpid()}", "w"):
        pass
    time.sleep(120)
if __name__ == "__main__":
    launch(body, 3, sys.argv[1], timeout=300)
"""


@pytest.mark.slow
@pytest.mark.parametrize("watcher", [False, True], ids=["pdeathsig", "watcher-thread"])
def test_ranks_of_a_killed_parent_end_with_it(tmp_path, watcher):
    """`timeout 60 python script.py` sends SIGTERM to the parent only (each rank leads its own process group):
    the ranks must not live on, blocked, after it. The watcher thread is the path off Linux."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "job.py"
    source = _KILLED_PARENT
    if watcher:  # take the non-Linux path: the kernel is not asked to watch the parent
        source = source.replace("from commlab.launch import launch",
                                "from commlab.launch import launch, local\nlocal._USE_PDEATHSIG = False")
    script.write_text(source)
    marker = tmp_path / "rank"
    parent = subprocess.Popen([sys.executable, str(script), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank.*"))) < 3:
            assert parent.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("rank.*")]
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in pids if _is_running(p)]
        assert not alive, f"ranks {alive} outlived their parent"
    finally:
        parent.kill()
        for p in tmp_path.glob("rank.*"):
            try:
                os.kill(int(p.name.split(".")[1]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _is_running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"   # a zombie has exited
    except FileNotFoundError:
        return False
