"""Tables from recorded runs: quality over seeds, the source article's table re-measured, targets.

Quality changes are paired by seed: each compressed run is compared with the dense run of the same task
and seed (same initial model, same mini-batches), and the mean and sample standard deviation of those
differences are reported. For perplexity the change is relative, in % (as the article's "PPL 影响");
for accuracy it is in percentage points.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import pathlib
import statistics
import unicodedata
from typing import Sequence

from commlab import checks, data
from commlab.experiments.harness import RunConfig, RunRecord

__all__ = ["run_group", "SummaryRow", "summarize", "format_summary", "ArticleRow", "article_table", "format_article_table",
           "load_article_claims", "dense_target", "group_runs"]

#: The source article's claims: ``article_claims.json`` of the package data (:mod:`commlab.data`).
ARTICLE_CLAIMS = data.path("article_claims.json")


def run_group(rec: RunRecord) -> str:
    """The record's task, with its optimizer if that is not the task's default (:attr:`RunConfig.group`)."""
    return RunConfig(**rec.config).group


def _method_key(rec: RunRecord) -> tuple:
    c = rec.config
    return (run_group(rec), c["method"], bool(c["error_feedback"]), c["warmup_steps"], c.get("aggregation", "auto"))


def _settings(rec: RunRecord) -> str:
    """The run's key without its seed: what must be equal for runs to be averaged over seeds."""
    return "|".join(p for p in RunConfig(**rec.config).key.split("|") if not p.startswith("seed="))


def group_runs(records: Sequence[RunRecord]) -> dict[tuple, list[RunRecord]]:
    """Records grouped by (task group, method spec, error feedback, warm-up steps, aggregation), in first-seen order.
    The task group is the task, or ``task/optimizer`` for runs with another optimizer than the task's.

    Raises:
        ValueError: the same run (same settings and seed) twice, or one group holding runs whose other
            settings differ (steps, ranks, batch, learning rate, link): averaging them would mix
            experiments. Keep each grid in its own file.
    """
    groups: dict[tuple, list[RunRecord]] = collections.OrderedDict()
    seen: set[str] = set()
    for r in records:
        key = RunConfig(**r.config).key
        if key in seen:
            raise ValueError(f"the run {key} appears twice in the records; keep each grid in its own file")
        seen.add(key)
        groups.setdefault(_method_key(r), []).append(r)
    for k, runs in groups.items():
        settings = {_settings(r) for r in runs}
        if len(settings) > 1:
            raise ValueError(f"the records mix runs of {k[1]} on {k[0]} with different settings ({sorted(settings)}); "
                             "keep each grid (e.g. --grid quick and --grid full) in its own file")
    return groups


def _change(rec: RunRecord, dense: RunRecord) -> float:
    if rec.metric == "perplexity":
        return 100.0 * (rec.final_quality - dense.final_quality) / dense.final_quality
    return 100.0 * (rec.final_quality - dense.final_quality)


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One method on one task, over seeds.

    Attributes:
        task, label, method, error_feedback, warmup_steps, aggregation: what ran.
        seeds: number of runs; diverged: how many stopped on a NaN/Inf gradient.
        ratio: dense float32 bytes / payload bytes; payload_nbytes, bytes_sent_per_rank: per step.
        quality_mean, quality_std: final quality over the runs that finished (accuracy, or perplexity).
        change_mean, change_std: change against dense, paired by seed (perplexity: %, accuracy: points).
        compute_s, codec_s, comm_s, step_s: medians over steps and runs (seconds, slowest rank).
        seed_changes: ``(seed, change)`` of each run, in run order (NaN for a run that diverged), so that two
            rows of the same task can be compared seed by seed (e.g. all-gather against two-phase).
    """

    task: str
    label: str
    method: str
    error_feedback: bool
    warmup_steps: int
    metric: str
    seeds: int
    diverged: int
    ratio: float
    payload_nbytes: int
    bytes_sent_per_rank: float
    quality_mean: float
    quality_std: float
    change_mean: float
    change_std: float
    compute_s: float
    codec_s: float
    comm_s: float
    step_s: float
    aggregation: str = "auto"
    seed_changes: tuple[tuple[int, float], ...] = ()


def summarize(records: Sequence[RunRecord], skip: int = 5) -> list[SummaryRow]:
    """One :class:`SummaryRow` per method and task group (``skip``: first steps, and a run's dense warm-up
    steps, left out of the timing medians; >= 0) (grid order; ``task`` holds the group, e.g.
    ``"charlm/sgd-momentum"``). Needs the dense run of each group and seed.

    Raises:
        ValueError: a compressed run whose dense run (same group and seed) is missing.
    """
    checks.integer("skip", skip, least=0)
    groups = group_runs(records)
    dense = {(run_group(r), r.config["seed"]): r for r in records if r.config["method"] == "dense"}
    rows = []
    for (task, method, ef, warm, agg), runs in groups.items():
        changes = []
        for r in runs:
            d = dense.get((task, r.config["seed"]))
            if d is None:
                raise ValueError(f"no dense run of {task} with seed {r.config['seed']} to compare {r.label} with")
            if _settings(d).replace(RunConfig(**d.config).method_segment, "") != _settings(r).replace(
                    RunConfig(**r.config).method_segment, ""):
                raise ValueError(f"the dense run of {task}, seed {r.config['seed']}, has other settings than "
                                 f"{r.label}'s; keep each grid in its own file")
            changes.append(_change(r, d))
        q = _mean_std([r.final_quality for r in runs])
        ch = _mean_std(changes)
        start = max(skip, warm)
        med = lambda field: statistics.median(statistics.median(getattr(r, field)[start:]) for r in runs  # noqa: E731
                                              if len(getattr(r, field)) > start) if any(
            len(getattr(r, field)) > start for r in runs) else math.nan
        r0 = runs[0]
        rows.append(SummaryRow(task, r0.label, method, ef, warm, r0.metric, len(runs),
                               sum(r.diverged_at_step is not None for r in runs), r0.ratio, r0.payload_nbytes,
                               r0.bytes_sent_per_rank, *q, *ch, med("compute_s"), med("codec_s"),
                               med("comm_s"), med("step_s"), agg,
                               tuple((r.config["seed"], c) for r, c in zip(runs, changes))))
    return rows


def _pad(text: str, width: int) -> str:
    """Left-align ``text`` in ``width`` terminal columns (CJK characters take two)."""
    cols = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
    return text + " " * max(0, width - cols)


def format_summary(rows: Sequence[SummaryRow]) -> str:
    """A plain-text table of :func:`summarize`'s rows: mean ± sample standard deviation over the seeds."""
    lines = []
    for task in dict.fromkeys(r.task for r in rows):
        sub = [r for r in rows if r.task == task]
        unit = "Δ ppl %" if sub[0].metric == "perplexity" else "Δ acc pts"
        lines.append(f"{task}: final {sub[0].metric}, mean ± sd over seeds; Δ against dense, paired by seed")
        lines.append(f"  {'method':34s} {'seeds':>5s} {'ratio':>6s} {'sent/step':>10s} {sub[0].metric:>16s} {unit:>14s}")
        for r in sub:
            sd = lambda x, f: f" ± {x:{f}}" if r.seeds > 1 else ""  # noqa: E731
            q = "diverged" if math.isnan(r.quality_mean) else f"{r.quality_mean:.4g}{sd(r.quality_std, '.2g')}"
            ch = "" if math.isnan(r.change_mean) else f"{r.change_mean:+.2f}{sd(r.change_std, '.2f')}"
            div = f" ({r.diverged} diverged)" if r.diverged else ""
            lines.append(f"  {r.label:34s} {r.seeds:5d} {r.ratio:6.1f} {r.bytes_sent_per_rank / 1024:8.1f}Ki {q:>16s} "
                         f"{ch:>14s}{div}")
    return "\n".join(lines)


def load_article_claims(path: str | pathlib.Path | None = None) -> dict:
    """The source article's §5.2 table as recorded in :data:`ARTICLE_CLAIMS` (or the file at ``path``); a copy."""
    return copy.deepcopy(data.load_json(path, "article_claims.json"))


@dataclasses.dataclass(frozen=True)
class ArticleRow:
    """One row of the article's table beside our measurement on the character LM.

    Attributes:
        row: the article's row name; label: our method.
        claimed_ratio, claimed_ppl_change_pct: the article's values.
        ratio_fp32: our payload's ratio against float32 gradients; ratio_bf16: against BF16 (the article's baseline).
        ppl_change_mean, ppl_change_std: measured perplexity change against dense, % (paired by seed).
        seeds, diverged: runs behind the measurement.
    """

    row: str
    label: str
    claimed_ratio: float
    claimed_ppl_change_pct: float
    ratio_fp32: float
    ratio_bf16: float
    ppl_change_mean: float
    ppl_change_std: float
    seeds: int
    diverged: int


def article_table(records: Sequence[RunRecord], task: str = "charlm", claims: dict | None = None) -> list[ArticleRow]:
    """The article's rows (``commlab/data/article_claims.json``) with our measured values for ``task``.

    Raises:
        ValueError: a method of the article's table missing from ``records``.
    """
    claims = claims or load_article_claims()
    # The article's rows are the all-gather runs (the two-phase ones are chapter 8's correction).
    by_method = {(r.method, r.error_feedback, r.warmup_steps): r for r in summarize(records)
                 if r.task == task and r.aggregation == "auto"}
    out = []
    for c in claims["rows"]:
        key = (c["method"], c["error_feedback"], 0)
        if key not in by_method:
            raise ValueError(f"no {task} runs of {c['method']} (error feedback {c['error_feedback']}) for the "
                             f"article's row {c['row']!r}")
        s = by_method[key]
        out.append(ArticleRow(c["row"], s.label, c["ratio"], c["ppl_change_pct"], s.ratio, s.ratio / 2,
                              s.change_mean, s.change_std, s.seeds, s.diverged))
    return out


def format_article_table(rows: Sequence[ArticleRow]) -> str:
    """Plain-text version of :func:`article_table` for the command line."""
    lines = [f"{'article row':20s} {'ours':22s} {'claimed ratio':>13s} {'ours vs BF16':>12s} {'vs fp32':>8s} "
             f"{'claimed ΔPPL':>12s} {'measured ΔPPL (mean ± sd)':>26s} {'seeds':>5s}"]
    for r in rows:
        meas = "diverged" if math.isnan(r.ppl_change_mean) else f"{r.ppl_change_mean:+.2f} ± {r.ppl_change_std:.2f} %"
        div = f" ({r.diverged} diverged)" if r.diverged else ""
        lines.append(f"{_pad(r.row, 20)} {r.label:22s} {r.claimed_ratio:12.1f}x {r.ratio_bf16:11.1f}x {r.ratio_fp32:7.1f}x "
                     f"{r.claimed_ppl_change_pct:+11.1f}% {meas:>26s} {r.seeds:5d}{div}")
    return "\n".join(lines)


def dense_target(records: Sequence[RunRecord], task: str, fraction: float = 0.75) -> float:
    """A target quality for the task group ``task`` (:func:`run_group`, e.g. ``"charlm/sgd-momentum"``): the median over seeds of the dense run's quality at ``fraction`` of its steps
    (the first evaluation at or after that step). Dense runs reach it by construction; a method that
    never does within its run is "never reaches target" in :func:`commlab.experiments.time_to_accuracy.break_even`.

    Raises:
        ValueError: no dense run of ``task``, one without a finite quality at that step (diverged), or
            ``fraction`` outside (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    dense = [r for r in records if run_group(r) == task and r.config["method"] == "dense"]
    if not dense:
        raise ValueError(f"no dense run of {task}")
    values = []
    for r in dense:
        at = fraction * r.config["steps"]
        i = next((i for i, s in enumerate(r.eval_steps) if s >= at), None)
        if i is None or r.diverged_at_step is not None or math.isnan(r.eval_quality[i]):
            raise ValueError(f"the dense run of {task} with seed {r.config['seed']} has no finite quality at step "
                             f"{at:g} (it stopped at {r.eval_steps[-1]}, diverged at {r.diverged_at_step})")
        values.append(r.eval_quality[i])
    return statistics.median(values)
