"""Grader for lab 7: the bytes one rank sends per PowerSGD step, and the largest approximation rank r for 10x.

The learner writes ``bytes_per_step(shapes, r)`` for float32 tensors of the given shapes with
``min_compression_rate`` 2 (chapter 7 §7.6), and sets ``largest_r_for_10x``. The reference is
:func:`commlab.compress.powersgd_nbytes` (the rule of :func:`commlab.compress.powersgd.compressed_shape`). A
wrong total is traced to the first tensor whose bytes, asked for alone, are wrong, and that tensor's slip is
named (elements instead of bytes, a tensor that should or should not be compressed, n not the product of
the trailing dimensions); the reference's numbers are not printed.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from commlab import checks
from commlab.compress import powersgd_nbytes
from commlab.compress.powersgd import compressed_shape
from commlab.exercises.report import NO_ANSWER, CheckReport, raised

__all__ = ["check_bytes_per_step", "mlp_shapes", "bytes_per_step_cases"]

_RANKS = (1, 2, 3, 8)
_MAX_R = 64


def mlp_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of the labs' digits MLP (:class:`commlab.train.DigitsMLP`), in registration order."""
    from commlab.train import DigitsMLP
    return [tuple(p.shape) for p in DigitsMLP(seed=0).parameters()]


def bytes_per_step_cases() -> dict[str, list[tuple[int, ...]]]:
    """The graded models: the MLP, a small conv net, and shapes that test each branch of the rule."""
    return {"MLP": mlp_shapes(),
            "conv net": [(8, 1, 3, 3), (8,), (32, 288), (32,), (10, 32), (10,)],
            "odd shapes": [(3, 50), (4, 4), (1, 1000), (7, 5, 2), (16, 16)]}


def _want(shapes: Sequence[tuple[int, ...]], r: int) -> int:
    return powersgd_nbytes([torch.empty(s, device="meta") for s in shapes], rank=r).total_nbytes


def _tensor_slip(shape: tuple[int, ...], r: int, got) -> str:
    """Why ``got`` bytes is wrong for one float32 tensor of ``shape`` at approximation rank ``r``."""
    numel = math.prod(shape)
    if len(shape) <= 1:
        if got == numel:
            return "that counts elements, not bytes (float32: 4 bytes each)"
        return "a tensor with at most one dimension is sent as it is, 4 bytes per entry"
    m, n = shape[0], numel // shape[0]
    rr = min(m, n, r)
    layout = compressed_shape(torch.Size(shape), r, 2)
    if got in (numel, (m + n) * rr):
        return "that counts elements, not bytes (float32: 4 bytes each)"
    if layout is None:
        if got in (4 * (m + n) * rr, 4 * (m + n) * r):
            return (f"compressing it does not pay: (m + n) r' * 2 >= m n for m = {m}, n = {n}, so it is sent as "
                    "it is")
        return f"it is not worth compressing (m = {m}, n = {n}), so it is sent as it is"
    if got == 4 * numel:
        return f"it should be compressed: (m + n) r' * 2 < m n for m = {m}, n = {n}, r' = {rr}; it sends P and Q"
    if len(shape) > 2 and got == 4 * (m + shape[1]) * min(m, shape[1], r):
        return "n is the product of all dimensions after the first, not just the second"
    return f"compressed, it sends P (m x r') and Q (n x r') in float32, with m = {m}, n = {n}, r' = min(m, n, r)"


def check_bytes_per_step(fn: Callable, answer) -> CheckReport:
    """Grade ``fn(shapes, r) -> int`` bytes per step, and ``answer``, the largest r whose MLP ratio is >= 10."""
    report = CheckReport(f"PowerSGD bytes exercise ({getattr(fn, '__name__', 'fn')})")
    for name, shapes in bytes_per_step_cases().items():
        for r in _RANKS:
            desc = f"{name}, r={r}"
            got = report.call(desc, fn, list(shapes), r)
            if report.not_attempted:
                return report
            if got is NO_ANSWER:
                continue
            if got == _want(shapes, r):
                report.cases.append((desc, True, ""))
                continue
            msg = f"{got!r} bytes is not right"
            for shape in shapes:
                try:
                    alone = fn([shape], r)
                except Exception as e:
                    msg += f"; for the tensor of shape {shape} alone it {raised(e)}"
                    break
                if alone != _want([shape], r):
                    msg += (f"; the first tensor it gets wrong is shape {shape} (alone: {alone!r} bytes): "
                            + _tensor_slip(shape, r, alone))
                    break
            else:
                msg += "; every tensor alone is right, so the total is not the sum over the tensors"
            report.cases.append((desc, False, msg))

    desc = "largest_r_for_10x: the largest r for which the MLP's ratio is at least 10"
    shapes = mlp_shapes()
    dense = 4 * sum(math.prod(s) for s in shapes)
    ratios = {r: dense / _want(shapes, r) for r in range(1, _MAX_R + 1)}
    best = max(r for r, q in ratios.items() if q >= 10)
    if answer is None:
        report.cases.append((desc, False, "not set yet: put your answer in `largest_r_for_10x`"))
    elif not checks.is_int(answer) or not 1 <= answer <= _MAX_R:
        report.cases.append((desc, False, f"{answer!r} is not an approximation rank: give an int in 1..{_MAX_R}"))
    elif answer == best:
        report.cases.append((desc, True, ""))
    elif ratios[answer] < 10:
        report.cases.append((desc, False, f"too large: at r = {answer} the ratio is {ratios[answer]:.2f}, below 10"))
    else:
        report.cases.append((desc, False, f"too small: r = {answer} gives {ratios[answer]:.2f}, and a larger r "
                             "still gives at least 10"))
    return report
