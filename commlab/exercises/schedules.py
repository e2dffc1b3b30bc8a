"""Grader for lab 10's last exercise: the bubble of 1F1B, interleaved 1F1B and ZB-H1, as a share of the work.

The learner writes ``bubble_ratio(schedule, p, m, v)`` for ``schedule`` in ``"1f1b"``, ``"interleaved"`` and
``"zb-h1"``: the idle time of a stage over its busy time, with a forward, an input-gradient backward (B) and a
weight-gradient backward (W) taking the same time. The reference is not a formula but the schedules' own ideal
timelines (:func:`commlab.parallel.pipeline.compare_bubbles`, measured on the op order), which equal
``(p-1)/m`` for 1F1B (Narayanan et al. 2021, §2.2.1), ``(p-1)/(v·m)`` interleaved (§2.2.2) and a third of
1F1B's for ZB-H1 (Qi et al. 2024, §2.1, with T_F = T_B = T_W). A wrong answer is matched against the usual
slips: the bubble's share of the step rather than of the work, the interleaving left out, ZB-H1 taken for
1F1B or for no bubble at all; the right number is not shown.
"""

from __future__ import annotations

from typing import Callable

from commlab.exercises.report import CheckReport, grade_number
from commlab.parallel.pipeline import compare_bubbles

__all__ = ["check_schedule_bubbles", "BUBBLE_CASES"]

#: ``(p, m, v)`` graded for each schedule (m a multiple of p, as interleaving needs).
BUBBLE_CASES = [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)]
_NAMES = {"1f1b": 0, "interleaved": 1, "zb-h1": 2}  # rows of compare_bubbles, in its order


def _slips(schedule: str, p: int, m: int, v: int) -> dict[str, float]:
    one = (p - 1) / m
    slips = {"that is the bubble's share of the whole step; the exercise asks for idle over busy time":
             {"1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (v * m + p - 1),
              "zb-h1": (p - 1) / (3 * m + p - 1)}[schedule]}
    if schedule == "interleaved":
        slips["the interleaving was left out: v chunks per rank divide 1F1B's bubble by v"] = one
    if schedule == "zb-h1":
        slips["that is 1F1B's bubble: ZB-H1 moves the W passes into 1F1B's idle slots"] = one
        slips["ZB-H1 (the schedule at 1F1B's memory) still has a bubble; ZB-H2 would remove it"] = 0.0
    return slips


def check_schedule_bubbles(fn: Callable) -> CheckReport:
    """Grade ``fn(schedule, p, m, v) -> idle / busy`` for the three schedules on :data:`BUBBLE_CASES`."""
    report = CheckReport(f"schedule bubble exercise ({getattr(fn, '__name__', 'fn')})")
    for p, m, v in BUBBLE_CASES:
        rows = compare_bubbles(p, m, v)
        for schedule, i in _NAMES.items():
            label = f"{schedule}, p = {p}, m = {m}" + (f", v = {v}" if schedule == "interleaved" else "")
            grade_number(report, label, fn, (schedule, p, m, v), rows[i]["bubble_time_ratio"],
                          _slips(schedule, p, m, v), lambda got: f"{got:.6g}")
            if report.not_attempted:
                return report
    return report
