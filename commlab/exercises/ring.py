"""Graders for lab 2: the learner's ring ReduceScatter and AllGather, run on real gloo ranks.

The learner writes ``fn(x) -> tensor`` to be run inside each rank (using ``dist.get_rank()``,
``dist.get_world_size()`` and point-to-point messages: the lab teaches one ``dist.batch_isend_irecv`` of
``dist.P2POp`` per ring step, the form NCCL needs, and any correct use of ``dist.isend``/``dist.irecv``
passes too). Each case launches it on N ranks with
integer-valued data (so sums are exact and any difference is a real mistake), compares with
commlab's reference, and explains the first difference it finds. While the learner's function runs,
torch's own collectives are disabled, so a solution that calls them is caught.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from commlab.collectives.common import chunk_bounds
from commlab.exercises.report import CheckReport
from commlab.launch import LaunchTimeout, RankError, launch

_CASE_TIMEOUT_S = 6.0
# Every collective of torch.distributed (point-to-point calls and barrier stay allowed) ...
_FORBIDDEN_TORCH = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_object", "all_gather_coalesced", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather",
    "gather_object", "scatter", "scatter_object_list", "broadcast_object_list",
)
# ... and commlab's own collectives, which would answer the exercise for the learner.
_FORBIDDEN_COMMLAB_PREFIXES = ("ring_", "rhd_", "tree_", "hierarchical_", "recursive_doubling_")


def _forbidden_targets():
    import importlib

    modules = [dist, importlib.import_module("torch.distributed.distributed_c10d")]
    targets = [(m, name, f"dist.{name}") for m in modules for name in _FORBIDDEN_TORCH if hasattr(m, name)]
    import commlab.collectives as pkg
    for mod in [pkg] + [getattr(pkg, sub) for sub in ("ring", "halving_doubling", "tree", "hierarchical")
                        if hasattr(pkg, sub)]:
        for name in dir(mod):
            if name.startswith(_FORBIDDEN_COMMLAB_PREFIXES) and not name.endswith("_seconds") and callable(getattr(mod, name)):
                targets.append((mod, name, f"commlab's {name}"))
    return targets


@contextlib.contextmanager
def _only_point_to_point():
    targets = _forbidden_targets()
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]

    def refuse(label):
        def _refuse(*_a, **_k):
            raise RuntimeError(f"{label} is off-limits in this exercise: build it from point-to-point "
                               "messages (dist.batch_isend_irecv of dist.P2POp, or dist.isend / dist.irecv)")
        return _refuse

    for mod, name, label in targets:
        setattr(mod, name, refuse(label))
    try:
        yield
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)


def _inputs(numel: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(-9, 10, (numel,), generator=g).to(torch.float32)


def _full_sum(numel: int, n: int) -> torch.Tensor:
    return sum(_inputs(numel, r) for r in range(n))


def _run(fn, kind: str, numel: int):
    rank, n = dist.get_rank(), dist.get_world_size()
    if kind == "reduce_scatter":
        x = _inputs(numel, rank)
    else:
        a, b = chunk_bounds(numel, n)[rank]
        x = _full_sum(numel, n)[a:b].clone()
    original = x.clone()
    with _only_point_to_point():
        out = fn(x)
    modified_input = not torch.equal(x, original)
    if out is not None and not isinstance(out, torch.Tensor):
        return ("type", type(out).__name__, modified_input)
    if out is not None and (out.dim() != 1 or out.dtype != x.dtype):
        return ("form", f"a tensor of shape {tuple(out.shape)} and dtype {str(out.dtype).replace('torch.', '')}",
                modified_input)
    return ("ok", None if out is None else out.detach().clone(), modified_input)


def _explain(kind: str, rank: int, n: int, numel: int, got, expected: torch.Tensor) -> str | None:
    if got is None:
        return f"rank {rank} returned None: every rank must return a tensor"
    if got.numel() != expected.numel():
        what = ("this rank's chunk of the sum" if kind == "reduce_scatter"
                else "the whole gathered tensor")
        return (f"rank {rank} returned {got.numel()} elements, expected {expected.numel()} "
                f"({what}; chunks follow torch.tensor_split)")
    if torch.equal(got, expected):
        return None
    i = int((got != expected).nonzero()[0])
    msg = f"rank {rank}: element {i} is {got[i].item():g}, expected {expected[i].item():g}"
    if kind == "reduce_scatter":
        a, b = chunk_bounds(numel, n)[rank]
        if torch.equal(got, _inputs(numel, rank)[a:b]):
            msg += " -- that is this rank's own input: nothing was added"
        else:
            for c, (ca, cb) in enumerate(chunk_bounds(numel, n)):
                if cb - ca == got.numel() and c != rank and torch.equal(got, _full_sum(numel, n)[ca:cb]):
                    msg += (f" -- you returned the complete sum of chunk {c}: the ring is rotated; "
                            f"rank r must end with chunk r")
                    break
            else:
                msg += " -- a chunk was added to the wrong slot, added twice, or missed a step"
    else:
        msg += " -- a received chunk was stored in the wrong slot, or a step is missing"
    return msg


_PEER_HINT = (" -- a rank finished while a neighbour was still sending to it or waiting for it: "
              "wait() on every request before returning")
_EMPTY_BATCH_HINT = (" -- dist.batch_isend_irecv needs at least one P2POp: when a step has nothing to send "
                     "or receive (empty chunks), skip the call")


def _check(kind: str, fn: Callable, world_sizes: Sequence[int], counts: Sequence[int]) -> CheckReport:
    title = {"reduce_scatter": "ReduceScatter", "all_gather": "AllGather"}[kind]
    report = CheckReport(f"{title} exercise ({getattr(fn, '__name__', 'fn')})")
    hung = False
    for n in world_sizes:
        for numel in counts:
            desc = f"{n} ranks, {numel} elements"
            if hung:  # one hang says enough, and each would cost the full timeout
                report.cases.append((desc, False, "not run: an earlier case hung"))
                continue
            try:
                outs = launch(_run, n, fn, kind, numel, timeout=_CASE_TIMEOUT_S, print_output=False)
            except RankError as e:
                hint = _PEER_HINT if "by peer" in e.exc_message.lower() else ""
                if e.exc_type == "IndexError" and "batch_isend_irecv" in e.remote_traceback:
                    hint = _EMPTY_BATCH_HINT
                report.cases.append((desc, False, f"rank {e.rank} raised {e.exc_type}: {e.exc_message}{hint}"))
                continue
            except LaunchTimeout:
                hung = True
                report.cases.append((desc, False, f"no result within {_CASE_TIMEOUT_S:g} s: a rank waits for "
                                     "a message nobody sends (every send needs the matching receive on the "
                                     "neighbour, and every request must be waited)"))
                continue
            if not report.cases and all(status == "ok" and got is None for status, got, _ in outs):
                # Every rank returned the stub's None in the first case: unfilled, say so in one line.
                report.not_attempted = getattr(fn, "__name__", "fn")
                return report
            total = _full_sum(numel, n)
            problems = []
            for rank, (status, got, modified) in enumerate(outs):
                if status == "type":
                    problems.append(f"rank {rank} returned a {got}, expected a torch.Tensor")
                    continue
                if status == "form":
                    problems.append(f"rank {rank} returned {got}; expected a 1-D float32 tensor like the input")
                    continue
                if modified:
                    problems.append(f"rank {rank} changed its input tensor in place; work on a copy "
                                    "(x.clone()), since the caller still owns x")
                    continue
                if kind == "reduce_scatter":
                    a, b = chunk_bounds(numel, n)[rank]
                    expected = total[a:b]
                else:
                    expected = total
                why = _explain(kind, rank, n, numel, got, expected)
                if why:
                    problems.append(why)
            report.cases.append((desc, not problems, problems[0] if problems else ""))
    return report


def check_reduce_scatter(fn: Callable[[torch.Tensor], torch.Tensor], world_sizes: Sequence[int] = (2, 3, 4),
                         counts: Sequence[int] = (12, 10, 2)) -> CheckReport:
    """Grade a ring ReduceScatter: ``fn(x)`` gets a 1-D float32 tensor (same size on every rank) and
    must return this rank's chunk of the sum over ranks (chunk ``rank`` of ``torch.tensor_split(sum, N)``).
    """
    return _check("reduce_scatter", fn, world_sizes, counts)


def check_all_gather(fn: Callable[[torch.Tensor], torch.Tensor], world_sizes: Sequence[int] = (2, 3, 4),
                     counts: Sequence[int] = (12, 10, 2)) -> CheckReport:
    """Grade a ring AllGather: ``fn(chunk)`` gets this rank's chunk (chunk ``rank`` of
    ``torch.tensor_split(full, N)``, so sizes may differ by one between ranks) and must return the full
    1-D tensor, the chunks concatenated in rank order.
    """
    return _check("all_gather", fn, world_sizes, counts)
