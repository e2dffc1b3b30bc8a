"""The cluster door: launcher variables read and checked, init_from_env, and launch() under srun."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from commlab import RankError, launch
from commlab.launch import DistContext, LauncherEnvError, detect_launcher, init_from_env, read_env
from commlab.launch.env import slurm_default_port, slurm_first_host, slurm_tasks_on_node
from commlab.launch.torchrun import free_port

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job7", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_JOB_ID": "123456"}


def test_torchrun_variables_are_read():
    env = read_env(TORCHRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == \
        ("torchrun", 5, 8, 1, 4, 1)
    assert dict(env.exports) == {}


def test_srun_variables_are_read_and_master_address_and_port_derived():
    env = read_env(SRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == \
        ("slurm", 5, 8, 1, 4, 1)
    assert env.exports == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                           "MASTER_ADDR": "gpu007", "MASTER_PORT": str(20000 + 123456 % 10000)}
    exported = read_env({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "31000"})
    assert "MASTER_ADDR" not in exported.exports and "MASTER_PORT" not in exported.exports


@pytest.mark.parametrize("env, launcher", [
    ({}, "none"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}, "none"),  # a batch script: not a step
    ({**SRUN, **TORCHRUN}, "torchrun"),                                          # srun torchrun: torchrun's
    ({**TORCHRUN, "COMMLAB_LAUNCH_RANK": "0"}, "commlab.launch"),                 # a forked rank, whatever it inherited
    ({"RANK": "0", "WORLD_SIZE": "2"}, "env"),
])
def test_which_launcher(env, launcher):
    assert detect_launcher(env) == launcher


@pytest.mark.parametrize("change, message", [
    ({"RANK": "8"}, "RANK=8 is out of range: this process's global rank (WORLD_SIZE=8), allowed 0..7"),
    ({"RANK": "-1"}, "RANK=-1 is out of range"),
    ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
    ({"WORLD_SIZE": "1_0"}, "WORLD_SIZE='1_0' is not an integer (decimal digits)"),  # int() reads it as 10
    ({"RANK": "\u0665"}, "RANK='\u0665' is not an integer"),                           # an Arabic-Indic 5
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is out of range"),
    ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is out of range: this process's index on its node (LOCAL_WORLD_SIZE=4), "
                          "allowed 0..3"),
    ({"LOCAL_WORLD_SIZE": "9"}, "LOCAL_WORLD_SIZE=9 is out of range"),
    ({"GROUP_RANK": "2"}, "GROUP_RANK=2 is out of range: this node's index, allowed 0..1 (2 nodes)"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range: the TCP port of the rendezvous store, "
                               "allowed 1..65535"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"LOCAL_RANK": None}, "LOCAL_RANK is not set"),
])
def test_bad_torchrun_variables_are_named_with_value_and_range(change, message):
    env = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    with pytest.raises(LauncherEnvError) as info:
        read_env(env)
    assert message in str(info.value)


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 is out of range: this task's rank (SLURM_STEP_NUM_TASKS=8), allowed 0..7"),
    ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID=4 is out of range"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2"}, "SLURM_STEP_TASKS_PER_NODE='4(x2' with SLURM_NODEID=1: cannot read"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
     "MASTER_ADDR is not set and cannot be taken from Slurm's node list"),
    ({"SLURM_JOB_ID": None}, "MASTER_PORT is not set and SLURM_JOB_ID=None gives no port"),
    ({"SLURM_JOB_ID": "\u00b2"}, "MASTER_PORT is not set and SLURM_JOB_ID='\u00b2' gives no port"),  # isdigit() accepts it
    ({"SLURM_STEP_NUM_TASKS": "8_0"}, "SLURM_STEP_NUM_TASKS='8_0' is not an integer"),
])
def test_bad_srun_variables_are_named(change, message):
    env = {k: v for k, v in {**SRUN, **change}.items() if v is not None}
    with pytest.raises(LauncherEnvError) as info:
        read_env(env)
    assert message in str(info.value)
    if "MASTER_ADDR" in message:
        assert "export MASTER_ADDR=" in str(info.value)


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("gpu[007-010,12]", "gpu007"), ("a,b", "a"), ("login[3,1],x[1-2]", "login3"),
    ("rack[1-2]-n[01-04]", "rack1-n01"), ("n[0009-0012]", "n0009"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert slurm_first_host(nodelist) == first


@pytest.mark.parametrize("bad", ["", "gpu[1-2", "gpu]1["])
def test_unreadable_node_lists_are_refused(bad):
    with pytest.raises(ValueError):
        slurm_first_host(bad)


def test_tasks_per_node():
    assert [slurm_tasks_on_node("4(x2),3", i) for i in range(3)] == [4, 4, 3]
    with pytest.raises(ValueError, match="node 3 is not among the 3 nodes"):
        slurm_tasks_on_node("4(x2),3", 3)
    assert slurm_default_port(123456) == 23456 and 20000 <= slurm_default_port(9999) < 30000


# -------------------------------------------------------------------------------- init_from_env, for real

def _clean_env(**extra):
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "COMMLAB_LAUNCH_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def _python(code, env, timeout=60):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_with_no_launcher_it_makes_a_world_of_one():
    proc = _python("""
        import torch.distributed as dist
        from commlab.launch import init_from_env
        ctx = init_from_env()
        assert init_from_env() == ctx                 # idempotent
        x = __import__("torch").ones(3); dist.all_reduce(x)
        try:
            init_from_env("nccl")
        except RuntimeError as e:
            print("refused:", e)
        print(ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend, ctx.device, ctx.launcher, x.tolist())
        dist.destroy_process_group()
    """, _clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "0 1 0 gloo cpu none [1.0, 1.0, 1.0]" in proc.stdout
    assert "refused: torch.distributed is already initialised with backend 'gloo'" in proc.stdout


def test_bad_variables_fail_before_anything_connects():
    proc = _python("from commlab.launch import init_from_env; init_from_env()",
                   _clean_env(RANK="4", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"))
    assert proc.returncode != 0
    assert "LauncherEnvError: RANK=4 is out of range: this process's global rank (WORLD_SIZE=4), allowed 0..3" \
        in proc.stderr


def test_nccl_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="backend 'nccl' needs CUDA"):
        init_from_env("nccl")
    assert not dist.is_initialized()


def test_bad_backend_and_timeout_are_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        init_from_env("mpi")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        init_from_env(timeout=0)


def _context_in_a_forked_rank():
    ctx = init_from_env()  # already initialised by launch(): returns the context, initialises nothing
    try:
        init_from_env("nccl")
    except RuntimeError as e:
        refused = "already initialised with backend 'gloo'" in str(e)
    return ctx, refused, detect_launcher()


def test_inside_a_forked_rank_it_returns_the_context():
    out = launch(_context_in_a_forked_rank, 2)
    assert [o[0] for o in out] == [DistContext(rank=r, world_size=2, local_rank=r, local_world_size=2, node_rank=0,
                                               backend="gloo", device=torch.device("cpu"),
                                               launcher="commlab.launch") for r in range(2)]
    assert all(o[1] for o in out) and all(o[2] == "commlab.launch" for o in out)


def _as_if_inherited(rank):
    # What a rank could inherit from a parent started inside a torchrun job or an srun step.
    os.environ.update(TORCHELASTIC_RUN_ID="inherited", RANK="0", WORLD_SIZE="8", SLURM_PROCID=str(rank),
                      SLURM_STEP_NUM_TASKS="8", SLURM_STEP_ID="0")


def _doors():
    from commlab.launch.inprocess import runs_in_process
    return detect_launcher(), runs_in_process(), init_from_env().world_size


def test_a_forked_rank_is_not_mistaken_for_a_torchrun_worker():
    assert launch(_doors, 2, init_hook=_as_if_inherited) == [("commlab.launch", False, 2)] * 2


SRUN_JOB = """
    import os, torch, torch.distributed as dist
    from commlab import launch
    from commlab.launch import UnfinishedSendsError
    from commlab.collectives import ring_all_reduce

    def work(scale):
        x = torch.full((5,), scale * (dist.get_rank() + 1))
        return dist.get_rank(), dist.get_world_size(), ring_all_reduce(x)

    out = launch(work, 2, 10.0)
    assert [(r, n) for r, n, _ in out] == [(0, 2), (1, 2)], out
    assert all(t.tolist() == [30.0] * 5 for _, _, t in out)
    assert dist.is_initialized()                           # kept for the next launch (destroyed at exit)
    assert launch(work, 2, 1.0)[1][2].tolist() == [3.0] * 5
    assert os.environ["LOCAL_RANK"] == os.environ["SLURM_LOCALID"]
    try:
        launch(work, 3, 1.0)
    except ValueError as e:
        print("mismatch:", e)
    print("rank", os.environ["SLURM_PROCID"], "ok")
"""


def test_launch_under_srun_without_torchrun_runs_in_process():
    port = free_port()
    base = _clean_env(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0", SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2",
                      SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="77", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(SRUN_JOB)],
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    for r, (out, _) in enumerate(outs):
        assert f"rank {r} ok" in out
        assert ("mismatch: launch(fn, 3) runs under slurm, whose job has 2 rank(s) (this is rank "
                f"{r}): pass world_size=2") in out


def _raise_in_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("only here")
    return dist.get_rank()


def test_rank_error_contract_is_the_same_for_forked_ranks():
    with pytest.raises(RankError) as info:
        launch(_raise_in_rank_one, 2, timeout=20)
    assert info.value.rank == 1 and info.value.exc_type == "KeyError"


UNMATCHED_JOB = """
    import torch, torch.distributed as dist
    from commlab import launch

    def send_nobody_receives():
        if dist.get_rank() == 1:
            dist.isend(torch.ones(10), 0)
        return dist.get_rank()

    launch(send_nobody_receives, 2, timeout=3)
"""


def test_under_srun_a_send_never_received_is_named_on_both_ranks():
    port = free_port()
    base = _clean_env(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0", SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2",
                      SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="78", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(UNMATCHED_JOB)],
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], errs  # an error, not a crash at exit
    named = "rank 1 returned with 1 send still in flight: 1 to rank 0 (40 bytes), not completed 3 s after the launch"
    assert f"UnfinishedSendsError: {named}" in errs[1]
    # Rank 0 returned and waited for rank 1 in the results' gather; when rank 1 ended, it named rank 1's error.
    # (Under srun without torchrun the job's store lives in rank 0's process: were rank 0 the one to fail,
    # its peers could not read its error from there, and would report their own.)
    assert f"RankError: rank 1 of 2 failed with UnfinishedSendsError: {named}" in errs[0]


def _launch_inside(world):
    return launch(_raise_in_rank_one, world)


def test_launch_inside_a_forked_rank_is_refused():
    with pytest.raises(RankError) as info:
        launch(_launch_inside, 2, 2, timeout=20)
    assert info.value.exc_type == "RuntimeError"
    assert (f"launch() was called inside rank {info.value.rank} of a launch, whose process group is already "
            "initialised: call the function directly there") in info.value.exc_message


def test_forking_with_a_group_already_initialised_here_is_refused():
    proc = _python("""
        from commlab import launch
        from commlab.launch import init_from_env
        init_from_env("gloo")
        try:
            launch(print, 2)
        except RuntimeError as e:
            print(e)
    """, _clean_env())
    assert proc.returncode == 0, proc.stderr
    assert ("torch.distributed is already initialised in this process (rank 0 of 1, backend gloo), and the ranks "
            "launch() forks would inherit that group: call torch.distributed.destroy_process_group() first") \
        in proc.stdout


def test_a_torchrun_restart_makes_a_fresh_group(tmp_path):
    """torchrun --max-restarts 1 after a rank died: with env:// the new attempt read the dead attempt's gloo
    addresses from the agent's store and hung or was refused (torch 2.13); init_from_env prefixes each attempt."""
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).parent / "jobs" / "restart_job.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", str(job)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attempt 1 rank 0: sum 2" in proc.stdout and "attempt 1 rank 1: sum 2" in proc.stdout


def test_cpu_thread_share_never_oversubscribes_and_keeps_one():
    from commlab.launch.env import cpu_thread_share
    assert cpu_thread_share(4, 2, cores=2) == 1
    assert cpu_thread_share(4, 1, cores=16) == 4       # fewer threads asked than the share: kept
    assert cpu_thread_share(8, 2, cores=16) == 8
    assert cpu_thread_share(16, 4, cores=16) == 4
    assert cpu_thread_share(4, 8, cores=2) == 1        # more ranks than cores: still one thread each


def test_gloo_ranks_under_torchrun_get_their_share_of_the_cores(tmp_path):
    # Each rank writes its own file: two ranks printing to one pipe can interleave their lines.
    script = tmp_path / "threads.py"
    script.write_text("import os, sys, torch\nfrom commlab.launch import init_from_env\ninit_from_env('gloo')\n"
                      "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write("
                      "f\"{torch.get_num_threads()} {len(os.sched_getaffinity(0))}\")\n"
                      "torch.distributed.destroy_process_group()\n")  # see tests/jobs/restart_job.py
    env = {**os.environ, "OMP_NUM_THREADS": "64"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [(tmp_path / f"rank{rank}").read_text().split() for rank in range(2)]
    for threads, cores in lines:
        assert int(threads) == max(1, min(64, int(cores) // 2))


def test_exit_process_exits_with_the_code_after_freezing_the_collector(capsys):
    import gc

    from commlab.launch import exit_process
    print("buffered", end="")
    try:
        with pytest.raises(SystemExit) as exit_info:
            exit_process(3)
        assert exit_info.value.code == 3 and gc.get_freeze_count() > 0
        assert capsys.readouterr().out == "buffered"
    finally:
        gc.unfreeze()   # this test process goes on
