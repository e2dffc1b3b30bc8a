"""What the capstone measures: where a step's time goes, tokens/s and MFU, the JSON-lines log and the trace.

:class:`StepMeter` times one rank's step (host clock on the CPU, CUDA events on a GPU; TP's collectives one
by one) and combines the ranks' times into a :class:`StepStats`, whose parts (:data:`SPLIT`) add up to the
step. Two ratios of the model FLOP/s: MFU, over the datasheet peak (PaLM's definition) where
:func:`peak_flop_per_s` knows the device, and the share of the GEMM rate every rank measures at start-up at
the model's largest matrix product (:func:`measure_gemm_flops`, the slowest rank's). :func:`steady_means` and
:func:`summary` read a run's steps; :class:`StepLog` writes them, one JSON line each; :func:`profiled` records
a Chrome trace; :func:`straggler` names a rank the others waited for, from each rank's compute and step.
Chapter 14 §14.5 explains the split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from commlab import hardware
from commlab.overlap.profile import all_threads_config
from commlab.parallel.planner import model_flops_per_token
from commlab.parallel.tensor.communications import CommTimer, timed

from labs.capstone.model import MATMUL_DTYPE

__all__ = ["SPLIT", "StepStats", "StepMeter", "gemm_shape", "measure_gemm_flops", "peak_flop_per_s",
           "steady_means", "straggler", "summary", "StepLog", "profiled"]

#: The parts of a step, in the order the summary and the chapter's figure show them.
SPLIT = ("compute_s", "tp_s", "pp_s", "bubble_s", "dp_s", "optimizer_s", "other_s")


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step, the same on every rank: ``step_s`` is the slowest rank's, each part the mean over the ranks
    (so the parts of :data:`SPLIT` add up to ``step_s``), and each rank's own compute and step beside them.
    Seconds; on a GPU read from CUDA events.

    Attributes:
        step, loss: the step index and the global batch's mean training loss (nats).
        pipeline_s: the forward and backward passes: compute, TP, PP and bubble (with pp = 1 also the DP
            AllReduces the backward could not hide).
        compute_s: the stage's forward and backward, less its TP collectives.
        tp_s: TP's collectives (Megatron's f and g, timed one by one), all exposed.
        bubble_s: the schedule's ideal bubble at the measured compute, ``(pp - 1) / m`` of the stage's busy
            seconds (Narayanan et al. 2021, §2.2.1), at most the stage's idle seconds.
        pp_s: the rest of ``pipeline_s``: PP transfers, waits for slower stages, the schedule's bookkeeping.
        dp_s: DP communication not hidden behind compute: with pp > 1 the averaging after the flush; with
            pp = 1 the wait after the last gradient was ready (0 with ``--dp-impl ddp``, which does not say);
            with ``--inner-steps`` DiLoCo's outer step (about 0 on the steps between).
        exposed_comm_s: ``tp_s + pp_s + dp_s``. optimizer_s: the optimizer step (ZeRO-1's AllGather too).
        other_s: ``step_s`` less the mean parts: the slowest rank's lag and the bookkeeping between marks.
        tokens_per_s: the global batch's tokens per second of ``step_s``.
        mfu: model FLOP utilisation (Chowdhery et al. 2022, App. B): model FLOP/s (``6 P + 12 L h s`` per
            token) over the ranks' datasheet peak (:func:`peak_flop_per_s`); None where no peak is known.
        gemm_share: the same model FLOP/s over ``gemm_flop_per_s`` times the ranks: the share of the GEMM rate
            measured at the model's own shape (higher than MFU; on a CPU, the only ratio there is).
        gemm_flop_per_s: the slowest rank's GEMM rate at the model's largest matrix product (FLOP/s).
        val_loss: the held-out loss after this step (nats) on ``--eval-every``'s steps and the last; else None.
        slowest_rank: the rank with the longest compute: with pp = 1 the one the others waited for in DP's
            averaging (a straggler; :func:`straggler` reads many steps); with pp > 1 also the busiest stage.
        rank_compute_s, rank_step_s: each rank's ``compute_s`` (before the mean) and step, by global rank.
    """

    step: int
    loss: float
    step_s: float
    pipeline_s: float
    compute_s: float
    tp_s: float
    bubble_s: float
    pp_s: float
    dp_s: float
    exposed_comm_s: float
    optimizer_s: float
    other_s: float
    tokens_per_s: float
    mfu: float | None
    gemm_share: float
    gemm_flop_per_s: float
    val_loss: float | None = None
    slowest_rank: int | None = None
    rank_compute_s: tuple[float, ...] = ()
    rank_step_s: tuple[float, ...] = ()


def gemm_shape(opts) -> tuple[int, int, int]:
    """``(m, k, n)`` of the model's largest matrix product on one rank: a micro-batch's tokens times the MLP's
    first layer, ``(micro_batch * seq, hidden) @ (hidden, ffn / tp)``."""
    c = opts.model
    return opts.micro_batch * c.seq, c.hidden, c.ffn // opts.tp


def measure_gemm_flops(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] = (256, 256, 256),
                       seconds: float = 0.1, trials: int = 3) -> float:
    """This rank's matrix-multiply rate (FLOP/s) at ``shape = (m, k, n)`` on ``device``: the best of ``trials``
    runs of about ``seconds`` each (a run the scheduler interrupted is not the rate).

    A CPU has no datasheet peak, and on a shared one each rank gets only its share of the machine; on a GPU
    this is the rate at this size and dtype, below the datasheet's peak.
    """
    m, k, n = shape
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(4):
        a @ b
    sync()
    best = 0.0
    for _ in range(trials):
        count, start = 0, time.perf_counter()
        while True:
            for _ in range(8):
                a @ b
            count += 8
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                best = max(best, 2.0 * m * k * n * count / elapsed)
                break
    return best


def peak_flop_per_s(device: torch.device, dtype: str) -> tuple[str, float] | None:
    """``(what, FLOP/s)``: one GPU's dense datasheet peak for the capstone's matrix products under ``--dtype
    dtype`` (bfloat16; float32 only with TF32 allowed), from the :mod:`commlab.hardware` presets; None where
    they hold none (a CPU, float64, plain float32, a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    preset = ("H100-SXM" if "H100" in name and "PCIE" not in name.upper() else
              "A100-PCIe" if "A100" in name and "PCIE" in name.upper() else "A100-SXM" if "A100" in name else None)
    tf32 = dtype == "float32" and torch.backends.cuda.matmul.allow_tf32
    figure = {"bfloat16": "bf16_dense_flop_per_s"}.get(dtype, "tf32_dense_flop_per_s" if tf32 else None)
    if preset is None or figure is None:
        return None
    return f"{preset} {figure.split('_')[0]} dense peak", hardware.value(preset, figure)


class StepMeter:
    """Times this rank's steps and combines the world's times into :class:`StepStats`.

    Per step: :meth:`start`, the passes inside :meth:`timing_tp`, then :meth:`mark` after the passes, after
    DP's averaging and after the optimizer (and with ``--inner-steps`` after DiLoCo's step), then :meth:`stats`.
    Collective: every rank of the world makes it (it measures the GEMM rate, keeping the slowest rank's) and
    calls :meth:`stats` every step.
    """

    def __init__(self, opts, clock, tp_group: dist.ProcessGroup, pp_rank: int, device: torch.device):
        self.opts, self.clock, self.tp_group, self.pp_rank, self.device = opts, clock, tp_group, pp_rank, device
        self.tp_timer = CommTimer(clock)
        self.model_flops_per_token = model_flops_per_token(opts.model.planner_config())
        dist.barrier()
        rate = torch.tensor([measure_gemm_flops(device, MATMUL_DTYPE[opts.dtype], gemm_shape(opts))],
                            dtype=torch.float64, device=device)
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
        self.gemm_flop_per_s = float(rate.item())
        known = peak_flop_per_s(device, opts.dtype)
        self.peak_flop_per_s = None if known is None else known[1]
        self.marks: list = []

    def start(self) -> None:
        self.tp_timer.reset()
        self.marks = [self.clock.mark()]

    def timing_tp(self):
        """A context inside which TP's collectives are timed one by one."""
        return timed(self.tp_group, self.tp_timer)

    def mark(self) -> None:
        self.marks.append(self.clock.mark())

    def stats(self, step: int, loss: float, pipeline, dp_wrapper) -> StepStats:
        """The step's :class:`StepStats` from the marks; ``pipeline``: the schedule's result (None with pp = 1),
        ``dp_wrapper``: the DP wrapper (its ``last_step`` says how long the backward waited for DP)."""
        opts, elapsed = self.opts, self.clock.elapsed
        t0, t1, t2, t3 = self.marks[:4]
        pipeline_s, tp_s = elapsed(t0, t1), self.tp_timer.seconds()
        if pipeline is None:   # pp = 1: DP overlaps the last backward; no bubble, no PP
            record = getattr(dp_wrapper, "last_step", None)
            waited = record is not None and record.wait_end_s is not None and record.last_grad_s is not None
            dp_s = max(0.0, record.wait_end_s - record.last_grad_s) if waited and opts.dp > 1 else 0.0
            busy_s, bubble_s, pp_s = pipeline_s - dp_s, 0.0, 0.0
        else:
            dp_s = elapsed(t1, t2)
            busy_s, idle_s = pipeline.busy_s[self.pp_rank], pipeline.idle_s[self.pp_rank]
            bubble_s = min(idle_s, (opts.pp - 1) / opts.micro_batches * busy_s)
            pp_s = max(0.0, pipeline_s - busy_s - bubble_s)
        if len(self.marks) == 5:   # --inner-steps: no averaging in the step; DP's time is the outer step's
            dp_s = elapsed(t3, self.marks[4])
        # Every rank's step and parts, gathered: the slowest step, the mean parts, and each rank's own.
        mine = torch.tensor([elapsed(t0, self.marks[-1]), pipeline_s, max(0.0, busy_s - tp_s), tp_s, bubble_s, pp_s,
                             dp_s, tp_s + pp_s + dp_s, elapsed(t2, t3)], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        with torch.profiler.record_function("stats::all_gather"):
            dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()
        step_s = float(table[:, 0].max())
        pipeline_s, compute_s, tp_s, bubble_s, pp_s, dp_s, exposed_s, opt_s = table[:, 1:].mean(dim=0).tolist()
        rank_compute_s, rank_step_s = tuple(table[:, 2].tolist()), tuple(table[:, 0].tolist())
        other_s = max(0.0, step_s - (compute_s + tp_s + bubble_s + pp_s + dp_s + opt_s))
        tokens = opts.global_batch * opts.model.seq
        model_flop_per_s = self.model_flops_per_token * tokens / step_s / dist.get_world_size()   # per rank
        mfu = None if self.peak_flop_per_s is None else model_flop_per_s / self.peak_flop_per_s
        return StepStats(step, loss, step_s, pipeline_s, compute_s, tp_s, bubble_s, pp_s, dp_s, exposed_s, opt_s,
                         other_s, tokens / step_s, mfu, model_flop_per_s / self.gemm_flop_per_s,
                         self.gemm_flop_per_s, slowest_rank=max(range(len(rank_compute_s)),
                                                                key=rank_compute_s.__getitem__),
                         rank_compute_s=rank_compute_s, rank_step_s=rank_step_s)


def steady_means(stats: Sequence[StepStats]) -> dict[str, float]:
    """Means over the steps after the first (which pays for warm-up) of every timed field: means, not medians,
    so that the split still adds up to the step. Tokens/s, MFU (None without a known peak) and the GEMM share
    are those of the mean step."""
    steady = stats[1:] or stats
    keys = ("step_s", "pipeline_s", "exposed_comm_s") + SPLIT
    out = {k: sum(getattr(s, k) for s in steady) / len(steady) for k in keys}
    scale = steady[0].step_s / out["step_s"]
    out["tokens_per_s"] = steady[0].tokens_per_s * scale
    out["mfu"] = None if steady[0].mfu is None else steady[0].mfu * scale
    out["gemm_share"] = steady[0].gemm_share * scale
    return out | {"steps": len(steady), "gemm_flop_per_s": steady[0].gemm_flop_per_s}


def straggler(stats: Sequence[StepStats]):
    """The straggler of a run, if any, from the per-rank times of its steps after the first
    (:func:`commlab.experiments.stragglers.find_straggler`: the rank whose compute is longest while the others
    wait); None for steps without per-rank times (a log written before they were added) or a world of one rank."""
    from commlab.experiments.stragglers import find_straggler

    steady = [s for s in stats[1:] or stats if len(s.rank_compute_s) >= 2]
    if not steady or len({len(s.rank_compute_s) for s in steady}) != 1:
        return None
    ranks = range(len(steady[0].rank_compute_s))
    return find_straggler([[s.rank_compute_s[r] for s in steady] for r in ranks],
                          [[s.rank_step_s[r] for s in steady] for r in ranks])


def summary(stats: Sequence[StepStats]) -> str:
    """One line of the steady means: the step, its split, throughput, MFU and the share of the GEMM rate."""
    mean = steady_means(stats)
    ms = {k: mean[k] * 1e3 for k in SPLIT + ("step_s", "exposed_comm_s")}
    mfu = "unknown (no datasheet peak for this device and dtype)" if mean["mfu"] is None else \
        f"{100 * mean['mfu']:.1f} % of the datasheet peak"
    above = ("; above 100 %: the GEMM rate measured at start-up was lower than what the steps reached "
             "(a machine busy with other work), so read it as unreliable") if mean["gemm_share"] > 1 else ""
    return (f"step {ms['step_s']:.1f} ms (mean of {mean['steps']}): compute {ms['compute_s']:.1f}, "
            f"TP {ms['tp_s']:.1f}, PP {ms['pp_s']:.1f}, bubble {ms['bubble_s']:.1f}, DP {ms['dp_s']:.1f}, "
            f"optimizer {ms['optimizer_s']:.1f}, other {ms['other_s']:.1f} ms "
            f"(exposed communication {ms['exposed_comm_s']:.1f} ms); "
            f"{mean['tokens_per_s']:.0f} tokens/s, MFU {mfu}; {100 * mean['gemm_share']:.1f} % of the measured "
            f"GEMM rate{above}")


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


class StepLog:
    """The run's JSON-lines log, one :class:`StepStats` a line; nothing when ``path`` is None.

    From step 0 the file starts empty; resuming at ``start`` it keeps the lines of the steps before it and
    drops the rest (a run that died after its last checkpoint had logged steps the resumed run does again), and
    an incomplete last line, with a note. Strict JSON: a non-finite value is written as the string "nan"/"inf".
    """

    def __init__(self, path: str | None, start: int = 0):
        self.file = None
        if path is None:
            return
        kept = []
        if start > 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines = [line for line in f if line.strip()]
            if lines and not lines[-1].endswith("\n") and not _parses(lines[-1]):   # killed while writing it
                print(f"resume: note: dropping the incomplete last line of --log-file {path}: {lines.pop()[:60]!r}",
                      file=sys.stderr, flush=True)
            kept = [line for line in lines if json.loads(line).get("step", start) < start]
        self.file = open(path, "w", encoding="utf-8")
        self.file.writelines(kept)
        self.file.flush()

    def write(self, stats: StepStats) -> None:
        if self.file is not None:
            row = {k: v if not isinstance(v, float) or math.isfinite(v) else str(v)   # strict JSON: "nan", "inf"
                   for k, v in dataclasses.asdict(stats).items()}
            for k in ("rank_compute_s", "rank_step_s"):   # microseconds are enough, and keep the line readable
                row[k] = [round(x, 6) for x in row[k]]
            self.file.write(json.dumps(row, allow_nan=False) + "\n")
            self.file.flush()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()


@contextlib.contextmanager
def profiled(directory: str | None, device: torch.device) -> Iterator[None]:
    """Record a ``torch.profiler`` trace (CPU, and CUDA on a GPU) of what runs inside, written to
    ``directory/rank<R>.json`` (open it in Perfetto); nothing when ``directory`` is None."""
    if not directory:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        config = all_threads_config()  # gloo's worker threads too, for python -m commlab overlap-check
    except RuntimeError:  # torch < 2.7: the training threads only
        config = None
    prof = profile(activities=activities, experimental_config=config)
    prof.__enter__()
    try:
        yield
    finally:
        prof.__exit__(None, None, None)
        os.makedirs(directory, exist_ok=True)
        prof.export_chrome_trace(os.path.join(directory, f"rank{dist.get_rank()}.json"))
