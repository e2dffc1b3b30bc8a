"""Graders for lab 13b: each exercise runs a fault for real and grades the learner's reading of its evidence.

* ``diagnose_hang(evidence) -> (rank, op, fix)``: a hang clinic case (:func:`hang_evidence`), read from what the ranks
  printed and their stacks; ``fix`` a key of :data:`FIXES`. Truth: the clinic's cases and :data:`CASE_ANSWERS`;
* ``odd_entry(evidence) -> (rank, size)``: each rank's Flight Recorder entries of a job whose ranks disagree on an
  AllReduce's size (:func:`flight_recorder_evidence`); checked against the majority of the dumps;
* ``read_traces(evidence) -> (kind, overlapped)``: two traces of a DP step, one overlapped (:func:`trace_evidence`);
* ``read_stragglers(evidence) -> (rank, step_s)``: per-rank timings with one slowed rank (:func:`straggler_evidence`);
* ``read_failure(evidence) -> (replica, step, divisor, healed_from)``: a fault-tolerant run's rounds with a replica
  killed and replaced (:func:`failure_evidence`); ``price(N, k, C, j)``: the replica-steps a restart and fault
  tolerance lose (:func:`check_failure_price`, truth :mod:`commlab.sync.recovery_cost`).

A wrong answer is told what it mistook (the launcher's rank for the cause, the mean for the maximum, N for the
quorum's size), not the answer. Book: lab 13b and chapter 13b, "When it goes wrong".
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import pickle
import random
import shutil
import statistics
import tempfile
import time
from typing import Callable

import torch

from commlab import checks
from commlab.exercises.report import NO_ANSWER, CheckReport, how_far

__all__ = ["FIXES", "CASE_ANSWERS", "HANG_CASES", "FR_FIELDS", "STEP_TOLERANCE", "HangEvidence",
           "FlightRecorderEvidence", "TraceEvidence", "StragglerEvidence", "hang_evidence", "flight_recorder_evidence",
           "trace_evidence", "straggler_evidence", "model_step_s", "check_hang_diagnosis", "check_flight_recorder",
           "check_trace_reading", "check_straggler",
           "PRICE_CASES", "FailureEvidence", "failure_evidence", "check_failure_reading", "check_failure_price"]

#: The fixes a diagnosis chooses from, each with the fault it cures.
FIXES = {
    "reorder the collectives": "ranks that call the same collectives in another order",
    "same shape on every rank": "ranks that pass tensors of different sizes to one collective",
    "same dtype on every rank": "ranks that pass tensors of different dtypes to one collective",
    "let the rank reach the collective": "a rank kept away from a collective its peers wait in (a sleep, a slow "
                                         "loader, a branch on the rank)",
    "restart from a checkpoint": "a rank that died: its peers cannot go on without it",
    "batch the send and receive": "pipeline stages whose blocking sends or receives wait for each other in a cycle "
                                  "(post them in the schedule's order, or together with batch_isend_irecv)",
    "raise the timeout": "work that is slow but on its way, on every rank",
}

#: Clinic case -> (the faulty rank's operation, the fix), for every case of commlab.launch.clinic.CASES.
CASE_ANSWERS = {
    "order": ("all_reduce", "reorder the collectives"),
    "size": ("all_reduce", "same shape on every rank"),
    "dtype": ("all_reduce", "same dtype on every rank"),
    "absent": ("all_reduce", "let the rank reach the collective"),
    "exit": ("all_reduce", "restart from a checkpoint"),
    "kill": ("all_reduce", "restart from a checkpoint"),
    "send-first": ("send", "batch the send and receive"),
    "recv-first": ("recv", "batch the send and receive"),
}

#: The cases :func:`hang_evidence` chooses from: those whose stacks name the rank on every run (tests/test_clinic.py);
#: a size or dtype mismatch leaves every stack at the same line, and a dead rank sometimes takes its peers' too.
HANG_CASES = ("order", "absent", "send-first", "recv-first")

#: Relative tolerance on the predicted step of the straggler exercise (medians of maxima against maxima of medians).
STEP_TOLERANCE = 0.05


def _name(fn) -> str:
    return getattr(fn, "__name__", "fn")


def _op_key(op) -> str:
    """``"dist.all_reduce"``, ``"AllReduce"`` and ``"all reduce"`` alike: lower case, no prefix, no separators."""
    text = str(op).strip().lower()
    for prefix in ("torch.distributed.", "dist."):
        text = text.removeprefix(prefix)
    return "".join(ch for ch in text.split("(")[0] if ch.isalnum() or ch == ".")


def _check_rank(report: CheckReport, label: str, rank, world_size: int) -> bool:
    if not checks.is_int(rank) or not 0 <= rank < world_size:
        report.cases.append((label, False, f"a rank is an int from 0 to {world_size - 1}, got {rank!r}"))
        return False
    return True


def _check_fix(report: CheckReport, fix, want: str) -> None:
    if fix == want:
        report.cases.append(("the fix", True, ""))
    elif fix not in FIXES:
        report.cases.append(("the fix", False, f"{fix!r} is not one of FIXES: {list(FIXES)}"))
    else:
        report.cases.append(("the fix", False, f"{fix!r} cures {FIXES[fix]}: not this fault"))


# ------------------------------------------------------------------------------------------------ 1. a hang

@dataclasses.dataclass(frozen=True)
class HangEvidence:
    """What a hang clinic run left: ``launcher`` (what the launcher said), ``printed`` and ``stacks`` (per rank, what
    the rank printed, and the top of its Python stack as ``"op at file:line  source"``), ``seconds`` to the end."""

    world_size: int
    launcher: str
    printed: dict
    stacks: dict
    seconds: float
    _case: str = dataclasses.field(repr=False)
    _launcher_ranks: tuple = dataclasses.field(repr=False, default=())

    def format_printed(self) -> str:
        """What the job printed without help: the launcher's verdict, then each rank's own error, in rank order."""
        return "\n".join([f"launcher: {self.launcher}"] + [f"rank {r}: {t}" for r, t in sorted(self.printed.items())])

    def format_stacks(self) -> str:
        """Each rank's Python stack at the hang (faulthandler), its innermost call of the job, in rank order."""
        return "\n".join(f"rank {r}: {t}" for r, t in sorted(self.stacks.items()))


def hang_evidence(seed: int = 0, timeout: float = 1.5) -> HangEvidence:
    """Run one clinic case, chosen by ``seed`` from :data:`HANG_CASES`, through :func:`commlab.launch.launch` with
    collectives that time out after ``timeout`` s, and keep what it printed and each rank's stack
    (:func:`commlab.launch.clinic.run_tools`, one run of 2-3 ranks, about ``timeout + 1`` s).

    Raises:
        ValueError: a seed that is not an int >= 0, a timeout outside [0.5, 60] s.
    """
    from commlab.launch.clinic import run_tools

    checks.integer("seed", seed, least=0)
    case = random.Random(seed).choice(HANG_CASES)
    plain, stacks = run_tools(case, ("plain", "stacks"), "launch", timeout)
    return HangEvidence(plain.world_size, plain.launcher, dict(plain.per_rank), dict(stacks.per_rank),
                        plain.seconds, case, tuple(plain.ranks))


def _wrong_arity(report: CheckReport, label: str, got: tuple, names: str) -> bool:
    """Record a failed case when the answer ``got`` does not have one value per name in ``names``."""
    want = len(names.split(", "))
    if len(got) != want:
        report.cases.append((label, False, f"return ({names}), got {len(got)} values"))
    return len(got) != want


def _as_triple(got) -> tuple:
    rank, op, fix = got
    return rank, op, fix


def check_hang_diagnosis(fn: Callable, evidence: HangEvidence) -> CheckReport:
    """Grade ``fn(evidence) -> (rank, op, fix)``: the rank that caused the hang, the operation it is in (or, for a
    rank that never reached one, the collective its peers wait in), and the fix (a key of :data:`FIXES`)."""
    from commlab.launch.clinic import CASES
    from commlab.launch.failures import faulty_rank

    report = CheckReport(f"hang diagnosis ({_name(fn)})")
    got = report.call("your diagnosis", fn, evidence, convert=_as_triple,
                      hint="return (rank, op, fix): an int, an operation's name, one of FIXES")
    if got is NO_ANSWER:
        return report
    rank, op, fix = got
    job, world, _ = CASES[evidence._case]
    want_rank = faulty_rank(job, world)
    want_op, want_fix = CASE_ANSWERS[evidence._case]
    ops = {r: t.split(" at ")[0] for r, t in evidence.stacks.items()}
    if _check_rank(report, "the faulty rank", rank, world):
        if rank == want_rank:
            report.cases.append(("the faulty rank", True, ""))
        elif rank in evidence._launcher_ranks:
            report.cases.append(("the faulty rank", False, f"rank {rank} is the rank the launcher names: the first "
                                 "whose collective timed out, a victim of the hang, not its cause"))
        elif want_op in ("send", "recv"):
            report.cases.append(("the faulty rank", False, f"rank {rank} blocks as its peer does, and its call is "
                                 "the one the pipeline's schedule makes there; the stage to fix is the one whose "
                                 "order breaks it (activation forward first, then the gradient back)"))
        else:
            report.cases.append(("the faulty rank", False, f"rank {rank} stands where most ranks stand: look for "
                                 "the stack at another line"))
    if _op_key(op) == _op_key(want_op):
        report.cases.append(("its operation", True, ""))
    elif _op_key(op) in ("time.sleep", "sleep"):
        report.cases.append(("its operation", False, "time.sleep is where the rank stands, not a communication: name "
                             "the collective its peers wait in, which it never reaches"))
    elif any(_op_key(op) == _op_key(o) for r, o in ops.items() if r != want_rank):
        report.cases.append(("its operation", False, f"{op!r} is where other ranks wait: name the faulty rank's own"))
    else:
        report.cases.append(("its operation", False, f"{op!r} is not the operation at fault: read the call at the "
                             "top of the faulty rank's stack"))
    _check_fix(report, fix, want_fix)
    return report


# ------------------------------------------------------------------------------------ 2. a Flight Recorder dump

#: The fields of a Flight Recorder entry that :func:`flight_recorder_evidence` keeps.
FR_FIELDS = ("collective_seq_id", "profiling_name", "input_sizes", "input_dtypes", "state", "retired")


@dataclasses.dataclass(frozen=True)
class FlightRecorderEvidence:
    """Each rank's Flight Recorder entries (``dumps[rank]``: dicts with :data:`FR_FIELDS`) and what each rank
    raised (``errors[rank]``, None where its collectives went through)."""

    world_size: int
    dumps: dict
    errors: dict
    seconds: float

    def format(self) -> str:
        """One line per rank and entry, in rank order, as the dump records it."""
        lines = [f"{'rank':>4} {'seq':>3}  {'profiling_name':<16} {'input_sizes':<12} {'dtypes':<8} {'state':<10} "
                 "retired"]
        for r in sorted(self.dumps):
            for e in self.dumps[r]:
                lines.append(f"{r:>4} {e['collective_seq_id']:>3}  {e['profiling_name']:<16} "
                             f"{str(e['input_sizes']):<12} {','.join(e['input_dtypes'] or []):<8} "
                             f"{str(e['state']):<10} {e['retired']}")
        lines += [f"rank {r}: {'raised ' + t if t else 'went through'}" for r, t in sorted(self.errors.items())]
        return "\n".join(lines)


def _fr_rank(timeout: float) -> tuple:
    """One rank: two collectives every rank agrees on, then the clinic's size mismatch; its dump, whatever happened."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    from commlab.launch.device import group_device
    from commlab.launch.failures import run_job
    from commlab.launch.inprocess import collective_timeout

    rank, world, device = dist.get_rank(), dist.get_world_size(), group_device()
    error = None
    try:
        with collective_timeout(timeout):
            dist.broadcast(torch.zeros(8, device=device), src=0)
            dist.all_reduce(torch.ones(8, device=device))
            run_job("shape", rank, world, device, timeout)
    except Exception as e:  # noqa: BLE001 - a timed-out collective is the point; its dump is the evidence
        error = type(e).__name__
    dump = pickle.loads(_dump_fr_trace())
    return error, [{k: e.get(k) for k in FR_FIELDS} for e in dump["entries"] if not e.get("is_p2p")]


def flight_recorder_evidence(world_size: int = 3, timeout: float = 1.5) -> FlightRecorderEvidence:
    """Launch ``world_size`` gloo ranks that broadcast, all-reduce, then all-reduce 4 elements on rank 0 and 5 on the
    others (the clinic's ``size`` case), and keep each rank's Flight Recorder entries at its end.

    Raises:
        ValueError: world_size below 2, a timeout outside [0.5, 60] s.
    """
    from commlab.launch import launch

    checks.integer("world_size", world_size, least=2)
    checks.number("timeout", timeout, least=0.5, most=60.0)
    start = time.monotonic()
    out = launch(_fr_rank, world_size, timeout, timeout=timeout + 30, print_output=False)
    return FlightRecorderEvidence(world_size, {r: d for r, (_, d) in enumerate(out)},
                                  {r: e for r, (e, _) in enumerate(out)}, time.monotonic() - start)


def _numel(size) -> int | None:
    """4, [4], (4,), [[4]] -> 4; [[2, 3]] -> 6 (a Flight Recorder entry's input_sizes: one shape per tensor)."""
    if checks.is_int(size):
        return int(size)
    if isinstance(size, (list, tuple)) and size:
        if all(checks.is_int(s) for s in size):
            return math.prod(size)
        if all(isinstance(s, (list, tuple)) for s in size):
            parts = [_numel(s) for s in size]
            return None if None in parts else sum(parts)
    return None


def _odd_entry(evidence: FlightRecorderEvidence) -> tuple[int, int, int, int] | None:
    """(rank, sequence number, its size, most ranks' size) of the first entry a minority of ranks recorded."""
    by_seq: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    for r, entries in evidence.dumps.items():
        for e in entries:
            by_seq[e["collective_seq_id"]][r] = e
    for seq in sorted(by_seq):
        keys = {r: (by_seq[seq][r]["profiling_name"], str(by_seq[seq][r]["input_sizes"]),
                    str(by_seq[seq][r]["input_dtypes"])) if r in by_seq[seq] else None for r in evidence.dumps}
        counts = collections.Counter(keys.values())
        if len(counts) > 1:
            top, _ = counts.most_common(1)[0]
            odd = [r for r, k in keys.items() if k != top]
            if len(odd) == 1 and keys[odd[0]] is not None:
                r = odd[0]
                other = next(q for q, k in keys.items() if k == top)
                return r, seq, _numel(by_seq[seq][r]["input_sizes"]), _numel(by_seq[seq][other]["input_sizes"])
    return None


def check_flight_recorder(fn: Callable, evidence: FlightRecorderEvidence) -> CheckReport:
    """Grade ``fn(evidence) -> (rank, size)``: the rank whose Flight Recorder entry differs from the other ranks'
    and the number of elements that entry records."""
    from commlab.launch.failures import faulty_rank

    report = CheckReport(f"Flight Recorder exercise ({_name(fn)})")
    got = report.call("your reading", fn, evidence, convert=tuple, hint="return (rank, size): two ints")
    if got is NO_ANSWER:
        return report
    if _wrong_arity(report, "your reading", got, "rank, size"):
        return report
    rank, size = got
    odd = _odd_entry(evidence)
    if odd is None or odd[0] != faulty_rank("shape", evidence.world_size):
        report.cases.append(("the evidence", False, "the dumps do not show one odd rank (a rank left none?): run the "
                             "cell that collects them again"))
        return report
    want_rank, seq, want_size, most_size = odd
    if _check_rank(report, "the rank whose entry differs", rank, evidence.world_size):
        report.cases.append(("the rank whose entry differs", rank == want_rank, "" if rank == want_rank else
                             f"rank {rank}'s entries match most ranks' at every sequence number"))
    n = _numel(size)
    if n == want_size:
        report.cases.append(("its size", True, ""))
    elif n is None:
        report.cases.append(("its size", False, f"a size is a number of elements (an int), got {size!r}"))
    elif n == most_size:
        report.cases.append(("its size", False, f"{n} elements is what most ranks all-reduce: give the odd entry's"))
    else:
        report.cases.append(("its size", False, f"no rank's entry #{seq} records {n} elements: read its input_sizes"))
    return report


# ------------------------------------------------------------------------------------------------ 3. a trace

@dataclasses.dataclass(frozen=True)
class TraceEvidence:
    """Rank ``rank``'s ``torch.profiler`` traces of one DP step, labelled ``"A"`` and ``"B"``, one with its gradient
    AllReduce overlapped with backward and one without (``traces[label]``, :class:`commlab.overlap.trace.Trace`),
    and what :func:`commlab.overlap.trace.check_overlap` reports on each (``reports[label]``)."""

    rank: int
    traces: dict
    reports: dict
    _overlapped: str = dataclasses.field(repr=False)

    def format(self) -> str:
        """The checker's table for each trace (:func:`commlab.overlap.trace.format_report`), A then B."""
        from commlab.overlap.trace import format_report
        return "\n\n".join(f"trace {k}:\n{format_report(self.reports[k])}" for k in sorted(self.reports))


def trace_evidence(seed: int = 0, rank: int = 0) -> TraceEvidence:
    """Profile one DP step on 2 gloo ranks with overlap on and off, and keep ``rank``'s two traces, labelled A and B
    in a seeded order.

    Raises:
        ValueError: a seed that is not an int >= 0, a rank other than 0 or 1.
    """
    from commlab.launch import launch
    from commlab.overlap.profile import trace_dp_step
    from commlab.overlap.trace import check_overlap, load_trace

    checks.integer("seed", seed, least=0)
    checks.integer("rank", rank, least=0, most=1)
    on = "AB"[random.Random(seed).randrange(2)]
    directory = tempfile.mkdtemp(prefix="commlab-lab13b-")
    try:
        paths = launch(trace_dp_step, 2, directory, timeout=90, print_output=False)[rank]
        traces = {}
        for label in "AB":
            with open(paths["on" if label == on else "off"][0], encoding="utf-8") as f:
                traces[label] = dataclasses.replace(load_trace(json.load(f)), source=f"trace_{label}.rank{rank}.json")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return TraceEvidence(rank, traces, {k: check_overlap(t) for k, t in traces.items()}, on)


def check_trace_reading(fn: Callable, evidence: TraceEvidence) -> CheckReport:
    """Grade ``fn(evidence) -> (kind, overlapped)``: the kind of communication with the most exposed seconds (as
    :func:`commlab.overlap.trace.check_overlap` names it, in either trace), and which trace, ``"A"`` or ``"B"``,
    overlapped its gradient AllReduce with backward."""
    from commlab.overlap.trace import check_overlap

    report = CheckReport(f"trace exercise ({_name(fn)})")
    got = report.call("your reading", fn, evidence, convert=tuple, hint="return (kind, overlapped): a str, 'A' or 'B'")
    if got is NO_ANSWER:
        return report
    if _wrong_arity(report, "your reading", got, "kind, overlapped"):
        return report
    kind, overlapped = got
    rows = [check_overlap(t).rows for t in evidence.traces.values()]   # recomputed from the traces themselves
    kinds = sorted({r.kind for rs in rows for r in rs})
    label = "the kind with the most exposed seconds"
    if any(rs and kind == max(rs, key=lambda r: r.exposed_s).kind for rs in rows):
        report.cases.append((label, True, ""))
    elif kind in kinds:
        report.cases.append((label, False, f"{kind!r} exposes fewer seconds than another kind"))
    else:
        report.cases.append((label, False, f"{kind!r} is not a kind of these reports, whose kinds are {kinds}"))
    label = "the trace with overlap on"
    if overlapped not in ("A", "B"):
        report.cases.append((label, False, f"overlapped is 'A' or 'B', got {overlapped!r}"))
    elif overlapped == evidence._overlapped:
        report.cases.append((label, True, ""))
    else:
        report.cases.append((label, False, f"trace {overlapped} hides less of its AllReduce under compute: overlap "
                             "starts each bucket's AllReduce while backward still runs, one AllReduce after "
                             "backward hides (almost) nothing"))
    return report


# ------------------------------------------------------------------------------------------------ 4. stragglers

@dataclasses.dataclass(frozen=True)
class StragglerEvidence:
    """Per-rank timings of a DP job's steady steps (``compute_s[rank][step]``, ``step_s[rank][step]``, seconds),
    ``allreduce_s``, the ring AllReduce's α-β time for its gradient with α and β calibrated in the same job, and
    ``measured_step_s``, the median over the steps of the mean over the ranks of their step."""

    world_size: int
    compute_s: tuple
    step_s: tuple
    allreduce_s: float
    measured_step_s: float
    _slow_rank: int = dataclasses.field(repr=False)

    def format(self) -> str:
        """Per rank: median compute and median step, milliseconds; then the AllReduce's α-β time."""
        lines = [f"{'rank':>4} {'compute (ms)':>12} {'step (ms)':>10}   ({len(self.compute_s[0])} steps, medians)"]
        for r, (c, s) in enumerate(zip(self.compute_s, self.step_s)):
            lines.append(f"{r:>4} {statistics.median(c) * 1e3:>12.1f} {statistics.median(s) * 1e3:>10.1f}")
        lines.append(f"ring AllReduce of the gradient, alpha-beta model: {self.allreduce_s * 1e3:.1f} ms")
        return "\n".join(lines)


def straggler_evidence(seed: int = 0, world_size: int = 3, delay_s: float = 0.03, steps: int = 12) -> StragglerEvidence:
    """Train a small MLP on ``world_size`` gloo ranks for ``steps`` steps, one rank (a seeded choice) slowed by
    ``delay_s`` in its forward (:func:`commlab.experiments.stragglers.run_case`); the first 2 steps are dropped.

    Raises:
        ValueError: a bad seed, world_size, delay or steps (named).
    """
    from commlab.experiments.stragglers import run_case

    checks.integer("seed", seed, least=0)
    checks.integer("world_size", world_size, least=2)
    checks.integer("steps", steps, least=4)
    slow = random.Random(seed).randrange(world_size)
    res = run_case(world_size, delay_s=delay_s, slow_rank=slow, steps=steps, skip=2, width=256, batch=64, seed=seed,
                   timeout=120)
    cut = lambda rows: tuple(tuple(row[2:]) for row in rows)  # noqa: E731
    return StragglerEvidence(world_size, cut(res["compute_s"]), cut(res["step_s"]), res["allreduce_model_s"],
                             res["measured_step_s"], slow)


def model_step_s(compute_s, allreduce_s: float) -> float:
    """The max-over-ranks model: the median over steps of the longest compute of any rank, plus the AllReduce."""
    return statistics.median(max(step) for step in zip(*compute_s)) + allreduce_s


def check_straggler(fn: Callable, evidence: StragglerEvidence) -> CheckReport:
    """Grade ``fn(evidence) -> (rank, step_s)``: the slowed rank, and the step seconds the max-over-ranks model
    predicts from the per-rank computes and the AllReduce's time (within :data:`STEP_TOLERANCE`)."""
    report = CheckReport(f"straggler exercise ({_name(fn)})")
    got = report.call("your reading", fn, evidence, convert=tuple, hint="return (rank, step_s): an int, seconds")
    if got is NO_ANSWER:
        return report
    if _wrong_arity(report, "your reading", got, "rank, step_s"):
        return report
    rank, step_s = got
    label = "the straggler"
    if _check_rank(report, label, rank, evidence.world_size):
        report.cases.append((label, rank == evidence._slow_rank, "" if rank == evidence._slow_rank else
                             f"rank {rank} computes no longer than the others; the straggler is the rank the "
                             "others wait for"))
    label = f"the step the max-over-ranks model predicts (within {100 * STEP_TOLERANCE:g} %)"
    if not checks.is_number(step_s) or not math.isfinite(step_s) or step_s <= 0:
        report.cases.append((label, False, f"step_s is a positive number of seconds, got {step_s!r}"))
        return report
    want = model_step_s(evidence.compute_s, evidence.allreduce_s)
    if abs(step_s - want) <= STEP_TOLERANCE * want:
        report.cases.append((label, True, ""))
        return report
    mean_c = statistics.median(statistics.fmean(step) for step in zip(*evidence.compute_s))
    slips = {"the mean over ranks: a synchronous step waits for the slowest rank": mean_c + evidence.allreduce_s,
             "the AllReduce is missing: it starts when the slowest rank's gradient is ready":
                 want - evidence.allreduce_s,
             "milliseconds: give seconds": want * 1e3}
    why = next((k for k, v in slips.items() if abs(step_s - v) <= STEP_TOLERANCE * v), "")
    report.cases.append((label, False, f"{step_s:.4g} s is {how_far(step_s, want)}" + (f": {why}" if why else "")))
    return report


# ----------------------------------------------------------------------------------------- 5. survive a failure

@dataclasses.dataclass(frozen=True)
class FailureEvidence:
    """A fault-tolerant run's rounds (one per ``start_step``, in order), as a survivor recorded them, with the
    replacement's heal merged in: ``rounds[i]`` has ``round``, ``step`` (committed steps when it started),
    ``members`` (the quorum), ``committed`` and ``healed_from`` (None, or ``(joiner, source)``: the replica that
    copied the state and the one it copied it from). ``seconds``: the run's wall time."""

    replicas: int
    steps: int
    rounds: tuple
    seconds: float
    _fault: tuple = dataclasses.field(repr=False)   # (replica, step, rejoin_step): the injected Fault

    def format(self) -> str:
        """One line per round: its step, members, whether it committed, and who healed from whom."""
        lines = [f"{'round':>5} {'step':>4}  {'members':<14} {'committed':<9}  healed_from"]
        for r in self.rounds:
            heal = "" if r["healed_from"] is None else f"replica {r['healed_from'][0]} from {r['healed_from'][1]}"
            lines.append(f"{r['round']:>5} {r['step']:>4}  {str(list(r['members'])):<14} "
                         f"{'yes' if r['committed'] else 'no':<9}  {heal}")
        return "\n".join(lines)


def _merge_rounds(results: dict, fault_replica: int) -> tuple | None:
    """A survivor's rounds with the replacement's heal marked on its first round; None if it never healed."""
    survivor = min(r for r in results if r != fault_replica)
    rounds = [dict(round=i, step=r["step"], members=tuple(r["members"]), committed=r["committed"], healed_from=None)
              for i, r in enumerate(results[survivor]["rounds"])]
    joined = next((r for r in results.get(fault_replica, {}).get("rounds", ()) if r["healed_from"] is not None),
                  None)
    if joined is None:
        return None
    aborted = next(i for i, r in enumerate(rounds) if not r["committed"])
    i = next((i for i, r in enumerate(rounds) if i > aborted and fault_replica in r["members"]
              and (r["step"], r["members"]) == (joined["step"], tuple(joined["members"]))), None)
    if i is None:
        return None
    rounds[i]["healed_from"] = (fault_replica, joined["healed_from"])
    return tuple(rounds)


def failure_evidence(seed: int = 0, replicas: int = 3, steps: int = 20, tries: int = 2) -> FailureEvidence:
    """Run the lost-work experiment's fault-tolerant job (:mod:`commlab.experiments.lost_work`, the digits MLP,
    :class:`commlab.sync.FaultTolerantDP`) on ``replicas`` replicas for ``steps`` steps, with one replica (a seeded
    choice) SIGKILLed after its backward of step 2..5 and a fresh one started 2..4 steps later (about 3 s).
    A replacement that came after the survivors finished (a loaded machine) leaves no heal: the run is tried
    again, ``tries`` runs at most.

    Raises:
        ValueError: a bad seed, replicas (3..8), steps (16..200) or tries. RuntimeError: no run saw the heal.
    """
    from commlab.experiments.lost_work import JobConfig, ft_replica
    from commlab.launch import Fault, run_replicas
    from commlab.train.data import load_digits_split

    where = "failure_evidence"
    checks.integer("seed", seed, least=0, where=where)
    checks.integer("replicas", replicas, least=3, most=8, where=where)
    checks.integer("steps", steps, least=16, most=200, where=where)
    checks.integer("tries", tries, least=1, most=5, where=where)
    rng = random.Random(seed)
    fault = Fault(rng.randrange(replicas), rng.randint(2, 5))
    fault = dataclasses.replace(fault, rejoin_step=fault.step + rng.randint(2, 4))
    cfg = JobConfig(replicas=replicas, steps=steps, seed=seed)
    digits = load_digits_split(seed=seed)   # loaded once here: the replicas, and the replacement, fork with it
    for _ in range(tries):
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="commlab-lab13b-") as folder:
            run = run_replicas(ft_replica, replicas, dict(cfg, fail_step=fault.step, fail_replica=fault.replica),
                               folder, digits, faults=(fault,), timeout_s=60, print_output=False)
        rounds = _merge_rounds(run.results, fault.replica)
        if rounds is not None:
            return FailureEvidence(replicas, steps, rounds, time.monotonic() - start,
                                   (fault.replica, fault.step, fault.rejoin_step))
    raise RuntimeError(f"{where}: in {tries} runs the replacement of replica {fault.replica} came after the "
                       "survivors finished (a loaded machine): run the cell again, or pass more steps")


def _out_rounds(evidence: FailureEvidence) -> list[dict]:
    """The committed rounds the failed replica was not a member of (after its abort, before its heal)."""
    return [r for r in evidence.rounds if r["committed"] and evidence._fault[0] not in r["members"]]


def _as_quadruple(got) -> tuple:
    replica, step, divisor, healed_from = got
    return replica, step, divisor, healed_from


def check_failure_reading(fn: Callable, evidence: FailureEvidence) -> CheckReport:
    """Grade ``fn(evidence) -> (replica, step, divisor, healed_from)``: the replica that failed, the step that was
    aborted, the divisor of the gradient average in the steps while it was out, and the replica it healed from;
    checked against the injected fault and the run's own rounds."""
    report = CheckReport(f"failure exercise ({_name(fn)})")
    got = report.call("your reading", fn, evidence, convert=_as_quadruple,
                      hint="return (replica, step, divisor, healed_from): four ints")
    if got is NO_ANSWER:
        return report
    replica, step, divisor, healed = got
    want_replica, want_step, _ = evidence._fault
    aborted = [r for r in evidence.rounds if not r["committed"]]
    heals = [r["healed_from"] for r in evidence.rounds if r["healed_from"] is not None]
    divisors = {len(r["members"]) for r in _out_rounds(evidence)}
    if not aborted or aborted[0]["step"] != want_step or len(heals) != 1 or len(divisors) != 1:
        report.cases.append(("the evidence", False, "this run's rounds do not show one abort, one heal and one "
                             "quorum size while the replica was out: run the cell that collects them again"))
        return report
    n = evidence.replicas
    label = "the replica that failed"
    if _check_rank(report, label, replica, n):
        if replica == want_replica:
            report.cases.append((label, True, ""))
        else:
            report.cases.append((label, False, f"replica {replica} is a member of every round: the failed one is "
                                 "missing from the quorums after the round that did not commit"))
    label = "the step that was aborted"
    if not checks.is_int(step):
        report.cases.append((label, False, f"a step is an int (the committed steps when the round began), got "
                             f"{step!r}"))
    elif step == want_step:
        report.cases.append((label, True, ""))
    elif step in (want_step + 1, want_step - 1):
        report.cases.append((label, False, f"step {step} is off by one: the aborted step is the 'step' of the "
                             "round that did not commit, and the survivors redo that same step in the next round"))
    elif step == aborted[0]["round"] != want_step:
        report.cases.append((label, False, f"{step} is the round's number; give its step"))
    else:
        report.cases.append((label, False, f"every member committed step {step}: look for the round that did not "
                             "commit"))
    label = "the divisor while it was out"
    want_div = divisors.pop()
    if checks.is_number(divisor) and divisor == want_div:
        report.cases.append((label, True, ""))
    elif divisor == n:
        report.cases.append((label, False, f"{n} is the number of replicas: the survivors average over the quorum, "
                             "the replicas whose gradients the sum holds, and the failed one sent none"))
    else:
        report.cases.append((label, False, f"{divisor!r} is not the size of the quorums of those steps: count "
                             "their members"))
    label = "the replica it healed from"
    joiner, source = heals[0]
    if _check_rank(report, label, healed, n):
        if healed == source:
            report.cases.append((label, True, ""))
        elif healed == joiner:
            report.cases.append((label, False, f"replica {healed} is the one that was healed: name the healthy "
                                 "replica that sent it the state"))
        else:
            report.cases.append((label, False, f"replica {healed} did not send the state: read the healed_from "
                                 "column of the round where the replacement joined"))
    return report


#: The graded cases of the pricing exercise: ``(replicas, fail_step, interval_steps, missed_steps)``; the
#: lost-work experiment's failure (4 replicas, step 37, back 10 steps later) for each of its checkpoint intervals,
#: a failure right after a checkpoint, and one at scale.
PRICE_CASES = ((4, 37, 5, 10), (4, 37, 10, 10), (4, 37, 20, 10), (4, 37, 40, 10), (8, 40, 10, 30),
               (1024, 1234, 500, 30))


def _how_far_count(got, want: int) -> str:
    return how_far(got, want) if checks.is_number(got) else "not a number of replica-steps"


def _cheaper(restart: int, ft: int) -> str:
    return "restart" if restart < ft else "fault tolerance" if ft < restart else "tie"


def check_failure_price(fn: Callable, cases=PRICE_CASES) -> CheckReport:
    """Grade ``fn(replicas, fail_step, interval_steps, missed_steps) -> (restart, ft, cheaper)``: the replica-steps
    lost by a checkpoint restart and by per-step fault tolerance, and ``cheaper``, ``"restart"``,
    ``"fault tolerance"`` or ``"tie"``, on each of ``cases``; the truth is
    :func:`commlab.sync.recovery_cost.restart_lost_replica_steps` and
    :func:`~commlab.sync.recovery_cost.ft_lost_replica_steps`."""
    from commlab.sync.recovery_cost import ft_lost_replica_steps, restart_lost_replica_steps

    report = CheckReport(f"pricing exercise ({_name(fn)})")
    for n, k, c, j in cases:
        desc = f"N={n}, failure in step {k}, a checkpoint every {c} steps, back after {j}"
        got = report.call(desc, fn, n, k, c, j, convert=tuple,
                          hint="return (restart, ft, cheaper): two ints and 'restart', 'fault tolerance' or 'tie'")
        if got is NO_ANSWER:
            if report.not_attempted:
                return report
            continue
        if _wrong_arity(report, desc, got, "restart, ft, cheaper"):
            continue
        restart, ft, cheaper = got
        want_r, want_f = restart_lost_replica_steps(k, c, n), ft_lost_replica_steps(j, n)
        wrong = []
        if restart != want_r:
            slips = {n * (k % c): "the step in flight is lost too: every replica redoes it",
                     k % c + 1: "that is one replica's: every one of the N replicas redoes those steps",
                     n * (k + 1): "the restart resumes from the last checkpoint, not from step 0"}
            wrong.append(f"restart {restart!r} is {_how_far_count(restart, want_r)}"
                         + (f": {slips[restart]}" if restart in slips else ""))
        if ft != want_f:
            slips = {j: "the aborted step is lost too, on all N replicas: nobody commits it",
                     1 + j: "the survivors' work on the aborted step is discarded too, not only the failed replica's",
                     n * j: "only the failed replica misses the j steps: the survivors go on"}
            wrong.append(f"fault tolerance {ft!r} is {_how_far_count(ft, want_f)}"
                         + (f": {slips[ft]}" if ft in slips else ""))
        if cheaper != _cheaper(want_r, want_f):
            if cheaper not in ("restart", "fault tolerance", "tie"):
                wrong.append(f"cheaper is 'restart', 'fault tolerance' or 'tie', got {cheaper!r}")
            elif not wrong:
                wrong.append(f"{cheaper!r} does not lose fewer replica-steps: compare your two counts")
            else:
                wrong.append("fix the counts, then compare them")
        report.cases.append((desc, not wrong, "; ".join(wrong)))
    return report
