"""The experiment grids of chapter 8 and the command that runs them into ``commlab/data/experiments/``.

``python -m commlab experiments run --grid full`` trains every method of :data:`FULL_METHODS` on both
tasks for :data:`FULL_SEEDS`, and :data:`SGD_CONTRAST_METHODS` on the character LM with SGD instead of Adam,
then the same for the two-phase rows (:data:`TWO_PHASE_METHODS`, :data:`TWO_PHASE_SGD_CONTRAST_METHODS`) and
sign with a scale per tensor on the character LM (:data:`PER_TENSOR_SIGN_METHODS`, under both optimizers), appending one JSON line per finished run (its whole :class:`RunRecord`,
config included) to ``commlab/data/experiments/full.jsonl``; runs already in the file are skipped, so an
interrupted grid resumes where it stopped (``--fresh`` starts over). ``--grid quick`` is the lab's short
version. Progress: a tqdm bar over runs and one line per finished run.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Iterable

from commlab import data as package_data
from commlab.experiments.harness import RunConfig, RunRecord, run

__all__ = ["FULL_METHODS", "SGD_CONTRAST_METHODS", "TWO_PHASE_METHODS", "TWO_PHASE_SGD_CONTRAST_METHODS",
           "PER_TENSOR_SIGN_METHODS", "FULL_SEEDS",
           "QUICK_METHODS", "grid_configs", "run_grid", "load_records", "default_path", "DATA_DIR"]

#: The recorded grids: ``experiments/`` of the package data (a Traversable; see :mod:`commlab.data`).
DATA_DIR = package_data.path("experiments")

#: (spec, error feedback, dense warm-up steps as a share of the run) of the full grid.
FULL_METHODS: list[tuple[str, bool, float]] = [
    ("dense", False, 0.0),
    ("cast:fp16", False, 0.0), ("cast:bf16", False, 0.0),
    ("int:8", False, 0.0), ("int:4", False, 0.0), ("int:4", True, 0.0),
    # QSGD as the paper runs it (a norm per 512 entries), and with one norm for the whole gradient as the
    # labelled contrast: its variance bound grows as sqrt(n)/s (chapter 6).
    ("qsgd:4", False, 0.0), ("qsgd:4:all", False, 0.0),
    ("sign", False, 0.0), ("sign", True, 0.0),
    ("topk:0.01", False, 0.0), ("topk:0.01", True, 0.0),
    ("randomk:0.01", False, 0.0), ("randomk:0.01", True, 0.0),
    ("powersgd:1", True, 0.0), ("powersgd:2", True, 0.0), ("powersgd:4", True, 0.0), ("powersgd:8", True, 0.0),
    ("powersgd:4", False, 0.0),
    # Warm-up: 10 % of the steps dense before compressing (PowerSGD's start_iter, applied to all three).
    ("topk:0.01", True, 0.1), ("sign", True, 0.1), ("powersgd:1", True, 0.1),
]
FULL_SEEDS = (0, 1, 2)
FULL_TASKS = ("digits", "charlm")

#: The character LM again with SGD + momentum 0.9 (lr 0.3) instead of Adam, for the methods whose behaviour
#: depends on the optimizer: error feedback assumes an update linear in the gradient, which Adam's is not.
SGD_CONTRAST_METHODS: list[tuple[str, bool, float]] = [
    ("dense", False, 0.0), ("int:8", False, 0.0), ("sign", False, 0.0), ("sign", True, 0.0),
    ("topk:0.01", False, 0.0), ("topk:0.01", True, 0.0), ("powersgd:4", True, 0.0), ("powersgd:4", False, 0.0)]

#: The non-linear compressors again with the two-phase compressed AllReduce (``aggregation="two_phase"``:
#: an all-to-all of compressed chunks, each owner recompresses its chunk's sum, an all-gather of the owners'
#: chunks) instead of all-gathering every payload; with error feedback, the chunk owners keep their own too.
#: Two-phase changes what is applied (a second compression), so its quality is measured, not assumed. These
#: runs come after the others in the full grid, so that a recorded grid resumes with them alone.
TWO_PHASE_METHODS: list[tuple[str, bool, float]] = [
    ("int:8", False, 0.0), ("int:4", True, 0.0), ("qsgd:4", False, 0.0), ("sign", False, 0.0), ("sign", True, 0.0),
    ("topk:0.01", False, 0.0), ("topk:0.01", True, 0.0)]
#: The same for the SGD + momentum contrast (its non-linear rows).
TWO_PHASE_SGD_CONTRAST_METHODS: list[tuple[str, bool, float]] = [
    ("int:8", False, 0.0), ("sign", False, 0.0), ("sign", True, 0.0), ("topk:0.01", False, 0.0),
    ("topk:0.01", True, 0.0)]

#: Sign with one scale per parameter tensor instead of one for the whole gradient, on the character LM under Adam
#: and under SGD + momentum: the contrast that separates the single scale from the optimizer (chapter 8, §8.5).
#: Recorded last, so that the grid resumes with them alone.
PER_TENSOR_SIGN_METHODS: list[tuple[str, bool, float]] = [("sign:tensor", False, 0.0), ("sign:tensor", True, 0.0)]

#: The lab's grid: a few methods, one seed, the digits task on 2 ranks, short runs.
QUICK_METHODS: list[tuple[str, bool, float]] = [
    ("dense", False, 0.0), ("cast:fp16", False, 0.0), ("topk:0.01", False, 0.0), ("topk:0.01", True, 0.0),
    ("sign", True, 0.0), ("powersgd:2", True, 0.0)]


def grid_configs(name: str) -> list[RunConfig]:
    """The runs of grid ``name`` (``"full"`` or ``"quick"``), in the order they run.

    Raises:
        ValueError: an unknown grid.
    """
    if name == "full":
        out = []
        for task in FULL_TASKS:
            steps = RunConfig(task).resolved().steps
            for seed in FULL_SEEDS:
                for spec, ef, warm in FULL_METHODS:
                    out.append(RunConfig(task, spec, ef, int(round(warm * steps)), seed=seed, world_size=4))
        for seed in FULL_SEEDS:
            for spec, ef, _ in SGD_CONTRAST_METHODS:
                out.append(RunConfig("charlm", spec, ef, seed=seed, world_size=4, optimizer="sgd-momentum", lr=0.3))
        for task in FULL_TASKS:
            steps = RunConfig(task).resolved().steps
            for seed in FULL_SEEDS:
                for spec, ef, warm in TWO_PHASE_METHODS:
                    out.append(RunConfig(task, spec, ef, int(round(warm * steps)), seed=seed, world_size=4,
                                         aggregation="two_phase"))
        for seed in FULL_SEEDS:
            for spec, ef, _ in TWO_PHASE_SGD_CONTRAST_METHODS:
                out.append(RunConfig("charlm", spec, ef, seed=seed, world_size=4, optimizer="sgd-momentum", lr=0.3,
                                     aggregation="two_phase"))
        for seed in FULL_SEEDS:
            for spec, ef, _ in PER_TENSOR_SIGN_METHODS:
                out.append(RunConfig("charlm", spec, ef, seed=seed, world_size=4))
                out.append(RunConfig("charlm", spec, ef, seed=seed, world_size=4, optimizer="sgd-momentum", lr=0.3))
        return out
    if name == "quick":
        return [RunConfig("digits", spec, ef, int(round(warm * 60)), seed=0, world_size=2, steps=60)
                for spec, ef, warm in QUICK_METHODS]
    raise ValueError(f"unknown grid {name!r}; choose 'full' or 'quick'")


def default_path(name: str):
    """Where grid ``name`` is recorded: ``experiments/<name>.jsonl`` of the package data, a Traversable
    (:func:`commlab.data.record_path` says where a recorder may write it)."""
    return package_data.path(f"experiments/{name}.jsonl")


def load_records(path) -> list[RunRecord]:
    """Every :class:`RunRecord` of a JSON-lines file written by :func:`run_grid`, in file order.

    ``path``: a file path, or a Traversable such as :func:`default_path`.

    Raises:
        FileNotFoundError: no such file (the message says how to create it).
    """
    if isinstance(path, (str, os.PathLike)):
        path = pathlib.Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a .jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; record it with `python -m commlab experiments run`")
    records = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(RunRecord.from_json(json.loads(line)))
            except (json.JSONDecodeError, TypeError, KeyError) as e:
                raise ValueError(f"{path}, line {i}: not a run record ({e}). A last line cut short by an "
                                 "interrupted write is repaired by `python -m commlab experiments run` on the "
                                 "same file") from None
    return records


def _repair_tail(path: pathlib.Path) -> int:
    """Drop a last line that is not a complete record (an interrupted write) and make the file end with a
    newline; return the number of lines dropped (0 or 1). Corrupt lines elsewhere are left for
    :func:`load_records` to report."""
    data = path.read_bytes()
    if not data:
        return 0
    lines = data.split(b"\n")
    tail = lines[-1] if lines[-1].strip() else (lines[-2] if len(lines) > 1 else b"")
    try:
        json.loads(tail)
        ok = True
    except json.JSONDecodeError:
        ok = False
    if ok:
        if not data.endswith(b"\n"):
            path.write_bytes(data + b"\n")
        return 0
    keep = data[:data.rstrip(b"\n").rfind(b"\n") + 1]
    path.write_bytes(keep)
    return 1


def run_grid(configs: Iterable[RunConfig], path: str | os.PathLike | None = None, *, fresh: bool = False,
             progress: bool = True) -> list[RunRecord]:
    """Run ``configs`` one after another; append each record to ``path`` (if given) as it finishes.

    Args:
        configs: the runs (e.g. :func:`grid_configs`).
        path: a ``.jsonl`` file; runs whose :attr:`RunConfig.key` it already holds are loaded, not rerun.
        fresh: truncate ``path`` first.
        progress: show a tqdm bar (on stderr) and one line per run.

    Returns:
        The records of ``configs``, in their order.
    """
    from tqdm.auto import tqdm

    configs = list(configs)
    done: dict[str, RunRecord] = {}
    if path is not None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and path.exists():
            path.unlink()
        if path.exists():
            if path.is_file() and _repair_tail(path) and progress:
                print(f"{path}: dropped an incomplete last line (an interrupted write); that run will be redone",
                      file=sys.stderr)
            for rec in load_records(path):
                done[RunConfig(**rec.config).key] = rec
    records, new = [], 0
    bar = tqdm(configs, desc="runs", unit="run", disable=not progress, file=sys.stderr)
    for cfg in bar:
        key = cfg.key
        if key in done:
            records.append(done[key])
            continue
        bar.set_postfix_str(f"{cfg.task} {cfg.label} seed {cfg.seed}")
        rec = run(cfg)
        new += 1
        records.append(rec)
        done[key] = rec
        if path is not None:
            with open(path, "a") as f:
                f.write(json.dumps(rec.to_json(), allow_nan=False) + "\n")
        if progress:
            q = "diverged" if rec.diverged_at_step is not None else f"{rec.metric} {rec.final_quality:.4g}"
            bar.write(f"{cfg.task:7s} {cfg.label:32s} seed {cfg.seed}: {q}, ratio {rec.ratio:.1f}, "
                      f"{rec.wall_s:.1f} s")
    if progress:
        print(f"{len(records) - new} runs were already recorded, {new} new", file=sys.stderr)
    return records
