"""Grader for lab 13: ring attention's block schedule under a causal mask, with causal load balancing.

The sequence is cut into ``2N`` chunks; rank ``i`` of the N-rank ring holds chunks ``i`` and ``2N-1-i`` (the
"zigzag" layout of :func:`commlab.parallel.context.chunk_indices`). At ring step ``t`` it holds the K/V of rank
``(i - t) mod N``. The learner writes ``ring_step_pairs(rank, step, n)``: the (query chunk, key chunk) pairs
that rank computes at that step, as an iterable of pairs of global chunk indices. A pair is computed when the
causal mask leaves anything of it (key chunk <= query chunk; the diagonal pair only below its diagonal).

The reference is :func:`commlab.parallel.context.block_plan` at one token per chunk, so that a block's rows and
columns *are* chunk indices, and :func:`~commlab.parallel.context.covered_pairs` is what a correct schedule
gives over all ranks and steps: every pair of the causal mask exactly once. A wrong answer names the rank, the
step and what breaks (a pair the rank does not hold at that step, a pair the mask removes, a pair left out, a
pair computed twice over the ring), never the whole expected set.
"""

from __future__ import annotations

from typing import Callable

from commlab.exercises.report import NO_ANSWER, CheckReport
from commlab.parallel.context import block_plan, chunk_indices, positions

__all__ = ["check_ring_schedule", "reference_ring_step_pairs", "RING_SIZES"]

#: The graded ring sizes N.
RING_SIZES = (1, 2, 3, 4, 8)


def reference_ring_step_pairs(rank: int, step: int, n: int) -> set[tuple[int, int]]:
    """The (query chunk, key chunk) pairs ``rank`` computes at ring ``step`` (load-balanced, causal), from
    :func:`~commlab.parallel.context.block_plan` with one token per chunk."""
    src = (rank - step) % n
    plan = block_plan(rank, src, n, 2, causal=True, load_balance=True)
    if plan is None:
        return set()
    rows = positions(rank, n, 2, True)[plan.q_rows].tolist()
    cols = positions(src, n, 2, True)[plan.k_cols].tolist()
    return {(q, k) for q in rows for k in cols if k <= q}


def _pairs(got) -> set[tuple[int, int]]:
    """The learner's answer as a set of int pairs; TypeError/ValueError for anything else."""
    out = set()
    for item in got:
        q, k = item
        if isinstance(q, bool) or isinstance(k, bool) or int(q) != q or int(k) != k:
            raise ValueError(f"{item!r} is not a pair of int chunk indices")
        out.add((int(q), int(k)))
    return out


def _problem(rank: int, step: int, n: int, got: set, want: set) -> str:
    src = (rank - step) % n
    mine, theirs = chunk_indices(rank, n, True), chunk_indices(src, n, True)
    where = (f"rank {rank}, step {step} (N = {n}: it holds query chunks {list(mine)} and the K/V of rank {src}, "
             f"chunks {list(theirs)})")
    foreign = sorted(p for p in got if p[0] not in mine or p[1] not in theirs)
    if foreign:
        q, k = foreign[0]
        who = f"query chunk {q} is not this rank's" if q not in mine else f"key chunk {k} is not in the K/V it holds"
        return f"{where}: pair {(q, k)}: {who} at this step"
    masked = sorted(p for p in got if p[1] > p[0])
    if masked:
        return f"{where}: pair {masked[0]} is removed by the causal mask (key chunk after query chunk)"
    if want - got:
        return (f"{where}: {len(want - got)} pair(s) left out that the causal mask keeps (key chunk <= query "
                "chunk)")
    return f"{where}: the answer differs"  # not reached: got is a subset of want, and want of got


def check_ring_schedule(fn: Callable) -> CheckReport:
    """Grade ``fn(rank, step, n) -> iterable of (query chunk, key chunk)`` for every rank and step of rings of
    :data:`RING_SIZES`; then, per ring size, that the union over ranks and steps covers the causal mask once
    and that every rank computes as many chunk pairs (the balance the layout is for)."""
    name = getattr(fn, "__name__", "fn")
    report = CheckReport(f"ring schedule exercise ({name})")
    for n in RING_SIZES:
        label = f"N = {n}: every rank's pairs at every ring step"
        problem, count, per_rank = None, {}, [0] * n
        for rank in range(n):
            for step in range(n):
                got = report.call(f"{label} (rank {rank}, step {step})", fn, rank, step, n, convert=_pairs,
                                  hint="return pairs (query chunk, key chunk) of ints")
                if report.not_attempted:
                    return report
                if got is NO_ANSWER:
                    problem = "recorded"
                    break
                want = reference_ring_step_pairs(rank, step, n)
                if got != want:
                    problem = _problem(rank, step, n, got, want)
                    break
                per_rank[rank] += len(got)
                for p in got:
                    count[p] = count.get(p, 0) + 1
            if problem:
                break
        if problem == "recorded":
            continue
        if problem is None:  # whole-ring properties, from the learner's answers
            wanted = {(q, k) for q in range(2 * n) for k in range(q + 1)}
            if set(count) != wanted or any(c != 1 for c in count.values()):
                problem = "over all ranks and steps the pairs do not cover the causal mask exactly once"
            elif len(set(per_rank)) != 1:
                problem = f"the ranks compute different numbers of chunk pairs: {per_rank}"
        report.cases.append((label, problem is None, problem or ""))
    return report
