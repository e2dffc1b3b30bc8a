"""Two torchrun agents as two "nodes" on loopback, the failures a cluster job meets, and the SLURM template.

Every job here runs the documented per-node command (``python -m commlab.launch.torchrun ...``, started by
:func:`commlab.launch.torchrun.run_local_nodes`) on gloo, and every test checks that no process of the job is
left behind. Each case is bounded: ``run_local_nodes`` stops nodes still running at its deadline, and the
tests assert that none had to be stopped. The tests named ``test_torchs_...`` run torch's own pieces alone and
show, at the pinned torch, what the per-node command adds to them.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from commlab.launch.torchrun import free_port, run_local_nodes
from tests.helpers import processes_mentioning

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELFTEST = ["-m", "commlab", "selftest"]


def _run_id():
    return f"commlab-test-{uuid.uuid4().hex[:12]}"


def _assert_nothing_left(*tokens):
    """No process mentions any of ``tokens`` (a run id: on the agents' command lines and in the workers'
    environment) any more."""
    for _ in range(100):  # processes that are exiting may still be listed for a moment
        left = sorted({pid for t in tokens for pid in processes_mentioning(t)})
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of the job ({tokens}) still running: {left}")


def test_two_nodes_pass_the_selftest():
    run_id = _run_id()
    nodes = run_local_nodes(2, 2, SELFTEST, run_id=run_id, timeout_s=150, join_timeout_s=60)
    assert [(n.returncode, n.stopped) for n in nodes] == [(0, False), (0, False)], [n.output for n in nodes]
    tables = [n.output for n in nodes if "# commlab selftest" in n.output]
    assert len(tables) == 1  # printed by global rank 0 only, on whichever node it is
    table = tables[0]
    assert "4 rank(s), backend gloo, launcher torchrun" in table
    assert "mesh 2 (DP) x 2 (TP): TP groups inside a node" in table
    assert "# 11 of 11 checks passed" in table and "FAILED" not in table
    _assert_nothing_left(run_id)


def test_a_rank_that_raises_is_the_root_cause_on_every_node():
    """Every node prints torchrun's summary: node 0's store outlives its agent, which in torch 2.13 returns at once
    on a failure, taking the store it hosted (see the test of torch's own agents below)."""
    run_id = _run_id()
    nodes = run_local_nodes(2, 2, SELFTEST + ["--fail-rank", "3"], run_id=run_id, timeout_s=150, join_timeout_s=60)
    assert all(n.returncode != 0 and not n.stopped for n in nodes)
    for n in nodes:
        # torchrun's summary, from the error files that record() wrote: on each node the first failure it saw,
        # which on the node without rank 3 is a peer's reaction, named for what it reacts to.
        assert "Root Cause (first observed failure)" in n.output, n.output
        summary = n.output[n.output.index("Root Cause (first observed failure)"):]
        assert "RankError: rank 3 of 4 failed with RuntimeError: selftest: rank 3 fails on purpose (--fail-rank 3)" \
            in summary
        assert 'raise RuntimeError(f"selftest: rank {fail_rank} fails on purpose' in summary  # the traceback
        assert "error_file:" in summary
    _assert_nothing_left(run_id)


@pytest.mark.timing
def test_a_node_that_never_joins_fails_within_the_join_timeout_naming_who_came():
    """torchrun bounds the wait by join_timeout but raises a bare RendezvousTimeoutError; the node names who came."""
    run_id = _run_id()
    start = time.monotonic()
    (node0,) = run_local_nodes(2, 2, SELFTEST, nodes=[0], run_id=run_id, timeout_s=60, join_timeout_s=5)
    assert node0.returncode == 1 and not node0.stopped
    assert "RendezvousTimeoutError" in node0.output  # torchrun's own word, and all it says
    assert "did not complete (torchrun's own error is above): 1 of 2 nodes had joined (node 0 (" in node0.output
    assert "never joined: node 1" in node0.output
    assert time.monotonic() - start < 60
    _assert_nothing_left(run_id)


@pytest.mark.timing
def test_a_port_already_in_use_stops_node_zero_with_torchs_error_and_the_others_after_the_probe():
    """Node 0 fails to host the store with torch's own EADDRINUSE error; the other nodes, whose torchrun would wait
    for good on a port that is not a store (see the test of torch's store client below), stop after PROBE_S."""
    run_id = _run_id()
    start = time.monotonic()
    with socket.socket() as holder:  # another program listening on the rendezvous port
        holder.bind(("127.0.0.1", 0))
        holder.listen(8)
        port = holder.getsockname()[1]
        node0, node1 = run_local_nodes(2, 2, SELFTEST, port=port, run_id=run_id, timeout_s=90, join_timeout_s=30)
    assert node0.returncode == 1 and not node0.stopped
    assert f"cannot host the rendezvous store at 127.0.0.1:{port}: " in node0.output
    assert "EADDRINUSE" in node0.output and "address already in use" in node0.output  # torch's words
    assert node1.returncode == 1 and not node1.stopped
    assert f"127.0.0.1:{port} accepts connections but does not answer as a torch rendezvous store" in node1.output
    assert time.monotonic() - start < 60  # PROBE_S and two interpreters starting, not join_timeout
    _assert_nothing_left(run_id)


@pytest.mark.timing
def test_torchs_store_client_waits_past_its_timeout_on_a_port_that_is_not_a_store():
    """Why the per-node command probes the endpoint (torch 2.13): a TCPStore client whose endpoint accepts the
    connection but never answers does not give up at its timeout, so a plain torchrun there waits for good."""
    import datetime
    import threading

    import torch.distributed as dist

    def connect(port):
        try:
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1))
        except Exception:  # noqa: BLE001 - it fails once the listener below closes
            pass

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(8)
        client = threading.Thread(target=connect, args=(holder.getsockname()[1],), daemon=True)
        client.start()
        client.join(6.0)
        assert client.is_alive()  # still waiting, 6 times its 1 s timeout later
    client.join(10.0)  # the listener has closed: the handshake fails and the thread ends


_SLEEP_JOB = """
import os, time, torch.distributed as dist
dist.init_process_group("gloo")
if os.environ["COMMLAB_TEST_FAIL_HERE"] == "1" and os.environ["LOCAL_RANK"] == "0":
    raise RuntimeError("fails on purpose")
time.sleep(60)
"""


@pytest.mark.timing
def test_torchs_agents_lose_the_store_when_the_agent_hosting_it_fails_first(tmp_path):
    """Why node 0 hosts the store and keeps it up (torch 2.13): an agent whose worker fails returns at once
    (SimpleElasticAgent._invoke_run calls _exit_barrier on success only), and the store it hosted goes with it;
    another node's agent, whose workers still run, then crashes with RendezvousConnectionError and prints no
    summary. Plain torchrun agents, the hosting one (is_host=1) with the failing worker."""
    job = tmp_path / "sleep_job.py"
    job.write_text(_SLEEP_JOB)
    run_id, port = _run_id(), free_port()
    procs = []
    for hosts in (1, 0):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "--max-restarts", "0", "--rdzv-conf", f"join_timeout=60,is_host={hosts}", "--local-addr", "127.0.0.1",
               str(job)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1", COMMLAB_TEST_FAIL_HERE=str(hosts))))
    start = time.monotonic()
    host, other = (p.communicate(timeout=150)[0] for p in procs)
    assert procs[0].returncode == 1 and "Root Cause (first observed failure)" in host, host
    assert "RuntimeError: fails on purpose" in host
    assert procs[1].returncode == 1
    assert "RendezvousConnectionError" in other and "Root Cause" not in other, other
    assert time.monotonic() - start < 50  # the other node's workers would sleep 60 s: its agent did not wait
    _assert_nothing_left(run_id)


def test_a_second_node_zero_gets_torchs_address_in_use_error():
    from commlab.launch.torchrun import _stop_session, node_command
    run_id, port = _run_id(), free_port()
    cmd = node_command(0, 2, 1, f"127.0.0.1:{port}", run_id, SELFTEST, join_timeout_s=30, local_addr="127.0.0.1")
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        for _ in range(300):  # until node 0's torchrun hosts the store
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # the same --node-rank 0
    finally:
        _stop_session(first)
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"[commlab node 0] cannot host the rendezvous store at 127.0.0.1:{port}: " in second.stderr
    assert "EADDRINUSE" in second.stderr  # torch's words
    _assert_nothing_left(run_id)


def test_launch_runs_in_process_under_torchrun():
    run_id = _run_id()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--rdzv-id", run_id, os.path.join(ROOT, "tests", "jobs", "inprocess_job.py")],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"in-process checks passed on rank {r}" in proc.stdout for r in range(2))
    # --standalone makes its own run id for the workers: they are found by their script instead.
    _assert_nothing_left(run_id, os.path.join("tests", "jobs", "inprocess_job.py"))


TIMEOUT_JOB = os.path.join("tests", "jobs", "inprocess_timeout_job.py")


def _torchrun_job(nproc, *argv, timeout=120):
    run_id = _run_id()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "--max-restarts", "0", "--rdzv-id", run_id, os.path.join(ROOT, *argv[:1]),
                           *argv[1:]], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=timeout)
    _assert_nothing_left(run_id, argv[0])
    return proc


def test_each_in_process_launch_bounds_its_collectives_by_its_own_timeout():
    # The first launch (timeout=1) made the group; the second (timeout=20) has rank 0 work alone for 5 s before
    # an AllReduce: with the first launch's timeout kept, rank 1 would give up after 3 s.
    proc = _torchrun_job(2, TIMEOUT_JOB, "short_then_long")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"rank {r}: the second launch kept its own timeout" in proc.stdout for r in range(2))


def test_under_torchrun_a_rank_that_skips_a_collective_is_named_by_every_rank():
    # Rank 1 skips an AllReduce; the group was made by init_from_env(timeout=120), the launch has timeout=2.
    # The job ends in seconds (within this test's 60 s), and whoever reports names the same ranks.
    proc = _torchrun_job(3, TIMEOUT_JOB, "skip", timeout=60)
    assert proc.returncode != 0
    verdict = "all 3 ranks joined, ranks [0, 2] were still running (finished: [1])"
    summary = proc.stderr[proc.stderr.index("Root Cause (first observed failure)"):]
    assert f"LaunchTimeout: launch timed out after 2 s: {verdict}" in summary, proc.stdout + proc.stderr
    reports = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert reports and all(verdict in line for line in reports), reports


def _free_slurm_job_id():
    # The template derives its port from the job id (20000 + id % 10000): pick an id whose port is free.
    for job in range(4242, 14242):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job % 10000))
                return job
            except OSError:
                continue
    pytest.skip("no free port in 20000..29999")


def _template_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.skipif(shutil.which("srun") is not None, reason="srun is installed: the template would submit a step")
def test_the_slurm_template_runs_the_capstone(tmp_path):
    job = _free_slurm_job_id()
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm", "commlab.sbatch"),
                           os.path.join(ROOT, "labs", "capstone", "train.py"), "--tp", "2", "--steps", "2",
                           "--no-plan", "--log-file", str(tmp_path / "run.jsonl")],
                          env=_template_env(SLURM_JOB_ID=str(job), SLURM_JOB_NODELIST="localhost",
                                            SLURM_JOB_NUM_NODES="1", NPROC_PER_NODE="2", JOIN_TIMEOUT="60"),
                          capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tp=2 pp=1 dp=1: loss" in proc.stdout
    assert len((tmp_path / "run.jsonl").read_text().splitlines()) == 2
    _assert_nothing_left(f"--rdzv-id\0{job}\0", f"TORCHELASTIC_RUN_ID={job}\0")


@pytest.mark.skipif(shutil.which("srun") is not None, reason="srun is installed: the template would submit a step")
@pytest.mark.skipif(not os.access(os.path.join(ROOT, ".venv", "bin", "python"), os.X_OK),
                    reason="no .venv in this checkout (scripts/setup.sh makes it)")
def test_the_slurm_template_runs_one_node_without_srun_with_the_checkouts_venv_and_nothing_on_path():
    # No PYTHON, no virtual environment activated, a bare PATH: what a batch job on a fresh login gets.
    job = _free_slurm_job_id()
    proc = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", f"SLURM_JOB_ID={job}", "SLURM_JOB_NODELIST=localhost",
                           "SLURM_JOB_NUM_NODES=1", "NPROC_PER_NODE=2", "JOIN_TIMEOUT=60", "OMP_NUM_THREADS=1",
                           "bash", "scripts/slurm/commlab.sbatch"],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"commlab: python {ROOT}/.venv/bin/python" in proc.stdout
    assert f"rendezvous localhost:{20000 + job % 10000} (job {job}): -m commlab selftest" in proc.stdout
    assert "srun not found: running this node's command directly (one node)" in proc.stdout
    assert "2 rank(s), backend gloo, launcher torchrun" in proc.stdout
    assert "# 11 of 11 checks passed" in proc.stdout
    _assert_nothing_left(f"--rdzv-id\0{job}\0", f"TORCHELASTIC_RUN_ID={job}\0")


def test_the_slurm_template_without_a_python_that_has_commlab_says_what_to_do(tmp_path):
    bare = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "bash", "-c", "python3 -c 'import commlab'"],
                          capture_output=True)
    if bare.returncode == 0:
        pytest.skip("python3 on /usr/bin can import commlab: the template would use it")
    copy = tmp_path / "scripts" / "slurm"
    copy.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "slurm", "commlab.sbatch"), copy)  # a checkout without .venv
    proc = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "SLURM_JOB_ID=5", "SLURM_JOB_NODELIST=localhost",
                           "bash", "scripts/slurm/commlab.sbatch"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"commlab: no Python with commlab installed: PYTHON is not set, there is no .venv/bin/python in {tmp_path}" \
        in proc.stderr
    assert "Run bash scripts/setup.sh in the checkout and submit from there, or export PYTHON=" in proc.stderr
    bad = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "PYTHON=/bin/true-python", "SLURM_JOB_ID=5",
                          "SLURM_JOB_NODELIST=localhost", "bash", "scripts/slurm/commlab.sbatch"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "PYTHON=/bin/true-python cannot import commlab" in bad.stderr


@pytest.mark.skipif(shutil.which("srun") is not None, reason="srun is installed")
def test_the_slurm_template_refuses_several_nodes_without_srun():
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm", "commlab.sbatch"), "train.py"],
                          env=_template_env(SLURM_JOB_ID="5", SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_NUM_NODES="2"),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "rendezvous n1:20005" in proc.stdout
    assert "srun not found, and 2 nodes cannot be started from here" in proc.stderr


def test_bench_runs_on_two_local_torchrun_nodes():
    proc = subprocess.run([sys.executable, "-m", "commlab", "bench", "--torchrun", "2x2", "-b", "1K", "-e", "4K",
                           "-f", "4", "-r", "1"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "# torchrun: 2 local node(s) x 2 process(es)" in out
    assert "# AllReduce, 4 ranks, backend gloo" in out and out.count(" float32 ") == 2
    assert "# out of bounds values: 0 OK" in out


@pytest.mark.parametrize("argv, message", [
    (["--torchrun", "2"], "--torchrun takes NODESxPROCS"),
    (["--torchrun", "2x2", "-n", "3"], "does not match --torchrun 2x2"),
    (["--torchrun", "2x2", "--overlap"], "under torchrun (and with --torchrun) only the AllReduce table"),
])
def test_bench_torchrun_flag_refuses_what_it_cannot_do(argv, message):
    proc = subprocess.run([sys.executable, "-m", "commlab", "bench", *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr


def test_the_leftover_check_sees_a_process_of_the_job():
    # The check above is only worth something if it finds what is there.
    token = _run_id()
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)",
                             "--rdzv-id", token], env=dict(os.environ, TORCHELASTIC_RUN_ID=token + "-w"),
                            stdout=subprocess.PIPE, text=True)
    try:
        # Until the child has exec'd, /proc shows the parent's command line and environment: wait for its word.
        assert proc.stdout.readline() == "up\n"
        assert processes_mentioning(token) == [proc.pid]
        assert processes_mentioning(f"TORCHELASTIC_RUN_ID={token}-w\0") == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    _assert_nothing_left(token)


# ------------------------------------------------------------------ the per-node command's arguments (no processes)

def _torchrun_argv(text, environ=None):
    from commlab.launch.torchrun import _plan
    return _plan(text.split(), environ or {})


def test_node_zero_hosts_the_store_and_node_rank_is_kept_from_torchrun():
    plan = _torchrun_argv("--nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint h:123 "
                          "--rdzv-id x --rdzv-conf join_timeout=5 -m commlab selftest --fail-rank 1")
    assert (plan.node_rank, plan.host, plan.port, plan.join_timeout_s) == (1, "h", 123, 5.0)
    assert plan.argv == ["--rdzv-conf", "join_timeout=5,is_host=0", "--nnodes", "2", "--nproc-per-node", "2",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:123", "--rdzv-id", "x",
                         "-m", "commlab", "selftest", "--fail-rank", "1"]  # the job's own --fail-rank untouched
    head = _torchrun_argv("--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint h --rdzv-id x t.py",
                          {"SLURM_NODEID": "0"})
    # Node 0's command hosts the store itself, so its torchrun joins as a client too; an explicit is_host wins.
    assert (head.node_rank, head.port, head.hosts_store) == (0, 29400, True)
    assert head.argv[:2] == ["--rdzv-conf", "is_host=0"] and not plan.hosts_store
    own = _torchrun_argv("--nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint h "
                         "--rdzv-id x --rdzv-conf is_host=1 t.py")
    assert own.argv[:2] == ["--rdzv-conf", "is_host=1"] and not own.hosts_store


@pytest.mark.parametrize("argv, message", [
    ("--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint h:1 --rdzv-id x t.py",
     "--nnodes 2 needs --node-rank on every node (0 on the node at --rdzv-endpoint h:1"),
    ("--nnodes 2 --node-rank 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint h:1 --rdzv-id x t.py",
     "--node-rank 2 is out of range: allowed 0..1"),
    ("--nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint h:99999 --rdzv-id x t.py",
     "the port must be an integer 1..65535"),
])
def test_the_per_node_command_refuses_what_cannot_work(argv, message, capsys):
    from commlab.launch.torchrun import main
    assert main(argv.split()) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timing
def test_node_zero_on_a_host_that_is_not_this_machine_gets_torchs_connect_timeout():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "commlab.launch.torchrun", "--nnodes", "2", "--node-rank", "0",
                           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.1:29400",
                           "--rdzv-id", "x", "t.py"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "cannot host the rendezvous store at 192.0.2.1:29400: " in proc.stderr
    assert "timed out after 10000ms while trying to connect to (192.0.2.1, 29400)" in proc.stderr  # torch's words
    assert time.monotonic() - start < 55


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "0"], "argument --timeout: must be a positive, finite number of seconds, got '0'"),
    (["--timeout", "nan"], "argument --timeout: must be a positive, finite number of seconds, got 'nan'"),
    (["--backend", "nccl"], "--backend nccl needs CUDA GPUs and torch"),
])
def test_selftest_refuses_bad_arguments_like_argparse(argv, message):
    if argv[0] == "--backend":
        import torch
        if torch.cuda.is_available():
            pytest.skip("CUDA is visible: --backend nccl is valid here")
    proc = subprocess.run([sys.executable, "-m", "commlab", "selftest", *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"python -m commlab selftest: error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr
