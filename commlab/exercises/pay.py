"""Grader for lab 8: the learner's step-time model for a compressed data-parallel step.

The learner writes ``step_seconds(compute_s, codec_s, payload_nbytes, path, n, alpha_s, beta_s_per_byte)``
returning the predicted seconds of one step: compute + encode/decode + the ring collective of the payload
(``path`` = ``"all_reduce"`` for linear compressors and dense, ``"all_gather"`` otherwise; one payload
tensor). The reference is :func:`commlab.experiments.time_to_accuracy.step_seconds`; a wrong answer is
matched against the usual slips (no α, AllGather priced as AllReduce, bytes not multiplied by the ring
factor) to say which one it is.
"""

from __future__ import annotations

import math
from typing import Callable

from commlab.exercises.report import NO_ANSWER, CheckReport, how_far
from commlab.experiments.time_to_accuracy import StepCosts, step_seconds
from commlab.topology.links import Link

__all__ = ["check_step_time"]

_CASES = [
    # compute_s, codec_s, payload bytes, path, n, alpha_s, beta_s_per_byte
    (0.05, 0.0, 4e6, "all_reduce", 4, 1e-4, 1e-9),
    (0.05, 0.002, 8e4, "all_gather", 4, 1e-4, 1e-9),
    (0.05, 0.002, 8e4, "all_gather", 64, 5e-6, 4e-11),
    (0.01, 0.001, 2e6, "all_reduce", 2, 0.0, 1e-8),
]


def _slips(case) -> dict[str, float]:
    compute, codec, p, path, n, a, b = case
    ar = 2 * (n - 1) * a + 2 * (n - 1) / n * p * b
    ag = (n - 1) * a + (n - 1) * p * b
    right = ar if path == "all_reduce" else ag
    return {
        "the latency term is missing (each of the ring's steps pays α)": compute + codec + right - (2 * (n - 1) * a if path == "all_reduce" else (n - 1) * a),
        "an AllGather of N payloads is priced as an AllReduce of one payload": compute + codec + ar,
        "the bytes are one payload, not what the ring makes each rank send": compute + codec + (2 * (n - 1) if path == "all_reduce" else n - 1) * a + p * b,
        "encode/decode time is left out": compute + right,
        "the AllGather's bytes were priced as (n-1)/n of one payload, but each rank forwards n-1 whole payloads": compute + codec + (n - 1) * a + (n - 1) / n * p * b,
    }


def _unit_slip(got: float, want: float) -> str | None:
    for factor, why in ((1e3, "the answer is in milliseconds; return seconds"),
                        (1e6, "the answer is in microseconds; return seconds"),
                        (8.0, "bytes were counted as bits (x8); β is in seconds per byte")):
        if math.isclose(got, want * factor, rel_tol=1e-6):
            return why
    return None


def check_step_time(fn: Callable) -> CheckReport:
    """Grade ``fn(compute_s, codec_s, payload_nbytes, path, n, alpha_s, beta_s_per_byte) -> seconds``."""
    report = CheckReport(f"step-time exercise ({getattr(fn, '__name__', 'fn')})")
    for case in _CASES:
        compute, codec, p, path, n, a, b = case
        want = step_seconds(StepCosts("case", compute, codec, p, path, n), Link(a, b))
        desc = f"{path}, {p:g}-byte payload, {n} ranks"
        got = report.call(desc, fn, *case, convert=float)
        if report.not_attempted:
            return report
        if got is NO_ANSWER:
            continue
        if math.isclose(got, want, rel_tol=1e-6):
            report.cases.append((desc, True, ""))
            continue
        why = next((k for k, v in _slips(case).items() if math.isclose(got, v, rel_tol=1e-9)), None) or _unit_slip(got, want)
        report.cases.append((desc, False, f"got {got:.6g} s, {how_far(got, want)}" + (f": {why}" if why else "")))
    return report
