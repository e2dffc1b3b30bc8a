"""The planner beside the measurement: what chapter 11's planner predicts for the capstone's own run.

After training (unless ``--no-plan``) every rank calibrates a cluster on the spot (:func:`calibrate_here`):
the slowest rank's GEMM rate at the model's largest matrix product (the denominator of the measured GEMM share,
the planner's peak at an achievable fraction of 1) and α-β of one ring step with every rank busy
(:func:`commlab.bench.calibrate.ring_exchange_here`), for every link. Rank 0 then prints (:func:`report`) the
planner's step for the layout that ran (:func:`predict`) beside the measured mean, and the layout its search
recommends among those the capstone can run (:func:`recommend`). Entry point: :func:`calibrate_and_report`.

The planner's bubble is ``(pp - 1) / m`` of the compute, TP and PP time, the measured one of the stage's busy
time; it prices TP and PP messages at 2 bytes per element (bfloat16), half a float32 run's. What it does not
model (per-operator overhead, more ranks than cores) is in chapter 14 §14.7.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from commlab.bench.calibrate import fit_alpha_beta, ring_exchange_here
from commlab.parallel.planner import Layout, TimeBreakdown, divisors, search, step_time
from commlab.topology import Cluster, Link

from labs.capstone.model import PARAM_DTYPE

__all__ = ["SIZES", "Calibration", "calibrate_here", "measured_cluster", "layout_of", "predict", "recommend",
           "report", "calibrate_and_report"]

#: Message sizes (bytes) of the α-β calibration: 4 KiB to 2 MiB, which covers the capstone's TP and PP
#: activations (16 KiB at the default config) and its DP gradient buckets.
SIZES = (4096, 32768, 262144, 2097152)

#: The planner's name of each dtype's peak (a key of ``Cluster.peak_flop_per_s``).
DTYPE_KEYS = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What was measured here.

    Attributes:
        alpha_s, beta_s_per_byte: one ring step's latency (s) and inverse bandwidth (s/byte); 0 for one rank.
        flop_per_s: the slowest rank's matrix-multiply rate at the model's largest GEMM, FLOP/s.
        world_size, local_world_size: ranks in all and per node.
    """

    alpha_s: float
    beta_s_per_byte: float
    flop_per_s: float
    world_size: int
    local_world_size: int


def calibrate_here(device: torch.device, flop_per_s: float, local_world_size: int) -> Calibration:
    """Measure α-β in the running process group, beside the GEMM rate ``flop_per_s`` the trainer measured;
    call it on every rank (collective). ``local_world_size``: ranks per node (the launcher's)."""
    world = dist.get_world_size()
    alpha = beta = 0.0
    if world > 1:
        fit = fit_alpha_beta(SIZES, ring_exchange_here(SIZES, rounds=3, device=device))
        alpha, beta = max(0.0, fit.alpha_s), max(0.0, fit.beta_s_per_byte)
    local = local_world_size if world % local_world_size == 0 else world
    return Calibration(alpha, beta, float(flop_per_s), world, local)


def _memory_bytes(device: torch.device, ranks_per_node: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks_per_node


def measured_cluster(cal: Calibration, dtype: str, device: torch.device) -> Cluster:
    """The planner's :class:`~commlab.topology.Cluster` of what :func:`calibrate_here` measured: one link type
    (the ring step's α and β) inside and across nodes, the measured rate as the peak of ``dtype``."""
    link = Link(cal.alpha_s, cal.beta_s_per_byte, name="ring step measured here")
    return Cluster(name="measured here", nodes=cal.world_size // cal.local_world_size,
                   devices_per_node=cal.local_world_size, nics_per_node=1, intra=link, inter=link,
                   device_memory_bytes=_memory_bytes(device, cal.local_world_size),
                   peak_flop_per_s={DTYPE_KEYS[dtype]: cal.flop_per_s},
                   description="calibrated by the capstone on the spot")


def layout_of(opts) -> Layout:
    """The planner's :class:`~commlab.parallel.planner.Layout` of the capstone's run (no sequence parallelism,
    no FlashAttention, no recomputation: what the capstone's layers do)."""
    return Layout(tp=opts.tp, pp=opts.pp, dp=opts.dp, micro_batch=opts.micro_batch, zero1=opts.zero1,
                  sequence_parallel=False, flash_attention=False)


def _itemsize(opts) -> int:
    """Bytes of one gradient element (the parameters' dtype)."""
    return PARAM_DTYPE[opts.dtype].itemsize


def predict(opts, cluster: Cluster) -> TimeBreakdown:
    """The planner's step for the run's layout: DP added after the pipeline's flush (pp > 1) or hidden behind
    the last backward as far as it can be (pp = 1, where the capstone overlaps it)."""
    return step_time(opts.model.planner_config(), layout_of(opts), cluster, opts.global_batch,
                     achievable_fraction=1.0, dp_overlap=1.0 if opts.pp == 1 else 0.0,
                     dtype=DTYPE_KEYS[opts.dtype], grad_bytes=_itemsize(opts))


def recommend(opts, cluster: Cluster):
    """The planner's fastest layout of the same model, world and global batch that the capstone can run, as a
    :class:`~commlab.parallel.planner.Plan` (ties: the least memory), or None if none fits or for float64,
    whose 8-byte gradients the planner's memory model does not know. DP is priced as the
    capstone runs it: hidden behind the last backward with pp = 1, after the flush with pp > 1 (two searches,
    since a search takes one ``dp_overlap``)."""
    if _itemsize(opts) not in (2, 4):
        return None
    c = opts.model
    world = cluster.world_size
    tps = [t for t in divisors(cluster.devices_per_node) if c.heads % t == 0 and c.ffn % t == 0]
    pps = [p for p in divisors(c.layers) if world % p == 0]
    micro = [b for b in divisors(opts.global_batch) if b <= 8]
    plans = []
    for pp_values, overlap in (([1], 1.0), ([p for p in pps if p > 1], 0.0)):
        if not pp_values:
            continue
        plans += search(c.planner_config(), cluster, world, opts.global_batch, micro_batches=micro, zero1=(False,),
                        recompute=(False,), interleave=(1,), tp_values=tps, pp_values=pp_values, even_stages=True,
                        sequence_parallel=False, flash_attention=False, achievable_fraction=1.0,
                        dp_overlap=overlap, grad_bytes=_itemsize(opts), dtype=DTYPE_KEYS[opts.dtype]).plans
    return min(plans, key=lambda p: (p.step_s, p.memory.total_bytes), default=None)


def report(opts, cal: Calibration, measured_s: float, predicted: TimeBreakdown, best) -> str:
    """Three lines: what was calibrated, predicted against measured, and the recommended layout."""
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    p = predicted
    link = (f"ring step alpha {cal.alpha_s * 1e6:.0f} us, 1/beta {1 / cal.beta_s_per_byte / 1e9:.2f} GB/s"
            if cal.world_size > 1 and cal.beta_s_per_byte > 0 else "no link (one rank)")
    lines = [f"planner, on a cluster measured here: {link}, GEMM {cal.flop_per_s / 1e9:.1f} GFLOP/s per rank",
             f"  predicted {ms(p.total_s)} ms for {layout_of(opts).short()} [compute {ms(p.compute_s)}, "
             f"TP {ms(p.tp_s)}, PP {ms(p.pp_s)}, bubble {ms(p.bubble_s)}, DP {ms(p.dp_exposed_s)} ms]; "
             f"measured {ms(measured_s)} ms; measured / predicted {measured_s / p.total_s:.2f}"]
    if best is None:
        lines.append("  recommended: none (" + ("the planner's memory model has no 8-byte gradients)"
                                                if _itemsize(opts) == 8 else "no layout of the model fits)"))
    else:
        L = best.layout
        m = opts.global_batch // (L.dp * L.micro_batch)
        lines.append(f"  recommended for {cal.world_size} rank(s) and {opts.global_batch} sequences per step: "
                     f"{L.short()} (predicted {ms(best.step_s)} ms): --tp {L.tp} --pp {L.pp} --dp {L.dp} "
                     f"--micro-batch {L.micro_batch} --micro-batches {m}")
    return "\n".join(lines)


def calibrate_and_report(opts, measured_s: float, flop_per_s: float, local_world_size: int,
                         device: torch.device) -> str | None:
    """Calibrate here (collective: call it on every rank) and return :func:`report`'s lines on rank 0, None on
    the others; ``measured_s``: the run's mean step (s), ``flop_per_s``: the GEMM rate the run measured."""
    cal = calibrate_here(device, flop_per_s, local_world_size)
    if dist.get_rank() != 0:
        return None
    cluster = measured_cluster(cal, opts.dtype, device)
    return report(opts, cal, measured_s, predict(opts, cluster), recommend(opts, cluster))
