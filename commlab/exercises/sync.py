"""Graders for lab 8b: Streaming DiLoCo's fragment schedule, the tau that hides an outer sync, bytes per step.

The learner writes:
* ``fragment_schedule(inner_steps, fragments, sync_delay)``: one cycle's ``(fragment, send_step, apply_step)``
  triples in the order they land. Reference: :func:`commlab.sync.fragment_schedule`;
* ``hiding_tau(payload_nbytes, n, alpha_s, beta_s_per_byte, base_step_s)``: the smallest tau whose inner steps
  cover one fragment's ring AllReduce. Reference: :func:`commlab.sync.cost.hiding_sync_delay`;
* ``sync_bytes_per_step(payload_nbytes, n, inner_steps, fragments, path)``: mean bytes a rank sends per inner step
  when the whole model's payload is synced once per H steps, in F fragments. Reference:
  :func:`commlab.sync.cost.bytes_sent_per_rank_per_step`.

A wrong answer is matched against the usual slips (tau forgotten, 0-based steps, fragments not staggered, floor
for ceil, the latency or the ring's 2(N-1)/N left out, bytes times F); the right answer is not shown. Book: lab 8b.
"""

from __future__ import annotations

import math
from typing import Callable

from commlab.exercises.report import NO_ANSWER, CheckReport, grade_number
from commlab.sync import fragment_schedule
from commlab.sync.cost import bytes_sent_per_rank_per_step, hiding_sync_delay, outer_sync_seconds

__all__ = ["check_fragment_schedule", "check_hiding_tau", "check_sync_bytes_per_step", "SCHEDULE_CASES",
           "HIDING_CASES", "BYTES_CASES"]

#: (H, F, tau) of the schedule exercise: DiLoCo, then Streaming DiLoCo with and without overlap.
SCHEDULE_CASES = ((6, 1, 0), (8, 2, 0), (8, 4, 1), (12, 3, 2), (100, 4, 5))

#: (payload bytes of one fragment, n, alpha s, beta s/byte, base step s) of the hiding exercise: 100 M fp32
#: parameters in 4 fragments on 5 and 50 MB/s, a small model on a fast link, and an exact multiple.
HIDING_CASES = ((1e8, 8, 0.05, 1 / 5e6, 1.0), (1e8, 8, 0.05, 1 / 50e6, 1.0), (4e5, 4, 1e-3, 1 / 1e9, 0.01),
                (1e6, 2, 0.0, 1e-6, 0.5), (2e9, 16, 0.1, 1 / 12.5e9, 0.3))

#: (payload bytes of the whole model, n, H, F, path) of the bytes exercise: per-step dense and INT8, DiLoCo, and
#: Streaming DiLoCo with dense and with INT8 Delta.
BYTES_CASES = ((4e8, 8, 1, 1, "all_reduce"), (1e8 + 400, 8, 1, 1, "all_gather"), (4e8, 8, 100, 1, "all_reduce"),
               (4e8, 8, 100, 4, "all_reduce"), (1e8 + 400, 4, 50, 2, "all_gather"))


def _schedule(h: int, f: int, tau: int) -> list[tuple[int, int, int]]:
    return [(s.fragment, s.send_step, s.apply_step) for s in fragment_schedule(h, f, tau)]


def _schedule_slips(h: int, f: int, tau: int) -> dict[str, list]:
    period = h // f
    return {
        "tau was ignored: a fragment is sent tau steps before it is applied":
            [(p, (p + 1) * period, (p + 1) * period) for p in range(f)],
        "send and apply are swapped: the AllReduce starts at send_step and lands tau steps later":
            [(p, (p + 1) * period, (p + 1) * period - tau) for p in range(f)],
        "steps are 0-based here; count inner steps from 1 (fragment 0 lands after step H/F)":
            [(p, (p + 1) * period - 1 - tau, (p + 1) * period - 1) for p in range(f)],
        "the fragments are not staggered: each lands H/F steps after the previous one, not all at step H":
            [(p, h - tau, h) for p in range(f)],
    }


def _as_triples(got) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in t) for t in got]


def check_fragment_schedule(fn: Callable) -> CheckReport:
    """Grade ``fn(inner_steps, fragments, sync_delay) -> [(fragment, send_step, apply_step), ...]`` (one cycle,
    steps counted from 1, in the order the fragments land)."""
    report = CheckReport(f"fragment-schedule exercise ({getattr(fn, '__name__', 'fn')})")
    for h, f, tau in SCHEDULE_CASES:
        label = f"H={h}, F={f}, tau={tau}"
        got = report.call(label, fn, h, f, tau, convert=_as_triples,
                          hint="return a list of (fragment, send_step, apply_step) tuples of ints")
        if got is NO_ANSWER:
            if report.not_attempted:
                return report
            continue
        want = _schedule(h, f, tau)
        if got == want:
            report.cases.append((label, True, ""))
            continue
        why = next((k for k, v in _schedule_slips(h, f, tau).items() if got == v), None)
        if why is None:
            why = (f"{len(got)} syncs; one cycle has one per fragment" if len(got) != len(want) else
                   f"first wrong entry at position {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}")
        report.cases.append((label, False, why))
    return report


def _sync_s(payload, n, alpha, beta):
    return outer_sync_seconds(payload, n, alpha, beta)


def check_hiding_tau(fn: Callable) -> CheckReport:
    """Grade ``fn(payload_nbytes, n, alpha_s, beta_s_per_byte, base_step_s) -> tau`` (an int): the smallest number
    of inner steps of ``base_step_s`` that cover one ring AllReduce of ``payload_nbytes`` over ``n`` ranks."""
    report = CheckReport(f"hiding-tau exercise ({getattr(fn, '__name__', 'fn')})")
    for payload, n, alpha, beta, base in HIDING_CASES:
        label = f"{payload / 1e6:g} MB over {n} ranks at {1 / beta / 1e6:g} MB/s, alpha {alpha * 1e3:g} ms, " \
                f"step {base:g} s"
        sync_s = _sync_s(payload, n, alpha, beta)
        slips = {
            "rounded down: tau steps must cover the whole sync (ceil)": math.floor(sync_s / base * (1 + 1e-12)),
            "the latency 2(N-1) alpha is missing": hiding_sync_delay(base, _sync_s(payload, n, 0.0, beta)),
            "the ring sends 2(N-1)/N of the payload, not the payload once": hiding_sync_delay(base, 2 * (n - 1) * alpha
                                                                                               + payload * beta),
            "that is seconds; return inner steps": sync_s,
        }
        grade_number(report, label, fn, (payload, n, alpha, beta, base), hiding_sync_delay(base, sync_s),
                     {k: v for k, v in slips.items() if v != hiding_sync_delay(base, sync_s)}, lambda got: f"tau = {got:g}")
        if report.not_attempted:
            return report
    return report


def check_sync_bytes_per_step(fn: Callable) -> CheckReport:
    """Grade ``fn(payload_nbytes, n, inner_steps, fragments, path) -> bytes``: mean bytes each rank sends per inner
    step, ``path`` ``"all_reduce"`` (ring) or ``"all_gather"`` (payloads that cannot be added)."""
    report = CheckReport(f"bytes-per-step exercise ({getattr(fn, '__name__', 'fn')})")
    for payload, n, h, f, path in BYTES_CASES:
        label = f"{payload / 1e6:g} MB, N={n}, H={h}, F={f}, {path}"
        want = bytes_sent_per_rank_per_step(payload, n, h, path)
        other = "all_gather" if path == "all_reduce" else "all_reduce"
        slips = {
            "the bytes were multiplied by F: F fragments of 1/F of the model each sync once per H steps": want * f,
            "the bytes were divided by F: each fragment is 1/F of the model, but all F sync every H steps": want / f,
            "not divided by H: the payload is sent once every H inner steps": want * h,
            f"priced as {other.replace('_', ' ')}: an {path.replace('_', ' ')} sends "
            + ("2(N-1)/N payloads" if path == "all_reduce" else "N-1 payloads"):
                bytes_sent_per_rank_per_step(payload, n, h, other),
        }
        grade_number(report, label, fn, (payload, n, h, f, path), want,
                     {k: v for k, v in slips.items() if not math.isclose(v, want)}, lambda got: f"{got:,.0f} B")
        if report.not_attempted:
            return report
    return report
