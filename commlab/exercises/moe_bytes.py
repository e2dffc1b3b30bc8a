"""Grader for lab 13: the bytes one rank sends in an expert-parallel MoE layer's dispatch AllToAll.

The learner writes ``dispatch_bytes(tokens, hidden, num_experts, k, capacity_factor, ep, element_nbytes)``: with
capacity-padded buffers every expert has ``C = ceil(capacity_factor * tokens * k / num_experts)`` slots, a rank's
dispatch buffer is ``[EP, E/EP, C, hidden]`` (every expert's slots, ``E * C * hidden * e`` bytes whatever the
routing), and the AllToAll sends all of it but the row that stays on the rank, ``(EP-1)/EP`` of it. The
reference is :func:`commlab.parallel.expert.moe_alltoall_cost` (``sent_per_alltoall_nbytes``), on shapes from a
toy layer up to DeepSeek-V3's (E = 256, k = 8, h = 7168, EP = 64). A wrong answer is matched against the usual
slips (no ceiling on the capacity, k or the capacity factor left out, the rank's own row counted, the tokens
sent without padding, elements instead of bytes) and how far it is off is said; the right number is not.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

from commlab.exercises.report import CheckReport, grade_number
from commlab.parallel.expert import moe_alltoall_cost

__all__ = ["check_dispatch_bytes", "DISPATCH_CASES"]

#: ``(label, (tokens, hidden, num_experts, k, capacity_factor, ep, element_nbytes))``, the graded shapes.
DISPATCH_CASES = [
    ("toy: 10 tokens, h 8, E 4, k 1, factor 1.0, EP 2, float32", (10, 8, 4, 1, 1.0, 2, 4)),
    ("Switch-like: 4096 tokens, h 1024, E 64, k 1, factor 1.25, EP 8, bf16", (4096, 1024, 64, 1, 1.25, 8, 2)),
    ("Mixtral-like: 8192 tokens, h 4096, E 8, k 2, factor 1.1, EP 8, bf16", (8192, 4096, 8, 2, 1.1, 8, 2)),
    ("capacity rounds up: 101 tokens, h 16, E 6, k 2, factor 1.5, EP 3, bf16", (101, 16, 6, 2, 1.5, 3, 2)),
    ("DeepSeek-V3-like: 4096 tokens, h 7168, E 256, k 8, factor 1.0, EP 64, fp8", (4096, 7168, 256, 8, 1.0, 64, 1)),
]


def _slips(tokens, hidden, e_, k, cf, ep, nbytes) -> dict[str, float]:
    exact = Fraction(repr(float(cf))) * tokens * k / e_
    cap = math.ceil(exact)
    full = e_ * cap * hidden * nbytes
    return {
        "that sends the tokens without padding: the buffer holds every expert's C = ceil(factor * tokens * k / E) "
        "slots, used or not": tokens * k * hidden * nbytes * (ep - 1) / ep,
        "the capacity was not rounded up to whole slots (C = ceil(factor * tokens * k / E))":
            float(e_ * exact * hidden * nbytes) * (ep - 1) / ep,
        "k was left out: each token fills k slots, so C = ceil(factor * tokens * k / E)":
            e_ * math.ceil(Fraction(repr(float(cf))) * tokens / e_) * hidden * nbytes * (ep - 1) / ep,
        "the capacity factor was left out: it multiplies the even share of slots":
            e_ * math.ceil(Fraction(tokens * k, e_)) * hidden * nbytes * (ep - 1) / ep,
        "the row that stays on the rank was counted: an AllToAll sends (EP-1)/EP of its buffer": full,
        "that divides the buffer by EP: every row but the rank's own leaves it, (EP-1)/EP": full / ep,
        "that counts elements, not bytes (times element_nbytes)": e_ * cap * hidden * (ep - 1) / ep,
    }


def check_dispatch_bytes(fn: Callable) -> CheckReport:
    """Grade ``fn(tokens, hidden, num_experts, k, capacity_factor, ep, element_nbytes) -> bytes sent``."""
    report = CheckReport(f"dispatch-bytes exercise ({getattr(fn, '__name__', 'fn')})")
    for label, args in DISPATCH_CASES:
        want = moe_alltoall_cost(*args).sent_per_alltoall_nbytes
        grade_number(report, label, fn, args, want, _slips(*args), lambda got: f"{got:.6g} bytes")
        if report.not_attempted:
            return report
    return report
