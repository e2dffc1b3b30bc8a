"""The capstone's training script (labs/capstone/train.py): every TP x PP x DP layout gives the single-process
run's per-step losses (same seed, same global batch, float64), on 8 real gloo ranks; its command line refuses a
layout that does not divide, and runs under torchrun."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from commlab import launch
from commlab.launch.torchrun import run_standalone
from labs.capstone.model import GPTConfig
from labs.capstone.train import Options, parse_args, train
from tests.helpers import exit_status

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
TOL = 1e-9   # float64; the layouts differ only in the order of their sums (TP AllReduces, DP averaging)


def _opts(tp, pp, dp):
    # The same global batch (8 sequences) whatever the layout: 2 per micro-batch, 4 / dp micro-batches.
    return Options(tp=tp, pp=pp, dp=dp, micro_batch=2, micro_batches=4 // dp, steps=STEPS, dtype="float64")


def _train_each(runs):
    """``train(opts)`` for each Options of ``runs`` in turn, in one launched world (each run makes its own
    groups): the list of their losses. One launch, not one per run: a launch costs seconds on a busy machine."""
    return [train(opts) for opts in runs]


def _launch_each(world, runs, timeout=300, print_output=False):
    """:func:`_train_each` on ``world`` ranks: for each run of ``runs``, the list of every rank's losses."""
    per_rank = launch(_train_each, world, list(runs), timeout=timeout, print_output=print_output)
    return [[losses[i] for losses in per_rank] for i in range(len(runs))]


@pytest.fixture(scope="module")
def single_process():
    return launch(train, 1, _opts(1, 1, 1), timeout=120)[0]


LAYOUTS = [(2, 2, 2), (1, 2, 4), (2, 1, 4), (4, 2, 1)]


@pytest.fixture(scope="module")
def eight_ranks():
    """Every rank's losses of the 8-rank runs compared with the single process, trained in one launch: each
    layout of LAYOUTS, keyed by it, and ``"zero1"``: 2 x 2 x 2 with ZeRO-1."""
    runs = {layout: _opts(*layout) for layout in LAYOUTS}
    runs["zero1"] = dataclasses.replace(_opts(2, 2, 2), zero1=True)
    return dict(zip(runs, _launch_each(8, runs.values())))


@pytest.mark.parametrize("tp, pp, dp", LAYOUTS)
def test_every_layout_gives_the_single_process_losses(single_process, eight_ranks, tp, pp, dp):
    results = eight_ranks[(tp, pp, dp)]
    for losses in results:
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, single_process)) < TOL, (losses, single_process)
    assert single_process[-1] < single_process[0]   # it trains


def _usage_error(argv, capsys):
    """``labs/capstone/train.py ARGV`` in this process: (exit status, stderr); a layout refused before any
    process group returns 2, an argparse error exits 2."""
    from labs.capstone.train import main
    return exit_status(main, argv, capsys)


def test_a_layout_that_does_not_divide_is_a_usage_error():
    # Through the real entry point once (the other usage errors call main() in this process, the same code).
    proc = subprocess.run([sys.executable, str(ROOT / "labs/capstone/train.py"), "--tp", "3", "--pp", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "heads (4) is not divisible by tp (3)" in proc.stderr and "layers (4) is not divisible by pp (3)" in proc.stderr


def test_a_model_whose_heads_do_not_divide_its_width_is_a_usage_error(capsys):
    code, err = _usage_error(["--heads", "3"], capsys)
    assert code == 2 and "hidden (64) must be divisible by heads (3)" in err


def test_a_world_that_does_not_match_the_layout_is_refused_on_every_rank():
    from commlab import RankError
    with pytest.raises(RankError, match="the world has 2 ranks but tp x pp x dp = 1 x 1 x 4 = 4"):
        launch(train, 2, _opts(1, 1, 4), timeout=60, print_output=False)


def test_flags_read_at_a_glance():
    opts = parse_args(["--tp", "2", "--pp", "2", "--dp", "2", "--micro-batch", "4", "--micro-batches", "8",
                       "--schedule", "gpipe", "--steps", "7", "--dtype", "float64"])
    assert dataclasses.replace(opts) == Options(tp=2, pp=2, dp=2, micro_batch=4, micro_batches=8, schedule="gpipe",
                                                steps=7, dtype="float64")
    assert opts.global_batch == 64
    sized = parse_args(["--layers", "2", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq", "16"])
    assert sized.model == GPTConfig(layers=2, hidden=32, heads=2, ffn=64, seq=16)
    diloco = parse_args(["--dp", "2", "--inner-steps", "4", "--outer-lr", "0.5", "--outer-momentum", "0.8",
                         "--no-nesterov", "--fragments", "2", "--sync-delay", "1", "--mixing", "0.5",
                         "--outer-compressor", "int8"])
    assert diloco == Options(dp=2, inner_steps=4, outer_lr=0.5, outer_momentum=0.8, nesterov=False, fragments=2,
                             sync_delay=1, mixing=0.5, outer_compressor="int:8")


TRAIN = [str(ROOT / "labs/capstone/train.py")]
#: train.py whose rank --fail-rank exits before step --fail-at-step on the first attempt (tests/jobs/).
CRASH = ["-m", "tests.jobs.capstone_crash_job"]


def _torchrun(tmp_path, *flags, job=TRAIN, restarts=0, nproc=4, timeout=240):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)   # for -m tests.jobs...
    return run_standalone([*job, *flags], nproc, timeout_s=timeout, cwd=str(tmp_path), env={"PYTHONPATH": path},
                          torchrun_args=["--max-restarts", str(restarts)])


# The 2 x 2 x 2 run under torchrun (8 ranks) and its JSON lines are checked where the book runs it:
# book/ch14_capstone.ipynb §14.2 and §14.5 assert every step's parts, the validation loss and the planner's line
# (nbval runs it in the same test session), so CI does not start the same 8-rank job twice.


def test_powersgd_on_the_dp_dimension_trains_below_a_stated_loss():
    """PowerSGD rank 2 with error feedback over DP (pp=2, dp=2): dense for its first two steps, so the first
    three losses equal the dense run's; compressed after, so the rest differ; below 3.4 nats within 30 steps
    (measured: first step 4.85; at step 30 the dense run 3.12, the PowerSGD run 3.21)."""
    base = Options(pp=2, dp=2, micro_batch=2, micro_batches=2, steps=30)
    dense, psgd = _launch_each(4, [base, dataclasses.replace(base, compressor="powersgd:2")])
    dense = dense[0]
    assert all(r == psgd[0] for r in psgd)                     # every rank logs the same global loss
    psgd = psgd[0]
    assert psgd[:3] == dense[:3] and psgd[3:] != dense[3:]
    assert min(psgd) < 3.4


OTHER_COMPRESSORS = ["topk:0.05", "int:8", "sign"]


@pytest.fixture(scope="module")
def other_compressors():
    """Rank 0's losses of 10 steps at dp = 2 with each of OTHER_COMPRESSORS, keyed by it, in one launch."""
    runs = [Options(dp=2, steps=10, compressor=spec) for spec in OTHER_COMPRESSORS]
    return {spec: losses[0] for spec, losses in zip(OTHER_COMPRESSORS, _launch_each(2, runs))}


@pytest.mark.parametrize("spec", OTHER_COMPRESSORS)
def test_other_compressors_on_the_dp_dimension_train(other_compressors, spec):
    losses = other_compressors[spec]
    assert losses[-1] < losses[0] - 0.5


def test_an_unknown_compressor_is_a_usage_error(capsys):
    code, err = _usage_error(["--compressor", "topk:2"], capsys)
    assert code == 2 and "the argument of topk must be share kept in (0, 1]" in err


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """``saved_runs(saved, dtype, flags)``: the losses of steps 3-5 of the uninterrupted 6-step run under the
    layout ``saved`` and the checkpoint directory of a second run that stopped after step 2. Each saved side is
    trained once per module: the reshard cases resume the same checkpoint under several layouts."""
    done = {}

    def get(saved, dtype, flags):
        key = (saved, dtype, tuple(sorted(flags.items())))
        if key not in done:
            tp, pp, dp = saved
            whole = dataclasses.replace(_opts(*saved), steps=6, dtype=dtype, **flags)
            ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
            first = dataclasses.replace(whole, steps=3, ckpt_dir=str(ckpt), ckpt_every=3)
            uninterrupted, _ = _launch_each(tp * pp * dp, [whole, first])
            done[key] = uninterrupted[0][3:], ckpt
        return done[key]
    return get


def _resume_case(saved_runs, tmp_path, saved, resumed, dtype, saved_flags=None, resumed_flags=None,
                 print_output=False):
    """Losses of steps 3-5 of the uninterrupted run under ``saved`` and of a run resumed under ``resumed`` from
    the checkpoint the ``saved`` run wrote after step 2 (a copy of it, in ``tmp_path``); ``*_flags``: more
    Options fields of each side."""
    want, saved_ckpt = saved_runs(saved, dtype, saved_flags or {})
    ckpt = shutil.copytree(saved_ckpt, tmp_path / "ckpt")
    second = dataclasses.replace(_opts(*resumed), steps=6, dtype=dtype, ckpt_dir=str(ckpt), resume=True,
                                 **(resumed_flags or {}))
    rest = launch(train, resumed[0] * resumed[1] * resumed[2], second, timeout=180, print_output=print_output)[0]
    return want, rest


def test_resume_gives_the_uninterrupted_losses_bitwise(saved_runs, tmp_path):
    want, got = _resume_case(saved_runs, tmp_path, (2, 2, 2), (2, 2, 2), "float32")
    assert got == want           # bitwise: the same layout, the same arithmetic


@pytest.mark.parametrize("resumed", [(1, 2, 4), (2, 2, 1), (4, 1, 2)])
def test_resume_under_another_layout_reshards_and_continues(saved_runs, tmp_path, resumed):
    want, got = _resume_case(saved_runs, tmp_path, (2, 2, 2), resumed, "float64")
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, want)) < TOL, (got, want)


def test_checkpoint_flags_without_a_directory_are_a_usage_error(capsys):
    code, err = _usage_error(["--resume"], capsys)
    assert code == 2 and "--ckpt-every and --resume need --ckpt-dir" in err


def _last_loss(path):
    return json.loads(path.read_text().splitlines()[-1])["loss"]


def test_a_killed_rank_restarts_from_the_checkpoint_and_loses_nothing(tmp_path):
    """torchrun --max-restarts 1: rank 1 exits before step 5; the job restarts, resumes from step 3's checkpoint
    and ends with the uninterrupted run's final loss, bitwise (same layout, float32)."""
    # Two ranks (pp=2) keep it cheap; the reshard tests cover the other layouts in-process.
    common = ["--pp", "2", "--steps", "8", "--no-plan"]
    whole = tmp_path / "whole.jsonl"
    assert _torchrun(tmp_path, *common, "--log-file", str(whole), nproc=2).returncode == 0
    log = tmp_path / "restarted.jsonl"
    proc = _torchrun(tmp_path, *common, "--log-file", str(log), "--ckpt-dir", str(tmp_path / "ckpt"),
                     "--ckpt-every", "4", "--resume", "--fail-at-step", "5", "--fail-rank", "1", job=CRASH,
                     restarts=1, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1: exiting before step 5" in proc.stderr
    assert "resume: from the checkpoint of step 3" in proc.stderr
    # Step 4 ran again (the checkpoint was after step 3); its first attempt's line was dropped from the log.
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(8))
    assert _last_loss(log) == _last_loss(whole)
    # Under torchrun too, each line holds every rank's compute and step, and the slowest rank.
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert all(len(r["rank_compute_s"]) == len(r["rank_step_s"]) == 2 and r["slowest_rank"] in (0, 1) for r in rows)
    # Run again: the newest checkpoint (step 7) already reaches --steps 8.
    again = _torchrun(tmp_path, *common, "--log-file", str(log), "--ckpt-dir", str(tmp_path / "ckpt"), "--resume",
                      nproc=2)
    assert again.returncode == 0 and "it already reaches --steps 8: nothing to do" in again.stderr


def test_diloco_with_tp_and_pp_under_torchrun_restarts_and_loses_nothing(tmp_path):
    """Streaming DiLoCo over DP at 2 x 2 x 2 under torchrun (8 ranks): H = 2 with the outer AllReduce in flight for
    one step. With --max-restarts 1, rank 5 exits before step 4; the job restarts from step 2's checkpoint and
    every step from there equals the uninterrupted run's, bitwise (a checkpoint saved with a sync in flight: the
    in-process test above). The sync sent after the last step is still in flight when the run ends, cleanly."""
    common = ["--tp", "2", "--pp", "2", "--dp", "2", "--steps", "6", "--inner-steps", "2", "--sync-delay", "1"]
    whole = tmp_path / "whole.jsonl"
    proc = _torchrun(tmp_path, *common, "--log-file", str(whole), nproc=8)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "plan: not predicted: the planner prices a DP AllReduce every step" in proc.stdout
    log = tmp_path / "restarted.jsonl"
    proc = _torchrun(tmp_path, *common, "--no-plan", "--log-file", str(log), "--ckpt-dir", str(tmp_path / "ckpt"),
                     "--ckpt-every", "3", "--resume", "--fail-at-step", "4", "--fail-rank", "5", job=CRASH,
                     restarts=1, nproc=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 5: exiting before step 4" in proc.stderr
    assert "resume: from the checkpoint of step 2" in proc.stderr
    want = [json.loads(line)["loss"] for line in whole.read_text().splitlines()]
    got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(want) == 6 and got == want and want[-1] < want[0]


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--compressor", "topk:0.1"], "--dp 1 has no other replica to send to"),
    (["--ckpt-dir", "{file}", "--ckpt-every", "1"], "is a file, not a directory"),
    (["--ckpt-dir", "{file}/ckpt", "--ckpt-every", "1"], "/ckpt: cannot create it (Not a directory)"),
    (["--ckpt-dir", "{dir}/ckpt", "--resume", "--overwrite"], "--overwrite deletes them: pass one"),
    (["--profile", "{file}"], "is a file, not a directory"),
    (["--log-file", "{dir}"], "is a directory; give a file name"),
    (["--log-file", "{dir}/no/such/run.jsonl"], "does not exist or is not writable"),
    (["--seq", "100000"], "is longer than the held-out split allows"),
    (["--dp", "2"], "the world has 1 rank but tp x pp x dp = 1 x 1 x 2 = 2 (start it with torchrun "
                    "--nproc-per-node 2"),
    (["--dp", "2", "--inner-steps", "0"], "--inner-steps must be >= 1"),
    (["--inner-steps", "2"], "--dp 1 has no other replica"),
    (["--dp", "2", "--inner-steps", "2", "--compressor", "topk:0.1"], "--compressor topk:0.1 compresses the "
                                                                     "per-step gradient AllReduce"),
    (["--dp", "2", "--inner-steps", "2", "--zero1"], "--zero1 shards Adam's state over DP"),
    (["--dp", "2", "--inner-steps", "2", "--sync-delay", "2"], "--sync-delay must be in 0..1"),
    (["--dp", "2", "--inner-steps", "2", "--mixing", "1.5"], "--mixing must be in [0, 1]"),
    (["--dp", "2", "--inner-steps", "2", "--outer-compressor", "int:3"], "--outer-compressor: method 'int:3'"),
    (["--dp", "2", "--outer-lr", "0.5"], "--outer-lr sets DiLoCo's outer step, which runs only with --inner-steps"),
], ids=["lr", "compressor-dp1", "ckpt-file", "ckpt-uncreatable", "resume-overwrite", "profile-file", "log-dir",
        "log-missing", "seq", "world", "inner-steps-0", "inner-steps-dp1", "inner-steps-compressor",
        "inner-steps-zero1", "sync-delay", "mixing", "outer-compressor", "outer-flag-alone"])
def test_what_would_fail_later_is_a_usage_error_now(tmp_path, flags, message, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    flags = [f.format(file=afile, dir=tmp_path) for f in flags]
    code, err = _usage_error([*flags, "--steps", "1"], capsys)
    assert code == 2 and message in err, err


def test_the_crash_job_refuses_a_rank_outside_the_world(capsys):
    from tests.jobs.capstone_crash_job import main
    code, err = exit_status(main, ["--fail-at-step", "1", "--fail-rank", "3", "--steps", "1"], capsys)
    assert code == 2 and "--fail-rank 3 is not a rank of this world of 1" in err, err


def test_a_killed_rank_without_restarts_fails_the_job_naming_it(tmp_path):
    proc = _torchrun(tmp_path, "--dp", "2", "--steps", "6", "--fail-at-step", "2", "--fail-rank", "1", job=CRASH,
                     nproc=2)
    assert proc.returncode != 0
    assert "rank 1: exiting before step 2" in proc.stderr
    assert "exitcode  : 13" in proc.stderr and "rank      : 1" in proc.stderr


def test_zero1_gives_the_same_losses_as_adam(single_process, eight_ranks):
    results = eight_ranks["zero1"]   # 2 x 2 x 2 with --zero1
    for losses in results:
        assert max(abs(a - b) for a, b in zip(losses, single_process)) < TOL


ZERO1 = {"zero1": True}


def test_zero1_resume_gives_the_uninterrupted_losses_bitwise(saved_runs, tmp_path):
    """ZeRO-1's sharded Adam state is gathered over DP into the one unsharded format and sharded again."""
    want, got = _resume_case(saved_runs, tmp_path, (2, 1, 2), (2, 1, 2), "float32", ZERO1, ZERO1)
    assert got == want


@pytest.mark.parametrize("resumed, flags", [((1, 2, 2), ZERO1), ((1, 1, 4), ZERO1), ((4, 1, 1), {})],
                         ids=["1x2x2-zero1", "1x1x4-zero1", "4x1x1-adam"])
def test_zero1_resume_under_another_layout_reshards_and_continues(saved_runs, tmp_path, resumed, flags):
    """Saved as 2x1x2 with --zero1, resumed under another TP/PP/DP split, with or without it: the uninterrupted
    run's losses within TOL (float64: the layouts differ only in the order of their sums, TP AllReduces and DP
    averaging; Adam's arithmetic is element-wise, the same on a flat ZeRO shard as on a parameter)."""
    want, got = _resume_case(saved_runs, tmp_path, (2, 1, 2), resumed, "float64", ZERO1, flags)
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, want)) < TOL, (got, want)


def _replicated_gap(spec):
    import torch.distributed as dist
    from commlab.parallel.tensor import tp_sharded_parameters
    from labs.capstone.train import Trainer
    _, _, outer = spec.partition("diloco/")   # "diloco/SPEC": DiLoCo every step, SPEC on its pseudo-gradient
    flags = {"inner_steps": 1, "outer_compressor": outer} if outer else {"compressor": spec}
    trainer = Trainer(Options(tp=2, dp=2, steps=3, **flags))
    for step in range(3):
        trainer.step(step)
    sharded = tp_sharded_parameters(trainer.stage)
    gap = 0.0
    for name, p in trainer.stage.named_parameters():
        if name not in sharded:
            other = p.detach().clone()
            dist.broadcast(other, src=dist.get_global_rank(trainer.groups["tp"], 0), group=trainer.groups["tp"])
            gap = max(gap, float((p.detach() - other).abs().max()))
    return gap


def _replicated_gaps(specs):
    return [_replicated_gap(spec) for spec in specs]


GAP_SPECS = ["topk:0.05", "int:8", "sign", "powersgd:2", "diloco/topk:0.05"]


@pytest.fixture(scope="module")
def replicated_gaps():
    """Every rank's :func:`_replicated_gap` at 2 x 1 x 2 for each of GAP_SPECS, keyed by it, in one launch."""
    per_rank = launch(_replicated_gaps, 4, GAP_SPECS, timeout=300, print_output=False)
    return {spec: [gaps[i] for gaps in per_rank] for i, spec in enumerate(GAP_SPECS)}


@pytest.mark.parametrize("spec", GAP_SPECS)
def test_compressed_dp_keeps_the_replicated_parameters_identical_on_every_tp_rank(replicated_gaps, spec):
    """TP shards and replicated parameters (embeddings, LayerNorms, row-parallel biases) sit in separate DP
    buckets, so a compressor whose output depends on the whole bucket (Top-K's selection, INT8's scale, sign's
    mean) sees the same replicated buckets on both TP ranks: those parameters stay bitwise equal. When they
    shared buckets, Top-K at 2x1x2 had them 5e-3 apart after 3 steps. The same for DiLoCo's outer step
    (``diloco/``: one DiLoCo per kind, train.OuterStep); with one for both, Top-K had them 8e-3 apart after
    3 outer steps."""
    assert replicated_gaps[spec] == [0.0] * 4


@pytest.mark.parametrize("saved, spec", [((2, 1, 2), "powersgd:2"), ((2, 1, 2), "topk:0.05")])
def test_resume_with_a_compressor_gives_the_uninterrupted_losses_bitwise(saved_runs, tmp_path, saved, spec):
    """The DP comm hook's state is in the checkpoint: PowerSGD's residuals, warm-start Q matrices, step count and
    seed stream (it compresses from step 2, so step 2 left all of them); Top-K's error-feedback residuals."""
    flags = {"compressor": spec}
    want, got = _resume_case(saved_runs, tmp_path, saved, saved, "float32", flags, flags)
    assert got == want


def test_resume_with_a_compressor_under_another_dp_layout_restarts_it_with_a_warning(saved_runs, tmp_path, capfd):
    """Saved as 1x2x2 with Top-K, resumed as 1x1x4: the model and Adam are resharded (so the first resumed loss,
    which depends on the parameters only, is the uninterrupted one), and the compressor's per-rank, per-bucket
    residuals, which do not map onto 4 other ranks' buckets, start from zero, as rank 0 says."""
    flags = {"compressor": "topk:0.05"}
    want, got = _resume_case(saved_runs, tmp_path, (1, 2, 2), (1, 1, 4), "float64", flags, flags, print_output=True)
    captured = capfd.readouterr()
    err = captured.out + captured.err   # the ranks' output, printed by launch in rank order
    assert abs(got[0] - want[0]) < TOL
    assert got[1:] != want[1:]          # the residuals withheld before the checkpoint are not applied
    assert "holds the compressor state of [tp=1 pp=2 dp=2, topk:0.05 with error feedback on" in err
    assert "this run is [tp=1 pp=1 dp=4, topk:0.05 with error feedback on" in err
    assert "the compressor starts afresh" in err


#: Streaming DiLoCo over DP: 2 fragments every 4 steps, each outer AllReduce in flight for 1 step, Delta sent in
#: INT8 with error feedback. Saved after step 2 (3 inner steps): fragment 0 has landed (its residual kept),
#: fragment 1 was just sent (in flight), and the two replicas hold different parameters and Adam states.
DILOCO = {"inner_steps": 4, "fragments": 2, "sync_delay": 1, "outer_compressor": "int:8"}


def test_diloco_over_dp_with_tp_and_pp_resumes_as_the_uninterrupted_run_bitwise(saved_runs, tmp_path):
    """--inner-steps at 2 x 2 x 2: each DP replica steps alone, the outer step averages over DP per TP shard and
    PP stage; the checkpoint holds each replica's parameters and Adam state and each rank's outer state (global
    copy, momentum, residuals, the sync in flight), and the resumed run is the uninterrupted one, bitwise."""
    want, got = _resume_case(saved_runs, tmp_path, (2, 2, 2), (2, 2, 2), "float32", DILOCO, DILOCO)
    assert got == want
    dense, _ = saved_runs((2, 2, 2), "float32", {})
    assert want != dense and want[-1] < 4.0   # DiLoCo is not the every-step AllReduce, and it trains
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(tmp_path / "ckpt" / "step_000002")).read_metadata().state_dict_metadata
    assert {"model.dp0/blocks.0.attn.proj.bias", "model.dp1/blocks.0.attn.proj.bias", "outer.setting"} <= set(keys)


def _refusals(runs):
    """The RunError message of each of ``runs``, or its losses if it trained."""
    from labs.capstone.checkpoint import RunError
    out = []
    for opts in runs:
        try:
            out.append(train(opts))
        except RunError as e:
            out.append(str(e))
    return out


@pytest.fixture(scope="module")
def diloco_refusals(saved_runs):
    """The RunError messages (or losses) of four DiLoCo-related runs at 8 ranks, in one launch
    (:func:`_refusals`): the DiLoCo checkpoint resumed as 1 x 2 x 4, and without --inner-steps; a plain
    checkpoint resumed with DILOCO; a DiLoCo run at --lr 1e30 (inner_steps 1); one with 32 fragments."""
    _, diloco_ckpt = saved_runs((2, 2, 2), "float32", DILOCO)
    _, dense_ckpt = saved_runs((2, 2, 2), "float32", {})
    resumed = {"steps": 6, "dtype": "float32", "resume": True}
    runs = [dataclasses.replace(_opts(1, 2, 4), **resumed, **DILOCO, ckpt_dir=str(diloco_ckpt)),
            dataclasses.replace(_opts(2, 2, 2), **resumed, ckpt_dir=str(diloco_ckpt)),
            dataclasses.replace(_opts(2, 2, 2), **resumed, **DILOCO, ckpt_dir=str(dense_ckpt)),
            dataclasses.replace(_opts(2, 2, 2), steps=3, lr=1e30, inner_steps=1),
            dataclasses.replace(_opts(2, 2, 2), steps=1, inner_steps=32, fragments=32)]
    per_rank = launch(_refusals, 8, runs, timeout=180, print_output=False)
    assert all(r == per_rank[0] for r in per_rank)   # every rank raises the same RunError
    return per_rank[0]


def test_a_diloco_checkpoint_resumes_only_under_its_own_layout_and_flags(diloco_refusals):
    """Between outer steps the DP replicas differ, so a DiLoCo checkpoint does not map onto another DP degree or
    onto plain DP: each is refused on every rank, naming both settings."""
    other_layout, plain = diloco_refusals[:2]
    assert "holds the DiLoCo state of [--tp 2 --pp 2 --dp 2" in other_layout, other_layout
    assert "this run is [--tp 1 --pp 2 --dp 4" in other_layout
    assert "was saved with DiLoCo over DP (--inner-steps)" in plain, plain


def test_diloco_starts_from_a_checkpoint_of_plain_dp(saved_runs, diloco_refusals):
    """As DiLoCo starts from a pretrained model (arXiv:2311.08105 §3): a plain checkpoint resumed with
    --inner-steps loads every replica alike, so the first resumed loss is the plain run's; then the replicas
    step alone, and the losses part."""
    dense, _ = saved_runs((2, 2, 2), "float32", {})
    started = diloco_refusals[2]
    assert started[0] == dense[0] and started[1:] != dense[1:], (started, dense)


def test_a_non_finite_pseudo_gradient_stops_every_rank_with_one_error(diloco_refusals):
    """--lr 1e30: step 1's loss is still finite, its pseudo-gradient is not; DiLoCo refuses it within each DP group
    and one AllReduce makes every rank of the world stop at that step with the same message (no hang)."""
    assert diloco_refusals[3].startswith("step 1: DiLoCo's pseudo-gradient is not finite"), diloco_refusals[3]


def test_more_fragments_than_a_stage_has_tensors_is_refused_on_every_rank(diloco_refusals):
    """A fragment is a run of whole tensors; each rank's stage has its own count, so the ranks agree first."""
    assert diloco_refusals[4].startswith("--fragments 32: a fragment is a run of whole parameter tensors"), \
        diloco_refusals[4]


def test_profile_writes_a_chrome_trace_per_rank_with_the_course_ranges(tmp_path):
    out = tmp_path / "prof"
    launch(train, 2, Options(pp=2, steps=2, profile=str(out)), timeout=120, print_output=False)
    for rank in (0, 1):
        trace = json.loads((out / f"rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"capstone::step0", "capstone::step1"} <= names
        assert any(n.startswith("overlap::") for n in names)


def test_ddp_as_the_dp_wrapper_gives_the_same_losses(single_process):
    """The benchmark's reference (torch's DDP at 1 x 1 x 4) trains the same model to the same losses."""
    opts = dataclasses.replace(_opts(1, 1, 4), dp_impl="ddp")
    for losses in launch(train, 4, opts, timeout=120, print_output=False):
        assert max(abs(a - b) for a, b in zip(losses, single_process)) < TOL


def test_ddp_with_a_pipeline_is_a_usage_error(capsys):
    code, err = _usage_error(["--dp-impl", "ddp", "--pp", "2"], capsys)
    assert code == 2 and "--dp-impl ddp runs with --pp 1" in err


def test_bfloat16_is_mixed_precision_close_to_float32():
    """--dtype bfloat16: float32 parameters and Adam, the passes under bfloat16 autocast (TP's AllReduces carry
    bfloat16 partial sums); the first losses stay within 0.01 nats of the float32 run's."""
    base = Options(tp=2, steps=3)
    fp32, bf16 = _launch_each(2, [base, dataclasses.replace(base, dtype="bfloat16")])
    fp32 = fp32[0]
    assert bf16[0] == bf16[1] and bf16[0] != fp32
    assert max(abs(a - b) for a, b in zip(bf16[0], fp32)) < 1e-2

