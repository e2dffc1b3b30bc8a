"""Send fewer bytes, or sync less often? Per-step compressors against local SGD, DiLoCo and Streaming DiLoCo on
an emulated slow link (``python -m commlab experiments sync-link``).

For each task (chapter 8's two) and each method (:func:`default_methods`: the per-step compressors, then the
methods that sync every H steps, with dense or INT8 Δ), a base run measures the step behind a link too fast to
delay anything (:data:`commlab.experiments.slow_link.BASE_BYTES_PER_S`) and the same run (same seed) is
repeated behind each emulated link. The model adds the link to the base run's step: ``a·α + b/B`` for a
per-step method (:func:`commlab.experiments.time_to_accuracy.comm_coefficients`), the exposed part of the outer
sync per inner step for the others (:func:`commlab.sync.cost.predict_step_seconds`). :func:`measure` records the
runs in ``experiments/sync_link.jsonl`` (resumable, :func:`commlab.experiments.grid.run_grid`), and
:func:`analyze` sets the predicted beside the measured step and time to target (the dense run's quality at
``target_fraction`` of its steps), with bytes per step and the break-even bandwidths; :func:`save` writes it.

Book: chapter 8b, §8b.5 (the measured answer: table, figure, break-even).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import time
from typing import Callable, Sequence

from commlab import data
from commlab.experiments.analysis import dense_target
from commlab.experiments.harness import RunConfig, RunRecord
from commlab.experiments.methods import parse_sync
from commlab.experiments.slow_link import (BASE_BYTES_PER_S, DEFAULT_ALPHA_S, DEFAULT_BYTES_PER_S, read_result,
                                           unnull_times, write_result)
from commlab.experiments.time_to_accuracy import comm_coefficients, costs_from_record, steps_to_target

__all__ = ["PER_STEP_METHODS", "TASK_SETTINGS", "TARGET_FRACTION", "mean_step", "default_methods", "run_configs",
           "measure", "analyze",
           "crossing", "save", "load", "format_table"]

#: The per-step methods: dense, and the best compressors of the recorded grid (``full.jsonl``).
PER_STEP_METHODS: tuple[tuple[str, bool], ...] = (("dense", False), ("cast:fp16", False), ("int:8", False),
                                                  ("topk:0.01", True))
#: Steps and evaluation interval per task: short runs (the whole recording takes minutes), evaluated every H
#: steps so that time to target is resolved to one outer step.
TASK_SETTINGS = {"digits": dict(steps=150, eval_every=10), "charlm": dict(steps=120, eval_every=10)}


def default_methods(h: int = 10, fragments: int = 2, tau: int = 1, alpha: float = 0.5) -> list[tuple[str, bool, str]]:
    """(method, error feedback, sync) of every run: :data:`PER_STEP_METHODS` synced every step, then local SGD,
    DiLoCo and Streaming DiLoCo every ``h`` steps, the last two with dense and with INT8 Δ."""
    streaming = f"streaming:{h}:{fragments}:{tau}:{alpha:g}"
    return ([(m, ef, "every") for m, ef in PER_STEP_METHODS] +
            [("dense", False, f"local:{h}"), ("dense", False, f"diloco:{h}"), ("int:8", False, f"diloco:{h}"),
             ("dense", False, streaming), ("int:8", False, streaming)])


def run_configs(tasks: Sequence[str] = ("digits", "charlm"), methods=None, *, world_size: int = 4, seed: int = 0,
                bytes_per_s: Sequence[float] = DEFAULT_BYTES_PER_S, alpha_s: float = DEFAULT_ALPHA_S,
                steps: dict | None = None) -> list[RunConfig]:
    """Every run of the experiment, in the order they run: per task, each method's base run, then its emulated
    runs. ``steps`` maps a task to its number of steps (default :data:`TASK_SETTINGS`)."""
    methods = default_methods() if methods is None else [tuple(m) for m in methods]
    out = []
    for task in tasks:
        if task not in TASK_SETTINGS:
            raise ValueError(f"unknown task {task!r}; choose from {sorted(TASK_SETTINGS)}")
        s = dict(TASK_SETTINGS[task])
        if steps and task in steps:
            s["steps"] = steps[task]
        for spec, ef, sync in methods:
            cfg = RunConfig(task, spec, ef, seed=seed, world_size=world_size, sync=sync, **s)
            out.append(dataclasses.replace(cfg, link_bytes_per_s=BASE_BYTES_PER_S, link_alpha_s=0.0))
            out += [dataclasses.replace(cfg, link_bytes_per_s=b, link_alpha_s=alpha_s) for b in bytes_per_s]
    return out


def mean_step(record: RunRecord, skip: int) -> float:
    """A mean step robust to a shared machine's hiccups: the median step plus the mean communication beyond its
    median (so the steps that sync every H, and the exposed part of their outer syncs, count once each), over the
    steps after ``skip``."""
    comm = record.comm_s[skip:]
    return statistics.median(record.step_s[skip:]) + statistics.fmean(comm) - statistics.median(comm)


def _link_model(base: RunRecord, skip: int, alpha_s: float) -> Callable[[float], float]:
    """Seconds the link adds to a mean step at ``B`` bytes/s (per direction), as a function of ``B``: ``a·α + b/B``
    per step (chapter 8's model), or for a run that syncs every H steps the exposed part of its F fragments' outer
    syncs (:func:`commlab.sync.cost.predict_step_seconds`, one fragment's payload a 1/F share of the record's)."""
    cfg = base.config
    kind, nums = parse_sync(cfg.get("sync", "every"))
    if kind == "every":
        a, b = comm_coefficients(costs_from_record(base, skip))
        return lambda bw: a * alpha_s + b / bw
    from commlab.sync import cost

    h, fragments, tau = (nums[0], 1, 0) if kind != "streaming" else nums[:3]
    # The inner step alone: the median step (the steps that sync are the outliers when H > 2).
    inner = statistics.median(base.step_s[skip:])

    def add(bw: float) -> float:
        sync_s = cost.outer_sync_seconds(base.payload_nbytes / fragments, cfg["world_size"], alpha_s, 1.0 / bw,
                                         base.path)
        return cost.predict_step_seconds(inner, sync_s, inner_steps=h, fragments=fragments, sync_delay=tau) - inner
    return add


def crossing(t_method: Callable[[float], float], t_other: Callable[[float], float], lo: float = 1e3,
             hi: float = 1e12) -> tuple[float | None, str]:
    """Where two times to target (functions of the bandwidth B in bytes/s) cross between ``lo`` and ``hi``.

    Returns:
        ``(B*, "pays below")`` (``t_method`` is faster on links slower than B*), ``(B*, "pays above")``,
        ``(None, "always pays")`` or ``(None, "never pays")`` (no crossing in the range). inf times (never
        reaches the target) compare as slower than any finite one.
    """
    diff = lambda bw: _diff(t_method(bw), t_other(bw))  # noqa: E731
    grid = [lo * (hi / lo) ** (i / 400) for i in range(401)]
    signs = [diff(b) < 0 for b in grid]
    if all(signs):
        return None, "always pays"
    if not any(signs):
        return None, "never pays"
    i = next(i for i in range(400) if signs[i] != signs[i + 1])
    a, b = grid[i], grid[i + 1]
    for _ in range(100):
        mid = math.sqrt(a * b)
        if (diff(mid) < 0) == signs[i]:
            a = mid
        else:
            b = mid
    return math.sqrt(a * b), "pays below" if signs[0] else "pays above"


def _diff(x: float, y: float) -> float:
    if math.isinf(x) and math.isinf(y):
        return 0.0
    return x - y


#: The target: the dense run's quality at this share of its steps. Half, not chapter 8's three quarters: the methods
#: that sync every H steps lag the dense run by tens of steps, and a target they reach within a short run keeps
#: their time to target defined.
TARGET_FRACTION = 0.5


def analyze(records: Sequence[RunRecord], *, alpha_s: float = DEFAULT_ALPHA_S, target_fraction: float = TARGET_FRACTION,
            skip: int = 5) -> dict:
    """Predicted beside measured step times and times to target, bytes per step and break-even bandwidths.

    ``records``: the runs of :func:`run_configs` (any order; per task and method one base run, behind
    :data:`BASE_BYTES_PER_S`, and one run per emulated bandwidth).

    Returns:
        A JSON-serialisable dict: ``tasks``, one per task with ``target``, ``metric``, ``rows`` (one per method
        and bandwidth: ``bytes_per_step`` per rank, ``predicted_step_s``/``measured_step_s`` (:func:`mean_step`),
        ``error_pct``, ``steps_to_target``, ``predicted_tta_s``/``measured_tta_s``,
        ``quality_matches_base``) and ``break_even`` (against dense and against the best per-step compressor).

    Raises:
        ValueError: a task without a dense per-step base run.
    """
    by_task: dict[str, dict] = {}
    for r in records:
        c = r.config
        key = (c["method"], c["error_feedback"], c.get("sync", "every"))
        bw = None if c["link_bytes_per_s"] == BASE_BYTES_PER_S else c["link_bytes_per_s"]
        by_task.setdefault(c["task"], {}).setdefault(key, {})[bw] = r
    out = []
    for task, runs in by_task.items():
        dense_key = ("dense", False, "every")
        if dense_key not in runs or None not in runs[dense_key]:
            raise ValueError(f"{task}: no dense per-step base run")
        dense_base = runs[dense_key][None]
        target = dense_target([dense_base], task, target_fraction)
        hib = dense_base.higher_is_better
        rows, models = [], {}
        for key, by_bw in runs.items():
            base = by_bw[None]
            s_t = steps_to_target(base.eval_steps, base.eval_quality, target, hib)
            add = _link_model(base, skip, alpha_s)
            fixed = mean_step(base, skip)
            # The first steps as the base run took them (start-up), then the model's mean step.
            start = 0.0 if s_t is None else sum(base.step_s[:min(skip, s_t)])
            models[key] = (base, s_t, (lambda bw, add=add, s=s_t, start=start, fixed=fixed:
                                       math.inf if s is None else start + max(0, s - skip) * (fixed + add(bw))))
            for bw in sorted(b for b in by_bw if b is not None):
                rec = by_bw[bw]
                pred, meas = fixed + add(bw), mean_step(rec, skip)
                same = all(abs(x - y) <= 1e-6 * max(1.0, abs(y)) for x, y in zip(rec.eval_quality, base.eval_quality))
                rows.append(dict(label=base.label, method=key[0], error_feedback=key[1], sync=key[2], bytes_per_s=bw,
                                 bytes_per_step=base.bytes_sent_per_rank, base_step_s=fixed, predicted_step_s=pred,
                                 measured_step_s=meas, error_pct=100 * (pred - meas) / meas, steps_to_target=s_t,
                                 predicted_tta_s=models[key][2](bw),
                                 measured_tta_s=math.inf if s_t is None else sum(rec.step_s[:s_t]),
                                 tta_error_pct=None if s_t is None else
                                 100 * (models[key][2](bw) - sum(rec.step_s[:s_t])) / sum(rec.step_s[:s_t]),
                                 quality_matches_base=same, final_quality=rec.final_quality))
        # The best per-step compressor: the fastest to the target on the slowest link (None if none reaches it).
        slowest = min(r["bytes_per_s"] for r in rows)
        per_step = [r for r in rows if r["sync"] == "every" and r["method"] != "dense" and r["bytes_per_s"] == slowest
                    and math.isfinite(r["measured_tta_s"])]
        best = min(per_step, key=lambda r: r["measured_tta_s"]) if per_step else None
        best_key = None if best is None else (best["method"], best["error_feedback"], "every")
        # Measured ratios on each link, against dense per step and the best per-step compressor (one run each).
        at = {((r["method"], r["error_feedback"], r["sync"]), r["bytes_per_s"]): r for r in rows}
        for r in rows:
            for name, ref in (("dense", dense_key), ("best", best_key)):
                o = at.get((ref, r["bytes_per_s"]))
                r[f"bytes_vs_{name}"] = None if o is None else r["bytes_per_step"] / o["bytes_per_step"]
                ok = o is not None and math.isfinite(r["measured_tta_s"]) and math.isfinite(o["measured_tta_s"])
                r[f"tta_vs_{name}"] = r["measured_tta_s"] / o["measured_tta_s"] if ok else None
        breaks = []
        for key, (base, s_t, t) in models.items():
            if key == dense_key:
                continue
            row = dict(label=base.label, method=key[0], error_feedback=key[1], sync=key[2])
            row["vs_dense_bytes_per_s"], row["vs_dense"] = (
                crossing(t, models[dense_key][2]) if s_t is not None else (None, "never reaches target"))
            if best_key is not None and key != best_key and key[2] != "every":
                row["vs_best_bytes_per_s"], row["vs_best"] = (
                    crossing(t, models[best_key][2]) if s_t is not None else (None, "never reaches target"))
            breaks.append(row)
        out.append(dict(task=task, metric=dense_base.metric, higher_is_better=hib, target=target,
                        world_size=dense_base.config["world_size"], steps=dense_base.config["steps"],
                        dense_nbytes=dense_base.dense_nbytes, best_per_step=None if best is None else best["label"],
                        rows=rows, break_even=breaks))
    return dict(tasks=out)


_NAME = "experiments/sync_link.json"        # the analysed result, in the package data
_RECORDS = "experiments/sync_link.jsonl"    # its runs, one RunRecord a line


def measure(tasks: Sequence[str] = ("digits", "charlm"), *, world_size: int = 4, seed: int = 0,
            bytes_per_s: Sequence[float] = DEFAULT_BYTES_PER_S, alpha_s: float = DEFAULT_ALPHA_S, h: int = 10,
            fragments: int = 2, tau: int = 1, alpha: float = 0.5, target_fraction: float = TARGET_FRACTION,
            skip: int = 5,
            records_path=None, fresh: bool = False, progress: bool = True) -> dict:
    """Run (or resume) every run of :func:`run_configs` into ``records_path`` and :func:`analyze` them.

    ``records_path``: a ``.jsonl`` file (default: ``experiments/sync_link.jsonl`` of a checkout's package data,
    :func:`commlab.data.record_path`); runs already in it are loaded, not rerun; ``fresh`` starts over.

    Returns:
        :func:`analyze`'s dict with ``settings`` (every argument, the records' file name and the date).
    """
    from commlab.experiments.grid import run_grid

    methods = default_methods(h, fragments, tau, alpha)
    configs = run_configs(tasks, methods, world_size=world_size, seed=seed, bytes_per_s=bytes_per_s, alpha_s=alpha_s)
    path = pathlib.Path(records_path) if records_path else data.record_path(_RECORDS)
    records = run_grid(configs, path, fresh=fresh, progress=progress)
    result = analyze(records, alpha_s=alpha_s, target_fraction=target_fraction, skip=skip)
    settings = dict(tasks=list(tasks), world_size=world_size, seed=seed, bytes_per_s=list(bytes_per_s),
                    alpha_s=alpha_s, h=h, fragments=fragments, tau=tau, alpha=alpha, target_fraction=target_fraction,
                    skip=skip, task_settings={t: TASK_SETTINGS[t] for t in tasks},
                    methods=[list(m) for m in methods], records=path.name,
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return dict(settings=settings, **result)


def _clean(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def save(result: dict, path: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write :func:`measure`'s result as JSON (default: ``experiments/sync_link.json`` of a checkout's package
    data); inf and NaN become null.

    Raises:
        ValueError: no ``path`` and commlab installed from a wheel (:func:`commlab.data.record_path`).
    """
    tasks = [dict(t, rows=[{k: _clean(v) for k, v in r.items()} for r in t["rows"]]) for t in result["tasks"]]
    return write_result(dict(result, tasks=tasks), path, _NAME)


def load(path: str | pathlib.Path | None = None) -> dict:
    """Read a result written by :func:`save` (null times back to inf).

    Raises:
        FileNotFoundError: with the command that records it.
    """
    result = read_result(path, _NAME, "sync-link")
    for t in result["tasks"]:
        unnull_times(t["rows"])
    return result


def format_table(result: dict) -> str:
    """Per task and link: bytes per step, predicted beside measured step and time to target; then the break-even
    bandwidths (against dense per step, and against the best per-step compressor)."""
    s = result["settings"]
    tta = lambda x: f"{x:.1f}s" if math.isfinite(x) else "never"  # noqa: E731
    bw_text = lambda b: "" if b is None else f" {b / 1e6:.3g} MB/s"  # noqa: E731
    lines = [f"{s['world_size']} ranks, seed {s['seed']}, emulated α = {s['alpha_s'] * 1e3:g} ms, "
             f"recorded {s['date']}"]
    for t in result["tasks"]:
        lines.append(f"\n{t['task']}: {t['steps']} steps, target {t['metric']} {t['target']:.4g} "
                     f"(dense at {s['target_fraction']:g} of its steps), dense gradient {t['dense_nbytes']:,} B")
        lines.append(f"{'method':44s} {'link':>9s} {'B/step':>9s} {'step pred':>9s} {'meas':>8s} {'err':>6s} "
                     f"{'steps':>5s} {'to target pred':>14s} {'meas':>7s} {'err':>6s}")
        for r in t["rows"]:
            steps = "never" if r["steps_to_target"] is None else str(r["steps_to_target"])
            err = "" if r["tta_error_pct"] is None else f"{r['tta_error_pct']:+5.0f}%"
            flag = "" if r["quality_matches_base"] else " *"
            lines.append(f"{r['label'][:44]:44s} {r['bytes_per_s'] / 1e6:5g}MB/s {r['bytes_per_step']:9,.0f} "
                         f"{r['predicted_step_s'] * 1e3:7.1f}ms {r['measured_step_s'] * 1e3:6.1f}ms "
                         f"{r['error_pct']:+5.0f}% {steps:>5s} {tta(r['predicted_tta_s']):>14s} "
                         f"{tta(r['measured_tta_s']):>7s} {err:>6s}{flag}")
        for name, rows in (("per step", [r for r in t["rows"] if r["sync"] == "every"]),
                           ("every H", [r for r in t["rows"] if r["sync"] != "every"])):
            tta_err = [abs(r["tta_error_pct"]) for r in rows if r["tta_error_pct"] is not None]
            step_err = statistics.median(abs(r["error_pct"]) for r in rows)
            lines.append(f"model error, {name}: median |step error| {step_err:.0f}%"
                         + (f", median |time-to-target error| {statistics.median(tta_err):.0f}%" if tta_err else ""))
        lines.append("break-even bandwidth (the model), against dense per step"
                     + (f" | against the best per-step compressor ({t['best_per_step']})"
                        if t["best_per_step"] else ""))
        for b in t["break_even"]:
            vs_best = f" | {b['vs_best']}{bw_text(b.get('vs_best_bytes_per_s'))}" if "vs_best" in b else ""
            lines.append(f"  {b['label'][:44]:44s} {b['vs_dense']}{bw_text(b['vs_dense_bytes_per_s'])}{vs_best}")
        lines.append("measured ratios, time to target (and bytes per step) against dense per step | against "
                     f"{t['best_per_step'] or 'no per-step compressor'}")
        for r in t["rows"]:
            if r["sync"] == "every":
                continue
            ratio = lambda x: "never" if x is None else f"{x:.2f}x"  # noqa: E731
            lines.append(f"  {r['label'][:44]:44s} {r['bytes_per_s'] / 1e6:5g}MB/s {ratio(r['tta_vs_dense']):>6s} "
                         f"({ratio(r['bytes_vs_dense'])}) | {ratio(r['tta_vs_best']):>6s} "
                         f"({ratio(r['bytes_vs_best'])})")
    if any(not r["quality_matches_base"] for t in result["tasks"] for r in t["rows"]):
        lines.append("* the emulated run's quality curve differs from its base run's")
    return "\n".join(lines)
