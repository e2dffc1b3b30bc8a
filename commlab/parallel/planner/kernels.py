"""Compute time of one GPU from its kernels: each GEMM at its measured efficiency for its shape, FlashAttention
at its measured speed, the memory-bound operations at the memory's bandwidth.

:func:`gemm_efficiency` (``commlab/data/gemm_efficiency.json``), :func:`attention_flop_per_s`
(``attention_speed.json``), :func:`layer_kernels` (one layer's GEMMs on a TP rank), :func:`effective_fraction`
(the layout's share of peak, for the step model), :func:`layer_seconds` and :func:`validate_layer_times`
(one layer against Korthikanti et al. 2022, Table 4), :func:`in_stack_share` (the stack's share of the
microbenchmark rates, from those layers). Nothing is fitted to end-to-end runs. Book: chapter 11, §11.7."""
from __future__ import annotations

import bisect
import dataclasses
import math
from functools import lru_cache
from pathlib import Path

from commlab import checks, data, hardware
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner.communication import backward_tp_hidden_seconds, op_times
from commlab.parallel.planner.counting import (attention_flops_per_token, memory_bound_bytes_per_token,
                                               tp_all_reduce_nbytes)
from commlab.parallel.planner.memory import Layout, ModelConfig, load_model
from commlab.parallel.planner.software import load_software
from commlab.topology import load_preset

__all__ = ["Gemm", "GemmTable", "load_gemm_table", "gemm_efficiency", "gemm_seconds", "attention_flop_per_s",
           "layer_kernels", "layer_seconds", "effective_fraction",
           "LAYER_TIMES_PATH", "LayerTimeRow", "validate_layer_times", "InStackShare", "in_stack_share",
           "kernel_model_gap"]

_GEMM = "gemm_efficiency.json"  # files of the package data (commlab.data)
_ATTENTION = "attention_speed.json"
_LAYER_TIMES = "published_layer_times.json"
#: Measured per-layer times (:func:`validate_layer_times`): ``published_layer_times.json`` of the package data.
LAYER_TIMES_PATH = data.path(_LAYER_TIMES)
_TILE = 4096  # the largest m the tables measure; a taller GEMM counts as a batch of 4096-row ones


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix product ``[b, m, k] @ [k, n]`` on one GPU: ``2·b·m·n·k`` FLOP. ``name`` says which."""

    name: str
    m: int
    n: int
    k: int
    b: int = 1

    @property
    def flop(self) -> float:
        return 2.0 * self.b * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True)
class GemmTable:
    """Measured GEMM efficiency (share of dense peak) of ``device`` on a grid: ``efficiency[(b, m, n, k)]`` for m = n
    = k in ``grid`` and b in ``batches``; ``scale``: the factor applied to another device's curve (1.0 for its own)."""

    device: str
    grid: tuple[int, ...]
    batches: tuple[int, ...]
    efficiency: dict
    scale: float
    source: str


def _peak(device: str, dtype: str) -> float:
    return hardware.value(device, f"{dtype}_dense_flop_per_s")


@lru_cache(maxsize=8)
def load_gemm_table(device: str, path: str | None = None) -> GemmTable:
    """The GEMM table of ``device`` in ``commlab/data/gemm_efficiency.json`` (or the file at ``path``).

    Raises:
        ValueError: no table for ``device`` (lists the devices there are).
    """
    table = data.load_table(path, _GEMM)
    if device not in table:
        raise ValueError(f"no GEMM efficiency table for device {device!r}; the table has {sorted(table)}")
    e = table[device]
    if "entries" in e:
        peak = _peak(device, e["dtype"])
        eff = {(b, m, n, k): f / peak for b, m, n, k, f in e["entries"]}
        scale = 1.0
    else:
        base = load_gemm_table(e["shape_curve_from"], path)
        scale = e["ceiling_flop_per_s"] / _peak(device, e["dtype"]) / max(base.efficiency.values())
        eff = {key: min(1.0, v * scale) for key, v in base.efficiency.items()}
    grid = tuple(sorted({key[1] for key in eff}))
    batches = tuple(sorted({key[0] for key in eff}))
    return GemmTable(device, grid, batches, eff, scale, e["source"] + (f"; {e['assumption']}" if "assumption" in e else ""))


def _bracket(grid: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Neighbours of x in ``grid`` and the weight of the upper one, in log2; clamped at the ends."""
    lx = math.log2(min(max(x, grid[0]), grid[-1]))
    i = bisect.bisect_left([math.log2(g) for g in grid], lx)
    if i == 0:
        return grid[0], grid[0], 0.0
    lo, hi = grid[i - 1], grid[min(i, len(grid) - 1)]
    if lo == hi:
        return lo, hi, 0.0
    return lo, hi, (lx - math.log2(lo)) / (math.log2(hi) - math.log2(lo))


def gemm_efficiency(table: GemmTable, m: int, n: int, k: int, b: int = 1) -> float:
    """Share of peak of a ``[b, m, k] @ [k, n]`` GEMM: the table interpolated in log2(m, n, k), a GEMM taller than
    4096 rows counted as a batch of 4096-row ones, everything clamped to the measured range.

    Raises:
        ValueError: a dimension that is not an int >= 1.
    """
    for name, v in (("m", m), ("n", n), ("k", k), ("b", b)):
        checks.integer(f"GEMM dimension {name}", v)
    if m > _TILE:
        b, m = b * m / _TILE, _TILE
    bb = min(table.batches, key=lambda x: abs(math.log2(x / b)))  # nearest measured batch (the ends beyond them)
    (m0, m1, wm), (n0, n1, wn), (k0, k1, wk) = (_bracket(table.grid, v) for v in (m, n, k))
    total = 0.0
    for mm, fm in ((m0, 1 - wm), (m1, wm)):
        for nn, fn in ((n0, 1 - wn), (n1, wn)):
            for kk, fk in ((k0, 1 - wk), (k1, wk)):
                w = fm * fn * fk
                if w:
                    total += w * table.efficiency[(bb, mm, nn, kk)]
    return total


def gemm_seconds(table: GemmTable, peak_flop_per_s: float, g: Gemm) -> float:
    """Seconds of GEMM ``g`` on a device of ``peak_flop_per_s`` whose efficiency curve is ``table``."""
    return g.flop / (peak_flop_per_s * gemm_efficiency(table, g.m, g.n, g.k, g.b))


def attention_flop_per_s(device: str, head_dim: int, seq: int, path: str | Path | None = None) -> float:
    """FLOP/s of causal FlashAttention-2, forward and backward, on ``device`` (``attention_speed.json``: the
    FlashAttention authors' measurement), interpolated in log2(seq) and linearly in head_dim, clamped to the
    measured range; FLOP as :func:`~.counting.attention_flops_per_token` counts them.

    Raises:
        ValueError: no measurement for ``device``; head_dim or seq not a positive int.
    """
    for name, v in (("head_dim", head_dim), ("seq", seq)):
        checks.integer(name, v)
    table = data.load_table(path, _ATTENTION)
    if device not in table:
        raise ValueError(f"no FlashAttention measurement for device {device!r}; the table has {sorted(table)}")
    e = table[device]
    grid = tuple(e["seq"])
    lo, hi, w = _bracket(grid, seq)
    dims = sorted(int(d) for d in e["causal"])

    def at(d: int) -> float:
        row = dict(zip(grid, e["causal"][str(d)]))
        return row[lo] + (row[hi] - row[lo]) * w  # w is the weight in log2(seq), as for the GEMM table

    d = min(max(head_dim, dims[0]), dims[-1])
    j = max(i for i, x in enumerate(dims) if x <= d)
    if dims[j] == d:
        return at(d)
    a, b = dims[j], dims[j + 1]
    return at(a) + (at(b) - at(a)) * (d - a) / (b - a)


def layer_kernels(m: ModelConfig, micro_batch: int, tp: int, flash_attention: bool = True) -> dict[str, list[Gemm]]:
    """One layer's GEMMs on one of ``tp`` ranks for one micro-batch: ``{"forward", "backward", "core_forward",
    "core_backward"}`` lists of :class:`Gemm`. Rows ``T = b·s``; QKV, attention output, the MLP's (two when gated)
    and its output, each with an input-gradient and a weight-gradient GEMM backward; the attention core as batched
    GEMMs without FlashAttention, else empty (:func:`effective_fraction` prices the fused kernel).

    Raises:
        ValueError: ``tp`` does not divide the attention heads.
    """
    if m.heads % tp:
        raise ValueError(f"tp={tp} does not divide the model's {m.heads} attention heads")
    T, h, d = micro_batch * m.seq, m.hidden, m.hidden // m.heads
    kv = m.kv_heads * d
    weights = [("qkv", -(-(h + 2 * kv) // tp), h), ("attention-out", h, h // tp)]
    weights += [("mlp-in", m.ffn // tp, h)] * (2 if m.gated_ffn else 1) + [("mlp-out", h, m.ffn // tp)]
    fwd = [Gemm(name, T, n, k) for name, n, k in weights]
    bwd = [g for name, n, k in weights for g in (Gemm(name + " dgrad", T, k, n), Gemm(name + " wgrad", k, n, T))]
    core_f, core_b = [], []
    if not flash_attention:
        heads = micro_batch * m.heads // tp
        s = m.seq
        core_f = [Gemm("scores", s, s, d, heads), Gemm("attend", s, d, s, heads)]
        core_b = [Gemm("scores dgrad q", s, d, s, heads), Gemm("scores dgrad k", s, d, s, heads),
                  Gemm("attend dgrad", s, s, d, heads), Gemm("attend wgrad", s, d, s, heads)]
    return {"forward": fwd, "backward": bwd, "core_forward": core_f, "core_backward": core_b}


def effective_fraction(m: ModelConfig, layout: Layout, device: str, peak_flop_per_s: float,
                       hbm_bytes_per_s: float, executed_flop_per_token: float) -> float:
    """Share of peak the layout's executed FLOP run at, from its kernels (book §11.7): ``executed_flop_per_token / tp``
    over the seconds per token of every layer's GEMMs, attention and memory-bound bytes (recomputation included)
    and the output layer, divided by :func:`in_stack_share`, over peak.

    Raises:
        ValueError: what :func:`layer_kernels`, :func:`load_gemm_table`, :func:`attention_flop_per_s` and
            :func:`in_stack_share` raise.
    """
    seconds_per_token = _seconds_per_token(m, layout.tp, layout.micro_batch, layout.recompute, layout.recompute_every,
                                           layout.sequence_parallel, layout.flash_attention, device, peak_flop_per_s,
                                           hbm_bytes_per_s)
    return executed_flop_per_token / layout.tp / (peak_flop_per_s * seconds_per_token)


def _layer_parts(m: ModelConfig, tp: int, micro_batch: int, sequence_parallel: bool, flash_attention: bool,
                 device: str, peak_flop_per_s: float, hbm_bytes_per_s: float) -> tuple[float, float, float, float]:
    """Seconds per token of one layer on one tp rank at the microbenchmarks' rates: ``(forward without the
    attention core, the core's forward, backward without the core, the core's backward)``, GEMMs and
    memory-bound bytes together."""
    table = load_gemm_table(device)
    ks = layer_kernels(m, micro_batch, tp, flash_attention)
    tokens = micro_batch * m.seq
    sec = {key: sum(gemm_seconds(table, peak_flop_per_s, g) for g in gs) / tokens for key, gs in ks.items()}
    if flash_attention:
        af, ab = attention_flops_per_token(m, True, True)
        rate = attention_flop_per_s(device, m.hidden // m.heads, m.seq)
        sec["core_forward"], sec["core_backward"] = af / tp / rate, ab / tp / rate
    mem_layer, mem_core = (b / hbm_bytes_per_s for b in
                           memory_bound_bytes_per_token(m, tp, sequence_parallel, flash_attention))
    return (sec["forward"] + mem_layer, sec["core_forward"] + mem_core, sec["backward"] + 2 * mem_layer,
            sec["core_backward"] + 2 * mem_core)


def layer_seconds(m: ModelConfig, tp: int, micro_batch: int, device: str, recompute: str = "none",
                  sequence_parallel: bool = False, flash_attention: bool = True,
                  share: float = 1.0) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one layer for one micro-batch on one of ``tp`` GPUs from its kernels alone;
    the backward includes what ``recompute`` reruns. ``share`` divides every kernel's time (1.0: the
    microbenchmarks' rates; ``in_stack_share(device).share``: the step model's).

    Raises:
        ValueError: ``recompute`` not none, selective or full; ``share`` not in (0, 1]; what the tables raise.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    checks.share("share", share, zero=False, note="the stack's share of the microbenchmark rates")
    parts = _layer_parts(m, tp, micro_batch, sequence_parallel, flash_attention, device,
                         _peak(device, "bf16"), hardware.value(device, "hbm_bytes_per_s"))
    forward, core, backward, core_backward = (x * micro_batch * m.seq / share for x in parts)
    rerun = {"full": forward + core, "selective": core}.get(recompute, 0.0)
    return forward + core, backward + core_backward + rerun


@lru_cache(maxsize=4096)  # a search asks for the same few (tp, micro-batch, policy) many times
def _seconds_per_token(m: ModelConfig, tp: int, micro_batch: int, recompute: str, recompute_every: int,
                       sequence_parallel: bool, flash_attention: bool, device: str, peak_flop_per_s: float,
                       hbm_bytes_per_s: float) -> float:
    forward, core, backward, core_backward = _layer_parts(m, tp, micro_batch, sequence_parallel, flash_attention,
                                                          device, peak_flop_per_s, hbm_bytes_per_s)
    table = load_gemm_table(device)
    tokens = micro_batch * m.seq
    rerun = {"full": 1.0, "every-k": 1.0 / recompute_every}.get(recompute, 0.0)
    layer_s = ((forward + core) * (1.0 + rerun) + (core if recompute == "selective" else 0.0)
               + backward + core_backward)
    out_s = 3 * gemm_seconds(table, peak_flop_per_s, Gemm("output", tokens, -(-m.vocab // tp), m.hidden)) / tokens
    return (m.layers * layer_s + out_s) / in_stack_share(device).share  # the stack's share of those rates


@dataclasses.dataclass(frozen=True)
class LayerTimeRow:
    """One measured layer against the kernel model, ms per layer and micro-batch: reported and predicted forward and
    backward (:func:`layer_seconds` at ``share=1`` plus the TP collectives the step model exposes, and their
    slowdown, which ``tp_*_ms`` give)."""

    entry: str
    experiment: str
    recompute: str
    sequence_parallel: bool
    reported_forward_ms: float
    reported_backward_ms: float
    predicted_forward_ms: float
    predicted_backward_ms: float
    tp_forward_ms: float
    tp_backward_ms: float

    @property
    def forward_error_pct(self) -> float:
        return (self.predicted_forward_ms - self.reported_forward_ms) / self.reported_forward_ms * 100

    @property
    def backward_error_pct(self) -> float:
        return (self.predicted_backward_ms - self.reported_backward_ms) / self.reported_backward_ms * 100


def _layer_time_entries(path: str | Path | None) -> dict:
    """The layer-time file's entries, each checked: ``{key: (entry, Cluster, ModelConfig, SoftwareProfile)}``.

    Raises:
        ValueError: not an object of entries; an entry with a field missing or unknown, a tp not dividing a
            node, no rows, or a time not > 0 (names the entry).
    """
    table = data.load_table(path, _LAYER_TIMES)  # a top level that is not an object: ValueError
    out = {}
    for key, e in table.items():
        try:
            missing = [f for f in ("model", "preset", "software", "tp", "micro_batch", "flash_attention", "rows")
                       if f not in e]
            if missing:
                raise ValueError(f"it has no {', '.join(missing)}")
            m, sw = load_model(e["model"]), load_software(e["software"])
            cluster = load_preset(e["preset"], nodes=1)
            tp = e["tp"]
            if not checks.is_int(tp) or tp < 1 or cluster.devices_per_node % tp:
                raise ValueError(f"tp={tp!r} does not divide a node of {e['preset']!r}")
            if not e["rows"]:
                raise ValueError("it has no rows")
            for r in e["rows"]:
                for f in ("forward_ms", "backward_ms"):
                    checks.number(f, r.get(f), above=0, note="ms", where=f"row {r.get('experiment')!r}")
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"layer-time entry {key!r}: {err}") from None
        out[key] = (e, cluster, m, sw)
    return out


def validate_layer_times(path: str | Path | None = None, device: str | None = None) -> list[LayerTimeRow]:
    """The kernel model against measured layer times (``published_layer_times.json``: Korthikanti et al. 2022,
    Table 4) at the microbenchmarks' own rates, each row with its TP collectives as :func:`~.communication.op_times`
    prices them. Nothing fitted. ``device``: only that GPU's entries (None: all).

    Raises:
        ValueError: a malformed entry (named); a row's unknown recomputation policy.
    """
    out = []
    for key, (e, cluster, m, sw) in _layer_time_entries(path).items():
        if device is not None and cluster.device != device:
            continue
        tp, b = e["tp"], e["micro_batch"]
        table, peak = load_gemm_table(cluster.device), _peak(cluster.device, "bf16")
        one = ring_all_reduce_seconds(tp_all_reduce_nbytes(m, b), tp, cluster.intra.alpha_s,
                                      cluster.intra.beta_s_per_byte)
        ks = layer_kernels(m, b, tp, e["flash_attention"])
        wgrad = tuple(sum(gemm_seconds(table, peak, g) for g in ks["backward"] if g.name == name)
                      for name in ("qkv wgrad", "mlp-in wgrad"))  # a gated MLP's two first linears together
        for r in e["rows"]:
            sp = r.get("sequence_parallel", False)
            try:
                fwd, bwd = layer_seconds(m, tp, b, cluster.device, r.get("recompute", "none"), sp,
                                         e["flash_attention"])
            except ValueError as err:
                raise ValueError(f"layer-time entry {key!r}, row {r.get('experiment')!r}: {err}") from None
            overlap_tp, slow = (sw.overlap_tp if sp else 0.0), sw.overlap_compute_slowdown
            # The time model's rule for one op (op_times): what hides still slows the compute beside it.
            f = op_times(fwd, 2 * one, overlap_tp * 2 * one, slowdown=slow)
            tp_f = f.tp_exposed_s + f.slowdown_s
            b_ = op_times(bwd, 2 * one, backward_tp_hidden_seconds(one, sp, overlap_tp, sw.overlap_tp_backward, wgrad,
                                                                   slow), slowdown=slow)
            tp_b = b_.tp_exposed_s + b_.slowdown_s + (tp_f if r.get("recompute") == "full" else 0.0)
            out.append(LayerTimeRow(key, r.get("experiment", ""), r.get("recompute", "none"), sp, r["forward_ms"],
                                    r["backward_ms"], (fwd + tp_f) * 1e3, (bwd + tp_b) * 1e3, tp_f * 1e3,
                                    tp_b * 1e3))
    return out


@dataclasses.dataclass(frozen=True)
class InStackShare:
    """The share (0, 1] of the microbenchmark rates a stack's kernels run at on ``device``, ``measured_on`` that GPU;
    ``ratios``: each measured number's kernel-over-measured ratio (their spread says how well one share fits)."""

    device: str
    share: float
    measured_on: str
    ratios: tuple[float, ...]
    source: str


@lru_cache(maxsize=8)
def in_stack_share(device: str, path: str | None = None) -> InStackShare:
    """The stack's share of the microbenchmark rates on ``device``: ``sum(kernel s) / sum(measured - TP s)`` over the
    measured layers on it (:func:`validate_layer_times`), or the share of the GPU its ``gemm_efficiency.json`` entry
    names in ``in_stack_share_from`` (an assumption the entry states).

    Raises:
        ValueError: no measured layer on ``device`` or the GPU it names; a measured time not above its TP time; a
            share above 1; a malformed entry.
    """
    rows = validate_layer_times(path, device)
    if rows:
        return _measured_share(device, rows, path)
    entry = data.load_table(None, _GEMM).get(device)
    other = (entry or {}).get("in_stack_share_from")
    where = (f"no GEMM table for {device!r}" if entry is None
             else f"its entry in {_GEMM} names no 'in_stack_share_from'")
    if other is None or other == device:
        raise ValueError(f"no measured layer times on {device!r} and {where}: the kernel model has no share of "
                         f"the microbenchmark rates for it (add a measured layer to "
                         f"{(Path(path) if path else LAYER_TIMES_PATH).name}, or name a GPU with one in 'in_stack_share_from')")
    rows = validate_layer_times(path, other)
    if not rows:
        raise ValueError(f"{device!r} takes its share from {other!r} ('in_stack_share_from'), which has no "
                         f"measured layer times either")
    base = _measured_share(other, rows, path)
    assumption = entry.get("in_stack_assumption", f"assumption: the share measured on {other}")
    return InStackShare(device, base.share, base.measured_on, base.ratios, f"{base.source.rstrip('.')}; {assumption}")


def _measured_share(device: str, rows: list[LayerTimeRow], path: str | None) -> InStackShare:
    """:func:`in_stack_share` from the measured layers ``rows`` on ``device`` (see there; same errors)."""
    kernel, measured, ratios = 0.0, 0.0, []
    for r in rows:
        for pred, rep, tp in ((r.predicted_forward_ms, r.reported_forward_ms, r.tp_forward_ms),
                              (r.predicted_backward_ms, r.reported_backward_ms, r.tp_backward_ms)):
            if rep <= tp:
                raise ValueError(f"layer-time entry {r.entry!r} ({r.experiment}): measured {rep} ms is not more "
                                 f"than its modelled TP collectives ({tp:.3f} ms)")
            kernel += pred - tp
            measured += rep - tp
            ratios.append((pred - tp) / (rep - tp))
    share = kernel / measured
    if share > 1:
        raise ValueError(f"the measured layers on {device!r} give a share of {share:.3f} of the microbenchmark "
                         f"rates, outside (0, 1]: the kernel model would run the stack faster than its microbenchmarks")
    entries = data.load_table(path, _LAYER_TIMES)
    sources = "; ".join(sorted({entries[k].get("source", k) for k in {r.entry for r in rows}}))
    return InStackShare(device, share, device, tuple(ratios), sources)


@lru_cache(maxsize=16)
def kernel_model_gap(device: str, dtype: str = "bf16") -> str | None:
    """Why the kernel model cannot price ``dtype`` on ``device`` (None: it can): it needs a GEMM table in that dtype,
    a FlashAttention speed, ``hbm_bytes_per_s`` and :func:`in_stack_share`."""
    tables = data.load_table(None, _GEMM)
    entry = tables.get(device)
    if entry is None:
        return f"no GEMM table for {device!r} in {_GEMM}"
    base = entry if "entries" in entry else tables.get(entry.get("shape_curve_from"), {})
    if base.get("dtype") != dtype:
        return f"the GEMM table of {device!r} is in {base.get('dtype')}, not {dtype}"
    if device not in data.load_table(None, _ATTENTION):
        return f"no FlashAttention measurement for {device!r} in {_ATTENTION}"
    try:
        hardware.value(device, "hbm_bytes_per_s")
    except (KeyError, ValueError):
        return f"no memory bandwidth (hbm_bytes_per_s) for {device!r} in hardware.json"
    try:
        in_stack_share(device)
    except ValueError as err:
        return str(err)
    return None
