"""Graders for lab 11: a layout's memory per GPU and its step time, as the planner computes them (chapter 11).

The learner writes

* ``memory_per_gpu(stage_params, tp, dp, zero1, activation_bytes)``: bytes per GPU of the stage holding
  ``stage_params`` parameters (before the tp split), bf16 mixed precision with Adam: 2 + 2 + 12 bytes per
  parameter of the 1/tp shard, the 12 split over dp with ZeRO-1, plus activations. Reference:
  :func:`commlab.parallel.planner.memory_breakdown` (``total_bytes``), for layouts of published models;
* ``step_seconds(compute_s, tp_s, pp_s, dp_s, pp, micro_batches, interleave)``: compute + TP + PP + bubble +
  DP, the bubble ``(pp - 1) / (interleave * micro_batches)`` of compute + TP + PP. Reference:
  :func:`commlab.parallel.planner.step_time` (``total_s``, DP not overlapped, no optimizer step), terms passed in.

A wrong answer is matched against the usual slips (tp split forgotten, ZeRO-1 on every byte, the bubble as a
share of the step, interleaving ignored, a term left out); how far off it is is said, the right number is not.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from commlab.arithmetic import ADAM_STATE_BYTES_PER_PARAM, MIXED_PRECISION_ADAM_BYTES_PER_PARAM
from commlab.exercises.report import CheckReport, grade_number
from commlab.parallel.planner import DEFAULT_ACHIEVABLE_FRACTION, Layout, load_model, memory_breakdown, step_time
from commlab.parallel.planner.search import make_cluster

__all__ = ["check_memory_per_gpu", "check_step_seconds", "planner_cases"]


@lru_cache(maxsize=1)
def planner_cases():
    """``(label, model, layout, global_batch, cluster)``: published layouts and variants of them (ZeRO-1 or
    not, recomputation or not, interleaving, a layout without a pipeline)."""
    llama, meg = load_model("llama3-405b"), load_model("megatron-18.4b")
    h100, a100 = make_cluster("dgx-h100-ndr", 16384), make_cluster("dgx-a100-hdr", 256)
    return [
        ("llama3-405b, tp8 pp16 dp128 b1 v4, ZeRO-1 + recompute", llama,
         Layout(tp=8, pp=16, dp=128, micro_batch=1, interleave=4, zero1=True, recompute=True), 2048, h100),
        ("llama3-405b, tp8 pp16 dp128 b1 v4, recompute", llama,
         Layout(tp=8, pp=16, dp=128, micro_batch=1, interleave=4, recompute=True), 2048, h100),
        ("megatron-18.4b, tp8 pp2 dp16 b1", meg, Layout(tp=8, pp=2, dp=16, micro_batch=1), 1024, a100),
        ("megatron-18.4b, tp4 pp1 dp64 b2, ZeRO-1 + recompute", meg,
         Layout(tp=4, pp=1, dp=64, micro_batch=2, zero1=True, recompute=True), 1024, a100),
        ("megatron-18.4b, tp2 pp8 dp16 b1 v2, ZeRO-1", meg,
         Layout(tp=2, pp=8, dp=16, micro_batch=1, interleave=2, zero1=True), 1024, a100),
    ]


def _memory_slips(p: float, tp: int, dp: int, zero1: bool, act: float) -> dict[str, float]:
    shard = p / tp
    opt = ADAM_STATE_BYTES_PER_PARAM / (dp if zero1 else 1)
    return {
        "the parameters were not split by tp: each GPU holds 1/tp of its stage's": (4 + opt) * p + act,
        "ZeRO-1 shards only the 12 bytes of optimizer state, not the weights and gradients":
            (MIXED_PRECISION_ADAM_BYTES_PER_PARAM / (dp if zero1 else 1)) * shard + act,
        "ZeRO-1 was ignored: it divides the optimizer's 12 bytes by dp":
            MIXED_PRECISION_ADAM_BYTES_PER_PARAM * shard + act,
        "the gradients (2 bytes per parameter) are missing": (2 + opt) * shard + act,
        "the activations are missing": (4 + opt) * shard,
        "the weights were counted in fp32 (4 bytes); mixed precision keeps bf16 weights and an fp32 copy in the "
        "optimizer's 12 bytes": (6 + opt) * shard + act,
    }


def check_memory_per_gpu(fn: Callable) -> CheckReport:
    """Grade ``fn(stage_params, tp, dp, zero1, activation_bytes) -> bytes per GPU``."""
    report = CheckReport(f"memory exercise ({getattr(fn, '__name__', 'fn')})")
    for label, model, layout, batch, _ in planner_cases():
        mb = memory_breakdown(model, layout, global_batch=batch)
        stage = mb.params * layout.tp  # the stage's parameters before the tp split
        args = (stage, layout.tp, layout.dp, layout.zero1, mb.activations_bytes)
        slips = {**_memory_slips(*args), "that is GB; return bytes": mb.total_bytes / 1e9}
        grade_number(report, label, fn, args, mb.total_bytes, slips, lambda got: f"{got / 1e9:.4g} GB")
        if report.not_attempted:
            return report
    return report


def _step_slips(c, tp, pp_s, dp, p, m, v) -> dict[str, float]:
    work = c + tp + pp_s
    return {
        "the bubble was taken as (p-1)/(v m + p - 1), its share of the step; here it is (p-1)/(v m) of the work":
            work + (p - 1) / (v * m + p - 1) * work + dp,
        "the interleaving was ignored: v chunks divide the bubble by v": work + (p - 1) / m * work + dp,
        "the bubble idles the whole per-micro-batch work, TP and PP included, not only the compute":
            work + (p - 1) / (v * m) * c + dp,
        "the bubble is missing": work + dp,
        "the DP AllReduce is missing (it is not overlapped here)": work + (p - 1) / (v * m) * work,
    }


def check_step_seconds(fn: Callable) -> CheckReport:
    """Grade ``fn(compute_s, tp_s, pp_s, dp_s, pp, micro_batches, interleave) -> seconds``; ``compute_s`` is passed
    as the planner's ``compute_s + loss_s``, the GPU's computation with the loss over the vocabulary."""
    report = CheckReport(f"step-time exercise ({getattr(fn, '__name__', 'fn')})")
    for label, model, layout, batch, cluster in planner_cases():
        t = step_time(model, layout, cluster, batch, DEFAULT_ACHIEVABLE_FRACTION)
        args = (t.compute_s + t.loss_s, t.tp_s, t.pp_s, t.dp_s, layout.pp, t.micro_batches, layout.interleave)
        grade_number(report, label, fn, args, t.total_s, _step_slips(*args), lambda got: f"{got:.4g} s")
        if report.not_attempted:
            return report
    return report
