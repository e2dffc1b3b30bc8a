"""The verdict of a grader: one line per case, printed deterministically (nbval compares it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CheckReport:
    """Cases checked by a grader. ``cases``: list of ``(description, passed, message)``."""

    exercise: str
    cases: list[tuple[str, bool, str]] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(ok for _, ok, _ in self.cases)

    def __str__(self) -> str:
        lines = []
        for desc, ok, msg in self.cases:
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {desc}" + ("" if ok else f": {msg}"))
        n_ok = sum(ok for _, ok, _ in self.cases)
        verdict = "all checks passed" if self.passed else f"{n_ok} of {len(self.cases)} checks passed"
        return f"{self.exercise}: {verdict}\n" + "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython displays the report as text, not as a dataclass repr
        p.text(str(self))
