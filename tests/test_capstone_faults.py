"""The capstone under the faults a user running real jobs meets, each injected for real under torchrun with a
deadline: a damaged newest checkpoint, a resume with another model, a --ckpt-dir that cannot be created, two
runs in one directory, a non-finite loss, and preemption by SIGTERM or SIGUSR1 (labs/capstone/checkpoint.py,
chapter 14 §14.4). Also the two ratios of the step's model FLOP/s: MFU against a datasheet peak, and the share
of the measured GEMM rate."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commlab.launch.torchrun import run_standalone
from tests.helpers import child_pids

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [str(ROOT / "labs/capstone/train.py")]
COMMON = ["--pp", "2", "--no-plan"]   # two ranks, one pipeline: the cheapest world with a collective


def _torchrun(cwd, *flags, env=None, timeout=120):
    return run_standalone([*TRAIN, *COMMON, *flags], 2, timeout_s=timeout, cwd=str(cwd), env=env)


def _no_worker_traceback(stderr):
    """No traceback through the capstone's code (torchrun prints its own when a worker exits non-zero)."""
    return f'File "{ROOT / "labs"}' not in stderr


def _steps(log):
    return [json.loads(line)["step"] for line in Path(log).read_text().splitlines()] if Path(log).exists() else []


def _losses(log):
    return [json.loads(line)["loss"] for line in Path(log).read_text().splitlines()]


class _Background:
    """A torchrun job of train.py left running (its own session), stopped with SIGKILL at the latest on exit."""

    def __init__(self, cwd, *flags, torchrun_args=()):
        self.out, self.err = open(cwd / "bg.out", "w+"), open(cwd / "bg.err", "w+")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "0", *torchrun_args, *TRAIN, *COMMON, *flags]
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self.out, stderr=self.err, start_new_session=True)

    def wait_for_steps(self, log, count, timeout=90):
        deadline = time.monotonic() + timeout
        while len(_steps(log)) < count:
            assert self.proc.poll() is None, self.stderr()[-3000:]
            assert time.monotonic() < deadline, f"fewer than {count} steps logged in {timeout} s"
            time.sleep(0.2)

    def kill(self):
        """SIGKILL to the workers (torchrun starts each in its own session) and to torchrun: no cleanup anywhere."""
        for pid in [*child_pids(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stderr(self):
        self.err.seek(0)
        return self.err.read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.kill()
        self.out.close()
        self.err.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 6-step run (pp = 2) that saved after steps 1, 3 and 5: its directory and its log (every step's loss)."""
    where = tmp_path_factory.mktemp("saved")
    proc = _torchrun(where, "--steps", "6", "--ckpt-dir", "ckpt", "--ckpt-every", "2", "--log-file", "run.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / "ckpt", where / "run.jsonl"


def _truncate(path, keep=100):
    with open(path, "r+b") as f:
        f.truncate(keep)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_named_and_resume_goes_back_to_one_that_loads(saved, tmp_path):
    """Step 5's rank-1 .distcp and step 3's .metadata truncated: --resume names both (step and file), goes back to
    step 1 and ends with the uninterrupted run's final loss, bitwise. With step 1's manifest damaged as well,
    nothing loads: the run is refused, naming every checkpoint, before any step."""
    ckpt, whole = saved
    damaged = shutil.copytree(ckpt, tmp_path / "ckpt")
    _truncate(damaged / "step_000005" / "__1_0.distcp")
    _truncate(damaged / "step_000003" / ".metadata")
    none_loads = shutil.copytree(damaged, tmp_path / "none")
    _truncate(none_loads / "step_000001" / "manifest.json", 10)

    refused = _torchrun(tmp_path, "--steps", "6", "--ckpt-dir", "none", "--resume", "--log-file", "none.jsonl")
    assert refused.returncode != 0 and _no_worker_traceback(refused.stderr)
    for step, name in ((5, "__1_0.distcp"), (3, ".metadata"), (1, "manifest.json")):
        assert f"step {step} (none/step_{step:06d}): {name}" in refused.stderr, refused.stderr[-3000:]
    assert "no checkpoint in none can be loaded" in refused.stderr and _steps(tmp_path / "none.jsonl") == []

    proc = _torchrun(tmp_path, "--steps", "6", "--ckpt-dir", "ckpt", "--resume", "--log-file", "resumed.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("skipping the checkpoint of step 5 (ckpt/step_000005): __1_0.distcp has 100 bytes, its manifest says"
            in proc.stderr)
    assert "skipping the checkpoint of step 3 (ckpt/step_000003): .metadata has 100 bytes" in proc.stderr
    assert "resume: from the checkpoint of step 1" in proc.stderr
    assert _steps(tmp_path / "resumed.jsonl") == [2, 3, 4, 5]
    assert _losses(tmp_path / "resumed.jsonl")[-1] == _losses(whole)[-1]


@pytest.mark.slow
def test_a_file_damaged_behind_its_manifest_fails_on_every_rank_naming_the_step_and_never_hangs(saved, tmp_path):
    """A .distcp truncated and its manifest rewritten to match, so that only DCP finds it: the ranks that read it
    fail, and both ranks stop with one error naming the step, the path and the failing ranks, instead of a bare
    unpickling error (or a rank left waiting)."""
    from labs.capstone.checkpoint import MANIFEST, _write_manifest
    ckpt, _ = saved
    shutil.copytree(ckpt, tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "step_000005"
    _truncate(newest / "__1_0.distcp", 5000)
    _write_manifest(str(newest), 5, json.loads((newest / MANIFEST).read_text())["config"])
    proc = _torchrun(tmp_path, "--steps", "8", "--ckpt-dir", "ckpt", "--resume", "--log-file", "run.jsonl")
    assert proc.returncode != 0 and _no_worker_traceback(proc.stderr) and not proc.stopped
    assert "error: the checkpoint of step 5 (ckpt/step_000005) cannot be read (rank " in proc.stderr, \
        proc.stderr[-3000:]
    assert "rank 1: EOFError" in proc.stderr
    assert _steps(tmp_path / "run.jsonl") == []


@pytest.mark.slow
def test_resume_loads_a_checkpoint_without_manifest_and_survives_a_torn_log_a_stale_folder_and_a_bad_manifest(
        saved, tmp_path):
    """The leftovers of old versions and killed jobs, all at once: step 5's manifest lists its files as a list
    (malformed: skipped), step 3 has no manifest.json but DCP's .metadata (saved before manifests: loaded
    unverified, with a note), a step_000005.stale folder (a crash during a re-save) and a torn last line in the
    log. The run goes on from step 3 with the uninterrupted losses, re-saves step 5, and saves step 6, its last
    step, although --ckpt-every 2 does not divide 7 steps."""
    from labs.capstone.checkpoint import verify
    ckpt, whole = saved
    shutil.copytree(ckpt, tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / "step_000005" / "manifest.json"
    listed = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**listed, "files": list(listed["files"])}))
    (tmp_path / "ckpt" / "step_000003" / "manifest.json").unlink()
    (tmp_path / "ckpt" / "step_000005.stale").mkdir()
    (tmp_path / "ckpt" / "step_000005.stale" / "__0_0.distcp").write_text("x")
    (tmp_path / "run.jsonl").write_text(whole.read_text() + '{"step": 6, "loss": 3.4')
    unchanged = (tmp_path / "ckpt" / "step_000001" / "__0_0.distcp").read_bytes()
    proc = _torchrun(tmp_path, "--steps", "7", "--ckpt-dir", "ckpt", "--resume", "--ckpt-every", "2",
                     "--log-file", "run.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping the checkpoint of step 5 (ckpt/step_000005): manifest.json is malformed" in proc.stderr
    assert ("note: the checkpoint of step 3 (ckpt/step_000003) has no manifest.json (saved before manifests, or "
            "the manifest was lost) but DCP's .metadata: loading it without verifying") in proc.stderr
    assert "resume: from the checkpoint of step 3" in proc.stderr
    assert "dropping the incomplete last line of --log-file run.jsonl" in proc.stderr
    assert _steps(tmp_path / "run.jsonl") == list(range(7))
    assert _losses(tmp_path / "run.jsonl")[:6] == _losses(whole)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["run.lock", "step_000001", "step_000003", "step_000005",
                                                     "step_000006"]
    assert (tmp_path / "ckpt" / "step_000001" / "__0_0.distcp").read_bytes() == unchanged
    assert verify(str(tmp_path / "ckpt" / "step_000006"))[1] is None
    manifest = tmp_path / "ckpt" / "step_000006" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "files": {}}))
    assert "manifest.json is malformed" in verify(str(manifest.parent))[1]


@pytest.mark.slow
def test_foreign_step_folders_are_never_deleted_and_a_checkpoint_is_not_a_ckpt_dir(saved, tmp_path):
    """--overwrite deletes only the folders this script writes (step_NNNNNN holding DCP's files and a manifest):
    step_1 with notes and step_000002 holding a folder are named and kept, and the run is refused. --resume
    with --ckpt-dir naming a checkpoint is refused, naming its parent, and nothing is written inside it."""
    mine = tmp_path / "mine"
    shutil.copytree(saved[0] / "step_000001", mine / "step_000001")
    (mine / "step_1").mkdir()
    (mine / "step_1" / "notes.txt").write_text("my notes")
    (mine / "step_000002" / "sub").mkdir(parents=True)
    proc = _torchrun(tmp_path, "--steps", "2", "--ckpt-dir", "mine", "--overwrite")
    assert proc.returncode != 0 and _no_worker_traceback(proc.stderr)
    assert "--ckpt-dir mine holds step_000002, step_1, named like checkpoints but holding what" in proc.stderr
    assert sorted(os.listdir(mine)) == ["run.lock", "step_000001", "step_000002", "step_1"]
    assert (mine / "step_1" / "notes.txt").read_text() == "my notes"

    shutil.copytree(saved[0], tmp_path / "ckpt")
    before = sorted(os.listdir(tmp_path / "ckpt" / "step_000005"))
    proc = _torchrun(tmp_path, "--steps", "8", "--ckpt-dir", "ckpt/step_000005", "--resume", "--ckpt-every", "2")
    assert proc.returncode != 0 and _no_worker_traceback(proc.stderr)
    assert ("--ckpt-dir ckpt/step_000005 is a checkpoint, not the directory of a run's checkpoints; pass its "
            "parent: --ckpt-dir ckpt") in proc.stderr, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "ckpt" / "step_000005")) == before


@pytest.mark.slow
def test_a_save_that_fails_mid_run_stops_every_rank_with_one_error_naming_the_step_and_the_path(tmp_path):
    """Step 3's folder cannot be made (a dangling symlink in its place: the tests run as root, for whom chmod
    does not make a folder read-only; a read-only or full disk fails the same way inside DCP, on every rank):
    the run stops with one error naming the step, the path and the OS error, and no worker traceback."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_000003").symlink_to(tmp_path / "nowhere")
    proc = _torchrun(tmp_path, "--steps", "6", "--ckpt-dir", "ckpt", "--ckpt-every", "2", "--log-file", "run.jsonl")
    assert proc.returncode != 0 and _no_worker_traceback(proc.stderr), proc.stderr[-3000:]
    assert ("error: step 3: the checkpoint could not be written to ckpt/step_000003 (FileExistsError: [Errno 17] "
            "File exists") in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("error: step 3:") == 1 and _steps(tmp_path / "run.jsonl") == [0, 1, 2, 3]


@pytest.mark.slow
def test_resuming_with_another_model_is_refused_before_any_step_naming_the_fields(saved, tmp_path):
    ckpt, _ = saved
    shutil.copytree(ckpt, tmp_path / "ckpt")
    proc = _torchrun(tmp_path, "--steps", "8", "--ckpt-dir", "ckpt", "--resume", "--layers", "2", "--heads", "2",
                     "--log-file", "run.jsonl")
    assert proc.returncode != 0 and _no_worker_traceback(proc.stderr)
    assert ("the checkpoint of step 5 in ckpt holds another model (layers 4 there, 2 here; heads 4 there, 2 here)"
            in proc.stderr), proc.stderr[-3000:]
    assert _steps(tmp_path / "run.jsonl") == []


@pytest.mark.slow
def test_a_ckpt_dir_that_cannot_be_created_is_refused_before_any_step(tmp_path):
    (tmp_path / "afile").write_text("")
    proc = _torchrun(tmp_path, "--steps", "4", "--ckpt-dir", "afile/ckpt", "--ckpt-every", "2",
                     "--log-file", "run.jsonl")
    assert proc.returncode != 0 and _no_worker_traceback(proc.stderr)
    assert "--ckpt-dir afile/ckpt: cannot create it (Not a directory)" in proc.stderr
    assert not (tmp_path / "run.jsonl").exists()


@pytest.mark.slow
def test_a_live_run_holds_its_directory_a_dead_one_does_not_and_nothing_is_overwritten_silently(tmp_path):
    """Run A saves every step; B in the same directory is refused while A lives, naming A. A is killed (SIGKILL,
    no cleanup): its lock goes with it, so C gets past the lock, and is refused because the directory holds A's
    checkpoints and C did not ask to --resume; D passes --overwrite, which deletes them and says so."""
    with _Background(tmp_path, "--steps", "500", "--ckpt-dir", "ckpt", "--ckpt-every", "1",
                     "--log-file", "a.jsonl") as a:
        a.wait_for_steps(tmp_path / "a.jsonl", 2)
        b = _torchrun(tmp_path, "--steps", "2", "--ckpt-dir", "ckpt", "--resume")
        assert b.returncode != 0 and "--ckpt-dir ckpt is in use by another run (pid" in b.stderr, b.stderr[-3000:]
        a.kill()
    c = _torchrun(tmp_path, "--steps", "2", "--ckpt-dir", "ckpt")
    assert c.returncode != 0 and "--ckpt-dir ckpt holds checkpoints of an earlier run" in c.stderr, c.stderr[-3000:]
    d = _torchrun(tmp_path, "--steps", "2", "--ckpt-dir", "ckpt", "--overwrite", "--ckpt-every", "2")
    assert d.returncode == 0 and "overwrite: deleted the checkpoints of an earlier run in ckpt" in d.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["run.lock", "step_000001"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_preemption_signal_saves_at_the_next_step_boundary_and_exits(tmp_path, sig):
    """The signal goes to torchrun, as SLURM's --signal=TERM@60 sends it (torchrun forwards SIGTERM to its workers,
    and SIGUSR1 when its --signals-to-handle lists it). Every rank saves the same step and leaves within seconds;
    torchrun itself then reports the signal it got. With SIGTERM, --resume goes on from that step."""
    forward = ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"] if sig == "SIGUSR1" else []
    with _Background(tmp_path, "--steps", "500", "--ckpt-dir", "ckpt", "--log-file", "a.jsonl",
                     torchrun_args=forward) as a:
        a.wait_for_steps(tmp_path / "a.jsonl", 2)
        sent = time.monotonic()
        a.proc.send_signal(getattr(signal, sig))
        a.proc.wait(timeout=60)
        took = time.monotonic() - sent
        err = a.stderr()
    last = _steps(tmp_path / "a.jsonl")[-1]
    assert f"preempted: {sig} received; saved the checkpoint of step {last} (ckpt/step_{last:06d})" in err, err[-3000:]
    assert _no_worker_traceback(err) and took < 30
    assert sorted(os.listdir(tmp_path / "ckpt" / f"step_{last:06d}"))[-1] == "manifest.json"
    if sig == "SIGTERM":
        proc = _torchrun(tmp_path, "--steps", str(last + 3), "--ckpt-dir", "ckpt", "--resume", "--log-file",
                         "a.jsonl")
        assert proc.returncode == 0 and f"resume: from the checkpoint of step {last}" in proc.stderr
        assert _steps(tmp_path / "a.jsonl") == list(range(last + 3))


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_at_that_step_with_nothing_non_finite_saved(tmp_path):
    """--lr 1e30: step 0's update leaves huge but finite weights (saved), step 1's loss is NaN: every rank stops
    there, naming the step, and no checkpoint of step 1 or later is written."""
    proc = _torchrun(tmp_path, "--steps", "6", "--lr", "1e30", "--ckpt-dir", "ckpt", "--ckpt-every", "1",
                     "--log-file", "run.jsonl")
    assert proc.returncode != 0 and _no_worker_traceback(proc.stderr)
    assert "error: step 1: the training loss is nan; stopping at the first non-finite loss" in proc.stderr
    assert _steps(tmp_path / "run.jsonl") == [0, 1]
    assert json.loads((tmp_path / "run.jsonl").read_text().splitlines()[1], parse_constant=_bare)["loss"] == "nan"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["run.lock", "step_000000"]


def _bare(constant):
    raise AssertionError(f"the log holds a bare {constant}, which strict JSON parsers refuse")


def _save_with_an_infinity():
    import torch
    import torch.distributed as dist
    from labs.capstone import checkpoint
    from labs.capstone.train import Options, Trainer
    opts = Options(pp=2, steps=1)
    trainer = Trainer(opts)
    if dist.get_rank() == 1:
        with torch.no_grad():
            next(trainer.stage.parameters())[0] = float("inf")
    directory = os.environ["CAPSTONE_TEST_DIR"]
    try:
        checkpoint.save(directory, 0, trainer.model, trainer.stage, trainer.optimizer)
    except checkpoint.RunError as e:
        return str(e), os.path.exists(os.path.join(directory, "step_000000"))
    return None, True


@pytest.mark.slow
def test_a_checkpoint_with_a_non_finite_tensor_is_refused_on_every_rank(tmp_path, monkeypatch):
    from commlab import launch
    monkeypatch.setenv("CAPSTONE_TEST_DIR", str(tmp_path))
    results = launch(_save_with_an_infinity, 2, timeout=120, print_output=False)
    assert results[0] == results[1]
    message, written = results[0]
    assert not written and message.startswith("step 0: not saving a checkpoint that holds non-finite values "
                                              "(rank 1: blocks.2."), message


def test_the_summary_names_mfu_against_the_peak_and_the_share_of_the_measured_gemm_rate():
    """MFU is PaLM's (Chowdhery et al. 2022, App. B): model FLOP/s over the datasheet peak, unknown on a CPU; the
    share of the GEMM rate measured at the model's own shape is logged beside it."""
    import dataclasses
    import torch
    from labs.capstone.measure import StepStats, peak_flop_per_s, steady_means, summary
    assert peak_flop_per_s(torch.device("cpu"), "bfloat16") is None
    step = StepStats(0, 4.0, 0.1, 0.08, 0.05, 0.01, 0.0, 0.0, 0.01, 0.02, 0.01, 0.01, 2560.0, None, 0.25, 1e9)
    line = summary([step, dataclasses.replace(step, step=1)])
    assert "2560 tokens/s, MFU unknown (no datasheet peak for this device and dtype); 25.0 % of the measured GEMM" \
        in line
    known = dataclasses.replace(step, mfu=0.4)
    assert steady_means([known, known])["mfu"] == pytest.approx(0.4)
    assert "MFU 40.0 % of the datasheet peak; 25.0 % of the measured GEMM rate" in summary([known, known])
