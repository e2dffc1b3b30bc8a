"""Grader for lab 14: the tokens and model FLOPs of one capstone step, the numerator of its tokens/s and MFU.

The learner writes ``step_budget(model, tp, pp, dp, micro_batch, micro_batches) -> (tokens, model_flops)``
for a model described as the planner describes models (:class:`commlab.parallel.planner.ModelConfig`; the
capstone's is ``GPTConfig().planner_config()``): every DP replica runs ``micro_batches`` micro-batches of
``micro_batch`` sequences of ``model.seq`` tokens (TP and PP ranks share a replica's), at ``6 P + 12 L h s``
model FLOPs per token (PaLM's MFU accounting, Chowdhery et al. 2022, App. B; the reference is
:func:`commlab.parallel.planner.model_flops_per_token`). A wrong answer is matched against the usual slips
(the DP replicas forgotten, tokens counted per rank, the backward pass left out, ...) to say which it is.

Entry points: :func:`check_step_budget`, :func:`step_budget_cases`.
"""

from __future__ import annotations

import math
from typing import Callable

from commlab.exercises.report import NO_ANSWER, CheckReport, how_far
from commlab.parallel.planner import ModelConfig, load_model, model_flops_per_token, parameter_count

__all__ = ["check_step_budget", "step_budget_cases"]


def step_budget_cases() -> list[tuple[ModelConfig, int, int, int, int, int]]:
    """The graded cases: ``(model, tp, pp, dp, micro_batch, micro_batches)``; the capstone's GPT in the lab's
    layouts, and two published models at cluster scale."""
    capstone = ModelConfig(name="capstone", layers=4, hidden=64, heads=4, ffn=256, vocab=97, seq=32,
                           tied_embeddings=False)
    return [
        (capstone, 2, 2, 2, 2, 2),
        (capstone, 1, 2, 4, 2, 1),
        (capstone, 4, 2, 1, 2, 4),
        (capstone, 1, 1, 1, 3, 5),
        (load_model("megatron-18.4b"), 8, 2, 16, 1, 64),
        (load_model("llama3-405b"), 8, 16, 128, 1, 16),
    ]


def _want(model, tp, pp, dp, b, m) -> tuple[int, float]:
    tokens = b * m * dp * model.seq
    return tokens, model_flops_per_token(model) * tokens


def _token_slips(model, tp, pp, dp, b, m) -> dict[str, int]:
    s = model.seq
    return {
        "that is one DP replica's share: every one of the dp replicas runs its own micro-batches": b * m * s,
        "tokens were counted once per rank, but TP and PP ranks work on the same sequences of their replica":
            b * m * dp * s * tp * pp,
        "that counts sequences, not tokens: multiply by the sequence length": b * m * dp,
        "the micro-batches were forgotten: each replica runs micro_batches of them per step": b * dp * s,
    }


def _flop_slips(model, tokens: int) -> dict[str, float]:
    p, lhs = parameter_count(model), model.layers * model.hidden * model.seq
    return {
        "the attention term 12 L h s per token is missing (the score and value products are not in P)":
            6.0 * p * tokens,
        "that is the forward pass only (2 P + 4 L h s); the backward pass costs twice the forward":
            (2.0 * p + 4.0 * lhs) * tokens,
        "recomputation was counted; MFU counts model FLOPs, and the capstone does not recompute":
            (8.0 * p + 16.0 * lhs) * tokens,
        "that is per token: multiply by the step's tokens": 6.0 * p + 12.0 * lhs,
    }


def _float_pair(got) -> tuple[float, float]:
    tokens, flops = got
    return float(tokens), float(flops)


def check_step_budget(fn: Callable) -> CheckReport:
    """Grade ``fn(model, tp, pp, dp, micro_batch, micro_batches) -> (tokens, model_flops)``."""
    report = CheckReport(f"step-budget exercise ({getattr(fn, '__name__', 'fn')})")
    for case in step_budget_cases():
        model, tp, pp, dp, b, m = case
        want_tokens, want_flops = _want(*case)
        desc = f"{model.name}, tp={tp} pp={pp} dp={dp}, micro_batch={b} micro_batches={m}"
        got = report.call(desc, fn, *case, convert=_float_pair,
                          hint="return a pair: tokens, model FLOPs of the step")
        if report.not_attempted:
            return report
        if got is NO_ANSWER:
            continue
        got_tokens, got_flops = got
        problems = []
        if got_tokens != want_tokens:
            why = next((k for k, v in _token_slips(*case).items() if got_tokens == v), None)
            problems.append(f"tokens {got_tokens:g}, {how_far(got_tokens, want_tokens)}" + (f": {why}" if why else ""))
        if not math.isclose(got_flops, want_flops, rel_tol=1e-9):
            why = next((k for k, v in _flop_slips(model, want_tokens).items()
                        if math.isclose(got_flops, v, rel_tol=1e-9)), None)
            if why is None and got_tokens != want_tokens and got_tokens > 0 and \
                    math.isclose(got_flops, model_flops_per_token(model) * got_tokens, rel_tol=1e-9):
                why = "right per token, times the wrong tokens (see above)"
            problems.append(f"model FLOPs {got_flops:.6g}, {how_far(got_flops, want_flops)}" + (f": {why}" if why else ""))
        report.cases.append((desc, not problems, "; ".join(problems)))
    return report
