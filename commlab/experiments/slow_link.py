"""Check the time-to-accuracy model on an emulated slow link (``python -m commlab experiments slow-link``).

For each method, a base run measures the step on this machine (behind an emulated link too fast to delay
anything, :data:`BASE_BYTES_PER_S`, so it takes the slow runs' code path); the same run (same seed) is
repeated with every rank behind an emulated link of bandwidth B and latency α
(:class:`commlab.topology.EmulatedTopology`, one rank per node). The model predicts
``step(B) = base + a·α + b/B`` (:func:`commlab.experiments.time_to_accuracy.comm_coefficients`) and the time to
target from the base run's own seconds to the target step; :func:`measure` sets them beside the emulated
runs, at bandwidths on either side of each compressor's break-even, and :func:`save` records them.

Book: chapter 8, §8.7.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import time

from commlab import data
from commlab.experiments.analysis import dense_target
from commlab.experiments.harness import RunConfig, RunRecord, run
from commlab.experiments.time_to_accuracy import (StepCosts, break_even, comm_coefficients, costs_from_record,
                                                  steps_to_target)

__all__ = ["DEFAULT_METHODS", "DEFAULT_BYTES_PER_S", "DEFAULT_ALPHA_S", "measure", "save", "load", "format_table"]

DEFAULT_METHODS = (("dense", False), ("cast:fp16", False), ("int:8", False), ("sign", False), ("topk:0.01", True))
#: Emulated link bandwidths, bytes/s per direction: 5 MB/s (dense communication dominates the character LM's
#: step) and 50 MB/s (it does not).
DEFAULT_BYTES_PER_S = (5e6, 50e6)
DEFAULT_ALPHA_S = 0.5e-3
#: The base runs' link: 1e18 bytes/s and no latency delay nothing (a megabyte waits 1e-12 s, below the
#: emulation's one-microsecond threshold).
BASE_BYTES_PER_S = 1e18


def _median_step(rec: RunRecord, skip: int) -> float:
    start = max(skip, rec.config["warmup_steps"])
    return statistics.median(rec.step_s[start:])


def measure(task: str = "charlm", world_size: int = 4, steps: int = 120, seed: int = 0, methods=DEFAULT_METHODS,
            bytes_per_s=DEFAULT_BYTES_PER_S, alpha_s: float = DEFAULT_ALPHA_S, target_fraction: float = 0.75,
            skip: int = 5, progress: bool = True) -> dict:
    """Run every method without and with each emulated link; return predicted beside measured times.

    Returns:
        A JSON-serialisable dict: ``settings``; ``target`` (the dense run's quality at ``target_fraction``
        of its steps); ``rows``, one per (method, bandwidth) with ``predicted_step_s``, ``measured_step_s``,
        ``steps_to_target``, ``predicted_tta_s``, ``measured_tta_s`` (seconds to target; measured = the emulated
        run's own step times summed up to that step); ``break_even``, one per compressor (bytes/s and
        verdict); ``records``: the runs.

    Raises:
        ValueError: ``methods`` without ``("dense", False)``, PowerSGD (which the emulation cannot delay),
            or an emulated run whose quality curve differs from its base run's (the emulation must only
            add time).
    """
    from tqdm.auto import tqdm

    methods = [tuple(m) for m in methods]
    if ("dense", False) not in methods:
        raise ValueError("methods must include ('dense', False): it is what every break-even is against")
    configs = [RunConfig(task, spec, ef, seed=seed, world_size=world_size, steps=steps) for spec, ef in methods]
    jobs = [(c, None) for c in configs] + [(c, b) for c in configs for b in bytes_per_s]
    records: dict[tuple, RunRecord] = {}
    bar = tqdm(jobs, desc="slow link", unit="run", disable=not progress)
    for cfg, bw in bar:
        bar.set_postfix_str(f"{cfg.label} @ {'no delay' if bw is None else f'{bw / 1e6:g} MB/s'}")
        c = (dataclasses.replace(cfg, link_bytes_per_s=BASE_BYTES_PER_S, link_alpha_s=0.0) if bw is None
             else dataclasses.replace(cfg, link_bytes_per_s=bw, link_alpha_s=alpha_s))
        records[(cfg.method, cfg.error_feedback, bw)] = run(c)
    dense_base = records[("dense", False, None)]
    target = dense_target([dense_base], dense_base.config["task"], target_fraction)
    hib = dense_base.higher_is_better
    rows, base_costs, base_steps = [], {}, {}
    for spec, ef in methods:
        base = records[(spec, ef, None)]
        costs = costs_from_record(base, skip)
        # Everything measured without emulation goes into the fixed part; the emulated link adds a·α + b·β.
        base_costs[(spec, ef)] = StepCosts(base.label, _median_step(base, skip), 0.0, costs.payload_nbytes,
                                           costs.path, costs.world_size, costs.collectives)
        s_t = steps_to_target(base.eval_steps, base.eval_quality, target, hib)
        base_steps[(spec, ef)] = s_t
        a, b = comm_coefficients(costs)
        for bw in bytes_per_s:
            rec = records[(spec, ef, bw)]
            if any(abs(x - y) > 1e-6 * max(1.0, abs(y)) for x, y in zip(rec.eval_quality, base.eval_quality)):
                raise ValueError(f"{base.label}: the emulated run's quality differs from the base run's")
            pred = base_costs[(spec, ef)].compute_s + a * alpha_s + b / bw
            meas = _median_step(rec, skip)
            rows.append(dict(label=base.label, method=spec, error_feedback=ef, bytes_per_s=bw,
                             base_step_s=base_costs[(spec, ef)].compute_s, predicted_step_s=pred,
                             measured_step_s=meas, error_pct=100 * (pred - meas) / meas, steps_to_target=s_t,
                             # The fixed part as the base run measured it (first steps included), plus the link.
                             predicted_tta_s=math.inf if s_t is None else sum(base.step_s[:s_t]) + s_t * (pred - base_costs[(spec, ef)].compute_s),
                             measured_tta_s=math.inf if s_t is None else sum(rec.step_s[:s_t])))
    dense_c, dense_s = base_costs[("dense", False)], base_steps[("dense", False)]
    breaks = []
    for (spec, ef), c in base_costs.items():
        if spec == "dense":
            continue
        be = break_even(dense_c, dense_s, c, base_steps[(spec, ef)], alpha_s)
        breaks.append(dict(label=c.label, method=spec, error_feedback=ef, bytes_per_s=be.bytes_per_s, verdict=be.verdict))
    return dict(settings=dict(task=task, world_size=world_size, steps=steps, seed=seed, alpha_s=alpha_s,
                              bytes_per_s=list(bytes_per_s), target_fraction=target_fraction, skip=skip,
                              date=time.strftime("%Y-%m-%d")),
                target=target, metric=dense_base.metric, rows=rows, break_even=breaks,
                records=[dict(bytes_per_s=k[2], record=r.to_json()) for k, r in records.items()])


_NAME = "experiments/slow_link.json"  # the recorded result, in the package data


def _finite(x):
    return None if isinstance(x, float) and math.isinf(x) else x


def save(result: dict, path: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write :func:`measure`'s result as JSON (default: ``experiments/slow_link.json`` of the package data, where
    :func:`commlab.data.record_path` allows it: a checkout); inf becomes null.

    Raises:
        ValueError: no ``path`` and commlab installed from a wheel (see :func:`commlab.data.record_path`).
    """
    return write_result(dict(result, rows=[{k: _finite(v) for k, v in r.items()} for r in result["rows"]]), path,
                        _NAME)


def load(path: str | pathlib.Path | None = None) -> dict:
    """Read a result written by :func:`save` (null times back to inf).

    Raises:
        FileNotFoundError: with the command that records it.
    """
    result = read_result(path, _NAME, "slow-link")
    unnull_times(result["rows"])
    return result


def write_result(result: dict, path, name: str) -> pathlib.Path:
    """Write ``result`` as JSON to ``path`` (default: ``name`` of a checkout's package data); the path written.

    Raises:
        ValueError: no ``path`` and commlab installed from a wheel (:func:`commlab.data.record_path`); a
            non-finite number in ``result``.
    """
    path = pathlib.Path(path) if path else data.record_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return path


def read_result(path, name: str, action: str) -> dict:
    """The JSON at ``path`` (default: ``name`` of the package data).

    Raises:
        FileNotFoundError: with the command that records it (``python -m commlab experiments <action>``).
    """
    path = pathlib.Path(path) if path else data.path(name)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; record it with `python -m commlab experiments {action}`")
    return json.loads(path.read_text(encoding="utf-8"))


def unnull_times(rows) -> None:
    """Times to target stored as null (never reached) back to inf, in place."""
    for r in rows:
        for k in ("predicted_tta_s", "measured_tta_s"):
            if r[k] is None:
                r[k] = math.inf


def format_table(result: dict) -> str:
    """Predicted beside measured step times and times to target, then the predicted break-even bandwidths."""
    lines = [f"{result['settings']['task']}, {result['settings']['world_size']} ranks, target {result['metric']} "
             f"{result['target']:.4g}, emulated α = {result['settings']['alpha_s'] * 1e3:g} ms",
             f"{'method':24s} {'link':>9s} {'step pred':>10s} {'step meas':>10s} {'error':>7s} "
             f"{'steps':>6s} {'to target pred':>15s} {'meas':>8s}"]
    for r in result["rows"]:
        steps = "never" if r["steps_to_target"] is None else str(r["steps_to_target"])
        tta = lambda x: f"{x:.1f}s" if math.isfinite(x) else "never"  # noqa: E731
        lines.append(f"{r['label']:24s} {r['bytes_per_s'] / 1e6:6g}MB/s {r['predicted_step_s'] * 1e3:8.1f}ms "
                     f"{r['measured_step_s'] * 1e3:8.1f}ms {r['error_pct']:+6.1f}% {steps:>6s} "
                     f"{tta(r['predicted_tta_s']):>15s} {tta(r['measured_tta_s']):>8s}")
    lines.append("break-even bandwidth against dense (the model, from the base runs):")
    for b in result["break_even"]:
        bw = "" if b["bytes_per_s"] is None else f" {b['bytes_per_s'] / 1e6:.3g} MB/s"
        lines.append(f"  {b['label']:24s} {b['verdict']}{bw}")
    return "\n".join(lines)
