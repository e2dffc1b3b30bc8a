"""Grader for lab 9: the learner's gradient-bucket assignment, DDP's rule.

The learner writes ``my_buckets(sizes_bytes, cap)``: positions grouped in order, a bucket closed as soon as it
holds at least ``cap`` bytes, the open one last; and sets ``smallest_cap_kib_for_3``, the smallest cap in
whole KiB that gives the lab's MLP exactly 3 buckets. The reference is
``torch.distributed._compute_bucket_assignment_by_size``, the function DDP itself uses (and
:func:`commlab.overlap.assign_buckets`, tested against it). A wrong answer is explained by the first of the
learner's buckets that breaks the rule; the reference's buckets are not printed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.exercises.report import NO_ANSWER, CheckReport

__all__ = ["check_buckets", "mlp_gradient_sizes"]

KiB = 2**10


def mlp_gradient_sizes(widths: Sequence[int]) -> list[int]:
    """Bytes of each gradient of :func:`commlab.overlap.profile.make_mlp` ``(widths)``, in the order backward
    produces them (reverse registration order)."""
    from commlab.overlap.profile import make_mlp
    return [4 * p.numel() for p in reversed(list(make_mlp(widths).parameters()))]


def _reference(sizes: Sequence[int], cap: int) -> list[list[int]]:
    want, _ = dist._compute_bucket_assignment_by_size([torch.empty(s // 4 or 1) for s in sizes], [cap],
                                                      [False] * len(sizes))
    return [list(b) for b in want]


def _explain(sizes: Sequence[int], cap: int, got) -> str:
    """The first way ``got`` breaks DDP's rule for ``sizes`` and ``cap``."""
    if not isinstance(got, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in got):
        return f"return a list of buckets, each a list of positions; got a {type(got).__name__}"
    flat = [i for b in got for i in b]
    if sorted(flat) != list(range(len(sizes))):
        missing = sorted(set(range(len(sizes))) - set(flat))
        if missing:
            return (f"positions {missing} are in no bucket" +
                    (": a bucket still open at the end is the last bucket" if missing[-1] == len(sizes) - 1 else ""))
        return "some position is in two buckets, or is not a position of the list: each tensor goes in exactly one"
    if flat != list(range(len(sizes))):
        return "the positions are not in order: take the tensors as given, filling one bucket after the other"
    if any(len(b) == 0 for b in got):
        return "an empty bucket was returned"
    for k, bucket in enumerate(got):
        total = 0
        for j, i in enumerate(bucket):
            total += sizes[i]
            if total >= cap and j < len(bucket) - 1:
                return (f"your bucket {k} ({list(bucket)}) already holds {total} bytes >= the cap {cap} at position "
                        f"{i} and should close there: a bucket closes as soon as it holds at least the cap")
        if total < cap and k < len(got) - 1:
            return (f"your bucket {k} ({list(bucket)}) closed with {total} bytes, below the cap {cap}: only the last "
                    "bucket may hold less than the cap")
    return "the buckets do not follow DDP's rule"


def check_buckets(fn: Callable, answer, widths: Sequence[int] = (256, 1024, 1024, 512, 128, 10)) -> CheckReport:
    """Grade ``fn(sizes_bytes, cap) -> list of lists of positions`` and ``answer``, the smallest cap in KiB
    that gives the MLP of ``widths`` exactly 3 buckets."""
    report = CheckReport(f"bucket exercise ({getattr(fn, '__name__', 'fn')})")
    mlp = mlp_gradient_sizes(widths)
    cases = [([16, 256, 64, 1536, 96, 2304], 1000), ([40, 4, 2304, 96], 1), ([8] * 10, 24), ([100, 5000, 7], 2**40),
             (mlp, 2**20)]
    for sizes, cap in cases:
        desc = (f"sizes {sizes[:6]}{'...' if len(sizes) > 6 else ''}, cap {cap}" if sizes is not mlp
                else f"the lab's MLP, cap {cap}")
        got = report.call(desc, fn, list(sizes), cap)
        if report.not_attempted:
            return report
        if got is NO_ANSWER:
            continue
        ok = isinstance(got, (list, tuple)) and [list(b) for b in got if isinstance(b, (list, tuple))] == \
            _reference(sizes, cap) and len(got) == len(_reference(sizes, cap))
        report.cases.append((desc, ok, "" if ok else _explain(sizes, cap, got)))

    desc = "smallest_cap_kib_for_3: the smallest cap in whole KiB giving the MLP 3 buckets"
    best = next(k for k in range(1, 2**16) if len(_reference(mlp, k * KiB)) == 3)
    if answer is None:
        report.cases.append((desc, False, "not set yet: put your answer in `smallest_cap_kib_for_3`"))
    elif not checks.is_int(answer) or answer < 1:
        report.cases.append((desc, False, f"{answer!r} is not a cap in whole KiB: give an int >= 1"))
    elif answer == best:
        report.cases.append((desc, True, ""))
    else:
        count = len(_reference(mlp, answer * KiB))
        msg = (f"with a cap of {answer} KiB the MLP gets {count} buckets, not 3" if count != 3
               else f"{answer} KiB gives 3 buckets, but so does a smaller cap")
        report.cases.append((desc, False, msg))
    return report
