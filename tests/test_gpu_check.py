"""The GPU check script (scripts/gpu_check.sh) runs every step on gloo CPU ranks with --dry-run.

On a machine without CUDA the real run must refuse clearly; the dry run must pass every step and write one
report with each step's table, so that the script a GPU machine runs is the script CI has run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args, timeout=400):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _failed_steps(report: str) -> str:
    """The report's sections of the steps that did not exit 0 (their whole output), so that a failure shows its
    cause first rather than inside a long report."""
    sections = ["== " + part for part in report.split("\n== ")[1:]]
    failed = [s for s in sections if not any(line.strip() == "exit 0" or line.strip().startswith("exit 0 ")
                                             for line in s.splitlines())]
    return "\n".join(failed) or report


def test_dry_run_passes_every_step_and_writes_one_report(tmp_path):
    out = tmp_path / "report.txt"
    proc = _run("--dry-run", "--out", str(out))
    report = out.read_text()
    assert proc.returncode == 0, _failed_steps(report) + proc.stderr
    assert "# 0 step(s) failed" in report
    for part in ("commlab selftest:", "gpu_check codecs on cpu", "compress + decompress of", "gpu_check steps:",
                 "busbw ours/torch", "gpu_check collectives:", "tokens/s, MFU"):
        assert part in report, part
    # Every table's checks passed, none was skipped silently.
    assert "FAILED" not in report and "TIMEOUT" not in report
    summary = report[report.index("# summary"):].splitlines()[1:-1]
    # 1-5 and 5b run; 6a's part runs in step 4's torchrun (its table is asserted above), and 6b and 6c are steps 4
    # and 5's commands at the dry run's world size 2, so not repeated.
    assert len(summary) == 9 and all(line.startswith("ok ") for line in summary[:6]), summary
    assert [line.split()[0] for line in summary[6:]] == ["same", "same", "same"], summary
    assert "6a's collectives" in summary[3] and "6a. collectives" in summary[6], summary


def test_bad_argument_and_missing_gpu_are_refused(tmp_path):
    proc = _run("--bogus")
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr
    if not torch.cuda.is_available():
        proc = _run("--out", str(tmp_path / "r.txt"))
        assert proc.returncode == 2 and "no CUDA GPU is visible" in proc.stderr and "--dry-run" in proc.stderr
