"""The verdict of a grader: one line per case, printed deterministically (nbval compares it).

Three outcomes, each printed so that a lab's page stays short:

* not attempted (the exercise's stub still returns ``None``, its ``# TODO`` not replaced): one line,
  ``not attempted yet: fill in `NAME` in the cell above``, and no case is run or listed;
* passed: the title and one ``PASS`` line per case, so the learner sees what was checked;
* failed: the cases in order, the failures after the first :data:`MAX_FAILURES_SHOWN` only counted; each
  failure names its input and what is wrong with the learner's answer (the answer, its error or the rule it
  breaks), never the whole expected answer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

__all__ = ["CheckReport", "MAX_FAILURES_SHOWN", "NO_ANSWER", "is_stub_result", "how_far", "raised", "grade_number"]

#: Failures listed in a report; a mistake usually fails many cases alike, and the first ones say what it is.
MAX_FAILURES_SHOWN = 3


#: What :meth:`CheckReport.call` returns when a case is settled without an answer to compare: the learner's
#: function raised (a failed case is recorded) or is still the stub (the report is "not attempted").
NO_ANSWER = object()


def is_stub_result(value) -> bool:
    """Whether a learner's function returned what the labs' stubs return (``None``) instead of an answer."""
    return value is None


def raised(error: BaseException) -> str:
    """How a failed case names an exception the learner's code raised: ``"raised ValueError: <its message>"``."""
    return f"raised {type(error).__name__}: {error}"


def how_far(got: float, want: float) -> str:
    """How a wrong number compares with the right one, without giving the right one: ``"too high by 3.2 %"``,
    ``"too low by a factor of 8"`` (a factor from 2 on, where a percentage would hide the slip)."""
    if want == 0 or got == 0 or (got > 0) != (want > 0):
        return "of the wrong sign or zero" if got != want else "right"
    q = got / want
    word = "too high" if abs(got) > abs(want) else "too low"
    f = max(abs(q), 1 / abs(q))
    return f"{word} by a factor of {f:.3g}" if f >= 2 else f"{word} by {100 * (f - 1):.3g} %"


@dataclasses.dataclass
class CheckReport:
    """Cases checked by a grader.

    Attributes:
        exercise: the title, e.g. ``"ReduceScatter exercise (my_reduce_scatter)"``.
        cases: list of ``(description, passed, message)``; ``message`` says what is wrong (empty if passed).
        not_attempted: the name to fill in (a function, class or variable of the lab) when the learner's code
            is still the stub; then ``cases`` is empty and the report is one line.
    """

    exercise: str
    cases: list[tuple[str, bool, str]] = dataclasses.field(default_factory=list)
    not_attempted: str | None = None

    @property
    def passed(self) -> bool:
        return self.not_attempted is None and bool(self.cases) and all(ok for _, ok, _ in self.cases)

    def __str__(self) -> str:
        if self.not_attempted is not None:
            return f"{self.exercise}: not attempted yet: fill in `{self.not_attempted}` in the cell above"
        failures = [(d, m) for d, ok, m in self.cases if not ok]
        n_ok = len(self.cases) - len(failures)
        verdict = "all checks passed" if self.passed else f"{n_ok} of {len(self.cases)} checks passed"
        lines, shown = [], 0
        for d, ok, m in self.cases:  # in the grader's order; failures after the first few are only counted
            if ok:
                lines.append(f"  PASS  {d}")
            elif shown < MAX_FAILURES_SHOWN:
                lines.append(f"  FAIL  {d}: {m}")
                shown += 1
        if len(failures) > MAX_FAILURES_SHOWN:
            lines.append(f"  ... and {len(failures) - MAX_FAILURES_SHOWN} more failing cases: fix the first "
                         "ones and run the check again")
        return f"{self.exercise}: {verdict}\n" + "\n".join(lines)

    def call(self, description: str, fn, *args, convert=None, hint: str = ""):
        """The learner's ``fn(*args)`` for one case, or :data:`NO_ANSWER` when the case is settled without it.

        A stub's ``None`` on the first case sets :attr:`not_attempted` (stop grading and return the report); an
        exception, raised by ``fn`` or by ``convert`` (applied to the answer, e.g. ``float``), is recorded as
        the failed case ``description``, followed by ``hint`` (what to return). The one place where the
        graders run a learner's code.
        """
        try:
            got = fn(*args)
            if is_stub_result(got) and not self.cases:
                self.not_attempted = getattr(fn, "__name__", "fn")
                return NO_ANSWER
            return convert(got) if convert is not None else got
        except Exception as e:  # noqa: BLE001 - the learner's code: any error is a failed case
            message = raised(e) + (f" ({hint})" if hint else "")
            self.cases.append((description, False, message))
            return NO_ANSWER

    def _repr_pretty_(self, p, cycle):  # IPython displays the report as text, not as a dataclass repr
        p.text(str(self))


def grade_number(report: CheckReport, label: str, fn: Callable, args: tuple, want: float,
                 slips: dict[str, float], shown: Callable[[float], str]) -> None:
    """One case of a numeric exercise: ``fn(*args)`` against ``want`` (relative 1e-9), a wrong answer named by
    the slip it equals, if any, and shown by ``shown``; a stub or an exception as :meth:`CheckReport.call`
    records it."""
    got = report.call(label, fn, *args, convert=float)
    if got is NO_ANSWER:
        return
    if math.isclose(got, want, rel_tol=1e-9):
        report.cases.append((label, True, ""))
        return
    why = next((k for k, v in slips.items() if math.isclose(got, v, rel_tol=1e-9)), None)
    report.cases.append((label, False, f"{shown(got)}, {how_far(got, want)}" + (f": {why}" if why else "")))
