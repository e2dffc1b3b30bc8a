"""The lab 13b graders (commlab.exercises.diagnose): a reading of the evidence passes, each usual misreading is told
what it mistook, a stub is "not attempted". The Flight Recorder evidence comes from a real 3-rank gloo run; the
hang, trace, straggler and failure evidence is built here in the formats the clinic, the profiler, the trainer and
FaultTolerantDP write (a real fault-tolerant run: marked slow)."""

import collections
import statistics

import pytest

from commlab.exercises import (check_failure_price, check_failure_reading, check_flight_recorder, check_hang_diagnosis,
                               check_straggler, check_trace_reading)
from commlab.exercises.diagnose import (CASE_ANSWERS, FIXES, HANG_CASES, PRICE_CASES, FailureEvidence,
                                        FlightRecorderEvidence, HangEvidence, StragglerEvidence, TraceEvidence,
                                        failure_evidence, flight_recorder_evidence, model_step_s)
from commlab.launch.clinic import CASES
from commlab.overlap.trace import check_overlap, load_trace


def _stub(evidence):
    return None


def test_every_clinic_case_has_an_answer_among_the_fixes():
    assert set(CASE_ANSWERS) == set(CASES) and set(HANG_CASES) <= set(CASES)
    assert all(fix in FIXES for _, fix in CASE_ANSWERS.values())


# ------------------------------------------------------------------------------------------------ a hang

_JOB = "at commlab/launch/failures.py:"
# What run_tools("...", ("plain", "stacks")) keeps of each case: the stacks, and the rank the launcher names.
_STACKS = {
    "order": ({0: f"all_reduce {_JOB}76  dist.all_reduce(x)", 1: f"broadcast {_JOB}79  dist.broadcast(x, src=0)",
               2: f"broadcast {_JOB}79  dist.broadcast(x, src=0)"}, (1,)),
    "absent": ({0: f"all_reduce {_JOB}92  dist.all_reduce(torch.ones(1, device=device))",
                1: f"all_reduce {_JOB}92  dist.all_reduce(torch.ones(1, device=device))",
                2: f"time.sleep {_JOB}91  time.sleep(2 * timeout)"}, (1,)),
    "send-first": ({0: f"send {_JOB}117  dist.send(act, dst=rank + 1)",
                    1: f"send {_JOB}111  dist.send(grad, dst=rank - 1)"}, ()),
    "recv-first": ({0: f"recv {_JOB}113  dist.recv(grad, src=rank + 1)",
                    1: f"recv {_JOB}115  dist.recv(act, src=rank - 1)"}, ()),
}


def _hang(case):
    stacks, named = _STACKS[case]
    printed = {r: "RuntimeError: Timed out waiting 1500ms" if r in named else "(no error printed)" for r in stacks}
    return HangEvidence(len(stacks), "RankError: ...", printed, stacks, 2.5, case, named)


def _read_stacks(ev):
    """The lab's reading: the stack at another line; in a cycle, the stage that moves the gradient first."""
    op = {r: t.split(" at ")[0] for r, t in ev.stacks.items()}
    line = {r: t.split(" at ")[1] for r, t in ev.stacks.items()}
    if set(op.values()) in ({"send"}, {"recv"}):
        rank = next(r for r, t in ev.stacks.items() if "grad" in t.split("  ")[-1])
        return rank, op[rank], "batch the send and receive"
    counts = collections.Counter(line.values())
    rank = next(r for r in line if counts[line[r]] == 1)
    if op[rank].startswith("time."):
        return rank, op[(rank + 1) % ev.world_size], "let the rank reach the collective"
    return rank, op[rank], "reorder the collectives"


@pytest.mark.parametrize("case", sorted(_STACKS))
def test_a_reading_of_the_stacks_passes(case):
    report = check_hang_diagnosis(_read_stacks, _hang(case))
    assert report.passed and len(report.cases) == 3, str(report)


@pytest.mark.parametrize("case, answer, message", [
    ("order", (1, "all_reduce", "reorder the collectives"), "the rank the launcher names"),
    ("order", (2, "all_reduce", "reorder the collectives"), "stands where most ranks stand"),
    ("order", (0, "broadcast", "reorder the collectives"), "is where other ranks wait"),
    ("order", (0, "AllReduce", "raise the timeout"), "cures work that is slow but on its way"),
    ("absent", (2, "time.sleep", "let the rank reach the collective"), "not a communication"),
    ("absent", (2, "all_reduce", "wait longer"), "is not one of FIXES"),
    ("send-first", (0, "send", "batch the send and receive"), "whose order breaks it"),
    ("recv-first", (0, "dist.recv", "same shape on every rank"), "different sizes"),
    ("recv-first", (2, "recv", "batch the send and receive"), "a rank is an int from 0 to 1"),
])
def test_each_misreading_is_named(case, answer, message):
    report = check_hang_diagnosis(lambda ev: answer, _hang(case))
    text = str(report)
    assert not report.passed and message in text, text
    assert "FAIL" in text and text.count("FAIL") == 1, text


def test_an_unfilled_or_broken_diagnosis_is_reported():
    assert str(check_hang_diagnosis(_stub, _hang("order"))).endswith("fill in `_stub` in the cell above")
    text = str(check_hang_diagnosis(lambda ev: (0, "all_reduce"), _hang("order")))
    assert "raised ValueError" in text and "return (rank, op, fix)" in text


# ------------------------------------------------------------------------------------ a Flight Recorder dump

@pytest.fixture(scope="module")
def dumps():
    return flight_recorder_evidence(world_size=3, timeout=1.5)


def _odd_one(ev):
    """The lab's reading: the first sequence number whose input sizes differ, the rank that recorded its own."""
    seen = collections.defaultdict(dict)
    for r, entries in ev.dumps.items():
        for e in entries:
            seen[e["collective_seq_id"]][r] = str(e["input_sizes"])
    for seq, by_rank in sorted(seen.items()):
        counts = collections.Counter(by_rank.values())
        if len(counts) > 1:
            rank = next(r for r, s in by_rank.items() if counts[s] == 1)
            entry = next(e for e in ev.dumps[rank] if e["collective_seq_id"] == seq)
            return rank, entry["input_sizes"][0][0]


def test_the_real_dumps_show_rank_0s_short_all_reduce(dumps):
    assert sorted(dumps.dumps) == [0, 1, 2] and dumps.errors[0] is None and dumps.errors[1] and dumps.errors[2]
    assert [[e["profiling_name"] for e in d] for d in dumps.dumps.values()] == \
        [["gloo:broadcast", "gloo:all_reduce", "gloo:all_reduce"]] * 3
    report = check_flight_recorder(_odd_one, dumps)
    assert report.passed, str(report) + "\n" + dumps.format()
    assert check_flight_recorder(lambda ev: (0, [[4]]), dumps).passed


@pytest.mark.parametrize("answer, message", [
    ((1, 4), "match most ranks' at every sequence number"),
    ((0, 5), "what most ranks all-reduce"),
    ((0, 8), "no rank's entry #3 records 8 elements"),
    ((0, "four"), "a size is a number of elements"),
    ((3, 4), "a rank is an int from 0 to 2"),
])
def test_each_flight_recorder_misreading_is_named(dumps, answer, message):
    text = str(check_flight_recorder(lambda ev: answer, dumps))
    assert message in text and text.count("FAIL") == 1, text


def test_dumps_without_one_odd_rank_are_not_graded_against_the_learner(dumps):
    partial = FlightRecorderEvidence(3, {r: d for r, d in dumps.dumps.items() if r != 0}, dumps.errors, 0.0)
    text = str(check_flight_recorder(lambda ev: (0, 4), partial))
    assert "run the cell that collects them again" in text
    assert str(check_flight_recorder(_stub, dumps)).endswith("fill in `_stub` in the cell above")


# ------------------------------------------------------------------------------------------------ two traces

def _x(name, start_ms, end_ms, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": {}}


def _dp_trace(overlapped: bool):
    """A 100 ms DP step: compute 0-60 ms, the optimizer 90-100 ms; with overlap, bucket 0's AllReduce runs on gloo's
    worker (thread 2) under backward and bucket 1's after it; without, one AllReduce after backward."""
    ann = "user_annotation"
    ev = [_x("overlap::step", 0, 100, cat=ann), _x("aten::mm", 0, 30), _x("aten::mm", 31, 60),
          _x("aten::add_", 90, 100)]
    buckets = ((30, 31, 50), (60, 61, 70)) if overlapped else ((60, 61, 85),)
    for i, (a, b, end) in enumerate(buckets):
        ev += [_x(f"overlap::launch::bucket{i}", a, b, cat=ann), _x("c10d::allreduce_", a, b),
               _x("gloo:all_reduce", b, end, tid=2, cat=ann)]
    return load_trace({"traceEvents": ev, "distributedInfo": {"rank": 0, "world_size": 2}})


def _traces(on="B"):
    traces = {k: _dp_trace(k == on) for k in "AB"}
    return TraceEvidence(0, traces, {k: check_overlap(t) for k, t in traces.items()}, on)


def _read_traces(ev):
    kind = max(ev.reports["A"].rows, key=lambda r: r.exposed_s).kind
    return kind, max("AB", key=lambda k: ev.reports[k].all_comm.hidden_s)


@pytest.mark.parametrize("on", ["A", "B"])
def test_a_reading_of_the_traces_passes(on):
    ev = _traces(on)
    assert ev.reports[on].all_comm.hidden_s == pytest.approx(0.019)   # bucket 0's 31..50 ms under compute
    report = check_trace_reading(_read_traces, ev)
    assert report.passed, str(report) + "\n" + ev.format()


@pytest.mark.parametrize("answer, message", [
    (("DP AllReduce", "A"), "trace A hides less of its AllReduce"),
    (("TP", "B"), "'TP' is not a kind of these reports, whose kinds are ['DP AllReduce']"),
    (("DP AllReduce", True), "overlapped is 'A' or 'B'"),
])
def test_each_trace_misreading_is_named(answer, message):
    text = str(check_trace_reading(lambda ev: answer, _traces("B")))
    assert message in text and text.count("FAIL") == 1, text


def test_an_unfilled_trace_reading_is_not_attempted():
    assert str(check_trace_reading(_stub, _traces())).endswith("fill in `_stub` in the cell above")


# ------------------------------------------------------------------------------------------------ stragglers

def _stragglers(slow=1, n=3, steps=10, ar_s=0.005):
    """A synchronous DP job: every rank's step is the slowest compute plus the AllReduce (deterministic jitter)."""
    compute = [[(0.032 if r == slow else 0.002) + 0.001 * ((3 * r + i) % 4) for i in range(steps)] for r in range(n)]
    step = [[max(c[i] for c in compute) + ar_s for i in range(steps)] for _ in range(n)]
    return StragglerEvidence(n, tuple(map(tuple, compute)), tuple(map(tuple, step)), ar_s, 0.0, slow)


def _read_timings(ev):
    med = [statistics.median(c) for c in ev.compute_s]
    rank = max(range(len(med)), key=med.__getitem__)
    return rank, statistics.median(max(step) for step in zip(*ev.compute_s)) + ev.allreduce_s


def test_a_reading_of_the_timings_passes():
    ev = _stragglers()
    assert model_step_s(ev.compute_s, ev.allreduce_s) == pytest.approx(0.0385)
    assert check_straggler(_read_timings, ev).passed
    assert check_straggler(lambda e: (1, 0.037), ev).passed   # within 5 %: a max of medians is close enough


@pytest.mark.parametrize("answer, message", [
    ((0, 0.0385), "rank 0 computes no longer than the others"),
    ((1, 0.0385 - 0.005), "the AllReduce is missing"),
    ((1, statistics.median(statistics.fmean(s) for s in zip(*_stragglers().compute_s)) + 0.005), "the mean over ranks"),
    ((1, 38.5), "milliseconds"),
    ((1, -1.0), "a positive number of seconds"),
])
def test_each_straggler_misreading_is_named(answer, message):
    text = str(check_straggler(lambda ev: answer, _stragglers()))
    assert message in text and text.count("FAIL") == 1, text
    assert "0.0385" not in text   # the model's step is not shown


def test_an_unfilled_straggler_reading_is_not_attempted():
    assert str(check_straggler(_stub, _stragglers())).endswith("fill in `_stub` in the cell above")


# ------------------------------------------------------------------------------------------ survive a failure

def _rounds(n=3, failed=1, step=3, missed=3, steps=9, healer=0):
    """A survivor's rounds as FaultTolerantDP records them: all n members up to ``step``, that round aborted, the
    others from the same step for ``missed`` steps, then the replacement healed from ``healer``."""
    out, everyone = [], tuple(range(n))
    others = tuple(r for r in everyone if r != failed)
    for s in range(step + 1):
        out.append(dict(step=s, members=everyone, committed=s != step, healed_from=None))
    for s in range(step, step + missed):
        out.append(dict(step=s, members=others, committed=True, healed_from=None))
    for s in range(step + missed, steps):
        out.append(dict(step=s, members=everyone, committed=True,
                        healed_from=(failed, healer) if s == step + missed else None))
    return tuple(dict(r, round=i) for i, r in enumerate(out))


def _failure(**kw):
    n, failed, step = kw.get("n", 3), kw.get("failed", 1), kw.get("step", 3)
    return FailureEvidence(n, kw.get("steps", 9), _rounds(**kw), 1.0, (failed, step, step + 2))


def _read_rounds(ev):
    """The lab's reading: the round that did not commit, the quorums without the failed replica, the heal."""
    aborted = next(r for r in ev.rounds if not r["committed"])
    joiner, source = next(r["healed_from"] for r in ev.rounds if r["healed_from"])
    out = [r for r in ev.rounds if r["committed"] and joiner not in r["members"]]
    return joiner, aborted["step"], len(out[0]["members"]), source


@pytest.mark.parametrize("kw", [{}, dict(n=4, failed=0, step=5, healer=1), dict(n=4, failed=3, step=2, missed=1)])
def test_a_reading_of_the_rounds_passes(kw):
    ev = _failure(**kw)
    report = check_failure_reading(_read_rounds, ev)
    assert report.passed and len(report.cases) == 4, str(report) + "\n" + ev.format()
    assert "replica 1 from 0" in _failure().format()


@pytest.mark.parametrize("answer, message", [
    ((0, 3, 2, 0), "replica 0 is a member of every round"),
    ((1, 4, 2, 0), "off by one"),
    ((1, 2, 2, 0), "off by one"),
    ((1, 7, 2, 0), "every member committed step 7"),
    ((1, 3, 3, 0), "3 is the number of replicas: the survivors average over the quorum"),
    ((1, 3, 1, 0), "is not the size of the quorums"),
    ((1, 3, 2, 1), "replica 1 is the one that was healed"),
    ((1, 3, 2, 2), "replica 2 did not send the state"),
    ((5, 3, 2, 0), "a rank is an int from 0 to 2"),
])
def test_each_failure_misreading_is_named(answer, message):
    text = str(check_failure_reading(lambda ev: answer, _failure()))
    assert message in text and text.count("FAIL") == 1, text


def test_the_round_number_is_not_the_step():
    ev = _failure(step=3)
    shifted = tuple(dict(r, round=r["round"] + 10) for r in ev.rounds)   # a run whose rounds do not start at 0
    ev = FailureEvidence(3, 9, shifted, 1.0, ev._fault)
    assert "is the round's number; give its step" in str(check_failure_reading(lambda e: (1, 13, 2, 0), ev))


def test_an_unfilled_or_unusable_failure_reading_is_reported():
    assert str(check_failure_reading(_stub, _failure())).endswith("fill in `_stub` in the cell above")
    assert "four ints" in str(check_failure_reading(lambda ev: (1, 3), _failure()))
    no_heal = FailureEvidence(3, 9, tuple(dict(r, healed_from=None) for r in _rounds()), 1.0, (1, 3, 5))
    assert "run the cell that collects them again" in str(check_failure_reading(lambda ev: (1, 3, 2, 0), no_heal))


@pytest.mark.slow
def test_a_real_run_shows_the_injected_fault():
    """One real run (3 replicas, a SIGKILL and a replacement; a few seconds): the reading passes on it."""
    ev = failure_evidence(seed=1)
    replica, step, _ = ev._fault
    assert [r["step"] for r in ev.rounds if not r["committed"]] == [step], ev.format()
    assert check_failure_reading(_read_rounds, ev).passed, ev.format()
    assert check_failure_reading(lambda e: (replica, step, 3, 0), ev).cases[2][1] is False


def _price(n, k, c, j):
    restart, ft = n * (k % c + 1), n + j
    return restart, ft, "restart" if restart < ft else "fault tolerance" if ft < restart else "tie"


def test_a_right_price_passes_and_the_cases_cover_both_winners():
    report = check_failure_price(_price)
    assert report.passed and len(report.cases) == len(PRICE_CASES), str(report)
    assert {_price(*case)[2] for case in PRICE_CASES} == {"restart", "fault tolerance"}


@pytest.mark.parametrize("fn, message", [
    (lambda n, k, c, j: (n * (k % c), n + j, "fault tolerance"), "the step in flight is lost too"),
    (lambda n, k, c, j: (k % c + 1, n + j, "fault tolerance"), "every one of the N replicas redoes"),
    (lambda n, k, c, j: (n * (k + 1), n + j, "fault tolerance"), "not from step 0"),
    (lambda n, k, c, j: (n * (k % c + 1), j, "fault tolerance"), "the aborted step is lost too"),
    (lambda n, k, c, j: (n * (k % c + 1), n * j, "fault tolerance"), "only the failed replica misses"),
    (lambda n, k, c, j: (n * (k % c + 1), 1 + j, "fault tolerance"), "the survivors' work on the aborted step"),
    (lambda n, k, c, j: _price(n, k, c, j)[:2] + ("ft",), "cheaper is 'restart', 'fault tolerance' or 'tie'"),
    (lambda n, k, c, j: _price(n, k, c, j)[:2] + ("restart",), "does not lose fewer replica-steps"),
])
def test_each_pricing_slip_is_named(fn, message):
    text = str(check_failure_price(fn))
    assert message in text and "FAIL" in text, text


def test_an_unfilled_or_broken_price_is_reported():
    assert str(check_failure_price(lambda n, k, c, j: None)).endswith("fill in `<lambda>` in the cell above")
    text = str(check_failure_price(lambda n, k, c, j: (1, 2)))
    assert "return (restart, ft, cheaper), got 2 values" in text
