"""Search the TP × PP × DP layouts of a cluster for the fastest one that fits in memory, and check the
planner against published layouts.

:func:`search` enumerates tp (divisors of the node), pp (uneven stages allowed), micro-batch, interleaving,
ZeRO stage and recomputation policy for one software profile, rejects what does not fit or cannot split the
global batch (each with its reason), and ranks the rest by step time: the sum of terms, then the replayed
timelines of the first places (:func:`~.timeline.rerank_by_timeline`). It returns a :class:`SearchResult`
of :class:`Plan` s; a 16,384-GPU cluster is searched in well under a second.
:func:`validate_published` runs the time model and the search on ``commlab/data/published_layouts.json`` and
returns :class:`ValidationRow` s (``python -m commlab plan --validate``).

Book: chapter 11, §11.3 (the search), §11.4 (the validation), §11.5 (against the source article's
``optimal_3d_config``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Iterable, Sequence

from commlab import checks, data
from commlab.parallel.planner.memory import (DEFAULT_FRAGILE_MARGIN, DEFAULT_MEMORY_RESERVE, Layout,
                                             MemoryBreakdown, ModelConfig, is_fragile, load_model,
                                             memory_breakdown, usable_memory_bytes)
from commlab.parallel.planner.software import SoftwareProfile, check_recompute_policy, load_software
from commlab.parallel.planner.counting import model_flops_per_step
from commlab.parallel.planner.time_model import AUTO, DEFAULT_ACHIEVABLE_FRACTION, TimeBreakdown, compute_model, step_time
from commlab.parallel.planner.timeline import rerank_by_timeline
from commlab.topology import Cluster, load_preset

__all__ = ["Plan", "Rejected", "SearchResult", "ValidationRow", "PUBLISHED_PATH", "TIMELINE_TOP_K", "divisors",
           "make_cluster",
           "search", "load_published", "validate_published", "validation_table", "validation_summary", "WITHIN_PCT"]

#: Published layouts and throughputs: ``published_layouts.json`` of the package data (:mod:`commlab.data`).
PUBLISHED_PATH = data.path("published_layouts.json")

#: How many places of :func:`search`'s ranking come from replayed step timelines: 10, twice the "top 5" in
#: which the validation looks for published layouts, because the sum of terms and the replay disagree by a
#: few per cent on the interleaving and the micro-batch (a plan sixth by the sum can replay first); the search
#: replays the 10 fastest by the sum and then each next one that could still replay into them
#: (:func:`~.timeline.rerank_by_timeline`); a replay costs milliseconds, the analytical form microseconds.
TIMELINE_TOP_K = 10

#: The agreement the validation asks of the time model: predicted within this many percent of reported.
WITHIN_PCT = 25.0


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A layout that fits, with its memory (bytes per GPU) and time (seconds per step) breakdowns;
    ``fragile``: its memory is within the search's ``fragile_margin`` of the usable limit
    (:func:`~commlab.parallel.planner.memory.is_fragile`); for the top candidates of a search, the step time
    of its replayed timeline (:func:`~commlab.parallel.planner.timeline.step_timeline`), which then is its
    step time."""

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    fragile: bool = False
    timeline_step_s: float | None = None

    @property
    def step_s(self) -> float:
        """Predicted step time, s: the timeline's where it was replayed, else the analytical sum of terms."""
        return self.time.total_s if self.timeline_step_s is None else self.timeline_step_s

    def flop_per_s_per_gpu(self, flop_per_step: float) -> float:
        """FLOP/s per GPU at :attr:`step_s`, given the FLOP per step in some accounting."""
        return flop_per_step / self.step_s / self.time.gpus

    def row(self) -> dict:
        """A flat dict for tables: layout, step and term times (s; ``loss_s`` the cross-entropy over the vocabulary,
        ``slowdown_s`` what hidden communication adds by slowing compute, ``optimizer_s`` the optimizer step),
        memory (GB), tokens/s, TFLOP/s/GPU."""
        t, mem = self.time, self.memory
        return {"layout": self.layout.short(), "step_s": self.step_s, "analytical_step_s": t.total_s,
                "compute_s": t.compute_s, "loss_s": t.loss_s, "tp_s": t.tp_s,
                "pp_s": t.pp_s, "bubble_s": t.bubble_s, "dp_s": t.dp_exposed_s, "slowdown_s": t.overlap_slowdown_s,
                "optimizer_s": t.optimizer_s, "micro_batches": t.micro_batches,
                "memory_gb": mem.total_bytes / 1e9, "fragile": self.fragile,
                "tokens_per_s": t.tokens_per_step / self.step_s,
                "tflops_per_gpu": self.flop_per_s_per_gpu(t.model_flop_per_step) / 1e12}


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A layout the search turned down: ``reason`` says why (``kind`` is ``"memory"``, ``"batch"``, or
    ``"heads"`` where tp does not divide the attention heads or the KV heads, which Megatron-LM asserts and the
    kernel model needs: each rank holds whole heads and whole query groups)."""

    layout: Layout
    kind: str
    reason: str


@dataclasses.dataclass
class SearchResult:
    """What :func:`search` found.

    Attributes:
        plans: layouts that fit, fastest first.
        rejected: layouts turned down, with reasons (memory first).
        candidates: layouts considered.
        elapsed_s: wall time of the search, s.
        compute_model: what priced compute (:func:`~.time_model.compute_model` of the ``achievable_fraction``
            asked for): ``"kernels"`` or the share of peak.
    """

    plans: list[Plan]
    rejected: list[Rejected]
    candidates: int
    elapsed_s: float
    compute_model: float | str = DEFAULT_ACHIEVABLE_FRACTION

    @property
    def rejected_for_memory(self) -> int:
        """How many layouts did not fit in device memory."""
        return sum(r.kind == "memory" for r in self.rejected)

    @property
    def best(self) -> Plan:
        """The fastest plan. Raises ValueError when nothing fits (the message gives the smallest need)."""
        if not self.plans:
            mem = [r.reason for r in self.rejected if r.kind == "memory"]
            hint = f"; e.g. {mem[0]}" if mem else ""
            raise ValueError(f"no layout fits: {self.rejected_for_memory} rejected for memory, "
                             f"{len(self.rejected) - self.rejected_for_memory} for the batch{hint}")
        return self.plans[0]


def make_cluster(preset: str | Cluster, gpus: int) -> Cluster:
    """The preset's node type with ``gpus / devices_per_node`` nodes.

    Raises:
        KeyError: unknown preset (the message lists the known ones).
        ValueError: ``gpus`` not a positive multiple of ``devices_per_node``.
    """
    base = preset if isinstance(preset, Cluster) else load_preset(preset, nodes=1)
    if not checks.is_int(gpus) or gpus < 1 or gpus % base.devices_per_node:
        raise ValueError(f"gpus={gpus!r} must be a positive multiple of devices_per_node="
                         f"{base.devices_per_node} of preset {base.name!r} (whole nodes), e.g. "
                         f"{max(1, (gpus if isinstance(gpus, int) else 0) // base.devices_per_node) * base.devices_per_node}")
    return dataclasses.replace(base, nodes=gpus // base.devices_per_node)


def search(model: ModelConfig | str, cluster: Cluster | str, gpus: int, global_batch: int, *,
           micro_batches: Sequence[int] = (1, 2, 4, 8), zero1: Sequence[bool] | None = None,
           recompute: Sequence[bool | str] | None = None, interleave: Sequence[int] = (1, 2, 4, 8),
           tp_values: Iterable[int] | None = None, pp_values: Iterable[int] | None = None,
           even_stages: bool | None = None, sequence_parallel: bool | None = None, flash_attention: bool | None = None,
           achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
           usable_fraction: float | None = None, grad_bytes: int | None = None, dtype: str = "bf16",
           software: SoftwareProfile | str | None = None, memory_reserve: float = DEFAULT_MEMORY_RESERVE,
           fragile_margin: float = DEFAULT_FRAGILE_MARGIN, timeline_top: int = TIMELINE_TOP_K) -> SearchResult:
    """Every layout of ``gpus`` GPUs for ``model``, the fitting ones ranked by predicted step time.

    Ranked analytically; the ``timeline_top`` fastest (and any plan that could still replay into those
    places) are replayed as step timelines (:func:`~.timeline.rerank_by_timeline`) and re-ranked
    (``timeline_top=0``: analytical only). Book: chapter 11, §11.3.

    Args:
        model, cluster: a :class:`ModelConfig` / :class:`~commlab.topology.Cluster` or a name.
        gpus: a multiple of ``devices_per_node``. global_batch: sequences per step.
        micro_batches, interleave, zero1, recompute, tp_values, pp_values: the values to try; defaults: every
            ZeRO stage up to the profile's (with HSDP inside a node under ZeRO-3), ``none``/``full`` plus the
            profile's recompute policy, tp dividing ``devices_per_node``, every pp <= L with tp·pp dividing
            ``gpus`` (divisors of L with ``even_stages``); v > 1 only when pp > 1 and it fits L and m.
        even_stages, sequence_parallel, flash_attention: default the software profile's (see :class:`Layout`).
        achievable_fraction, dp_overlap, grad_bytes, dtype: passed to :func:`~.time_model.step_time`.
        software: a :class:`~.software.SoftwareProfile` or a name (default :data:`~.software.DEFAULT_SOFTWARE`).
        memory_reserve: share of device memory kept free, in [0, 1) (default 10 %); ``usable_fraction`` is
            the older spelling of ``1 - memory_reserve``.
        fragile_margin: plans within this share of usable memory are marked ``fragile`` (default 5 %).
        timeline_top: how many of the fastest plans to replay (int >= 0).

    Raises:
        KeyError: unknown model or preset.
        ValueError: ``gpus`` not a multiple of ``devices_per_node``; a tp crossing nodes; bad ``global_batch``;
            unknown software profile or recompute policy; reserve or margin outside [0, 1); ``timeline_top`` < 0.
    """
    started = time.perf_counter()
    checks.integer("timeline_top", timeline_top, least=0, note="plans to replay as timelines")
    sw = load_software(software)
    sequence_parallel = sw.sequence_parallel if sequence_parallel is None else sequence_parallel
    even_stages = sw.even_stages if even_stages is None else even_stages
    flash_attention = sw.flash_attention if flash_attention is None else flash_attention
    g_bytes = sw.grad_bytes if grad_bytes is None else grad_bytes
    stages = tuple(range(sw.zero_stage + 1)) if zero1 is None else tuple(sorted({int(bool(z)) for z in zero1}))
    if recompute is None:
        recompute = ("none", "full") + ((sw.recompute,) if sw.recompute not in ("none", "full") else ())
    m = load_model(model) if isinstance(model, str) else model
    c = make_cluster(cluster, gpus)
    achievable_fraction = compute_model(achievable_fraction, c.device, dtype)  # "auto" resolved once
    checks.integer("global_batch", global_batch, note="sequences per step")
    d = c.devices_per_node
    tps = divisors(d) if tp_values is None else sorted(set(tp_values))
    bad = [t for t in tps if d % t]
    if bad:
        raise ValueError(f"tp values {bad} do not divide devices_per_node={d}: tensor parallelism must stay "
                         f"inside a node (choose from {divisors(d)})")
    if pp_values is not None:
        pps = sorted(set(pp_values))
    elif even_stages:
        pps = divisors(m.layers)
    else:
        pps = [p for p in range(1, m.layers + 1) if gpus % p == 0]
    plans: list[Plan] = []
    rejected: list[Rejected] = []
    candidates = 0
    if usable_fraction is not None:
        if not 0 < usable_fraction <= 1:
            raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction!r}")
        memory_reserve = 1.0 - usable_fraction
    memory_cap = usable_memory_bytes(c.device_memory_bytes, memory_reserve)
    is_fragile(0.0, memory_cap, fragile_margin)  # checks the margin before the loop
    for tp in tps:
        for pp in pps:
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for b in micro_batches:
                for v in interleave:
                    if v > 1 and (pp == 1 or pp * v > m.layers or (even_stages and m.layers % (pp * v))):
                        continue
                    in_node = d // (tp * pp) if (tp * pp < d and d % (tp * pp) == 0) else 1
                    hsdp = (in_node,) if 1 < in_node < dp and dp % in_node == 0 else ()
                    for z, shard in [(z, None) for z in stages] + [(3, k) for k in hsdp if 3 in stages]:
                        if z and dp == 1:
                            continue
                        for r in recompute:
                            layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=b, zero_stage=z, recompute=r,
                                            interleave=v, sequence_parallel=sequence_parallel,
                                            flash_attention=flash_attention, recompute_every=sw.recompute_every,
                                            dp_shard=shard)
                            candidates += 1
                            if m.heads % tp or m.kv_heads % tp:
                                rejected.append(Rejected(layout, "heads", f"tp={tp} does not divide the model's "
                                                         f"{m.heads} attention heads and {m.kv_heads} KV heads"))
                                continue
                            if global_batch % (dp * b):
                                rejected.append(Rejected(layout, "batch", f"global batch {global_batch} is not a "
                                                         f"multiple of dp·b = {dp}·{b}"))
                                continue
                            n_micro = global_batch // (dp * b)
                            if v > 1 and n_micro % pp:
                                rejected.append(Rejected(layout, "batch", f"interleaving needs the {n_micro} "
                                                         f"micro-batches to be a multiple of pp={pp}"))
                                continue
                            mem = memory_breakdown(m, layout, global_batch, g_bytes, optimizer=sw.optimizer)
                            if mem.total_bytes > memory_cap:
                                rejected.append(Rejected(layout, "memory", f"{layout.short()} needs "
                                                         f"{mem.total_bytes / 1e9:.1f} GB per GPU ({mem.stage} "
                                                         f"stage) > {memory_cap / 1e9:.1f} GB"))
                                continue
                            t = step_time(m, layout, c, global_batch, achievable_fraction, dp_overlap, dtype,
                                          g_bytes, sw)
                            plans.append(Plan(layout, mem, t, is_fragile(mem.total_bytes, memory_cap, fragile_margin)))
    plans.sort(key=lambda p: (p.step_s, p.memory.total_bytes))
    plans = rerank_by_timeline(plans, timeline_top, m, c, global_batch, sw, achievable_fraction, dp_overlap, dtype,
                               g_bytes)
    rejected.sort(key=lambda r: r.kind != "memory")
    return SearchResult(plans, rejected, candidates, time.perf_counter() - started, achievable_fraction)


# ----------------------------------------------------------------------------------------- validation

def load_published(path: str | Path | None = None) -> dict[str, dict]:
    """The entries of ``commlab/data/published_layouts.json`` (keys starting with ``_`` dropped), read once per path
    like the planner's other tables (:func:`commlab.data.load_table`): do not change them."""
    return data.load_table(path, "published_layouts.json")


@dataclasses.dataclass(frozen=True)
class ValidationRow:
    """One published run beside the planner.

    Attributes:
        config, software: the key in ``commlab/data/published_layouts.json`` and the software profile named.
        published: its layout with its knobs (``tp8 pp64 dp6 b1 recompute``), ``*`` on each knob the planner
            chose because the source does not report it (``b1*``).
        planner_top: the planner's fastest layout for the same model, GPUs, batch and software.
        reported_tflops, predicted_tflops, top_tflops: TFLOP/s per GPU in the source's FLOP definition
            (``accounting``, a key of :data:`~.time_model.FLOP_DEFINITIONS`): reported (or derived from its
            ``iteration_s``), predicted for the published layout at :attr:`Plan.step_s`, and for the top one.
        error_pct: (predicted - reported) / reported × 100.
        top_tp_within_node: the top layout's tp divides devices_per_node.
        published_step_s, top_step_s: predicted step times, s.
        published_rank: rank of the published tp × pp × dp split among the planner's splits (1 = the top
            plan's split; None = none fits).
        exact_rank: rank of the published configuration, every knob the source fixes (None: does not fit).
        plan_rank: rank of the first plan of the published split among all plans.
        knobs_fixed: the source fixes micro-batch or interleaving (else ``exact_rank`` prints ``n/a``).
        published_time: the analytical breakdown of the published plan (seconds per term).

    Ranks are positions in the planner's ranking (:func:`~.timeline.rerank_by_timeline`); equal step times
    share the position of the first.
    """

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


#: The micro-batches and interleaving depths the validation's searches try, the same for every row: the
#: planner's defaults plus what Megatron-LM's Table 1 script uses (micro-batch 16; v = 3 for 76.1B and 529.6B),
#: so that every published configuration is among the candidates of its own row and of every other.
VALIDATION_MICRO_BATCHES = (1, 2, 4, 8, 16)
VALIDATION_INTERLEAVE = (1, 2, 3, 4, 8)


def validate_published(achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
                       path: str | Path | None = None) -> list[ValidationRow]:
    """The planner against every published run it can model (runs with context parallelism are skipped).

    For each run: the software profile it names (``software``, a key of ``commlab/data/software.json``) sets what
    the stack overlaps and how; the published tp, pp and dp are fixed, and whatever the source fixes besides
    (activation recomputation, ZeRO, ``micro_batch``, ``interleave``); the search picks the rest and the
    fastest such plan is the "published layout" prediction. The unconstrained search with the same software
    (every knob free, recomputation and ZeRO included) gives the planner's top layout and the ranks of
    :class:`ValidationRow`. Both searches try :data:`VALIDATION_MICRO_BATCHES` and
    :data:`VALIDATION_INTERLEAVE` for every row. Throughput is put in the source's own FLOP definition
    (``flop_accounting``).

    One compute model for all runs (default :data:`~.time_model.AUTO`: the kernel model, which every row's
    GPU has; or one global ``achievable_fraction``); nothing is fitted per run.

    Raises:
        ValueError: a row names an unknown software profile or FLOP definition; a row's ``micro_batch`` or
            ``interleave`` is not one of the values above, or it fixes a ZeRO stage or recomputation policy
            that its profile's search does not try; the published configuration does not fit or does not
            split the batch (the message names the row, its fixed knobs and the search's reason).
    """
    rows = []
    for key, e in load_published(path).items():
        if e.get("cp", 1) != 1:
            continue
        m = load_model(e["model"])
        if e.get("seq"):
            m = m.with_seq(e["seq"])
        sw = load_software(e.get("software"))
        common = dict(achievable_fraction=achievable_fraction, dp_overlap=dp_overlap, software=sw)
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
    """The row's TFLOP/s per GPU: ``tflops_per_gpu`` as the source prints it, or, where the source gives its
    iteration time instead (``iteration_s``, seconds), its FLOP per step in its definition / that time / GPUs.

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
        if e["zero1"] and sw.zero_stage < 1:
            raise ValueError(f"published row {key!r}: zero1 is true but software {sw.name!r} has zero_stage 0")
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
    """``(split rank, plan rank, exact rank)`` of a published run in a ranked list of plans (see
    :class:`ValidationRow`; None: not among them).

    The split rank counts each tp × pp split once, at its first (fastest) plan: five variants of the top
    split (micro-batch, interleaving, recomputation) do not push the second-best split to rank 6. The plan
    rank is that first plan's position among all plans, the exact rank the position of the first plan with
    every fixed knob; plans with the same step time share the position of the first of them.
    """
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
    """``{"rows", "median_abs_error_pct", "within_10", "within_25", "published_in_top5", "plan_in_top5",
    "exact_in_top5", "knobs_fixed"}`` of ``rows``: the rows whose published split ranks in the planner's top
    5 counting each split once, and counting every plan; of the ``knobs_fixed`` rows whose knobs the source
    fixes, those whose exact published configuration does (see :class:`ValidationRow`).

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
    """The rows as a fixed-width text table (TFLOP/s per GPU, error in %, the three ranks of
    :class:`ValidationRow`), and a closing summary line (:func:`validation_summary`). In the published
    layout a ``*`` marks each knob the planner chose because the source does not give it."""
    # The name columns are as wide as their longest entry, so that long row and profile names keep the
    # numbers aligned.
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
