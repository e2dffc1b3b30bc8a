"""Search the TP × PP × DP layouts of a cluster for the fastest one that fits in memory.

:func:`search` enumerates tp (divisors of the node), pp (uneven stages allowed), micro-batch, interleaving, the
ZeRO stages the profile offers (ZeRO-3 also as HSDP over 1, 2, 4, ... nodes) and recomputation, rejects what
does not fit or split the batch (with the reason), ranks the rest by the sum of terms and replays the first
places as timelines (:func:`~.timeline.rerank_by_timeline`: the replay decides). :func:`load_published` reads
the published runs :mod:`~.validation` checks. Book: chapter 11, §11.3."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Iterable, Sequence

from commlab import checks, data
from commlab.parallel.planner.memory import (DEFAULT_FRAGILE_MARGIN, DEFAULT_MEMORY_RESERVE, Layout,
                                             MemoryBreakdown, ModelConfig, is_fragile, load_model,
                                             memory_breakdown, usable_memory_bytes)
from commlab.parallel.planner.software import SoftwareProfile, load_software
from commlab.parallel.planner.time_model import AUTO, DEFAULT_ACHIEVABLE_FRACTION, TimeBreakdown, compute_model, step_time
from commlab.parallel.planner.timeline import rerank_by_timeline
from commlab.topology import Cluster, load_preset

__all__ = ["Plan", "Rejected", "SearchResult", "PUBLISHED_PATH", "TIMELINE_TOP_K", "divisors", "make_cluster",
           "search", "load_published"]

#: Published layouts and throughputs: ``published_layouts.json`` of the package data (:mod:`commlab.data`).
PUBLISHED_PATH = data.path("published_layouts.json")

#: Places of :func:`search`'s ranking that come from replayed timelines: twice the validation's "top 5", as the
#: sum and the replay differ by a few per cent (a plan sixth by the sum can replay first).
TIMELINE_TOP_K = 10


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A layout that fits, its memory (bytes per GPU) and time (seconds per step); ``fragile``: within the search's
    margin of usable memory; ``timeline_step_s``: the replayed step time of a top candidate, which then is its
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
        """FLOP/s per GPU at :attr:`step_s` for ``flop_per_step`` in some accounting."""
        return flop_per_step / self.step_s / self.time.gpus

    def row(self) -> dict:
        """A flat dict for tables: layout, step and term times (s), memory (GB), tokens/s, TFLOP/s per GPU."""
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
    """A layout the search turned down: ``kind`` ``"memory"``, ``"batch"`` or ``"heads"`` (tp does not divide the
    attention or KV heads), and the ``reason``."""

    layout: Layout
    kind: str
    reason: str


@dataclasses.dataclass
class SearchResult:
    """What :func:`search` found: ``plans`` (fastest first), ``rejected`` (memory first), ``candidates``,
    ``elapsed_s`` and ``compute_model`` (``"kernels"`` or the share of peak that priced compute)."""

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
        KeyError: unknown preset.
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
    """Every layout of ``gpus`` GPUs for ``model``, the fitting ones ranked by predicted step time (book §11.3):
    by the sum of terms, then the ``timeline_top`` fastest (and any plan that could still replay into those
    places) by their replayed timelines (0: the sum alone).

    ``micro_batches``, ``interleave``, ``zero1``, ``recompute``, ``tp_values``, ``pp_values``: the values tried
    (defaults: the profile's ZeRO stages with HSDP, ``none``/``full`` and the profile's policy, tp dividing the
    node, every pp with tp·pp dividing ``gpus``); ``even_stages``, ``sequence_parallel``, ``flash_attention``:
    the profile's unless given; the pricing arguments as :func:`~.time_model.step_time`; ``memory_reserve``
    (``usable_fraction`` = 1 - it) and ``fragile_margin`` in [0, 1).

    Raises:
        KeyError: unknown model or preset.
        ValueError: ``gpus`` not whole nodes; a tp crossing nodes; a bad batch, profile, policy, reserve or margin;
            ``timeline_top`` < 0.
    """
    started = time.perf_counter()
    checks.integer("timeline_top", timeline_top, least=0, note="plans to replay as timelines")
    sw = load_software(software)
    sequence_parallel = sw.sequence_parallel if sequence_parallel is None else sequence_parallel
    even_stages = sw.even_stages if even_stages is None else even_stages
    flash_attention = sw.flash_attention if flash_attention is None else flash_attention
    g_bytes = sw.grad_bytes if grad_bytes is None else grad_bytes
    stages = sw.zero_stages if zero1 is None else tuple(sorted({int(bool(z)) for z in zero1}))
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
                    # HSDP: shard groups of the DP ranks of 1, 2, 4, ... nodes (FSDP2's 2-D mesh, MiCS)
                    in_node = d // (tp * pp) if (tp * pp < d and d % (tp * pp) == 0) else 1
                    hsdp = [in_node << j for j in range(dp.bit_length()) if 1 < in_node << j < dp
                            and dp % (in_node << j) == 0]
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
    """The entries of ``commlab/data/published_layouts.json``, read once per path (do not change them)."""
    return data.load_table(path, "published_layouts.json")
