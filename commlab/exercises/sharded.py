"""Graders for lab 12: ZeRO-3's bytes per rank, and the prefetch that hides the AllGather.

* :func:`check_zero3_bytes`: the learner writes ``zero3_bytes(numel, n, param_bytes, grad_bytes,
  optimizer_bytes)``, the model-state bytes one rank holds under ZeRO-3 (a dict with ``params``, ``grads``,
  ``optimizer``); the reference is :func:`commlab.parallel.zero_memory_bytes` (Rajbhandari et al. 2020, §5).
  A wrong part is compared with what the other stages hold (the usual slip: a part left whole), or said to be
  too high or too low, never printed.
* :func:`check_prefetch`: the learner writes ``wrap(model)``, returning a
  :class:`~commlab.parallel.ShardedDataParallel` of :func:`lab_model`, and predicts how many of a step's
  AllGathers are prefetched. The grader profiles one step on 2 gloo ranks (:func:`profile_sharded`) and reads
  from the *order* of the bars (:func:`gathers_issued_ahead`), not their lengths, whether every unit's
  AllGather but the first of each pass was launched while the unit before it computed: a property that does
  not depend on the machine's speed or load.
"""

from __future__ import annotations

import collections
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from commlab import checks
from commlab.exercises.report import NO_ANSWER, CheckReport, how_far, raised

__all__ = ["check_zero3_bytes", "check_prefetch", "lab_model", "memory_model", "ZERO3_CASES", "MEMORY_WIDTHS"]

#: The widths of :func:`memory_model`, the memory exercise's float64 MLP: its units hold 8,320, 16,512 and 1,290
#: elements, all even, so that on 2 ranks no shard is padded and the formula is exact.
MEMORY_WIDTHS = (64, 128, 128, 10)
MEMORY_NUMEL = sum(a * b + b for a, b in zip(MEMORY_WIDTHS[:-1], MEMORY_WIDTHS[1:]))


def memory_model(seed: int = 0) -> nn.Sequential:
    """The memory exercise's model: float64 Linear layers of :data:`MEMORY_WIDTHS` with ReLUs between."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for a, b in zip(MEMORY_WIDTHS[:-1], MEMORY_WIDTHS[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1]).double()

#: (description, numel, n, param_bytes, grad_bytes, optimizer_bytes) of the ZeRO-3 bytes exercise.
ZERO3_CASES = [
    ("ZeRO's Figure 1: 7.5e9 parameters, N = 64, mixed-precision Adam (2, 2, 12 bytes)", 7_500_000_000, 64, 2, 2, 12),
    ("the lab's float64 MLP on 2 ranks, Adam (8, 8, 16 bytes)", MEMORY_NUMEL, 2, 8, 8, 16),
    ("1 rank (nothing to shard), float32 SGD with momentum (4, 4, 4 bytes)", 1_000, 1, 4, 4, 4),
    ("1e6 parameters, N = 8, bf16 weights, fp32 gradients, Adam (2, 4, 12 bytes)", 1_000_000, 8, 2, 4, 12),
]

PARTS = ("params", "grads", "optimizer")


def _zero(stage, numel, n, p, g, k):
    from commlab.parallel import zero_memory_bytes
    return zero_memory_bytes(stage, numel, n, p, g, k)


def _part_problem(part: str, got: float, case) -> str:
    _, numel, n, p, g, k = case
    want = _zero(3, numel, n, p, g, k)[part]
    whole = [stage for stage in (0, 1, 2) if n > 1 and math.isclose(got, _zero(stage, numel, n, p, g, k)[part],
                                                                     rel_tol=1e-9)]
    if whole:
        return (f"'{part}' is what a rank holds when that part is not sharded (as under ZeRO-"
                f"{'/'.join(map(str, whole))}); under ZeRO-3 every rank keeps 1/N of it")
    return f"'{part}' is {how_far(got, want)}"


def check_zero3_bytes(fn: Callable) -> CheckReport:
    """Grade ``fn(numel, n, param_bytes, grad_bytes, optimizer_bytes) -> {"params", "grads", "optimizer"}`` (bytes
    per rank under ZeRO-3) against :func:`~commlab.parallel.zero_memory_bytes` on :data:`ZERO3_CASES`."""
    report = CheckReport(f"ZeRO-3 bytes exercise ({getattr(fn, '__name__', 'fn')})")
    for case in ZERO3_CASES:
        desc, numel, n, p, g, k = case
        got = report.call(desc, fn, numel, n, p, g, k,
                          hint="return a dict with the keys 'params', 'grads', 'optimizer' (bytes per rank)")
        if report.not_attempted:
            return report
        if got is NO_ANSWER:
            continue
        if not isinstance(got, dict) or set(PARTS) - set(got):
            report.cases.append((desc, False, f"return a dict with the keys {list(PARTS)}, got {got!r}"))
            continue
        try:
            values = {part: float(got[part]) for part in PARTS}
        except (TypeError, ValueError):
            report.cases.append((desc, False, f"each part must be a number of bytes, got {got!r}"))
            continue
        want = _zero(3, numel, n, p, g, k)
        wrong = [part for part in PARTS if not math.isclose(values[part], want[part], rel_tol=1e-9, abs_tol=1e-9)]
        report.cases.append((desc, not wrong, _part_problem(wrong[0], values[wrong[0]], case) if wrong else ""))
    return report


#: The widths of :func:`lab_model`: four Linear layers.
LAB_WIDTHS = (256, 512, 512, 512, 10)


def lab_model(seed: int = 0) -> nn.Sequential:
    """The prefetch exercise's model: float32 Linear layers of :data:`LAB_WIDTHS` with ReLUs between, all inside
    one child ``body``, so that by default (a unit per child that holds parameters) the whole model is one unit."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for a, b in zip(LAB_WIDTHS[:-1], LAB_WIDTHS[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(collections.OrderedDict(body=nn.Sequential(*layers[:-1])))


def _prefetch_job(wrap: Callable):
    from commlab.parallel import ShardedDataParallel
    from commlab.parallel.sharded_profile import gathers_issued_ahead, profile_sharded
    try:
        sdp = wrap(lab_model())
    except Exception as exc:  # noqa: BLE001 - the learner's code: any error is a failed case
        return ("error", f"wrap(model) {raised(exc)}")
    if sdp is None:
        return ("stub",)
    if not isinstance(sdp, ShardedDataParallel):
        return ("error", f"wrap(model) returned a {type(sdp).__name__}; return a ShardedDataParallel of the model")
    if sdp.stage != 3:
        return ("error", f"stage {sdp.stage} keeps every parameter whole: there is no AllGather before a unit's "
                         "forward to hide; use stage=3")
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(32, LAB_WIDTHS[0], generator=g)
    prof = profile_sharded(sdp, sdp.make_optimizer(torch.optim.SGD, lr=0.01), lambda out: out.pow(2).mean(), (x,),
                           steps=1, warmup=1)
    return ("ok", len(sdp.units), gathers_issued_ahead(prof.timeline), sdp.last_step.prefetched)


def check_prefetch(wrap: Callable, prefetched_per_step) -> CheckReport:
    """Grade ``wrap(model) -> ShardedDataParallel`` of :func:`lab_model` and ``prefetched_per_step``, the learner's
    count of the AllGathers of one step that are prefetched (launched by the hook of another unit), on 2 gloo
    ranks: one profiled step, read with :func:`~commlab.parallel.sharded_profile.gathers_issued_ahead`."""
    from commlab import launch
    report = CheckReport(f"prefetch exercise ({getattr(wrap, '__name__', 'wrap')})")
    results = launch(_prefetch_job, 2, wrap, timeout=120)
    first = results[0]
    if first[0] == "stub":
        report.not_attempted = getattr(wrap, "__name__", "wrap")
        return report
    if first[0] == "error":
        report.cases.append(("wrap(model) gives a ZeRO-3 ShardedDataParallel", False, first[1]))
        return report
    report.cases.append(("wrap(model) gives a ZeRO-3 ShardedDataParallel", True, ""))
    _, units, ahead, prefetched = first
    desc = "the model is cut into more than one unit"
    report.cases.append((desc, units > 1, "" if units > 1 else
                         "it is one unit: the first AllGather of a pass has nothing to hide behind, and here it is "
                         "the only one; give `units=` the layers, in forward order"))
    for rank, (_, _, got, _) in enumerate(results):
        for pas, want in (("forward", list(range(1, units))), ("backward", list(range(units - 1)))):
            if units < 2:
                continue
            late = [i for i in want if i not in got[pas]]
            desc = f"rank {rank}, {pas}: every unit's AllGather but the pass's first is launched while another computes"
            report.cases.append((desc, not late, "" if not late else
                                 f"the AllGathers of units {late} were launched only when their unit was reached, "
                                 "so the unit waited for them: launch the next unit's while this one computes"))
    desc = "prefetched_per_step: AllGathers of one step launched ahead"
    if prefetched_per_step is None:
        report.cases.append((desc, False, "not set yet: put your answer in `prefetched_per_step`"))
    elif not checks.is_int(prefetched_per_step):
        report.cases.append((desc, False, f"{prefetched_per_step!r} is not a count: give an int"))
    else:
        ok = prefetched_per_step == prefetched
        report.cases.append((desc, ok, "" if ok else
                             f"{prefetched_per_step} is {how_far(prefetched_per_step, prefetched) if prefetched else 'too high'} "
                             f"for the {units} units you made (count the forward pass and the backward pass)"))
    return report
