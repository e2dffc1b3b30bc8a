"""The lab 8b graders (commlab.exercises.sync): the solutions pass, each usual slip is named, the answer is not shown."""

import math

import pytest

from commlab.exercises import check_fragment_schedule, check_hiding_tau, check_sync_bytes_per_step


def _schedule_right(h, f, tau):
    return [(p, (p + 1) * h // f - tau, (p + 1) * h // f) for p in range(f)]


def _tau_right(payload, n, alpha, beta, base):
    sync_s = 2 * (n - 1) * alpha + 2 * (n - 1) / n * payload * beta
    return math.ceil(sync_s / base - 1e-9)


def _bytes_right(payload, n, h, f, path):
    return (2 * (n - 1) / n if path == "all_reduce" else n - 1) * payload / h


def _stub(*args):
    return None


def test_the_solutions_pass():
    for check, fn in ((check_fragment_schedule, _schedule_right), (check_hiding_tau, _tau_right),
                      (check_sync_bytes_per_step, _bytes_right)):
        report = check(fn)
        assert report.passed, str(report)


@pytest.mark.parametrize("check", [check_fragment_schedule, check_hiding_tau, check_sync_bytes_per_step])
def test_an_unfilled_exercise_prints_one_line(check):
    report = check(_stub)
    assert not report.passed and report.cases == [] and str(report).endswith("fill in `_stub` in the cell above")


@pytest.mark.parametrize("slip, message", [
    (lambda h, f, tau: _schedule_right(h, f, 0), "tau was ignored"),
    (lambda h, f, tau: [(p, a - 1, b - 1) for p, a, b in _schedule_right(h, f, tau)], "0-based"),
    (lambda h, f, tau: [(p, h - tau, h) for p in range(f)], "not staggered"),
    (lambda h, f, tau: [(p, b, a) for p, a, b in _schedule_right(h, f, tau)], "swapped"),
    (lambda h, f, tau: _schedule_right(h, f, tau)[:1], "one per fragment"),
    (lambda h, f, tau: "no", "raised"),
])
def test_each_schedule_slip_is_named_without_the_schedule(slip, message):
    text = str(check_fragment_schedule(slip))
    assert message in text and "FAIL" in text, text
    assert str(_schedule_right(100, 4, 5)) not in text


@pytest.mark.parametrize("slip, message", [
    (lambda p, n, a, b, s: math.floor((2 * (n - 1) * a + 2 * (n - 1) / n * p * b) / s), "rounded down"),
    (lambda p, n, a, b, s: _tau_right(p, n, 0.0, b, s), "latency"),
    (lambda p, n, a, b, s: math.ceil((2 * (n - 1) * a + p * b) / s), "2(N-1)/N"),
    (lambda p, n, a, b, s: 2 * (n - 1) * a + 2 * (n - 1) / n * p * b, "return inner steps"),
])
def test_each_tau_slip_is_named(slip, message):
    text = str(check_hiding_tau(slip))
    assert message in text and "too" in text, text


@pytest.mark.parametrize("slip, message", [
    (lambda p, n, h, f, path: _bytes_right(p, n, h, f, path) * f, "multiplied by F"),
    (lambda p, n, h, f, path: _bytes_right(p, n, h, f, path) / f, "divided by F"),
    (lambda p, n, h, f, path: _bytes_right(p, n, 1, f, path), "not divided by H"),
    (lambda p, n, h, f, path: _bytes_right(p, n, h, f, "all_reduce"), "priced as all reduce"),
])
def test_each_bytes_slip_is_named(slip, message):
    text = str(check_sync_bytes_per_step(slip))
    assert message in text and "expected" not in text, text
