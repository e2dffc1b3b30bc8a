"""One slow rank sets everyone's step: a straggler injected on purpose into a DP job, measured and found
(``python -m commlab experiments stragglers``).

Gloo ranks, each pinned to its own core, train a small MLP through :class:`commlab.overlap.BucketedDataParallel`
(one bucket: the AllReduce starts when backward ends). One rank is slowed by a delay in its forward (a sweep,
:data:`DEFAULT_DELAYS_S`) or by a CPU-bound neighbour on its core; per rank and step the step and compute seconds
are recorded. The model: ``step = max_r compute_r + T_AllReduce``, the ring's α-β time with α and β calibrated in
the same job. :func:`find_straggler` names the rank the others wait for (the capstone's log too).
:func:`measure` runs the cases, :func:`save`/:func:`load` keep ``experiments/stragglers.json``,
:func:`format_table` prints it and :func:`plot` draws it.

Book: the chapter "When it goes wrong" (in preparation); the capstone log's per-rank times, chapter 14.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Sequence

from commlab import checks

__all__ = ["DEFAULT_DELAYS_S", "StragglerReport", "find_straggler", "measure", "run_case", "save", "load",
           "format_table", "plot"]

#: Delays added to the slow rank's forward, seconds.
DEFAULT_DELAYS_S = (0.0, 0.005, 0.01, 0.02, 0.04)

_NAME = "experiments/stragglers.json"   # the recorded result, in the package data

# The neighbour: a pure-Python busy loop (one core's worth of work), which ends by itself after its limit.
_BUSY = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@dataclasses.dataclass(frozen=True)
class StragglerReport:
    """What :func:`find_straggler` concluded. Seconds are medians over the steps.

    Attributes:
        rank: the straggler, or None when no rank stands out.
        compute_s: each rank's compute. wait_s: each rank's step less its compute (the AllReduce and the wait
            for the slowest rank in it).
        excess_s: the longest compute less the median of the other ranks' computes.
        others_wait_s: the median over the other ranks of their wait, less the longest-computing rank's own.
        last_steps: in how many steps the longest-computing rank waited least (it arrived last).
        reason: one line, with the figures.
    """

    rank: int | None
    compute_s: tuple[float, ...]
    wait_s: tuple[float, ...]
    excess_s: float
    others_wait_s: float
    last_steps: int
    reason: str

    def __str__(self) -> str:
        return self.reason


def _per_rank(name: str, values) -> list[list[float]]:
    """``values`` as one list of per-step seconds per rank; a flat list is one step per rank."""
    rows = [list(v) if isinstance(v, (list, tuple)) else [v] for v in values]
    if len(rows) < 2:
        checks.fail(name, values, "per-rank seconds of at least 2 ranks")
    for r, row in enumerate(rows):
        if not row:
            checks.fail(f"{name}[{r}]", row, "a non-empty list of seconds")
        for x in row:
            checks.number(f"{name}[{r}]", x, least=0, note="seconds")
    return rows


def find_straggler(compute_s: Sequence, step_s: Sequence, *, least_s: float = 1e-3,
                   share: float = 0.1) -> StragglerReport:
    """Name the straggler from per-rank timings: the rank whose compute is longest while the others wait.

    A rank is named when its median compute exceeds the median of the other ranks' by at least ``least_s`` and by
    ``share`` of it, the other ranks wait (step less compute) at least half that excess longer than it does (in a
    synchronous DP step the fast ranks' extra wait is the slow rank's extra compute), and it arrives last (waits
    least) in more steps than chance gives on a noisy machine: ``s/n`` of ``s`` steps plus two binomial standard
    deviations (at most ``s``).

    Args:
        compute_s, step_s: per rank, a sequence of per-step seconds (``[rank][step]``, all ranks the same number
            of steps), or one number per rank (a single step).
        least_s: the smallest excess that counts, seconds. share: the smallest excess as a share of the others'
            compute.

    Returns:
        A :class:`StragglerReport` (``rank`` None when no rank stands out, with the reason).

    Raises:
        ValueError: fewer than 2 ranks, ranks with different numbers of steps, a negative or non-finite time, or
            a bad ``least_s``/``share``.
    """
    compute, step = _per_rank("compute_s", compute_s), _per_rank("step_s", step_s)
    checks.seconds("least_s", least_s)
    checks.share("share", share)
    if len({len(c) for c in compute}) != 1:
        checks.fail("compute_s", [len(c) for c in compute], "the same number of steps on every rank")
    if len(compute) != len(step) or any(len(c) != len(s) for c, s in zip(compute, step)):
        checks.fail("step_s", [len(s) for s in step], "as many steps per rank as compute_s has "
                    f"({[len(c) for c in compute]})")
    waits = [[s - c for s, c in zip(sr, cr)] for sr, cr in zip(step, compute)]
    med_c = tuple(statistics.median(c) for c in compute)
    med_w = tuple(statistics.median(w) for w in waits)
    slow = max(range(len(med_c)), key=med_c.__getitem__)
    others = [r for r in range(len(med_c)) if r != slow]
    base = statistics.median(med_c[r] for r in others)
    excess = med_c[slow] - base
    others_wait = statistics.median(med_w[r] for r in others) - med_w[slow]
    # The rank that waits least in a step arrived last at its AllReduce.
    last = sum(min(range(len(waits)), key=lambda r: waits[r][i]) == slow for i in range(len(waits[0])))
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    figures = (f"rank {slow} computes {ms(med_c[slow])} against a median {ms(base)} on the others "
               f"(+{ms(excess)}); the others wait {ms(others_wait)} longer than it does; it arrives last in {last} of "
               f"{len(waits[0])} steps")
    if excess < max(least_s, share * base):
        return StragglerReport(None, med_c, med_w, excess, others_wait, last, f"no straggler: {figures}")
    if others_wait < 0.5 * excess:
        return StragglerReport(None, med_c, med_w, excess, others_wait, last,
                               f"no straggler: {figures} (the others wait less than half its excess)")
    # By chance each rank arrives last in 1/n of the steps: ask for two standard deviations (binomial) above that.
    steps, p = len(waits[0]), 1 / len(waits)
    needed = min(steps, math.ceil(steps * p + 2 * math.sqrt(steps * p * (1 - p))))
    if last < needed:
        return StragglerReport(None, med_c, med_w, excess, others_wait, last,
                               f"no straggler: {figures} (by chance about {steps * p:.3g}; it takes {needed})")
    return StragglerReport(slow, med_c, med_w, excess, others_wait, last, f"straggler: {figures}")


def _pin(cores: Sequence[int] | None):
    """An ``init_hook`` that pins rank r to ``cores[r]`` (None: leaves the ranks where the scheduler puts them)."""
    if cores is None:
        return None

    def hook(rank: int) -> None:
        os.sched_setaffinity(0, {cores[rank]})
    return hook


def _rank(delay_s: float, slow_rank: int, steps: int, width: int, batch: int, seed: int,
          calibrate: bool) -> dict:
    """One rank of a case: calibrate α and β in the group, then train ``steps`` steps; per-step seconds."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from commlab.bench.calibrate import ring_exchange_here
    from commlab.overlap.bucketed import BucketedDataParallel, train_step

    class Delay(nn.Module):   # on every rank (the ranks' layouts must agree); it sleeps on the slow one only
        def forward(self, x):
            if mine > 0:
                time.sleep(mine)
            return x

    rank, n = dist.get_rank(), dist.get_world_size()
    mine = delay_s if rank == slow_rank else 0.0
    torch.manual_seed(seed)
    model = nn.Sequential(Delay(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dp = BucketedDataParallel(model, bucket_cap_bytes=nbytes)   # one bucket: launched when the backward ends
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    chunk = max(4, nbytes // n)
    sizes = sorted({4096, chunk // 4, chunk, 4 * chunk})
    ring = ring_exchange_here(sizes, rounds=3) if calibrate else []
    dist.barrier()
    times = [train_step(dp, opt, nn.functional.mse_loss, x, y) for _ in range(steps)]
    out = dict(step_s=[], comm_s=[], compute_s=[], nbytes=nbytes, sizes=sizes, ring_step_s=ring,
               core=sorted(os.sched_getaffinity(0)))
    for t in times:   # read once, after the steps
        comm = t.record.wait_end_s - t.record.buckets[0].launch_s
        out["step_s"].append(t.step_s)
        out["comm_s"].append(comm)
        out["compute_s"].append(t.step_s - comm)
    return out


def run_case(world_size: int, *, delay_s: float = 0.0, neighbour: bool = False, slow_rank: int | None = None,
             pin: bool = False, steps: int = 40, skip: int = 5, width: int = 512, batch: int = 256, seed: int = 0,
             timeout: float = 300.0) -> dict:
    """Launch one case and price it: ``world_size`` ranks, the last (or ``slow_rank``) slowed by ``delay_s`` in its
    forward and/or a busy neighbour pinned to its core (``neighbour``, which needs ``pin``: rank r on the r-th
    core this process may use).

    Returns:
        A JSON-serialisable dict: the case's settings; ``compute_s``, ``comm_s``, ``step_s`` per rank and step
        (``[rank][step]``, seconds); the medians over the steps after ``skip`` per rank; ``alpha_s``,
        ``beta_s_per_byte`` (the fit), ``nbytes`` (the gradient), ``allreduce_model_s`` (the ring's α-β time);
        ``max_compute_s`` (the median over the steps of the longest compute: the maximum over ranks, step by
        step) and ``predicted_step_s`` (it plus the AllReduce); ``measured_step_s`` (median over the steps of the
        mean over ranks of their steps); ``allreduce_measured_s`` (median over the steps of the least comm of any
        rank: the AllReduce with no one to wait for); ``straggler`` (:func:`find_straggler`, as a dict).

    Raises:
        ValueError: a bad argument (named), or ``pin`` with more ranks than usable cores.
    """
    from commlab.bench.calibrate import fit_alpha_beta
    from commlab.collectives.ring import ring_all_reduce_seconds
    from commlab.launch import launch

    checks.integer("world_size", world_size, least=2)
    slow_rank = world_size - 1 if slow_rank is None else checks.integer("slow_rank", slow_rank, least=0,
                                                                         most=world_size - 1)
    checks.seconds("delay_s", delay_s)
    checks.integer("steps", steps, least=2)
    checks.integer("skip", skip, least=0, most=steps - 1)
    for name, v in (("width", width), ("batch", batch)):
        checks.integer(name, v)
    cores = None
    if neighbour and not pin:
        checks.fail("pin", pin, "True with neighbour=True", note="the neighbour shares the slow rank's own core")
    if pin:
        usable = sorted(os.sched_getaffinity(0))
        if world_size > len(usable):
            checks.fail("world_size", world_size, f"at most the {len(usable)} usable cores with pin=True",
                        note="every rank is pinned to a core of its own")
        cores = usable[:world_size]
    # The neighbour ends by itself after ``timeout`` seconds should this process die before it kills it.
    proc = subprocess.Popen([sys.executable, "-c", _BUSY, str(timeout)]) if neighbour else None
    try:
        if proc is not None:
            os.sched_setaffinity(proc.pid, {cores[slow_rank]})
        ranks = launch(_rank, world_size, delay_s, slow_rank, steps, width, batch, seed, True, timeout=timeout,
                       print_output=False, init_hook=_pin(cores))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    r0 = ranks[0]
    fit = fit_alpha_beta(r0["sizes"], r0["ring_step_s"])
    link = fit.as_link()
    model_ar = ring_all_reduce_seconds(r0["nbytes"], world_size, link.alpha_s, link.beta_s_per_byte)
    per = {k: [r[k] for r in ranks] for k in ("compute_s", "comm_s", "step_s")}
    med = {k: [statistics.median(v[skip:]) for v in per[k]] for k in per}
    steady = range(skip, steps)
    # Step by step, everyone leaves the AllReduce when the slowest rank has computed and the ring is done.
    max_compute = statistics.median(max(c[i] for c in per["compute_s"]) for i in steady)
    report = find_straggler([c[skip:] for c in per["compute_s"]], [s[skip:] for s in per["step_s"]])
    return dict(world_size=world_size, delay_s=delay_s, neighbour=neighbour, slow_rank=slow_rank,
                cores=None if cores is None else [r["core"] for r in ranks], steps=steps, skip=skip, width=width,
                batch=batch, seed=seed, **per, median_compute_s=med["compute_s"], median_comm_s=med["comm_s"],
                median_step_s=med["step_s"], nbytes=r0["nbytes"], alpha_s=link.alpha_s,
                beta_s_per_byte=link.beta_s_per_byte, allreduce_model_s=model_ar,
                max_compute_s=max_compute, predicted_step_s=max_compute + model_ar,
                # Each rank's step runs from its own start to its own end, back to back: its period. Their mean.
                measured_step_s=statistics.median(statistics.fmean(s[i] for s in per["step_s"]) for i in steady),
                allreduce_measured_s=statistics.median(min(c[i] for c in per["comm_s"]) for i in steady),
                straggler=dict(rank=report.rank, excess_s=report.excess_s, others_wait_s=report.others_wait_s,
                               last_steps=report.last_steps, reason=report.reason))


def measure(world_size: int = 4, delays_s: Sequence[float] = DEFAULT_DELAYS_S, *, neighbour: bool = True,
            pin: bool = True, steps: int = 40, skip: int = 5, width: int = 512, batch: int = 256, seed: int = 0,
            progress: bool = True) -> dict:
    """The delay sweep (the last rank sleeps ``delay`` in each forward), then with ``neighbour`` the busy-neighbour
    case (no delay). With ``pin`` (default) every case runs on ``min(world_size, usable cores)`` ranks, each pinned
    to a core of its own, as each rank of a GPU job has its own device; without it the sweep runs on
    ``world_size`` unpinned ranks that share the cores (then a sleeping rank frees CPU for the others, which hides
    part of its delay), and there is no neighbour case.

    Returns:
        A JSON-serialisable dict: ``settings`` (the arguments, the ranks used, the machine's usable cores, the date,
        the command) and ``cases``, one :func:`run_case` dict each, with ``kind`` ``"delay"`` or ``"neighbour"``.

    Raises:
        ValueError: a bad argument (named); ``pin`` on a machine with one usable core.
    """
    from tqdm.auto import tqdm

    checks.integer("world_size", world_size, least=2)
    checks.flag("pin", pin)
    checks.flag("neighbour", neighbour)
    delays = [checks.seconds("delays_s", d) for d in delays_s]
    if not delays:
        checks.fail("delays_s", delays_s, "at least one delay in seconds")
    cores = len(os.sched_getaffinity(0))
    ranks = min(world_size, cores) if pin else world_size
    if ranks < 2:
        checks.fail("pin", pin, "False on a machine with one usable core", note="pinned ranks need a core each")
    common = dict(world_size=ranks, pin=pin, steps=steps, skip=skip, width=width, batch=batch, seed=seed)
    jobs = [("delay", dict(delay_s=d)) for d in delays] + ([("neighbour", dict(neighbour=True))]
                                                            if neighbour and pin else [])
    cases = []
    for kind, kw in tqdm(jobs, desc="stragglers", unit="case", disable=not progress):
        cases.append(dict(kind=kind, **run_case(**kw, **common)))
    settings = dict(common, requested_world_size=world_size, delays_s=delays, neighbour=neighbour and pin,
                    usable_cores=cores, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    command="python -m commlab experiments stragglers")
    return dict(settings=settings, cases=cases)


def save(result: dict, path: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write :func:`measure`'s result as JSON (default: ``experiments/stragglers.json`` of a checkout's package
    data, :func:`commlab.data.record_path`).

    Raises:
        ValueError: no ``path`` and commlab installed from a wheel; a non-finite number in ``result``.
    """
    from commlab.experiments.slow_link import write_result

    return write_result(result, path, _NAME)


def load(path: str | pathlib.Path | None = None) -> dict:
    """Read a result written by :func:`save`.

    Raises:
        FileNotFoundError: with the command that records it.
    """
    from commlab.experiments.slow_link import read_result

    return read_result(path, _NAME, "stragglers")


def _label(case: dict) -> str:
    if case["kind"] == "delay":
        return f"delay {case['delay_s'] * 1e3:g} ms"
    return "busy neighbour"


def format_table(result: dict) -> str:
    """Per case: the slowed rank, each rank's median compute and wait, the measured step beside the model's
    maximum over ranks, and what :func:`find_straggler` says."""
    s = result["settings"]
    ms = lambda x: f"{x * 1e3:6.1f}"  # noqa: E731
    lines = [f"{s['world_size']} ranks{', each pinned to a core' if s['pin'] else ''} "
             f"({s['usable_cores']} usable cores), {s['steps']} steps ({s['skip']} skipped), MLP {s['width']} wide, "
             f"batch {s['batch']} per rank, recorded {s['date']}",
             "step = max over ranks of compute + the ring AllReduce's alpha-beta time (ms)",
             f"{'case':24s} {'ranks':>5s} {'max compute':>11s} {'+ AllReduce':>11s} {'= predicted':>11s} "
             f"{'measured':>8s} {'error':>6s} {'AllReduce meas':>14s}  straggler"]
    for c in result["cases"]:
        what = _label(c)
        err = 100 * (c["predicted_step_s"] - c["measured_step_s"]) / c["measured_step_s"]
        found = "none" if c["straggler"]["rank"] is None else f"rank {c['straggler']['rank']}"
        lines.append(f"{what:24s} {c['world_size']:>5d} {ms(c['max_compute_s']):>11s} "
                     f"{ms(c['allreduce_model_s']):>11s} {ms(c['predicted_step_s']):>11s} "
                     f"{ms(c['measured_step_s']):>8s} {err:+5.0f}% {ms(c['allreduce_measured_s']):>14s}  {found}")
    lines.append("per rank, median compute / wait (ms); the slowed rank is starred")
    for c in result["cases"]:
        what = _label(c)
        slowed = c["kind"] == "neighbour" or (c["kind"] == "delay" and c["delay_s"] > 0)
        cells = [f"{'*' if slowed and r == c['slow_rank'] else ' '}{ms(comp).strip()}/{ms(st - comp).strip()}"
                 for r, (comp, st) in enumerate(zip(c["median_compute_s"], c["median_step_s"]))]
        lines.append(f"  {what:22s} " + "  ".join(f"{x:>12s}" for x in cells))
    lines.append("the finder, per case:")
    for c in result["cases"]:
        what = _label(c)
        lines.append(f"  {what:22s} {c['straggler']['reason']}")
    return "\n".join(lines)


def plot(result: dict):
    """Two panels of :func:`measure`'s result: each rank's median step against the injected delay, beside the
    model's maximum over ranks; and each rank's median compute and wait (stacked) in the largest-delay and the
    neighbour cases. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    delays = [c for c in result["cases"] if c["kind"] == "delay"]
    shown = [c for c in result["cases"] if c["kind"] == "neighbour"]
    shown = ([max(delays, key=lambda c: c["delay_s"])] if delays else []) + shown
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2), width_ratios=(1.2, 1))
    x = [c["delay_s"] * 1e3 for c in delays]
    for r in range(result["settings"]["world_size"]):
        ax.plot(x, [c["median_step_s"][r] * 1e3 for c in delays], "o", ms=7 - 1.5 * r, label=f"rank {r}, measured")
    ax.plot(x, [c["predicted_step_s"] * 1e3 for c in delays], "k--", label="max over ranks of compute + AllReduce")
    ax.set(xlabel="delay added to the last rank's forward (ms)", ylabel="step (ms)", ylim=(0, None),
           title="every rank's step follows the slowest")
    ax.legend(fontsize=8)
    width = 0.8 / max(1, len(shown))
    for i, c in enumerate(shown):
        ranks = range(c["world_size"])
        pos = [r + (i - (len(shown) - 1) / 2) * width for r in ranks]
        comp = [v * 1e3 for v in c["median_compute_s"]]
        wait = [(st - cp) * 1e3 for st, cp in zip(c["median_step_s"], c["median_compute_s"])]
        bars = bx.bar(pos, comp, width, label=f"{_label(c)}: compute")
        bx.bar(pos, wait, width, bottom=comp, color=bars[0].get_facecolor(), alpha=0.35, hatch="//",
               label=f"{_label(c)}: AllReduce + wait")
    bx.set(xticks=list(range(result["settings"]["world_size"])), xlabel="rank", ylabel="median per step (ms)",
           title="per-rank timings name the straggler")
    bx.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    return fig
