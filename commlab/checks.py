"""Argument checks: each raises a ``ValueError`` naming the argument, its value and the allowed range.

One place for the checks the whole package makes, so that every message reads the same way:
``"<where>: <name> must be <range> (<note>), got <value>"``. A bool is never a number here (``True`` is an
``int`` to Python, and accepting it as "1 GPU" would hide a caller's bug); numpy scalars are accepted.

Entry points: :func:`integer`, :func:`number`, :func:`seconds`, :func:`share`, :func:`flag`, :func:`one_of`.
Each returns the value (as ``int``/``float`` for the numeric ones) so that a caller can check and assign in
one line. ``where`` names the object being built (``"NcclSystem"``, ``"cluster 'dgx'"``); ``note`` says
what the value means or where a default comes from.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Iterable

__all__ = ["integer", "number", "seconds", "share", "flag", "one_of", "fail", "is_int", "is_number"]


def fail(name: str, value: Any, allowed: str, *, note: str = "", where: str = "") -> None:
    """Raise the package's argument error: ``"<where>: <name> must be <allowed> (<note>), got <value!r>"``."""
    prefix = f"{where}: " if where else ""
    suffix = f" ({note})" if note else ""
    raise ValueError(f"{prefix}{name} must be {allowed}{suffix}, got {value!r}")


def is_int(value) -> bool:
    """Whether ``value`` is an integer (Python or numpy) and not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """Whether ``value`` is a real number (Python or numpy, int or float) and not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def integer(name: str, value, least: int | None = 1, most: int | None = None, *, note: str = "",
            where: str = "") -> int:
    """``value`` as an int in ``least..most`` (either bound may be None: open on that side).

    Raises:
        ValueError: ``value`` is not an integer (a bool or a float is refused) or lies outside the range;
            e.g. "steps must be an int >= 1, got 0" or "rank must be an int in 0..3, got 4".
    """
    if least is not None and most is not None:
        allowed = f"an int in {least}..{most}"
    elif least is not None:
        allowed = f"an int >= {least}"
    elif most is not None:
        allowed = f"an int <= {most}"
    else:
        allowed = "an int"
    if not is_int(value) or (least is not None and value < least) or (most is not None and value > most):
        fail(name, value, allowed, note=note, where=where)
    return int(value)


def _interval(least, above, most, below) -> str:
    lo = f"[{least}" if least is not None else (f"({above}" if above is not None else None)
    hi = f"{most}]" if most is not None else (f"{below})" if below is not None else None)
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (f">= {least}" if least is not None else f"> {above}")
    if hi:
        return (f"<= {most}" if most is not None else f"< {below}")
    return ""


def number(name: str, value, least: float | None = None, *, above: float | None = None, most: float | None = None,
           below: float | None = None, finite: bool = True, note: str = "", where: str = "") -> float:
    """``value`` as a float, finite (unless ``finite=False``) and within the given bounds.

    ``least``/``most`` are inclusive bounds, ``above``/``below`` exclusive ones; give at most one per side.
    One-sided messages read "a finite number > 0"; two-sided ones "a finite number in (0, 1]".

    Raises:
        ValueError: ``value`` is not a real number (a bool is refused), is NaN or infinite (when ``finite``),
            or lies outside the bounds.
    """
    interval = _interval(least, above, most, below)
    allowed = ("a finite number" if finite else "a number") + (f" {interval}" if interval else "")
    ok = is_number(value) and not math.isnan(value) and (not finite or math.isfinite(value))
    ok = ok and (least is None or value >= least) and (above is None or value > above) \
        and (most is None or value <= most) and (below is None or value < below)
    if not ok:
        fail(name, value, allowed, note=note, where=where)
    return float(value)


def seconds(name: str, value, *, note: str = "", where: str = "") -> float:
    """``value`` as finite seconds >= 0.

    Raises:
        ValueError: "forward_s must be finite seconds >= 0, got -1.0".
    """
    if not is_number(value) or not (math.isfinite(value) and value >= 0):
        fail(name, value, "finite seconds >= 0", note=note, where=where)
    return float(value)


def share(name: str, value, *, zero: bool = True, one: bool = True, note: str = "", where: str = "") -> float:
    """``value`` as a float share of a whole: in [0, 1]; ``zero=False`` excludes 0, ``one=False`` excludes 1.

    Raises:
        ValueError: "overlap_dp must be a share in [0, 1], got 1.5".
    """
    interval = f"{'[' if zero else '('}0, 1{']' if one else ')'}"
    ok = is_number(value) and (value >= 0 if zero else value > 0) and (value <= 1 if one else value < 1)
    if not ok:
        fail(name, value, f"a share in {interval}", note=note, where=where)
    return float(value)


def flag(name: str, value, *, note: str = "", where: str = "") -> bool:
    """``value`` as a bool; only ``True`` and ``False`` themselves are accepted (not 0, 1 or "yes").

    Raises:
        ValueError: "warm_start must be True or False, got 1".
    """
    if not isinstance(value, bool):
        fail(name, value, "True or False", note=note, where=where)
    return value


def one_of(name: str, value, choices: Iterable, *, note: str = "", where: str = ""):
    """``value`` if it is one of ``choices``; an int choice is matched by integers only (not by 8.0 or True).

    Raises:
        ValueError: "backend must be one of ['gloo', 'nccl'], got 'mpi'".
    """
    choices = list(choices)
    if not any(_matches(value, c) for c in choices):
        fail(name, value, f"one of {choices}", note=note, where=where)
    return value


def _matches(value, choice) -> bool:
    if is_int(choice):
        return is_int(value) and value == choice
    return value == choice and not (is_number(choice) and isinstance(value, bool))
