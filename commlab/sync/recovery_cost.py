"""What a failed replica costs: checkpoint restart against per-step fault tolerance, for one failure and for a rate.

One failure at step k (after backward, before averaging): :func:`restart_lost_replica_steps` (every replica
redoes the steps since the last checkpoint and the step in flight) and :func:`ft_lost_replica_steps` (the aborted
step, and the steps the failed replica misses); :func:`restart_job_seconds` and :func:`ft_job_seconds` the wall
time. A rate λ of failures per second: :func:`restart_overhead_share` (Young's δ/τ + λ(τ/2 + R)),
:func:`young_interval_s` (τ* = sqrt(2δ/λ)), :func:`ft_overhead_share` and :func:`break_even_failure_rate` (when
each wins). α in s, β in s/byte; seconds end in ``_s``, counts of steps in ``_steps``.

Sources: J. W. Young, CACM 17(9):530-531, 1974 (τ* = sqrt(2δ/λ)); J. T. Daly, FGCS 22(3):303-312, 2006 (a
higher-order estimate: 117 min where Young's gives 120, for δ = 5 min and 1/λ = 24 h). Book: chapter "When it goes
wrong" (book/ch13b_when_it_goes_wrong), section "Survive a failure"; checked by hand in tests/test_lost_work.py.
"""

from __future__ import annotations

import dataclasses
import math

from commlab import checks

__all__ = ["restart_lost_replica_steps", "expected_restart_lost_replica_steps", "ft_lost_replica_steps",
           "checkpoints_written", "restart_job_seconds", "heal_seconds", "ft_failure_seconds", "ft_job_seconds",
           "young_interval_s", "restart_overhead_share", "ft_overhead_share", "FailureBreakEven",
           "break_even_failure_rate"]


def _counts(where, **kw):
    out = {}
    for name, (value, least) in kw.items():
        out[name] = checks.integer(name, value, least=least, where=where)
    return out


def restart_lost_replica_steps(fail_step: int, interval_steps: int, replicas: int) -> int:
    """Replica-steps a checkpoint restart throws away for a failure in step ``fail_step`` (0-based: ``fail_step``
    steps committed): every replica redoes the ``k mod C`` steps since the last checkpoint and the step in flight,
    ``N · (k mod C + 1)``.

    Raises:
        ValueError: ``fail_step < 0``, ``interval_steps < 1``, ``replicas < 1``.
    """
    c = _counts("restart_lost_replica_steps", fail_step=(fail_step, 0), interval_steps=(interval_steps, 1),
                replicas=(replicas, 1))
    return c["replicas"] * (c["fail_step"] % c["interval_steps"] + 1)


def expected_restart_lost_replica_steps(interval_steps: int, replicas: int) -> float:
    """The mean of :func:`restart_lost_replica_steps` over a failure step drawn uniformly: ``N (C + 1) / 2``.

    Raises:
        ValueError: ``interval_steps < 1``, ``replicas < 1``.
    """
    c = _counts("expected_restart_lost_replica_steps", interval_steps=(interval_steps, 1), replicas=(replicas, 1))
    return c["replicas"] * (c["interval_steps"] + 1) / 2


def ft_lost_replica_steps(missed_steps: int, replicas: int) -> int:
    """Replica-steps per-step fault tolerance loses for one failure: the aborted step on all ``N`` replicas (the
    survivors' and the failed one's, in flight), plus the ``j`` committed steps the failed replica misses while out
    (work not done): ``N + j``.

    Raises:
        ValueError: ``missed_steps < 0``, ``replicas < 2`` (one replica has no survivor to go on with).
    """
    c = _counts("ft_lost_replica_steps", missed_steps=(missed_steps, 0), replicas=(replicas, 2))
    return c["replicas"] + c["missed_steps"]


def checkpoints_written(steps: int, interval_steps: int) -> int:
    """Checkpoints a job of ``steps`` steps writes, one after every ``C``-th committed step: ``floor(S / C)``; a
    failure adds none (the restart resumes from the last one and writes the next ones once).

    Raises:
        ValueError: ``steps < 1``, ``interval_steps < 1``.
    """
    c = _counts("checkpoints_written", steps=(steps, 1), interval_steps=(interval_steps, 1))
    return c["steps"] // c["interval_steps"]


def restart_job_seconds(steps: int, step_s: float, *, interval_steps: int, checkpoint_s: float,
                        fail_step: int | None = None, restart_s: float = 0.0) -> float:
    """Wall seconds of ``steps`` steps under checkpoint restart (start-up excluded):
    ``S t + floor(S/C) δ``, and for a failure in step k ``+ (k mod C + 1) t + R``.

    Args:
        step_s: t, one step. checkpoint_s: δ, writing one checkpoint. restart_s: R, from the failure to the first
            step of the new attempt (detection, relaunch, rendezvous, loading the checkpoint).
        fail_step: k (None: no failure), in ``0..steps-1``.

    Raises:
        ValueError: a negative time, ``steps`` or ``interval_steps`` < 1, ``fail_step`` out of range.
    """
    where = "restart_job_seconds"
    c = _counts(where, steps=(steps, 1), interval_steps=(interval_steps, 1))
    t, delta, r = (checks.seconds(n, v, where=where) for n, v in
                   (("step_s", step_s), ("checkpoint_s", checkpoint_s), ("restart_s", restart_s)))
    total = c["steps"] * t + checkpoints_written(steps, interval_steps) * delta
    if fail_step is not None:
        k = checks.integer("fail_step", fail_step, least=0, most=c["steps"] - 1, where=where)
        total += (k % c["interval_steps"] + 1) * t + r
    return total


def heal_seconds(state_nbytes: float, alpha_s: float, beta_s_per_byte: float) -> float:
    """α-β seconds for a joining replica to copy the model and optimizer state from a healthy one:
    ``α + β · state_nbytes`` (one message).

    Raises:
        ValueError: a negative size, α or β.
    """
    checks.number("state_nbytes", state_nbytes, least=0.0, where="heal_seconds")
    checks.seconds("alpha_s", alpha_s, where="heal_seconds")
    checks.number("beta_s_per_byte", beta_s_per_byte, least=0.0, where="heal_seconds", note="s/byte")
    return alpha_s + beta_s_per_byte * state_nbytes


def ft_failure_seconds(step_s: float, replicas: int, *, detect_s: float = 0.0, heal_s: float = 0.0,
                       reconfigure_s: float = 0.0, out_s: float = 0.0) -> float:
    """Job seconds one failure costs under per-step fault tolerance: the aborted step and its detection, the heal
    and the group changes, plus the lost throughput of the failed replica while out, in whole-job seconds:
    ``t + detect + heal + reconfigure + out / N``.

    Raises:
        ValueError: a negative time, ``replicas < 2``.
    """
    where = "ft_failure_seconds"
    checks.integer("replicas", replicas, least=2, where=where)
    vals = [checks.seconds(n, v, where=where) for n, v in (("step_s", step_s), ("detect_s", detect_s),
                                                          ("heal_s", heal_s), ("reconfigure_s", reconfigure_s),
                                                          ("out_s", out_s))]
    return sum(vals[:4]) + vals[4] / replicas


def ft_job_seconds(steps: int, step_s: float, *, quorum_s: float = 0.0, failures: int = 0, detect_s: float = 0.0,
                   heal_s: float = 0.0, reconfigure_s: float = 0.0) -> float:
    """Wall seconds of ``steps`` committed steps under per-step fault tolerance (start-up excluded):
    ``S (t + q)``, and per failure ``+ t + q + detect + heal + reconfigure`` (the aborted step redone). The
    survivors do not wait for the failed replica: its missed steps cost throughput, not time.

    Raises:
        ValueError: a negative time or count, ``steps < 1``.
    """
    where = "ft_job_seconds"
    s = checks.integer("steps", steps, where=where)
    n = checks.integer("failures", failures, least=0, where=where)
    t, q, d, h, g = (checks.seconds(k, v, where=where) for k, v in
                     (("step_s", step_s), ("quorum_s", quorum_s), ("detect_s", detect_s), ("heal_s", heal_s),
                      ("reconfigure_s", reconfigure_s)))
    return s * (t + q) + n * (t + q + d + h + g)


def _rate(failures_per_s, where):
    return checks.number("failures_per_s", failures_per_s, above=0.0, where=where, note="λ, failures per second")


def young_interval_s(checkpoint_s: float, failures_per_s: float) -> float:
    """Young's first-order optimal checkpoint interval, ``τ* = sqrt(2 δ / λ)`` seconds of work between checkpoints
    (Young 1974); valid while τ* is short against the mean time between failures 1/λ.

    Raises:
        ValueError: ``checkpoint_s <= 0`` or ``failures_per_s <= 0``.
    """
    d = checks.number("checkpoint_s", checkpoint_s, above=0.0, where="young_interval_s", note="δ, seconds")
    return math.sqrt(2 * d / _rate(failures_per_s, "young_interval_s"))


def restart_overhead_share(interval_s: float | None, checkpoint_s: float, restart_s: float,
                           failures_per_s: float) -> float:
    """Seconds lost per second of useful work under checkpoint restart: ``δ/τ + λ (τ/2 + R)`` (writing the
    checkpoints, redoing half an interval and restarting per failure). ``interval_s`` None: Young's τ*, where the
    share is ``sqrt(2 δ λ) + λ R``.

    Raises:
        ValueError: ``interval_s <= 0``, a negative δ or R, ``failures_per_s <= 0``; ``interval_s`` None with δ = 0.
    """
    where = "restart_overhead_share"
    lam = _rate(failures_per_s, where)
    d = checks.seconds("checkpoint_s", checkpoint_s, where=where)
    r = checks.seconds("restart_s", restart_s, where=where)
    tau = young_interval_s(d, lam) if interval_s is None else \
        checks.number("interval_s", interval_s, above=0.0, where=where, note="τ, seconds between checkpoints")
    return d / tau + lam * (tau / 2 + r)


def ft_overhead_share(step_s: float, quorum_s: float, failure_s: float, failures_per_s: float) -> float:
    """Seconds lost per second of useful work under per-step fault tolerance: ``q / t + λ c`` (the quorum's store
    round trips every step, and :func:`ft_failure_seconds` ``c`` per failure).

    Raises:
        ValueError: ``step_s <= 0``, a negative q or c, ``failures_per_s <= 0``.
    """
    where = "ft_overhead_share"
    t = checks.number("step_s", step_s, above=0.0, where=where)
    q = checks.seconds("quorum_s", quorum_s, where=where)
    c = checks.seconds("failure_s", failure_s, where=where)
    return q / t + _rate(failures_per_s, where) * c


@dataclasses.dataclass(frozen=True)
class FailureBreakEven:
    """Where per-step fault tolerance and checkpoint restart (at Young's interval) lose the same share of time.

    Attributes:
        failures_per_s: the break-even rates λ (none, one, or two: fault tolerance wins between them).
        verdict: ``"ft wins above"``, ``"ft wins below"``, ``"ft wins between"``, ``"ft always wins"``,
            ``"ft never wins"`` or ``"tie"``.
    """

    failures_per_s: tuple[float, ...]
    verdict: str


def break_even_failure_rate(step_s: float, *, checkpoint_s: float, restart_s: float, quorum_s: float,
                            ft_failure_s: float) -> FailureBreakEven:
    """The failure rates at which :func:`ft_overhead_share` equals :func:`restart_overhead_share` at Young's τ*.

    Fault tolerance wins where ``sqrt(2 δ λ) + λ (R - c) > q / t``: with ``x = sqrt(λ)`` the roots of
    ``(R - c) x² + sqrt(2δ) x - q/t``. Typically R > c and q > 0: one rate, above which fault tolerance wins.

    Raises:
        ValueError: ``step_s <= 0``, a negative time.
    """
    where = "break_even_failure_rate"
    t = checks.number("step_s", step_s, above=0.0, where=where)
    a = checks.seconds("restart_s", restart_s, where=where) - checks.seconds("ft_failure_s", ft_failure_s,
                                                                             where=where)
    b = math.sqrt(2 * checks.seconds("checkpoint_s", checkpoint_s, where=where))
    c = checks.seconds("quorum_s", quorum_s, where=where) / t
    if a == 0:
        if b == 0:
            return FailureBreakEven((), "tie" if c == 0 else "ft never wins")
        return FailureBreakEven((), "ft always wins") if c == 0 else FailureBreakEven(((c / b) ** 2,), "ft wins above")
    if c == 0:
        if a > 0:
            return FailureBreakEven((), "ft always wins")
        return FailureBreakEven(((b / a) ** 2,), "ft wins below") if b > 0 else FailureBreakEven((), "ft never wins")
    disc = b * b + 4 * a * c
    if a > 0:
        return FailureBreakEven((((-b + math.sqrt(disc)) / (2 * a)) ** 2,), "ft wins above")
    if disc <= 0:
        return FailureBreakEven((), "ft never wins")
    roots = sorted(((-b + s * math.sqrt(disc)) / (2 * a)) ** 2 for s in (1, -1))
    return FailureBreakEven(tuple(roots), "ft wins between")
