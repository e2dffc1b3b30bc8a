"""Grader for lab 10: a rank's coordinates and its TP, PP and DP groups in a 3D mesh, TP innermost.

The learner writes ``coords_and_groups(rank, dp, pp, tp) -> ((d, p, t), {"tp": [...], "pp": [...],
"dp": [...]})`` with integer arithmetic, ``rank = (d * pp + p) * tp + t``. The reference is
:class:`commlab.parallel.ParallelLayout` (``coords``, ``group_of``), for every rank of several layouts, sizes
of 1 and sizes that are not powers of two among them. A wrong answer names the rank and what breaks (the
coordinates do not give back the rank; a group misses the rank, has the wrong size, or holds a rank that
differs in another coordinate); the reference's answer is not printed.
"""

from __future__ import annotations

from typing import Callable

from commlab.exercises.report import CheckReport, is_stub_result, raised
from commlab.parallel import ParallelLayout

__all__ = ["check_coords_and_groups", "MESH_LAYOUTS"]

#: The graded (dp, pp, tp) layouts.
MESH_LAYOUTS = [(2, 2, 2), (1, 1, 1), (3, 2, 4), (2, 4, 1), (4, 1, 2), (1, 3, 1), (2, 3, 5)]
_OTHER = {"tp": "d or p", "pp": "d or t", "dp": "p or t"}


def _coords_problem(rank, got_c, dp, pp, tp) -> str:
    try:
        d, p, t = (int(v) for v in got_c)
    except (TypeError, ValueError):
        return f"rank {rank}: the coordinates should be three ints (d, p, t), got {got_c!r}"
    if not (0 <= d < dp and 0 <= p < pp and 0 <= t < tp):
        return f"rank {rank}: coordinates {(d, p, t)} are out of range (d < dp, p < pp, t < tp)"
    back = (d * pp + p) * tp + t
    if back != rank:
        return f"rank {rank}: coordinates {(d, p, t)} give back (d * pp + p) * tp + t = {back}, not {rank}"
    return f"rank {rank}: coordinates {(d, p, t)} are not in the order (d, p, t)"


def _group_problem(rank, dim, got, want, layout) -> str:
    size = layout.size(dim)
    if not isinstance(got, (list, tuple)):
        return f"rank {rank}: its {dim} group should be a list of ranks, got {got!r}"
    got = list(got)
    if rank not in got:
        return f"rank {rank}: its {dim} group {got} does not hold rank {rank} itself"
    if len(got) != size:
        return f"rank {rank}: its {dim} group {got} holds {len(got)} ranks; a {dim} group holds {dim} = {size}"
    stranger = next((r for r in got if r not in want), None)
    if stranger is not None:
        return (f"rank {rank}: its {dim} group {got} holds rank {stranger}, whose {_OTHER[dim]} differs from "
                f"rank {rank}'s")
    return f"rank {rank}: its {dim} group {got} is not sorted"


def check_coords_and_groups(fn: Callable) -> CheckReport:
    """Grade ``fn(rank, dp, pp, tp) -> ((d, p, t), {"tp": [...], "pp": [...], "dp": [...]})``."""
    report = CheckReport(f"mesh exercise ({getattr(fn, '__name__', 'fn')})")
    for dp, pp, tp in MESH_LAYOUTS:
        ref = ParallelLayout(dp, pp, tp, devices_per_node=tp)
        problem = None
        for rank in range(ref.world_size):
            want_c = ref.coords(rank)
            want_g = {dim: ref.group_of(rank, dim) for dim in ("tp", "pp", "dp")}
            try:
                got = fn(rank, dp, pp, tp)
            except Exception as exc:  # the learner's code: report any error as a failed case
                problem = f"rank {rank} {raised(exc)}"
                break
            if is_stub_result(got) and not report.cases:
                report.not_attempted = getattr(fn, "__name__", "fn")
                return report
            if not (isinstance(got, tuple) and len(got) == 2):
                problem = f"rank {rank}: return a pair (coords, groups), got {got!r}"
                break
            got_c, got_g = got
            if not isinstance(got_c, (tuple, list)) or tuple(got_c) != want_c:
                problem = _coords_problem(rank, got_c, dp, pp, tp)
                break
            if not isinstance(got_g, dict):
                problem = f"rank {rank}: groups should be a dict with keys 'tp', 'pp', 'dp', got {got_g!r}"
                break
            wrong = [dim for dim in want_g if got_g.get(dim) != want_g[dim]]
            if wrong:
                problem = _group_problem(rank, wrong[0], got_g.get(wrong[0]), want_g[wrong[0]], ref)
                break
        report.cases.append((f"dp={dp}, pp={pp}, tp={tp}: every rank's coordinates and groups", problem is None,
                             problem or ""))
    return report
