"""What one training step counts, before any time: FLOP per token and bytes per message, per layer and per GPU.

Model FLOP in published definitions (:data:`FLOP_DEFINITIONS`, :func:`model_flops_per_step`) and executed FLOP
(:func:`executed_flops_per_token`); the bytes of a TP AllReduce, a pipeline message and a GPU's DP gradient
(:func:`tp_all_reduce_nbytes`, :func:`pp_message_nbytes`, :func:`dp_gradient_nbytes`); the HBM bytes of the
memory-bound operations, the loss and the optimizer step. Sources: Kaplan et al. 2020; Narayanan et al. 2021
Eq. 3, §4.1; Korthikanti et al. 2022 App. A, §4-6; PaLM App. B. Book: chapter 11, §11.2."""

from __future__ import annotations

from commlab import checks
from commlab.parallel.context.cost import ATTENTION_BACKWARD_OVER_FORWARD
from commlab.parallel.planner.memory import Layout, ModelConfig, layer_params, parameter_count, stage_params
from commlab.parallel.planner.software import check_recompute_policy

__all__ = ["FLOP_DEFINITIONS", "model_flops_per_token", "attention_flops_per_token", "executed_flops_per_token",
           "forward_flops_per_token", "megatron_eq3_flops", "korthikanti_eq7_flops", "megatron_2024_flops",
           "model_flops_per_step", "tp_all_reduce_nbytes", "input_grad_share", "column_wgrad_flops_per_token",
           "pp_message_nbytes", "dp_gradient_nbytes", "LOSS_FORWARD_BYTES_PER_LOGIT",
           "LOSS_BACKWARD_BYTES_PER_LOGIT", "memory_bound_bytes_per_token", "loss_bytes_per_token",
           "optimizer_step_bytes"]


#: Model-FLOP definitions published runs use, for :func:`model_flops_per_step`.
FLOP_DEFINITIONS = {
    "megatron-eq3": "Narayanan et al. 2021, Eq. 3: 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)); assumes full "
                    "activation recomputation (counts the recomputed forward)",
    "model": "6·P + 12·L·h·s per token, P with embeddings, no recomputation (PaLM's MFU accounting, Chowdhery et "
             "al. 2022, Appendix B)",
    "6n": "6·P per token, P with embeddings: weights only, no attention, no recomputation",
    "korthikanti-eq7": "Korthikanti et al. 2022, Appendix A, Eq. 7 (their model FLOPs, the numerator of their MFU): "
                       "72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)): the weight matmuls, full attention and the logits, "
                       "forward and backward, no recomputation",
    "megatron-2024": "Megatron-LM megatron/training/training.py num_floating_point_operations (at commit "
                     "937571cfd4, 2024-07-15): 12·B·s·L·h²·((1 + g/a + s/h)·(a·d/h) + (F/h)·(3/2 if SwiGLU) + "
                     "V/(2·L·h)), g the key/value heads, d the head width, F the MLP width: the weight matmuls, "
                     "full (not causal-halved) attention and the output layer, no recomputation, no embedding lookup",
}


def model_flops_per_token(m: ModelConfig) -> float:
    """Model FLOP per token, no recomputation: ``6·P + 12·L·h·s`` (PaLM App. B; P with embeddings, so the
    embedding lookup is counted as if a matmul, as the definition does)."""
    return 6.0 * parameter_count(m) + 12.0 * m.layers * m.hidden * m.seq


def attention_flops_per_token(m: ModelConfig, flash_attention: bool = True, causal: bool = True) -> tuple[float, float]:
    """``(forward, backward)`` FLOP per token of one layer's attention core: ``4·s·h`` and ``8·s·h`` without
    FlashAttention (PaLM App. B); with it, the forward halved when causal and the backward
    :data:`ATTENTION_BACKWARD_OVER_FORWARD` times it (FlashAttention-2's benchmark accounting)."""
    fwd = 4.0 * m.seq * m.hidden
    if not flash_attention:
        return fwd, 2.0 * fwd
    if causal:
        fwd /= 2.0
    return fwd, ATTENTION_BACKWARD_OVER_FORWARD * fwd


def _matmul_params(m: ModelConfig) -> float:
    """Parameters that take part in matmuls: the layers plus the ``V·h`` output layer (tied or not); the
    input embedding (and a learned position table) is a lookup."""
    return m.layers * layer_params(m) + m.vocab * m.hidden


def executed_flops_per_token(m: ModelConfig, recompute: bool | str = False, flash_attention: bool = True,
                             causal: bool = True, recompute_every: int = 1) -> float:
    """FLOP per token the GPUs execute in one step (book §11.2): ``6·P_mm + L·attention``, plus the recomputed
    forward of every layer (``"full"``), of ``floor(L/k)`` layers (``"every-k"``) or of the attention core
    (``"selective"``, Korthikanti et al. 2022 §5); the output layer is not recomputed.

    Raises:
        ValueError: unknown recompute policy; ``recompute_every`` not an int >= 1.
    """
    policy = check_recompute_policy(recompute)
    checks.integer("recompute_every", recompute_every)
    fwd, bwd = attention_flops_per_token(m, flash_attention, causal)
    base = 6.0 * _matmul_params(m) + m.layers * (fwd + bwd)
    layer_forward = 2.0 * layer_params(m) + fwd
    extra = {"none": 0.0, "full": m.layers * layer_forward,
             "every-k": (m.layers // recompute_every) * layer_forward,
             "selective": m.layers * fwd}[policy]
    return base + extra


def forward_flops_per_token(m: ModelConfig, flash_attention: bool, causal: bool = True) -> float:
    """FLOP per token of the forward pass alone: ``2·P_mm + L × attention forward``."""
    fwd, _ = attention_flops_per_token(m, flash_attention, causal)
    return 2.0 * _matmul_params(m) + m.layers * fwd


def megatron_eq3_flops(m: ModelConfig, global_batch: int) -> float:
    """FLOP per iteration as Megatron-LM reports them (Narayanan et al. 2021, Eq. 3, recomputation counted)."""
    B, s, L, h, V = global_batch, m.seq, m.layers, m.hidden, m.vocab
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def korthikanti_eq7_flops(m: ModelConfig, global_batch: int) -> float:
    """Model FLOP per iteration of Korthikanti et al. 2022 (Appendix A, Eq. 7), recomputation not counted."""
    B, s, L, h, V = global_batch, m.seq, m.layers, m.hidden, m.vocab
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def megatron_2024_flops(m: ModelConfig, global_batch: int) -> float:
    """FLOP per iteration as Megatron-LM of 2024 logs them (:data:`FLOP_DEFINITIONS` ``"megatron-2024"``), with
    ``m.vocab`` taken as already padded."""
    B, s, L, h, V = global_batch, m.seq, m.layers, m.hidden, m.vocab
    attention = (1 + m.kv_heads / m.heads + s / h) * (m.heads * (h // m.heads) / h)
    mlp = m.ffn / h * (1.5 if m.gated_ffn else 1.0)
    return 12.0 * B * s * L * h * h * (attention + mlp + V / (2 * L * h))


def model_flops_per_step(m: ModelConfig, global_batch: int, definition: str = "model") -> float:
    """Model FLOP of one step of ``global_batch`` sequences in a definition of :data:`FLOP_DEFINITIONS`.

    Raises:
        ValueError: an unknown definition (lists the known ones); ``global_batch`` not an int >= 1.
    """
    checks.integer("global_batch", global_batch, note="sequences per step")
    tokens = global_batch * m.seq
    if definition == "megatron-eq3":
        return megatron_eq3_flops(m, global_batch)
    if definition == "megatron-2024":
        return megatron_2024_flops(m, global_batch)
    if definition == "korthikanti-eq7":
        return korthikanti_eq7_flops(m, global_batch)
    if definition == "model":
        return model_flops_per_token(m) * tokens
    if definition == "6n":
        return 6.0 * parameter_count(m) * tokens
    raise ValueError(f"unknown FLOP definition {definition!r}; known: {sorted(FLOP_DEFINITIONS)}")


def tp_all_reduce_nbytes(m: ModelConfig, micro_batch: int) -> float:
    """Bytes of one TP AllReduce: the bf16 activation ``b·s·h·2``, the same on every rank whatever tp is."""
    return 2.0 * micro_batch * m.seq * m.hidden


def input_grad_share(sequence_parallel: bool) -> float:
    """Share of a layer's backward TP bytes that are the column-parallel input-gradient reductions: 1.0, or 0.5
    with sequence parallelism (the rest are AllGathers; Megatron-LM ``mpu/layers.py``, 2022)."""
    return 0.5 if sequence_parallel else 1.0


def column_wgrad_flops_per_token(m: ModelConfig) -> tuple[float, float]:
    """FLOP per token and layer of the weight-gradient GEMMs of QKV and the MLP's first linear (gated: fused gate
    and up), each bounding its own input-gradient reduction (Korthikanti et al. 2022, §6.2)."""
    h = m.hidden
    kv = m.kv_heads * (h // m.heads)
    return 2.0 * h * (h + 2 * kv), 2.0 * h * m.ffn * (2 if m.gated_ffn else 1)


def pp_message_nbytes(m: ModelConfig, micro_batch: int, tp: int = 1, split: bool = False) -> float:
    """Bytes a rank sends its neighbour stage per micro-batch, each way: ``2·b·s·h``, ``/tp`` when ``split``
    (scatter/gather, Narayanan et al. 2021 §4.1, or sequence parallelism).

    Raises:
        ValueError: tp not an int >= 1.
    """
    checks.integer("tp", tp)
    return 2.0 * micro_batch * m.seq * m.hidden / (tp if split else 1)


def dp_gradient_nbytes(m: ModelConfig, layout: Layout, grad_bytes: int = 2) -> float:
    """Bytes each GPU reduces over its DP group: the heavier stage's parameters / tp × ``grad_bytes``."""
    if layout.pp == 1:
        p = stage_params(m, 1, "only")
    else:
        p = max(stage_params(m, layout.pp, "first", layout.interleave),
                stage_params(m, layout.pp, "last", layout.interleave))
    return p / layout.tp * grad_bytes


#: HBM bytes per logit the loss moves, forward (fp32 cast 2 + 4, max 4, subtract 8, exp 8, sum 4, divide 8) and
#: backward (scale 8, cast back 4 + 2), :func:`loss_bytes_per_token`.
LOSS_FORWARD_BYTES_PER_LOGIT = 38
LOSS_BACKWARD_BYTES_PER_LOGIT = 14


def memory_bound_bytes_per_token(m: ModelConfig, tp: int, sequence_parallel: bool = False,
                                 flash_attention: bool = True) -> tuple[float, float]:
    """HBM bytes per token of one layer's forward outside its GEMMs on one TP rank, ``(layer, attention core)``:
    norms, residuals (and dropout masks with ``bias``), the MLP activation, and without FlashAttention the
    softmax and its dropout; 2-byte tensors read and written once (Korthikanti et al. 2022, §4.1)."""
    h = m.hidden
    replicated = 8 * h + 12 * h + (2 * h if m.bias else 0)
    layer = replicated / (tp if sequence_parallel else 1) + (6 if m.gated_ffn else 4) * m.ffn / tp
    core = 0.0 if flash_attention else 9 * m.heads * m.seq / tp
    return layer, core


def loss_bytes_per_token(m: ModelConfig, tp: int) -> tuple[float, float]:
    """``(forward, backward)`` HBM bytes per token of the vocabulary cross-entropy on one of ``tp`` ranks:
    :data:`LOSS_FORWARD_BYTES_PER_LOGIT` and :data:`LOSS_BACKWARD_BYTES_PER_LOGIT` times ``ceil(V/tp)`` (the
    passes of Megatron's ``tensor_parallel/cross_entropy.py`` over fp32 logits; book §11.2).

    Raises:
        ValueError: ``tp`` not an int >= 1.
    """
    checks.integer("tp", tp)
    logits = -(-m.vocab // tp)
    return LOSS_FORWARD_BYTES_PER_LOGIT * logits, LOSS_BACKWARD_BYTES_PER_LOGIT * logits


def optimizer_step_bytes(params_on_gpu: float, state_bytes: int, grad_bytes: int, param_bytes: int) -> float:
    """HBM bytes of one Adam step: read and write the state, read the gradient, write the parameter."""
    return params_on_gpu * (2 * state_bytes + grad_bytes + param_bytes)
