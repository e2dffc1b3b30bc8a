"""Calibrate the α-β model on the machine you are on, and check it against the real ring AllReduce.

``t = α + n·β`` (α latency in s, β inverse per-direction bandwidth in s/byte; Hockney 1994), measured:
:func:`pingpong` (ranks 0 and 1, one-way time = round trip / 2, as the OSU and Intel MPI PingPong) and
:func:`ring_exchange` (one ring step with every rank sending and receiving at once, the contention a ring
collective meets on a few shared cores; the default; :func:`ring_exchange_here` inside a running job);
:func:`fit_alpha_beta` fits the line with standard errors, :func:`calibrate` does both, and
:func:`ring_model_error` sets ``ring_all_reduce_seconds`` (plus a measured reduction term) beside the timed
:func:`commlab.collectives.ring_all_reduce`. Each time is the median over ``rounds`` of the slowest rank's
time, rounds being the outer loop so that a drifting load shifts all sizes together (after nccl-tests).
On a shared 2-core machine rounds differ by 2 to 10 times; no function here asserts a speed.

Book: lab 3 (calibrate the α-β model on your machine, and check it); chapter 3, §3.1.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from commlab import checks
from commlab.bench.timing import calls_per_round, slowest_rank
from commlab.collectives import p2p
from commlab.collectives.common import ring_geometry
from commlab.collectives.ring import ring_all_reduce, ring_all_reduce_seconds, ring_steps
from commlab.launch import launch
from commlab.topology.links import Link

__all__ = ["DEFAULT_SIZES", "DEFAULT_VALIDATION_SIZES", "AlphaBetaFit", "RingModelRow", "RingModelReport",
           "pingpong", "ring_exchange", "ring_exchange_here", "fit_alpha_beta", "calibrate", "ring_model_error"]

#: Message sizes (bytes) for calibration: 4 KiB ... 16 MiB, every factor of 4. They cover the chunk sizes
#: (n/N) of the validation sizes below for 2 to 8 ranks.
DEFAULT_SIZES = tuple(4**k * 4096 for k in range(7))

#: Tensor sizes (bytes) for :func:`ring_model_error`: 64 KiB ... 16 MiB, every factor of 4.
DEFAULT_VALIDATION_SIZES = tuple(4**k * 65536 for k in range(5))

_METHODS = ("ring_exchange", "pingpong")

# The collective's tensors are float32; their element size, in bytes, from the dtype itself.
_DTYPE = torch.float32
_ITEMSIZE = torch.empty((), dtype=_DTYPE).element_size()


def _check_sizes(sizes: Iterable[int], least: int = 1) -> list[int]:
    sizes = [int(s) for s in sizes]
    if not sizes:
        raise ValueError("sizes must name at least one message size in bytes")
    if any(s < least for s in sizes):
        raise ValueError(f"every size must be >= {least} bytes, got {sizes}")
    return sizes


def _check_common(world_size: int, rounds: int, least_ranks: int) -> None:
    checks.integer("world_size", world_size, least_ranks)
    checks.integer("rounds", rounds)


def _progress_line(what: str, nbytes: int, rounds_s: Sequence[float]) -> str:
    med = statistics.median(rounds_s)
    return (f"  {what:<22} {nbytes:>10} B  {med * 1e6:>10.1f} us  "
            f"(rounds {min(rounds_s) * 1e6:.1f}-{max(rounds_s) * 1e6:.1f} us)")


# ------------------------------------------------------------------------------------ measurements
# A task is (kind, nbytes). Inside a rank, _make_call builds the operation once and says how many
# unit operations (one-way messages, ring steps) one call holds, so that times come out per unit.

def _pingpong_call(nbytes: int, device: torch.device | str = "cpu"):
    rank = dist.get_rank()
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def bounce():
        # One message at a time, each through commlab.collectives.p2p like every message of the course.
        if rank == 0:
            p2p.exchange(sends=[(buf, 1)]).wait()
            p2p.exchange(recvs=[(buf, 1)]).wait()
        elif rank == 1:
            p2p.exchange(recvs=[(buf, 0)]).wait()
            p2p.exchange(sends=[(buf, 0)]).wait()
        # other ranks only take part in the barriers (they are there to load the machine, if asked)

    return bounce, 2  # a round trip carries the message twice


def _exchange_call(nbytes: int, device: torch.device | str = "cpu"):
    n = dist.get_world_size()
    steps = max(1, n - 1)
    # The ring's own step loop (commlab.collectives.ring), on chunks that are views into one tensor,
    # receiving into one scratch buffer (ReduceScatter) or straight into the chunks (AllGather), so that a
    # step costs the same Python and transport work as one of the ring's.
    data = torch.zeros((steps + 1) * nbytes, dtype=torch.uint8, device=device)
    chunks = [data[i * nbytes:(i + 1) * nbytes] for i in range(steps + 1)]
    scratch = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    geom = ring_geometry(None, None)

    def both():
        # A call is the 2(N-1) steps of a ring AllReduce without its additions: one grouped exchange per
        # step, each step's send after the previous step's receive (a ring forwards what it received).
        ring_steps(n, geom, None, None, lambda step: (chunks[step], scratch, None))
        ring_steps(n, geom, None, None, lambda step: (chunks[step], chunks[step + 1], None))

    return both, 2 * steps


def _ring_call(nbytes: int, device: torch.device | str = "cpu"):
    # Zeros, summed in place: repeated sums of random data would overflow, and the speed of add_ on
    # float32 does not depend on the values.
    buf = torch.zeros(max(1, nbytes // _ITEMSIZE), dtype=_DTYPE, device=device)
    return (lambda: ring_all_reduce(buf, inplace=True, check=False)), 1


def _add_call(nbytes: int, device: torch.device | str = "cpu"):
    # One ReduceScatter addition: the largest chunk of an nbytes float32 tensor, as tensor_split cuts it.
    count, n = max(1, nbytes // _ITEMSIZE), dist.get_world_size()
    chunk = -(-count // n)
    a, b = torch.zeros(chunk, dtype=_DTYPE, device=device), torch.zeros(chunk, dtype=_DTYPE, device=device)
    return (lambda: a.add_(b)), 1


_CALLS = {"pingpong": _pingpong_call, "exchange": _exchange_call, "ring": _ring_call, "add": _add_call}


def _one_round(tasks: Sequence[tuple[str, int]], device: torch.device | str = "cpu") -> list[float]:
    """Inside a rank: time each task once (after a warm-up call) on ``device``; seconds per unit, slowest rank."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    out = []
    for kind, nbytes in tasks:
        call, units = _CALLS[kind](nbytes, device)
        payload = nbytes * units if kind != "add" else nbytes // dist.get_world_size()
        iters = calls_per_round(payload, 2 * 2**20, 100 if kind != "add" else 1000)
        call()  # warm-up: connection set-up and first-touch allocation are not the link's
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        out.append(slowest_rank((time.perf_counter() - t0) / (iters * units), device))
    return out


def _measure_rounds(tasks: Sequence[tuple[str, int]], world_size: int, rounds: int, progress: bool,
                    label: str, timeout: float) -> list[list[float]]:
    """``rounds`` launches, each timing every task once; returns ``times[task][round]`` in seconds.

    Rounds are the outer loop, so that every size (and, in :func:`ring_model_error`, calibration and
    collective alike) is measured across the same stretch of time: a shared machine whose load drifts then
    shifts all of them together instead of bending the fitted line. The task order alternates between
    rounds so that no task always runs first after the launch.
    """
    times: list[list[float]] = [[] for _ in tasks]
    t_start = time.perf_counter()
    for r in range(rounds):
        order = list(range(len(tasks)))
        if r % 2:
            order.reverse()
        got = launch(_one_round, world_size, [tasks[i] for i in order], timeout=timeout, print_output=True)[0]
        for i, t in zip(order, got):
            times[i].append(t)
        if progress:
            print(f"  {label}: round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.1f} s)", flush=True)
    return times


def _medians(kind: str, what: str, sizes: Sequence[int], world_size: int, rounds: int, progress: bool,
             timeout: float) -> list[float]:
    times = _measure_rounds([(kind, s) for s in sizes], world_size, rounds, progress, what, timeout)
    if progress:
        for nbytes, t in zip(sizes, times):
            print(_progress_line(what, nbytes, t), flush=True)
    return [statistics.median(t) for t in times]


def pingpong(sizes: Iterable[int] = DEFAULT_SIZES, world_size: int = 2, rounds: int = 5,
             progress: bool = False, timeout: float = 60.0) -> list[float]:
    """One-way message time between ranks 0 and 1, per size: round trip / 2, median over rounds.

    Args:
        sizes: message sizes in bytes (>= 1), sent as uint8 tensors with blocking ``send``/``recv``.
        world_size: ranks launched (>= 2); ranks beyond 1 only join the barriers.
        rounds: timed rounds (>= 1), one launch each; a round times, per size, enough round trips to carry
            about 2 MiB.
        progress: print a line per round, then one per size (median and the range over rounds, which
            shows how noisy the machine was).
        timeout: seconds allowed per launch.

    Returns:
        Seconds per one-way message, one float per size, in the order given.

    Raises:
        ValueError: no sizes, a size < 1, ``world_size`` < 2 or ``rounds`` < 1.
    """
    sizes = _check_sizes(sizes)
    _check_common(world_size, rounds, 2)
    return _medians("pingpong", f"pingpong N={world_size}", sizes, world_size, rounds, progress, timeout)


def ring_exchange(sizes: Iterable[int] = DEFAULT_SIZES, world_size: int = 4, rounds: int = 5,
                  progress: bool = False, timeout: float = 60.0) -> list[float]:
    """Time of one ring step per size: every rank sends n bytes to its successor while receiving n bytes
    from its predecessor, all links busy at once; slowest rank, median over rounds.

    A timed call is the 2(N-1) steps of a ring AllReduce without its additions, run by the ring's own step
    loop (:mod:`commlab.collectives.ring`): each step one grouped exchange (send to the successor, receive
    from the predecessor), posted after the previous step's receive, at most two sends in flight; the time
    is divided by 2(N-1). With N ranks on fewer cores a step's time is set as much by the scheduler as by
    the copy, and this is the rhythm in which a ring collective meets it.

    Args:
        sizes: message sizes in bytes (>= 1), sent as uint8 tensors.
        world_size: ranks in the ring (>= 2); with 2, the two ranks exchange with each other.
        rounds, progress, timeout: as in :func:`pingpong`.

    Returns:
        Seconds per step, one float per size, in the order given.

    Raises:
        ValueError: no sizes, a size < 1, ``world_size`` < 2 or ``rounds`` < 1.
    """
    sizes = _check_sizes(sizes)
    _check_common(world_size, rounds, 2)
    return _medians("exchange", f"ring_exchange N={world_size}", sizes, world_size, rounds, progress, timeout)


def ring_exchange_here(sizes: Iterable[int], rounds: int = 3, device: torch.device | str = "cpu") -> list[float]:
    """:func:`ring_exchange` inside the process group that already runs (every rank of the world calls it),
    for a training script under torchrun or srun that calibrates where it stands; on ``device`` (a GPU's
    tensors go through NCCL). Seconds per ring step, one float per size: the median over ``rounds`` of the
    slowest rank's time (after a warm-up call and a barrier, each round carrying about 2 MiB per size).

    Raises:
        ValueError: no sizes, a size < 1, ``rounds`` < 1, or a world of fewer than 2 ranks.
    """
    sizes = _check_sizes(sizes)
    if dist.get_world_size() < 2:
        raise ValueError("ring_exchange_here needs a process group of >= 2 ranks (one rank sends nothing)")
    checks.integer("rounds", rounds)
    # The same rounds as ring_exchange's launches (every size once per round), in the group that runs.
    times = [_one_round([("exchange", n) for n in sizes], device) for _ in range(rounds)]
    return [statistics.median(t[i] for t in times) for i in range(len(sizes))]


# ------------------------------------------------------------------------------------------ the fit

@dataclasses.dataclass(frozen=True)
class AlphaBetaFit:
    """``t = α + n·β`` fitted to measured times.

    Attributes:
        alpha_s: latency α, seconds (may come out slightly negative from noisy data; see :meth:`as_link`).
        beta_s_per_byte: inverse bandwidth β, s/byte (per direction for a link).
        alpha_se_s, beta_se_s_per_byte: their standard errors (square roots of the diagonal of the
            parameter covariance matrix); 0 for data that lie exactly on a line, nan with only 2 points.
        r2: coefficient of determination of the (weighted) fit.
        weighting: ``"relative"`` (weights 1/t²) or ``"uniform"``.
        sizes, seconds: the data fitted (bytes, seconds).
    """

    alpha_s: float
    beta_s_per_byte: float
    alpha_se_s: float
    beta_se_s_per_byte: float
    r2: float
    weighting: str
    sizes: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()

    @property
    def bytes_per_s(self) -> float:
        """1/β in bytes/s (inf for β <= 0)."""
        return math.inf if self.beta_s_per_byte <= 0 else 1.0 / self.beta_s_per_byte

    def predict(self, nbytes):
        """α + nbytes·β in seconds (``nbytes`` a number, or a sequence/array, which gives an array)."""
        if isinstance(nbytes, (np.ndarray, list, tuple)):
            return self.alpha_s + np.asarray(nbytes, dtype=float) * self.beta_s_per_byte
        return self.alpha_s + float(nbytes) * self.beta_s_per_byte

    def relative_residuals(self) -> list[float]:
        """(predicted - measured) / measured for each fitted point."""
        return [(self.predict(n) - t) / t for n, t in zip(self.sizes, self.seconds)]

    def as_link(self, name: str = "calibrated") -> Link:
        """The fit as a :class:`~commlab.topology.Link`. A negative α or β (noise around zero) becomes 0,
        since a link cannot have them."""
        return Link(alpha_s=max(self.alpha_s, 0.0), beta_s_per_byte=max(self.beta_s_per_byte, 0.0), name=name)

    def __str__(self) -> str:
        return (f"alpha = {self.alpha_s * 1e6:.2f} +- {self.alpha_se_s * 1e6:.2f} us, "
                f"beta = {self.beta_s_per_byte * 1e9:.4f} +- {self.beta_se_s_per_byte * 1e9:.4f} ns/B "
                f"({self.bytes_per_s / 1e9:.3f} GB/s), r2 = {self.r2:.4f} ({self.weighting}, {len(self.sizes)} sizes)")


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float], weighting: str = "relative") -> AlphaBetaFit:
    """Least-squares fit of ``t = α + n·β``, with standard errors from the parameter covariance matrix.

    ``weighting="relative"`` (default) weights each point by 1/t², minimising relative errors, so that a
    few-microsecond α is not drowned by the large sizes' millisecond residuals and every size counts alike (the
    bias this adds is of the order of the squared relative noise, far below the standard errors);
    ``"uniform"`` is plain OLS. Covariance ``s²·(X_wᵀX_w)⁻¹`` with ``s² = Σ r_w² / (m - 2)``; r² is the weighted
    coefficient of determination.

    Args:
        sizes: message sizes in bytes (>= 0), at least two distinct.
        seconds: measured times in seconds (> 0), one per size.
        weighting: ``"relative"`` (default) or ``"uniform"``.

    Returns:
        An :class:`AlphaBetaFit`.

    Raises:
        ValueError: lengths differ, fewer than two distinct sizes, a negative size, a non-positive or
            non-finite time, or an unknown ``weighting``.
    """
    if weighting not in ("relative", "uniform"):
        raise ValueError(f"weighting must be 'relative' or 'uniform', got {weighting!r}")
    n = np.asarray(list(sizes), dtype=float)
    t = np.asarray(list(seconds), dtype=float)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"sizes and seconds must be two lists of the same length, got {n.size} and {t.size}")
    if len(set(n.tolist())) < 2:
        raise ValueError(f"need at least two distinct sizes to fit two parameters, got {n.tolist()}")
    if np.any(n < 0) or not np.all(np.isfinite(n)):
        raise ValueError(f"sizes must be finite and >= 0 bytes, got {n.tolist()}")
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError(f"seconds must be finite and > 0, got {t.tolist()}")
    m = n.size
    w = 1.0 / t**2 if weighting == "relative" else np.ones(m)
    sw = np.sqrt(w)
    # Sizes in units of the largest keep the normal matrix well conditioned (n reaches ~1e7, 1 stays 1).
    scale = float(n.max())
    X = np.column_stack([np.ones(m), n / scale]) * sw[:, None]
    y = t * sw
    theta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ theta
    ssr = float(resid @ resid)
    t_mean = float(np.sum(w * t) / np.sum(w))
    sst = float(np.sum(w * (t - t_mean) ** 2))
    r2 = 1.0 - ssr / sst if sst > 0 else 1.0
    if m > 2:
        cov = ssr / (m - 2) * np.linalg.inv(X.T @ X)
        se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    else:
        se = np.array([math.nan, math.nan])
    return AlphaBetaFit(alpha_s=float(theta[0]), beta_s_per_byte=float(theta[1] / scale),
                        alpha_se_s=float(se[0]), beta_se_s_per_byte=float(se[1] / scale), r2=float(r2),
                        weighting=weighting, sizes=tuple(int(v) for v in n), seconds=tuple(float(v) for v in t))


def calibrate(world_size: int = 4, sizes: Iterable[int] = DEFAULT_SIZES, method: str = "ring_exchange",
              rounds: int = 5, weighting: str = "relative", progress: bool = True,
              timeout: float = 60.0) -> AlphaBetaFit:
    """Measure with ``method`` on ``world_size`` ranks and fit α and β.

    Args:
        world_size: ranks (>= 2). With ``"ring_exchange"`` the fit describes one ring step with all N ranks
            busy, which is what a ring collective on N ranks meets; calibrate once per world size.
        sizes: message sizes in bytes (at least two distinct).
        method: ``"ring_exchange"`` (default) or ``"pingpong"``.
        rounds, progress, timeout: as in :func:`pingpong`; weighting: as in :func:`fit_alpha_beta`.

    Returns:
        An :class:`AlphaBetaFit` (α in s, β in s/byte).

    Raises:
        ValueError: an unknown ``method``, or as :func:`ring_exchange` and :func:`fit_alpha_beta`.
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    sizes = _check_sizes(sizes)
    if len(set(sizes)) < 2:  # a line through one size is undetermined: say so before measuring
        raise ValueError(f"calibration needs at least two distinct sizes, got {sorted(set(sizes))}")
    measure = ring_exchange if method == "ring_exchange" else pingpong
    seconds = measure(sizes, world_size=world_size, rounds=rounds, progress=progress, timeout=timeout)
    fit = fit_alpha_beta(sizes, seconds, weighting=weighting)
    if progress:
        print(f"  {method} N={world_size}: {fit}", flush=True)
    return fit


# ------------------------------------------------------------------------------- model vs. machine

@dataclasses.dataclass(frozen=True)
class RingModelRow:
    """One (world size, tensor size) of :func:`ring_model_error`. Times in seconds.

    Attributes:
        world_size, nbytes: ranks and tensor size (bytes, float32).
        measured_s: ``ring_all_reduce`` (in place, check=False), slowest rank, median over rounds.
        comm_s: ``ring_all_reduce_seconds(nbytes, N, α, β)``, the α-β model.
        reduce_s: the γ term, (N-1) × the measured time of one ``add_`` of an n/N-byte chunk (0 if off).
        alpha_s, beta_s_per_byte: the fit used.
    """

    world_size: int
    nbytes: int
    measured_s: float
    comm_s: float
    reduce_s: float
    alpha_s: float
    beta_s_per_byte: float

    @property
    def predicted_s(self) -> float:
        return self.comm_s + self.reduce_s

    @property
    def error(self) -> float:
        """(predicted - measured) / measured: > 0 when the model is pessimistic."""
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclasses.dataclass(frozen=True)
class RingModelReport:
    """Rows of :func:`ring_model_error` and their mean absolute percentage error.

    Attributes:
        rows: one :class:`RingModelRow` per world size and tensor size.
        mape: mean of ``|error|`` over the rows, as a fraction (0.25 means 25 %).
        fits: the :class:`AlphaBetaFit` used per world size.
    """

    rows: tuple[RingModelRow, ...]
    mape: float
    fits: Mapping[int, AlphaBetaFit]

    def format(self) -> str:
        """The rows as a table (times in microseconds)."""
        lines = ["# ring AllReduce: measured vs alpha-beta model (+ reduction term)",
                 f"#{'N':>3} {'size (B)':>10} {'measured':>11} {'alpha-beta':>11} {'+ reduce':>10}"
                 f" {'predicted':>11} {'error':>8}"]
        for r in self.rows:
            lines.append(f" {r.world_size:>3} {r.nbytes:>10} {r.measured_s * 1e6:>11.1f} {r.comm_s * 1e6:>11.1f}"
                         f" {r.reduce_s * 1e6:>10.1f} {r.predicted_s * 1e6:>11.1f} {r.error * 100:>7.1f}%")
        lines.append(f"# MAPE {self.mape * 100:.1f} % over {len(self.rows)} rows")
        return "\n".join(lines)


def ring_model_error(world_sizes: Sequence[int] = (2, 4, 8), sizes: Iterable[int] = DEFAULT_VALIDATION_SIZES,
                     fits: Mapping[int, AlphaBetaFit] | None = None, gamma: bool = True, rounds: int = 7,
                     calibration_sizes: Iterable[int] | None = None, weighting: str = "relative",
                     progress: bool = True, timeout: float = 60.0) -> RingModelReport:
    """How well ``ring_all_reduce_seconds`` predicts :func:`commlab.collectives.ring_all_reduce` here.

    For each world size N and tensor size n: the measured ring AllReduce of n bytes of float32 beside
    ``2(N-1)·α + 2(N-1)/N·n·β``, plus with ``gamma`` the measured reduction ((N-1) × one ``add_`` of an n/N-byte
    chunk, all ranks at once: the γ term of Thakur, Rabenseifner & Gropp 2005, measured). α and β come from
    ``fits[N]`` or are calibrated with :func:`ring_exchange` in the same rounds as the collective (so both see
    the same load), by default at the chunk sizes n/N the ring sends plus 4 KiB.

    Args:
        world_sizes: numbers of ranks, each >= 2.
        sizes: tensor sizes in bytes (>= 4; rounded down to whole float32 elements).
        fits: ``{N: AlphaBetaFit}`` to use instead of calibrating (world sizes not in it are calibrated).
        gamma: add the measured reduction term.
        rounds: timed rounds (launches) per world size.
        calibration_sizes: message sizes (bytes, at least two distinct) for the calibration; default
            ``{4096} ∪ {n // N}`` per world size.
        weighting: as in :func:`fit_alpha_beta`.
        progress, timeout: print each round, measurement, fit and the table; seconds allowed per launch.

    Returns:
        A :class:`RingModelReport` (rows, MAPE as a fraction, the fit used per world size).

    Raises:
        ValueError: a world size < 2, no sizes or a size < 4, ``rounds`` < 1, or as :func:`fit_alpha_beta`.
    """
    world_sizes = list(world_sizes)
    if not world_sizes:
        raise ValueError("world_sizes must name at least one number of ranks")
    for ws in world_sizes:
        _check_common(ws, rounds, 2)
    sizes = [(s // _ITEMSIZE) * _ITEMSIZE for s in _check_sizes(sizes, least=_ITEMSIZE)]
    if calibration_sizes is not None:
        calibration_sizes = _check_sizes(calibration_sizes)
    for ws in world_sizes:  # every fit's sizes are known now: refuse a degenerate one before measuring
        cal = calibration_sizes if calibration_sizes is not None else {4096} | {max(1, n // ws) for n in sizes}
        if fits is None or ws not in fits:
            if len(set(cal)) < 2:
                raise ValueError(f"the calibration for {ws} ranks would use only the size(s) {sorted(set(cal))}; "
                                 "pass calibration_sizes with at least two distinct sizes, or larger sizes")
    used: dict[int, AlphaBetaFit] = dict(fits or {})
    rows = []
    for ws in world_sizes:
        tasks = [("ring", n) for n in sizes] + ([("add", n) for n in sizes] if gamma else [])
        calibrating = ws not in used
        cal_sizes = (calibration_sizes if calibration_sizes is not None
                     else sorted({4096} | {max(1, n // ws) for n in sizes}))
        if calibrating:
            tasks += [("exchange", m) for m in cal_sizes]
        times = _measure_rounds(tasks, ws, rounds, progress, f"N={ws}", timeout)
        by_task = dict(zip(tasks, times))
        if calibrating:
            cal = [by_task[("exchange", m)] for m in cal_sizes]
            if progress:
                for m, t in zip(cal_sizes, cal):
                    print(_progress_line(f"ring_exchange N={ws}", m, t), flush=True)
            used[ws] = fit_alpha_beta(cal_sizes, [statistics.median(t) for t in cal], weighting)
            if progress:
                print(f"  ring_exchange N={ws}: {used[ws]}", flush=True)
        fit = used[ws]
        link = fit.as_link()  # a link cannot have a negative α or β; noise can fit one slightly below 0
        for nbytes in sizes:
            ring = by_task[("ring", nbytes)]
            reduce_s = (ws - 1) * statistics.median(by_task[("add", nbytes)]) if gamma else 0.0
            row = RingModelRow(world_size=ws, nbytes=nbytes, measured_s=statistics.median(ring),
                               comm_s=ring_all_reduce_seconds(nbytes, ws, link.alpha_s, link.beta_s_per_byte),
                               reduce_s=reduce_s, alpha_s=fit.alpha_s, beta_s_per_byte=fit.beta_s_per_byte)
            rows.append(row)
            if progress:
                print(_progress_line(f"ring_all_reduce N={ws}", nbytes, ring)
                      + f"  predicted {row.predicted_s * 1e6:.1f} us ({row.error * 100:+.1f}%)", flush=True)
    mape = float(np.mean([abs(r.error) for r in rows]))
    report = RingModelReport(rows=tuple(rows), mape=mape, fits=used)
    if progress:
        print(report.format(), flush=True)
    return report
