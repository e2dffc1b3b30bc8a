"""One torchrun job on this machine from Python (commlab.launch.torchrun.run_standalone), the text it prints
made the same from run to run (tidy_output), and the jobs that fail on purpose (commlab.launch.failures):
each failure prints what chapter 14 says it prints, within its deadline, and leaves no process behind."""

import concurrent.futures
import socket
import sys
import uuid

import pytest

from commlab.launch.torchrun import run_standalone, tidy_output
from tests.helpers import processes_mentioning

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane


def _marker():
    return {"COMMLAB_TEST_JOB": uuid.uuid4().hex}


FAIL = ["-m", "commlab.launch.failures"]
# The failing jobs, started at once (three at a time): most of each one's time is spent waiting for its
# collective timeout, its grace period or its deadline, so together they take about as long as the slowest.
JOBS = {
    "order DETAIL": dict(job=FAIL + ["order", "--timeout", "20"], env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    "order": dict(job=FAIL + ["order", "--timeout", "2"], env={"TORCH_DISTRIBUTED_DEBUG": "OFF"}),
    "stuck": dict(job=FAIL + ["timeout", "--timeout", "2"]),
    "shape DETAIL": dict(job=FAIL + ["shape"], env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
}


@pytest.fixture(scope="module")
def failed():
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_standalone, nproc_per_node=2, timeout_s=120, **kw) for name, kw in JOBS.items()}
        return {name: f.result() for name, f in futures.items()}


def test_a_job_that_works_exits_zero_with_its_output():
    res = run_standalone(["-m", "commlab", "selftest"], 2, timeout_s=180).check()
    assert res.returncode == 0 and not res.stopped and res.seconds > 0
    assert "checks passed" in res.stdout
    assert "OMP_NUM_THREADS" not in res.stderr   # set for the job, so torchrun prints no banner


def test_an_order_mismatch_is_named_with_torch_distributed_debug_detail(failed):
    res = failed["order DETAIL"]
    assert res.returncode != 0 and not res.stopped
    assert "Detected mismatch between collectives on ranks" in res.stderr
    assert "rank 0: RuntimeError: Detected mismatch" in res.stderr and "rank 1: RuntimeError: Detected" in res.stderr
    assert "OpType=ALLREDUCE" in res.stderr and "OpType=BROADCAST" in res.stderr
    assert res.seconds < 60   # at the first wrong call, not after the 20 s timeout


def test_without_detail_the_same_mismatch_is_a_timeout_that_every_rank_reports(failed):
    # The first rank to time out closes its connections, so its peer reports either its own timeout or
    # "Connection closed by peer", depending on which of the two clocks ran out first (seen both ways).
    res = failed["order"]
    assert res.returncode != 0
    assert "Timed out waiting 2000ms" in res.stderr
    for rank in (0, 1):
        line = next(ln for ln in res.stderr.splitlines() if f"rank {rank}: RuntimeError:" in ln)
        assert "Timed out waiting 2000ms" in line or "Connection closed by peer" in line, line


def test_a_stuck_rank_makes_its_peers_time_out(failed):
    res = failed["stuck"]
    assert res.returncode != 0
    assert "rank 0: RuntimeError:" in res.stderr and "Timed out waiting 2000ms" in res.stderr


def test_shape_mismatch_is_named_with_detail(failed):
    res = failed["shape DETAIL"]
    assert res.returncode != 0
    assert "TensorShape=[4]" in res.stderr and "TensorShape=[5]" in res.stderr


def test_a_job_past_its_deadline_is_stopped_and_leaves_nothing_behind():
    env = _marker()
    res = run_standalone(["-m", "commlab.launch.failures", "timeout", "--timeout", "60"], 2, timeout_s=10, env=env)
    assert res.stopped and res.returncode != 0
    assert res.seconds < 45
    assert processes_mentioning(env["COMMLAB_TEST_JOB"]) == []
    with pytest.raises(RuntimeError, match="was stopped at its deadline"):
        res.check()


@pytest.mark.parametrize("kwargs, message", [
    (dict(job=[], nproc_per_node=2), "job is empty"),
    (dict(job=["x.py"], nproc_per_node=0), "nproc_per_node must be an int >= 1, got 0"),
    (dict(job=["x.py"], nproc_per_node=2, timeout_s=0), "timeout_s must be > 0 seconds, got 0"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_standalone(**kwargs)


def test_tidy_output_replaces_what_changes_between_runs():
    host = socket.gethostname()
    raw = ("USDT:2026-12-01 15:52:29 9147:9147 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
           "*****************************************\n"
           "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default\n"
           "W1201 15:53:39.229000 9882 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process "
           "9902 closing signal SIGTERM\n"
           f"exitcode  : -6 (pid: 9901) at 127.0.0.1:29400 on {host}, time 2026-12-01_15:53:39\n"
           f"port 38521 in /scratch/run7/ckpt and {sys.modules['commlab'].__file__}\n"
           "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed\n"
           "failed to listen on any local network address. port: 43211, useIpv6: false")
    got = tidy_output(raw, replace={"/scratch/run7": "DIR"})
    assert got.splitlines() == [
        "W torch/distributed/elastic/multiprocessing/api.py:1028] Sending process N closing signal SIGTERM",
        "exitcode  : -6 (pid: N) at 127.0.0.1:PORT on HOST, time TIME",
        "port PORT in DIR/ckpt and commlab/__init__.py",
        "RuntimeError: [gloo/gloo/transport/tcp/pair.cc:598] Connection closed",
        "failed to listen on any local network address. port: PORT, useIpv6: false",
    ]
