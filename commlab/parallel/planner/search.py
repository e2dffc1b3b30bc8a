"""Search the TP × PP × DP layouts of a cluster for the fastest one that fits in memory, and check the
planner against published layouts.

:func:`search` enumerates tp over the divisors of ``devices_per_node`` (TP stays inside a node), pp over
the divisors of the layer count (or, by default, any pp up to it with uneven stages), dp = gpus/(tp·pp), micro-batch sizes, interleaving depths, ZeRO-1 on/off
and recomputation on/off; it rejects the layouts that do not fit in device memory (each with its reason)
or cannot split the global batch, and ranks the rest by predicted step time. A few thousand candidates
at most, each a handful of arithmetic operations, so a 16,384-GPU cluster is searched in well under a
second (the count does not grow with the GPU count, only with its divisors).

:func:`validate_published` evaluates the time model on the layouts of ``data/published_layouts.json``
(Megatron-LM SC'21 Table 1, Llama 3 405B) and runs the search for each, returning
:class:`ValidationRow` s: published layout, planner's top layout, predicted vs reported TFLOP/s per GPU.

Unlike the source article's ``optimal_3d_config`` (§4.2), this planner does not divide TP traffic by the
TP size, counts embeddings in the parameters, checks memory, and does not assume a fixed overlap.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Iterable, Sequence

from commlab.parallel.planner.memory import (Layout, MemoryBreakdown, ModelConfig, load_model,
                                             memory_breakdown)
from commlab.parallel.planner.time_model import (DEFAULT_ACHIEVABLE_FRACTION, TimeBreakdown, megatron_eq3_flops,
                                                 step_time)
from commlab.topology import Cluster, load_preset

__all__ = ["Plan", "Rejected", "SearchResult", "ValidationRow", "PUBLISHED_PATH", "divisors", "make_cluster",
           "search", "load_published", "validate_published", "validation_table", "WITHIN_PCT"]

#: Published layouts and throughputs: the repository's ``data/published_layouts.json``.
PUBLISHED_PATH = Path(__file__).resolve().parents[3] / "data" / "published_layouts.json"

#: The agreement the validation asks of the time model: predicted within this many percent of reported.
WITHIN_PCT = 25.0


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A layout that fits, with its memory (bytes per GPU) and time (seconds per step) breakdowns."""

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown

    @property
    def step_s(self) -> float:
        """Predicted step time, s."""
        return self.time.total_s

    def row(self) -> dict:
        """A flat dict for tables: layout, step and term times (s), memory (GB), tokens/s, TFLOP/s/GPU."""
        t, mem = self.time, self.memory
        return {"layout": self.layout.short(), "step_s": t.total_s, "compute_s": t.compute_s, "tp_s": t.tp_s,
                "pp_s": t.pp_s, "bubble_s": t.bubble_s, "dp_s": t.dp_exposed_s, "micro_batches": t.micro_batches,
                "memory_gb": mem.total_bytes / 1e9, "tokens_per_s": t.tokens_per_s,
                "tflops_per_gpu": t.model_flop_per_s_per_gpu / 1e12}


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A layout the search turned down: ``reason`` says why (``kind`` is ``"memory"`` or ``"batch"``)."""

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
    """

    plans: list[Plan]
    rejected: list[Rejected]
    candidates: int
    elapsed_s: float

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
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 or gpus % base.devices_per_node:
        raise ValueError(f"gpus={gpus!r} must be a positive multiple of devices_per_node="
                         f"{base.devices_per_node} of preset {base.name!r} (whole nodes), e.g. "
                         f"{max(1, (gpus if isinstance(gpus, int) else 0) // base.devices_per_node) * base.devices_per_node}")
    return dataclasses.replace(base, nodes=gpus // base.devices_per_node)


def search(model: ModelConfig | str, cluster: Cluster | str, gpus: int, global_batch: int, *,
           micro_batches: Sequence[int] = (1, 2, 4, 8), zero1: Sequence[bool] = (False, True),
           recompute: Sequence[bool] = (False, True), interleave: Sequence[int] = (1, 2, 4, 8),
           tp_values: Iterable[int] | None = None, pp_values: Iterable[int] | None = None,
           even_stages: bool = False, sequence_parallel: bool = True, flash_attention: bool = True,
           achievable_fraction: float = DEFAULT_ACHIEVABLE_FRACTION, dp_overlap: float = 0.0,
           usable_fraction: float = 1.0, grad_bytes: int = 2, dtype: str = "bf16") -> SearchResult:
    """Every layout of ``gpus`` GPUs for ``model``, the fitting ones ranked by predicted step time.

    Args:
        model: a :class:`ModelConfig` or a name in ``data/models.json``.
        cluster: a :class:`~commlab.topology.Cluster` or a preset name.
        gpus: GPUs to use; a multiple of ``devices_per_node``.
        global_batch: sequences per step.
        micro_batches, zero1, recompute, interleave: the values to try.
        tp_values: default the divisors of ``devices_per_node`` (TP inside a node); a value that does not
            divide it raises.
        pp_values: the pipeline sizes to try. Default: with ``even_stages`` the divisors of the layer count
            L; otherwise every pp <= L for which tp·pp divides ``gpus``, the heaviest stage holding
            ``ceil(L/(pp·v))·v`` layers (priced in both memory and time). Uneven stages are the default because
            GPU counts are powers of two and layer counts often are not: Llama 3 405B's 126 layers have no
            divisor between 9 and 14 or above 21 other than 42, 63, 126, and its training used pp = 16 with
            uneven stages (Llama 3 paper, §3.3.2).
        even_stages: restrict the default pp values to the divisors of L.
        sequence_parallel, flash_attention: what the training software does (see :class:`Layout`).
        achievable_fraction, dp_overlap, grad_bytes, dtype: passed to
            :func:`~commlab.parallel.planner.time_model.step_time`.
        usable_fraction: share of device memory the model may use (see ``MemoryBreakdown.fits``).

    Interleaving (v > 1) is tried only when pp > 1, ``v·pp <= L`` (and divides L with ``even_stages``) and
    the number of micro-batches is a multiple of pp (Narayanan et al. 2021, §2.2.2).

    Raises:
        KeyError: unknown model or preset.
        ValueError: ``gpus`` not a multiple of ``devices_per_node``; a tp value that would cross nodes; bad
            ``global_batch``.
    """
    started = time.perf_counter()
    m = load_model(model) if isinstance(model, str) else model
    c = make_cluster(cluster, gpus)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be an int >= 1 (sequences per step), got {global_batch!r}")
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
    memory_cap = usable_fraction * c.device_memory_bytes
    for tp in tps:
        for pp in pps:
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for b in micro_batches:
                for v in interleave:
                    if v > 1 and (pp == 1 or pp * v > m.layers or (even_stages and m.layers % (pp * v))):
                        continue
                    for z in zero1:
                        if z and dp == 1:
                            continue
                        for r in recompute:
                            layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=b, zero1=z, recompute=r, interleave=v,
                                            sequence_parallel=sequence_parallel, flash_attention=flash_attention)
                            candidates += 1
                            if global_batch % (dp * b):
                                rejected.append(Rejected(layout, "batch", f"global batch {global_batch} is not a "
                                                         f"multiple of dp·b = {dp}·{b}"))
                                continue
                            n_micro = global_batch // (dp * b)
                            if v > 1 and n_micro % pp:
                                rejected.append(Rejected(layout, "batch", f"interleaving needs the {n_micro} "
                                                         f"micro-batches to be a multiple of pp={pp}"))
                                continue
                            mem = memory_breakdown(m, layout, global_batch, grad_bytes)
                            if mem.total_bytes > memory_cap:
                                rejected.append(Rejected(layout, "memory", f"{layout.short()} needs "
                                                         f"{mem.total_bytes / 1e9:.1f} GB per GPU ({mem.stage} "
                                                         f"stage) > {memory_cap / 1e9:.1f} GB"))
                                continue
                            t = step_time(m, layout, c, global_batch, achievable_fraction, dp_overlap, dtype,
                                          grad_bytes)
                            plans.append(Plan(layout, mem, t))
    plans.sort(key=lambda p: (p.step_s, p.memory.total_bytes))
    rejected.sort(key=lambda r: r.kind != "memory")
    return SearchResult(plans, rejected, candidates, time.perf_counter() - started)


# ----------------------------------------------------------------------------------------- validation

def load_published(path: str | Path | None = None) -> dict[str, dict]:
    """The entries of ``data/published_layouts.json`` (keys starting with ``_`` dropped)."""
    with open(Path(path or PUBLISHED_PATH), encoding="utf-8") as f:
        table = json.load(f)
    return {k: v for k, v in table.items() if not k.startswith("_")}


@dataclasses.dataclass(frozen=True)
class ValidationRow:
    """One published run beside the planner.

    Attributes:
        config: the key in ``data/published_layouts.json``.
        published: its layout (``tp8 pp64 dp6``) and the micro-batch/interleaving/ZeRO/recomputation the
            planner chose for what the source does not report.
        planner_top: the planner's fastest layout for the same model, GPUs and batch.
        reported_tflops: the source's TFLOP/s per GPU (in its own accounting, ``accounting``).
        predicted_tflops: the time model's, for the published layout, in the same accounting.
        top_tflops: the time model's for the planner's top layout, same accounting.
        error_pct: (predicted - reported) / reported × 100.
        top_tp_within_node: the top layout's tp divides devices_per_node.
        published_step_s, top_step_s: predicted step times, s.
        accounting: ``"megatron-eq3"`` or ``"model"``.
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

    @property
    def within(self) -> bool:
        """``|error_pct| <= WITHIN_PCT``."""
        return abs(self.error_pct) <= WITHIN_PCT


def _flops_per_step(entry: dict, m: ModelConfig, plan: Plan) -> float:
    if entry.get("flop_accounting") == "megatron-eq3":
        return megatron_eq3_flops(m, entry["global_batch"])
    return plan.time.model_flop_per_step


def validate_published(achievable_fraction: float = DEFAULT_ACHIEVABLE_FRACTION, dp_overlap: float = 0.0,
                       path: str | Path | None = None) -> list[ValidationRow]:
    """The planner against every published run it can model (runs with context parallelism are skipped).

    For each run: the published tp, pp and dp are fixed, and whatever the source fixes besides (activation
    recomputation, sequence parallelism, FlashAttention, ZeRO); the search picks the rest (micro-batch,
    interleaving) and the fastest such plan is the "published layout" prediction. The unconstrained search
    with the same software gives the planner's top layout. Throughput is put in the source's own FLOP
    accounting: Megatron's Eq. 3 (which counts the recomputed forward) or model FLOP for Llama 3.

    One global ``achievable_fraction`` for all runs; nothing is fitted per run.
    """
    rows = []
    for key, e in load_published(path).items():
        if e.get("cp", 1) != 1:
            continue
        m = load_model(e["model"])
        if e.get("seq"):
            m = m.with_seq(e["seq"])
        common = dict(sequence_parallel=e.get("sequence_parallel", True),
                      flash_attention=e.get("flash_attention", True),
                      achievable_fraction=achievable_fraction, dp_overlap=dp_overlap)
        fixed = {}
        if "recompute" in e:
            fixed["recompute"] = (e["recompute"],)
        if "zero1" in e:
            fixed["zero1"] = (e["zero1"],)
        pub = search(m, e["preset"], e["gpus"], e["global_batch"], tp_values=[e["tp"]], pp_values=[e["pp"]],
                     **fixed, **common).best
        top = search(m, e["preset"], e["gpus"], e["global_batch"], **fixed, **common).best
        flops = _flops_per_step(e, m, pub)
        predicted = pub.time.flop_per_s_per_gpu(flops) / 1e12
        top_tf = top.time.flop_per_s_per_gpu(_flops_per_step(e, m, top)) / 1e12
        reported = float(e["tflops_per_gpu"])
        d = load_preset(e["preset"]).devices_per_node
        rows.append(ValidationRow(config=key, published=pub.layout.short(), planner_top=top.layout.short(),
                                  reported_tflops=reported, predicted_tflops=predicted, top_tflops=top_tf,
                                  error_pct=(predicted - reported) / reported * 100,
                                  top_tp_within_node=d % top.layout.tp == 0, published_step_s=pub.step_s,
                                  top_step_s=top.step_s, accounting=e.get("flop_accounting", "model")))
    return rows


def validation_table(rows: Sequence[ValidationRow]) -> str:
    """The rows as a fixed-width text table (TFLOP/s per GPU, error in %)."""
    head = (f"{'config':<26} {'published (+planner-chosen knobs)':<34} {'reported':>8} {'predicted':>9} "
            f"{'error %':>8}  {'planner top layout':<32} {'top TF/s':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = "" if r.within else "  (outside ±%d %%)" % WITHIN_PCT
        lines.append(f"{r.config:<26} {r.published:<34} {r.reported_tflops:>8.0f} {r.predicted_tflops:>9.0f} "
                     f"{r.error_pct:>+8.1f}  {r.planner_top:<32} {r.top_tflops:>8.0f}{flag}")
    return "\n".join(lines)
