"""The planner against published runs: ``python -m commlab plan --validate``.

:func:`validate_published` runs the step model and the search on ``commlab/data/published_layouts.json``:
:class:`ValidationRow` s of predicted against reported TFLOP/s per GPU (each source's FLOP definition) and
the published layout's rank in the planner's search; :func:`validation_summary` and :func:`validation_table`
summarise them. Nothing is fitted per row. Book: chapter 11, §11.4, §11.6."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

from commlab import checks
from commlab.parallel.planner.counting import model_flops_per_step
from commlab.parallel.planner.memory import Layout, load_model
from commlab.parallel.planner.search import TIMELINE_TOP_K, Plan, load_published, search
from commlab.parallel.planner.software import SoftwareProfile, check_recompute_policy, load_software
from commlab.parallel.planner.time_model import AUTO, TimeBreakdown
from commlab.topology import load_preset

__all__ = ["ValidationRow", "WITHIN_PCT", "VALIDATION_MICRO_BATCHES", "VALIDATION_INTERLEAVE", "validate_published",
           "validation_summary", "validation_table"]

#: The agreement the validation asks of the step model: predicted within this many percent of reported.
WITHIN_PCT = 25.0


@dataclasses.dataclass(frozen=True)
class ValidationRow:
    """One published run beside the planner (``config``: its key; ``software``: its profile).

    ``published``: its layout, ``*`` on each knob the planner chose; ``planner_top``: the planner's fastest;
    ``reported_tflops``, ``predicted_tflops``, ``top_tflops`` in the source's definition (``accounting``);
    ``error_pct``: (predicted - reported) / reported × 100; ``published_rank``, ``plan_rank``, ``exact_rank``: the
    published split among the splits, its first plan among all plans, the exact configuration (``knobs_fixed``:
    the source fixes micro-batch or interleaving); None: does not fit. Equal step times share a rank."""

    config: str
    published: str
    planner_top: str
    reported_tflops: float
    predicted_tflops: float
    top_tflops: float
    error_pct: float
    top_tp_within_node: bool
    published_step_s: float
    top_step_s: float
    accounting: str
    published_rank: int | None = None
    software: str = ""
    exact_rank: int | None = None
    plan_rank: int | None = None
    knobs_fixed: bool = False
    published_time: TimeBreakdown | None = None

    @property
    def within(self) -> bool:
        """``|error_pct| <= WITHIN_PCT``."""
        return abs(self.error_pct) <= WITHIN_PCT


#: What every row's searches try: the planner's defaults plus Megatron-LM's Table 1 (b = 16; v = 3).
VALIDATION_MICRO_BATCHES = (1, 2, 4, 8, 16)
VALIDATION_INTERLEAVE = (1, 2, 3, 4, 8)


def validate_published(achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
                       path: str | Path | None = None, timeline_top: int = TIMELINE_TOP_K) -> list[ValidationRow]:
    """The planner against every published run without context parallelism.

    Per run, with the software profile it names: the fastest plan with its published tp, pp, dp and whatever
    else the source fixes is the prediction; the free search with the same profile gives the top layout and the
    ranks; both try :data:`VALIDATION_MICRO_BATCHES` and :data:`VALIDATION_INTERLEAVE`. One compute model for all
    rows; ``timeline_top`` as :func:`~.search.search`.

    Raises:
        ValueError: an unknown profile or FLOP definition; a fixed knob the searches do not try; a published
            configuration that does not fit or split the batch (names the row).
    """
    rows = []
    for key, e in load_published(path).items():
        if e.get("cp", 1) != 1:
            continue
        m = load_model(e["model"])
        if e.get("seq"):
            m = m.with_seq(e["seq"])
        sw = load_software(e.get("software"))
        common = dict(achievable_fraction=achievable_fraction, dp_overlap=dp_overlap, software=sw,
                      timeline_top=timeline_top)
        fixed = _fixed_knobs(key, e, sw)
        definition = e.get("flop_accounting", "model")
        space = {"micro_batches": VALIDATION_MICRO_BATCHES, "interleave": VALIDATION_INTERLEAVE}
        try:
            pub = search(m, e["preset"], e["gpus"], e["global_batch"], tp_values=[e["tp"]], pp_values=[e["pp"]],
                         **{**space, **fixed}, **common).best
        except ValueError as exc:
            raise ValueError(f"published row {key!r} (tp{e['tp']} pp{e['pp']}, fixed {fixed or 'nothing'}): "
                             f"{exc}") from exc
        res = search(m, e["preset"], e["gpus"], e["global_batch"], **space, **common)  # the planner's own
        top = res.best
        rank, plan_rank, exact = _published_ranks(res.plans, e["tp"], e["pp"], fixed)
        flops = model_flops_per_step(m, e["global_batch"], definition)
        predicted = pub.flop_per_s_per_gpu(flops) / 1e12
        top_tf = top.flop_per_s_per_gpu(flops) / 1e12
        reported = _reported_tflops(key, e, flops)
        d = load_preset(e["preset"]).devices_per_node
        rows.append(ValidationRow(config=key, published=_published_label(pub.layout, fixed),
                                  planner_top=top.layout.short(),
                                  reported_tflops=reported, predicted_tflops=predicted, top_tflops=top_tf,
                                  error_pct=(predicted - reported) / reported * 100,
                                  top_tp_within_node=d % top.layout.tp == 0, published_step_s=pub.step_s,
                                  top_step_s=top.step_s, accounting=definition, published_rank=rank,
                                  software=sw.name, exact_rank=exact, plan_rank=plan_rank,
                                  knobs_fixed=any(k in fixed for k in ("micro_batches", "interleave")),
                                  published_time=pub.time))
    return rows


def _reported_tflops(key: str, e: dict, flop_per_step: float) -> float:
    """The row's TFLOP/s per GPU: ``tflops_per_gpu``, or its FLOP per step / ``iteration_s`` / GPUs.

    Raises:
        ValueError: the row gives both or neither.
    """
    if ("tflops_per_gpu" in e) == ("iteration_s" in e):
        raise ValueError(f"published row {key!r} must give exactly one of tflops_per_gpu and iteration_s")
    if "iteration_s" in e:
        return flop_per_step / float(e["iteration_s"]) / e["gpus"] / 1e12
    return float(e["tflops_per_gpu"])


def _fixed_knobs(key: str, e: dict, sw: SoftwareProfile) -> dict:
    """The search arguments that pin what published row ``key`` fixes, checked against what the searches try.

    Raises:
        ValueError: see :func:`validate_published`; the message names the row and the knob.
    """
    fixed = {}
    if "recompute" in e:
        policy = check_recompute_policy(e["recompute"])
        if policy not in ("none", "full", sw.recompute):
            raise ValueError(f"published row {key!r}: recompute {policy!r} is not tried with software {sw.name!r} "
                             f"(it tries 'none', 'full' and its own {sw.recompute!r})")
        fixed["recompute"] = (policy,)
    if "zero1" in e:
        if e["zero1"] and 1 not in sw.zero_stages:
            raise ValueError(f"published row {key!r}: zero1 is true but software {sw.name!r} offers ZeRO stages "
                             f"{list(sw.zero_stages)}")
        fixed["zero1"] = (bool(e["zero1"]),)
    for field, arg, allowed in (("micro_batch", "micro_batches", VALIDATION_MICRO_BATCHES),
                                ("interleave", "interleave", VALIDATION_INTERLEAVE)):
        if e.get(field) is not None:
            if not checks.is_int(e[field]) or e[field] not in allowed:
                raise ValueError(f"published row {key!r}: {field} = {e[field]!r} is not one of the values the "
                                 f"validation searches, {allowed}")
            fixed[arg] = (e[field],)
    if fixed.get("interleave", (1,))[0] > 1 and e["pp"] == 1:
        raise ValueError(f"published row {key!r}: interleave = {e['interleave']} needs pp > 1 (virtual stages "
                         f"split a pipeline stage), but pp = 1")
    return fixed


def _published_label(layout: Layout, fixed: dict) -> str:
    """``layout.short()`` with a ``*`` on each knob the planner chose rather than the source (``b1*``)."""
    knob = {"b": "micro_batches", "v": "interleave", "zero": "zero1"}
    out = []
    for token in layout.short().split():
        arg = "recompute" if token in ("recompute", "selective") else next(
            (a for k, a in knob.items() if token.startswith(k) and token[len(k):].isdigit()), None)
        out.append(token + ("*" if arg and arg not in fixed else ""))
    return " ".join(out)


def _published_ranks(plans: Sequence[Plan], tp: int, pp: int,
                     fixed: dict) -> tuple[int | None, int | None, int | None]:
    """``(split rank, plan rank, exact rank)`` of a published run in ranked ``plans`` (:class:`ValidationRow`): each
    tp × pp split counted once, at its fastest plan; equal step times share the first's position."""
    want = {k: v[0] for k, v in fixed.items()}

    def matches(layout: Layout) -> bool:
        have = {"micro_batches": layout.micro_batch, "interleave": layout.interleave,
                "zero1": layout.zero_stage == 1, "recompute": layout.recompute}
        return all(have[k] == v for k, v in want.items())

    def position(i: int) -> int:  # 0-based index -> 1-based position; equal step times share the first's
        while i > 0 and math.isclose(plans[i - 1].step_s, plans[i].step_s, rel_tol=1e-9):
            i -= 1
        return i + 1

    splits, split_rank, plan_rank, exact_rank = [], None, None, None
    for i, p in enumerate(plans):
        key = (p.layout.tp, p.layout.pp)
        if key not in splits:
            splits.append(key)
            if key == (tp, pp):
                split_rank, plan_rank = len(splits), position(i)
        if exact_rank is None and key == (tp, pp) and matches(p.layout):
            exact_rank = position(i)
        if split_rank is not None and exact_rank is not None:
            break
    return split_rank, plan_rank, exact_rank


def validation_summary(rows: Sequence[ValidationRow]) -> dict:
    """Counts over ``rows``: rows, median |error|, within 10 and 25 %, published split / plan / exact configuration
    in the top 5 (the last of the ``knobs_fixed`` rows).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no validation rows")
    errs = sorted(abs(r.error_pct) for r in rows)
    n = len(errs)
    median = errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2
    return {"rows": n, "median_abs_error_pct": median, "within_10": sum(e <= 10 for e in errs),
            "within_25": sum(e <= 25 for e in errs),
            "published_in_top5": sum(_top5(r.published_rank) for r in rows),
            "plan_in_top5": sum(_top5(r.plan_rank) for r in rows),
            "exact_in_top5": sum(_top5(r.exact_rank) for r in rows if r.knobs_fixed),
            "knobs_fixed": sum(r.knobs_fixed for r in rows)}


def _top5(rank: int | None) -> bool:
    return rank is not None and rank <= 5


def validation_table(rows: Sequence[ValidationRow]) -> str:
    """The rows as a fixed-width table (TFLOP/s per GPU, error %, the three ranks) and the summary lines."""
    wc = max([26] + [len(r.config) for r in rows])
    ws = max([27] + [len(r.software) for r in rows])
    wp = max([38] + [len(r.published) for r in rows])
    head = (f"{'config':<{wc}} {'software':<{ws}} {'published layout (*: chosen)':<{wp}} {'reported':>8} "
            f"{'predicted':>9} {'error %':>8} {'split':>5} {'plan':>5} {'exact':>5}  {'planner top layout':<34} "
            f"{'top TF/s':>8}")
    lines = [head, "-" * len(head)]
    show = lambda rank: "-" if rank is None else str(rank)  # noqa: E731
    for r in rows:
        flag = "" if r.within else "  (outside ±%d %%)" % WITHIN_PCT
        exact = show(r.exact_rank) if r.knobs_fixed else "n/a"
        lines.append(f"{r.config:<{wc}} {r.software:<{ws}} {r.published:<{wp}} {r.reported_tflops:>8.0f} "
                     f"{r.predicted_tflops:>9.0f} {r.error_pct:>+8.1f} {show(r.published_rank):>5} "
                     f"{show(r.plan_rank):>5} {exact:>5}  {r.planner_top:<34} {r.top_tflops:>8.0f}{flag}")
    if rows:
        s = validation_summary(rows)
        lines.append(f"median |error| {s['median_abs_error_pct']:.1f} % over {s['rows']} rows; within 10 %: "
                     f"{s['within_10']}, within 25 %: {s['within_25']}")
        lines.append(f"in the planner's top 5: the published split in {s['published_in_top5']} rows (each split "
                     f"counted once; {s['plan_in_top5']} counting every plan), the exact published configuration "
                     f"in {s['exact_in_top5']} of the {s['knobs_fixed']} rows that fix their knobs")
    return "\n".join(lines)
