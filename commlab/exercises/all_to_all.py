"""Grader for lab 3's AllToAllV exercise: the bytes each rank sends, and the slowest step of the pairwise schedule.

The learner writes ``bytes_sent(splits, row_nbytes)``: for an AllToAllV in which rank i sends ``splits[i][j]``
rows of ``row_nbytes`` bytes to rank j, the list of bytes each rank sends to the others. Then, for the lab's
split matrix :data:`LAB_SPLITS`, sets ``slowest_step``: the step s (1 .. N-1) of the pairwise schedule (rank i
sends to rank i+s mod N) whose largest message is the largest. The references are
:func:`commlab.collectives.all_to_all.all_to_all_v_bytes_sent` and
:func:`~commlab.collectives.all_to_all.pairwise_step_nbytes`; a wrong list is matched against the usual slips
(the block a rank keeps counted, what it receives instead of what it sends, rows instead of bytes); the
expected bytes are not printed.
"""

from __future__ import annotations

from typing import Callable

from commlab import checks
from commlab.collectives.all_to_all import all_to_all_v_bytes_sent, pairwise_step_nbytes
from commlab.exercises.report import NO_ANSWER, CheckReport

__all__ = ["check_all_to_all_bytes", "LAB_SPLITS"]

#: The lab's split matrix: 4 ranks, rows rank i sends rank j; rank 2 holds a popular expert.
LAB_SPLITS = [[3, 2, 9, 1],
              [2, 4, 8, 2],
              [1, 2, 5, 3],
              [2, 1, 7, 4]]

_CASES = [
    ("2 ranks", [[1, 3], [2, 0]], 4096),
    ("3 ranks with zeros", [[0, 2, 0], [5, 1, 0], [0, 0, 3]], 14336),
    ("4 ranks, the lab's matrix", LAB_SPLITS, 2),
    ("1 rank", [[7]], 8),
]


def _slip(splits, row_nbytes, got) -> str:
    n = len(splits)
    if checks.is_number(got):
        return f"a single number ({got!r}); return a list with one entry per rank ({n} entries)"
    try:
        got = [float(v) for v in got]
    except (TypeError, ValueError):
        return f"{got!r} is not a list of numbers; return one number of bytes per rank"
    if len(got) != n:
        return f"it has {len(got)} entries; return one per rank ({n})"
    sent = [sum(row) - row[i] for i, row in enumerate(splits)]
    with_own = [sum(row) for row in splits]
    received = [sum(splits[i][j] for i in range(n)) - splits[j][j] for j in range(n)]
    if got == [float(v) for v in sent]:
        return "that counts rows, not bytes (multiply by row_nbytes)"
    if got == [float(v * row_nbytes) for v in with_own] or got == [float(v) for v in with_own]:
        return "it counts the block each rank keeps for itself (splits[i][i]); that block never leaves the rank"
    if got == [float(v * row_nbytes) for v in received] or got == [float(v) for v in received]:
        return ("that is what each rank receives (a column of the matrix); a rank sends its row, "
                "splits[i][j] rows to each rank j")
    wrong = [i for i in range(n) if got[i] != sent[i] * row_nbytes]
    return f"the entry for rank {wrong[0]} is not right (rank i sends splits[i][j] rows of row_nbytes to every j != i)"


def check_all_to_all_bytes(fn: Callable, slowest_step) -> CheckReport:
    """Grade ``fn(splits, row_nbytes) -> list of bytes per rank`` on a few matrices, and ``slowest_step`` for
    :data:`LAB_SPLITS`."""
    report = CheckReport(f"AllToAllV bytes exercise ({getattr(fn, '__name__', 'fn')})")
    for desc, splits, row_nbytes in _CASES:
        desc = f"{desc}, rows of {row_nbytes} B"
        got = report.call(desc, fn, [list(r) for r in splits], row_nbytes)
        if report.not_attempted:
            return report
        if got is NO_ANSWER:
            continue
        want = all_to_all_v_bytes_sent([[v * row_nbytes for v in row] for row in splits])
        try:
            ok = len(got) == len(want) and all(float(g) == w for g, w in zip(got, want))
        except TypeError:
            ok = False
        report.cases.append((desc, ok, "" if ok else _slip(splits, row_nbytes, got)))

    desc = "slowest_step: the pairwise step with the largest message, for LAB_SPLITS"
    steps = pairwise_step_nbytes(LAB_SPLITS)  # steps[s - 1]: the largest message of step s, in rows
    n = len(LAB_SPLITS)
    if slowest_step is None:
        report.cases.append((desc, False, "not set yet: put your answer in `slowest_step`"))
    elif not checks.is_int(slowest_step) or not 1 <= slowest_step <= n - 1:
        report.cases.append((desc, False, f"{slowest_step!r} is not a step: give an int s in 1..{n - 1} (at step s "
                                          "rank i sends to rank (i + s) mod N)"))
    elif steps[slowest_step - 1] == max(steps):
        report.cases.append((desc, True, ""))
    else:
        report.cases.append((desc, False, f"not the slowest: the largest message of step {slowest_step} is "
                                          f"{steps[slowest_step - 1]} rows, and another step has a larger one"))
    return report
