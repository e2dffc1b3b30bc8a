"""Figures of lost work: checkpoint restart against per-step fault tolerance.

:func:`plot_lost_work` draws a recording of :mod:`commlab.experiments.lost_work` (replica-steps lost and wall
seconds against the checkpoint interval C, measured points beside the model's line, fault tolerance as a
horizontal line); :func:`plot_break_even` maps which approach loses less time over failure rate × checkpoint cost
(:mod:`commlab.sync.recovery_cost`, Young's interval for the restart); :func:`plot_quorum_history` draws the rounds
of a :class:`commlab.sync.FaultTolerantDP` run as a grid of replicas × rounds. Book: chapter "When it goes wrong"
(book/ch13b_when_it_goes_wrong), section "Survive a failure".
"""

from __future__ import annotations

__all__ = ["plot_lost_work", "plot_break_even", "plot_quorum_history", "quorum_grid", "QUORUM_STATES"]

#: What a replica did in a round, in the order of :func:`plot_quorum_history`'s colours (index = code).
QUORUM_STATES = ("absent", "committed", "aborted in flight", "healed, then committed", "healed, aborted")
_STATE_COLORS = ("#f2f2f2", "#2ca02c", "#ff7f0e", "#1f77b4", "#9ecae1")


def plot_lost_work(result: dict):
    """Two panels of a :func:`commlab.experiments.lost_work.measure` result: lost replica-steps and the seconds
    the failure cost (:func:`commlab.experiments.lost_work.failure_seconds`, log axis) against C, each restart run
    measured (circles) beside the model (``N (k mod C + 1)`` for every C; ``N (C + 1)/2`` for a failure at a
    random step, dashed), the FT run measured and modelled (horizontal lines). Returns the matplotlib figure.

    Raises:
        ValueError: a result without restart runs.
    """
    import matplotlib.pyplot as plt

    from commlab import checks
    from commlab.sync import recovery_cost as rc

    s = result["settings"]
    n, k = s["job"]["replicas"], s["fail_step"]
    restarts = sorted((r for r in result["runs"] if r["kind"] == "restart"), key=lambda r: r["interval_steps"])
    if not restarts:
        checks.fail("result", [r["kind"] for r in result["runs"]], "a recording with restart runs",
                    where="plot_lost_work")
    ft = next((r for r in result["runs"] if r["kind"] == "ft"), None)
    cs = [r["interval_steps"] for r in restarts]
    grid = list(range(1, max(cs) + 1))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    ax.plot(grid, [rc.restart_lost_replica_steps(k, c, n) for c in grid], ".-", color="C0", lw=0.6, ms=3,
            label=f"restart, model N(k mod C + 1), k = {k}")
    ax.plot(grid, [rc.expected_restart_lost_replica_steps(c, n) for c in grid], "--", color="C0", lw=1, alpha=0.6,
            label="restart, model at a random step N(C+1)/2")
    ax.plot(cs, [r["lost_replica_steps"] for r in restarts], "o", color="C0", ms=8, mfc="none", mew=2,
            label="restart, measured")
    if ft:
        ax.axhline(ft["lost_replica_steps"], color="C1", label=f"fault tolerant, measured (j = {ft['missed_steps']})")
        ax.axhline(ft["predicted"]["lost_replica_steps"], color="C1", ls=":", lw=2, label="fault tolerant, model N + j")
    ax.set(xlabel="checkpoint interval C (steps)", ylabel="replica-steps lost", xlim=(0, max(cs) + 1), ylim=(0, None),
           title=f"{n} replicas, one killed in step {k}")
    ax.legend(fontsize=7)
    from commlab.experiments.lost_work import failure_seconds

    costs = [failure_seconds(result, r) for r in restarts]
    bx.plot(cs, [p for _, p in costs], "x-", color="C0", lw=0.6, ms=8, label="restart, model")
    bx.plot(cs, [m for m, _ in costs], "o", color="C0", ms=8, mfc="none", mew=2, label="restart, measured")
    if ft:
        m, p = failure_seconds(result, ft)
        floor = 0.01   # the log axis' floor: a cost within the noise of zero is drawn there
        bx.axhline(max(m, floor), color="C1",
                   label="fault tolerant, measured" + ("" if m > floor else f" (<= {floor:g} s)"))
        bx.axhline(max(p, floor), color="C1", ls=":", lw=2, label="fault tolerant, model")
    bx.set(yscale="log", xlabel="checkpoint interval C (steps)", xlim=(0, max(cs) + 1),
           ylabel="seconds the failure cost",
           title="time: the restart pays a start-up again")
    bx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_break_even(step_s: float, *, restart_s: float, quorum_s: float, ft_failure_s: float,
                    failures_per_s=(1e-7, 1e-1), checkpoint_s=(1e-2, 1e3), points: int = 121, ax=None, mark=None):
    """Which approach loses less time per unit of work, over failure rate λ (x) × checkpoint cost δ (y), both on
    log axes: colour = log10 of restart share / FT share (:func:`~commlab.sync.recovery_cost.restart_overhead_share`
    at Young's interval, :func:`~commlab.sync.recovery_cost.ft_overhead_share`), the break-even curve in black, and
    dashed where Young's τ* reaches 1/λ (above it the first-order model is only indicative).

    Args:
        step_s, restart_s, quorum_s, ft_failure_s: t, R, q and c (seconds). failures_per_s, checkpoint_s: the
            (low, high) ranges. points: grid points per axis. ax: an Axes (a new figure when None).
        mark: optional ``(λ, δ, label)`` to mark (a measured job).

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: a bad time or range (named).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    from commlab import checks
    from commlab.sync import recovery_cost as rc

    where = "plot_break_even"
    for name, rng in (("failures_per_s", failures_per_s), ("checkpoint_s", checkpoint_s)):
        if len(rng) != 2 or not all(checks.is_number(x) and x > 0 for x in rng) or not rng[0] < rng[1]:
            checks.fail(name, rng, "a (low, high) pair with 0 < low < high", where=where)
    checks.integer("points", points, least=2, where=where)
    if checks.seconds("quorum_s", quorum_s, where=where) == 0 and checks.seconds("ft_failure_s", ft_failure_s,
                                                                                 where=where) == 0:
        checks.fail("ft_failure_s", ft_failure_s, "> 0 when quorum_s is 0", where=where,
                    note="fault tolerance would then lose nothing: there is no map to draw")
    lam = np.logspace(np.log10(failures_per_s[0]), np.log10(failures_per_s[1]), points)
    dl = np.logspace(np.log10(checkpoint_s[0]), np.log10(checkpoint_s[1]), points)
    ratio = np.array([[rc.restart_overhead_share(None, d, restart_s, x) / rc.ft_overhead_share(
        step_s, quorum_s, ft_failure_s, x) for x in lam] for d in dl])
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 4.5))
    else:
        fig = ax.figure
    mesh = ax.pcolormesh(lam, dl, np.clip(np.log10(ratio), -2, 2), cmap="RdBu_r", vmin=-2, vmax=2, shading="auto")
    ax.contour(lam, dl, np.log10(ratio), levels=[0.0], colors="k", linewidths=1.5)
    fig.colorbar(mesh, ax=ax, label="log10(restart / FT time lost)")
    # Young's first order assumes τ* << 1/λ; τ* = 1/λ where δ = 1/(2λ): beyond that line it is only indicative.
    ax.plot(lam, 1 / (2 * lam), "--", color="0.3", lw=1, label="τ* = 1/λ (first order breaks down above)")
    ax.set_ylim(dl[0], dl[-1])
    ax.legend(fontsize=7, loc="upper left")
    ax.set(xscale="log", yscale="log", xlabel="failures per second λ", ylabel="checkpoint cost δ (s)",
           title=f"t = {step_s * 1e3:.3g} ms, q = {quorum_s * 1e3:.3g} ms, R = {restart_s:.3g} s, c = "
                 f"{ft_failure_s:.3g} s")
    ax.text(0.03, 0.05, "checkpoint restart wins", transform=ax.transAxes, fontsize=8, color="w")
    ax.text(0.97, 0.95, "fault tolerance wins", transform=ax.transAxes, ha="right", va="top", fontsize=8)
    if mark is not None:
        ax.plot([mark[0]], [mark[1]], "k*", ms=10)
        ax.annotate(mark[2], (mark[0], mark[1]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    fig.tight_layout()
    return fig


def quorum_grid(histories, replicas: int):
    """The rounds of a fault-tolerant run as a grid: ``(codes, steps, divisors, failed)`` where ``codes[r][i]``
    indexes :data:`QUORUM_STATES` for replica r in round i, ``steps[i]`` is the step round i worked on,
    ``divisors[i]`` its quorum's size and ``failed`` the ``(replica, round)`` pairs of a member of an aborted
    round that is not a member of the next one (it died in flight: its own record died with it).

    Args:
        histories: the :attr:`~commlab.sync.FaultTolerantDP.history` lists of the replicas (a mapping replica ->
            list, or an iterable of lists); the quorums are the same on every member, so they are merged by
            round id, and a round no list holds is an error.
        replicas: N, the replicas of the run.

    Raises:
        ValueError: no rounds, ``replicas < 1``, a member outside 0..N-1, or a gap in the round ids.
    """
    from commlab import checks

    where = "quorum_grid"
    n = checks.integer("replicas", replicas, least=1, where=where)
    lists = histories.values() if hasattr(histories, "values") else histories
    by_id = {}
    for hist in lists:
        for rec in hist:
            by_id.setdefault(rec.quorum.id, rec)
    if not by_id:
        checks.fail("histories", "no rounds", "at least one StepRecord", where=where)
    ids = sorted(by_id)
    if ids != list(range(ids[0], ids[-1] + 1)):
        checks.fail("histories", f"round ids {ids}", "consecutive round ids (every round held by some replica)",
                    where=where)
    rounds = [by_id[i] for i in ids]
    codes = [[0] * len(rounds) for _ in range(n)]
    failed = []
    for i, rec in enumerate(rounds):
        q = rec.quorum
        for m in q.members:
            if not 0 <= m < n:
                checks.fail("histories", f"member {m} in round {q.id}", f"members in 0..{n - 1}", where=where)
            healed = m in q.joining
            codes[m][i] = (3 if healed else 1) if rec.committed else (4 if healed else 2)
            if not rec.committed and i + 1 < len(rounds) and m not in rounds[i + 1].quorum.members:
                failed.append((m, i))
    return codes, [r.quorum.step for r in rounds], [len(r.quorum.members) for r in rounds], failed


def plot_quorum_history(histories, replicas: int, ax=None, title: str | None = None):
    """Draw :func:`quorum_grid`: one row per replica, one column per round (its step below it), coloured by
    :data:`QUORUM_STATES`, a cross where a replica died in flight, and the AllReduce's divisor (the quorum's size)
    above the columns where it changes. Returns the matplotlib figure.

    Raises:
        ValueError: as :func:`quorum_grid`.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    codes, steps, divisors, failed = quorum_grid(histories, replicas)
    rounds = len(steps)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6.0, min(14.0, 0.32 * rounds + 2.5)), 0.45 * replicas + 1.9))
    else:
        fig = ax.figure
    ax.pcolormesh(range(rounds + 1), range(replicas + 1), codes, cmap=ListedColormap(_STATE_COLORS), vmin=-0.5,
                  vmax=len(_STATE_COLORS) - 0.5, edgecolors="w", linewidth=1.5)
    for m, i in failed:
        ax.plot(i + 0.5, m + 0.5, "kx", ms=9, mew=2)
    for i, d in enumerate(divisors):
        if i == 0 or d != divisors[i - 1]:
            ax.annotate(f"÷{d}", (i + 0.5, 0), xytext=(0, 3), textcoords="offset points", ha="center",
                        va="bottom", fontsize=8)
    every = max(1, rounds // 30 + 1)
    ax.set_xticks([i + 0.5 for i in range(0, rounds, every)], [str(steps[i]) for i in range(0, rounds, every)],
                  fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(replicas)], [f"replica {r}" for r in range(replicas)])
    ax.set_xlim(0, rounds)
    ax.set_ylim(replicas, 0)
    ax.set_xlabel("round (labelled with the step it worked on; an aborted step is redone in the next round)")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    used = sorted({c for row in codes for c in row})
    handles = [Patch(color=_STATE_COLORS[c], label=QUORUM_STATES[c]) for c in used]
    if failed:
        handles.append(plt.Line2D([], [], color="k", marker="x", ls="", mew=2, label="killed in flight"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(handles), fontsize=7,
              frameon=False)
    if title:
        ax.set_title(title, pad=14)
    fig.tight_layout()
    return fig
