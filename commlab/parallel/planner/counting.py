"""What one training step counts, before any time: FLOP per token and bytes per message, per layer and per GPU.

Model FLOP in the definitions published runs use (:data:`FLOP_DEFINITIONS`, :func:`model_flops_per_step`) and
the FLOP the GPUs execute (:func:`executed_flops_per_token`, with recomputation); the bytes of a TP AllReduce
(:func:`tp_all_reduce_nbytes`), a pipeline message (:func:`pp_message_nbytes`) and a GPU's DP gradient
(:func:`dp_gradient_nbytes`); the HBM bytes of the memory-bound operations, the loss and the optimizer step
(:func:`memory_bound_bytes_per_token`, :func:`loss_bytes_per_token`, :func:`optimizer_step_bytes`).
Sources: Kaplan et al. 2020; Narayanan et al. 2021 Eq. 3 and §4.1; Korthikanti et al. 2022 App. A, §4-6;
PaLM App. B. Book: chapter 11, §11.2.
"""

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
    """Model FLOP per token of a training step, no recomputation: ``6·P + 12·L·h·s`` (P with embeddings;
    the input-embedding lookup is not a matmul, a small over-count that this definition keeps). PaLM's MFU
    accounting (Chowdhery et al. 2022, Appendix B); the ``"model"`` entry of :data:`FLOP_DEFINITIONS`."""
    return 6.0 * parameter_count(m) + 12.0 * m.layers * m.hidden * m.seq


def attention_flops_per_token(m: ModelConfig, flash_attention: bool = True, causal: bool = True) -> tuple[float, float]:
    """``(forward, backward)`` FLOP per token of one layer's attention core (QKᵀ and attention over V).

    Without FlashAttention: ``4·s·h`` forward, ``8·s·h`` backward (the full s × s scores are computed and
    masked; PaLM, Appendix B). With FlashAttention (FlashAttention-2's benchmark accounting,
    Dao-AILab/flash-attention ``benchmarks/benchmark_flash_attention.py``): forward ``4·s·h``, halved
    when causal (the masked blocks are skipped), backward :data:`ATTENTION_BACKWARD_OVER_FORWARD` (2.5) times
    the forward (its kernel recomputes the scores).
    """
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
    """FLOP per token the GPUs execute in one training step (book §11.2, the compute term).

    ``6·P_mm + L·(attention forward + backward)`` (:func:`attention_flops_per_token`), plus the recomputed
    forward: ``L·(2·layer_params + attention forward)`` with ``"full"`` (the output layer is not
    recomputed), ``floor(L/k)`` layers of it with ``"every-k"`` (k = ``recompute_every``), and
    ``L × attention forward`` with ``"selective"`` (Korthikanti et al. 2022, §5).

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
    """FLOP per iteration as Megatron-LM reports them (Narayanan et al. 2021, Eq. 3, which assumes activation
    recomputation): ``96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))``. Their teraFLOP/s per GPU = this / time / n."""
    B, s, L, h, V = global_batch, m.seq, m.layers, m.hidden, m.vocab
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def korthikanti_eq7_flops(m: ModelConfig, global_batch: int) -> float:
    """Model FLOP per iteration as Korthikanti et al. 2022 count them for their MFU (Appendix A, Eq. 7):
    ``72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h))``, a layer's ``24·B·s·h² + 4·B·s²·h`` forward and the logits'
    ``2·B·s·h·V``, times 3 for the backward pass; recomputation is not counted (their Eq. 8, the hardware
    FLOP, adds the selectively recomputed attention)."""
    B, s, L, h, V = global_batch, m.seq, m.layers, m.hidden, m.vocab
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def megatron_2024_flops(m: ModelConfig, global_batch: int) -> float:
    """FLOP per iteration as Megatron-LM of 2024 logs them (:data:`FLOP_DEFINITIONS` ``"megatron-2024"``:
    ``num_floating_point_operations`` in ``megatron/training/training.py``). Per token and layer,
    ``6·(2 + 2g/a)·h²`` for QKV and the attention projection, ``12·s·h`` for the scores and context and
    ``6·h·F`` per MLP matrix (two, or three with SwiGLU); once per token, ``6·V·h`` for the output layer.
    ``m.vocab`` is taken as already padded (Megatron pads to a multiple of 128·tp)."""
    B, s, L, h, V = global_batch, m.seq, m.layers, m.hidden, m.vocab
    attention = (1 + m.kv_heads / m.heads + s / h) * (m.heads * (h // m.heads) / h)
    mlp = m.ffn / h * (1.5 if m.gated_ffn else 1.0)
    return 12.0 * B * s * L * h * h * (attention + mlp + V / (2 * L * h))


def model_flops_per_step(m: ModelConfig, global_batch: int, definition: str = "model") -> float:
    """Model FLOP of one step of ``global_batch`` sequences in a published definition (:data:`FLOP_DEFINITIONS`):
    ``"megatron-eq3"`` (:func:`megatron_eq3_flops`), ``"megatron-2024"`` (:func:`megatron_2024_flops`),
    ``"korthikanti-eq7"`` (:func:`korthikanti_eq7_flops`),
    ``"model"`` (:func:`model_flops_per_token` × tokens) or ``"6n"`` (``6·P`` × tokens). Divide by the step
    time and the GPUs for the FLOP/s per GPU a source reports.

    Raises:
        ValueError: unknown definition (the message lists the known ones); ``global_batch`` not an int >= 1.
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
    """Share of a layer's backward TP bytes that are the column-parallel linears' input-gradient reductions
    (QKV and the MLP's first linear): 1.0 without sequence parallelism, 0.5 with it (the other half is the
    row-parallel outputs' AllGathers). Megatron-LM ``megatron/mpu/layers.py`` and ``mappings.py`` (2022)."""
    return 0.5 if sequence_parallel else 1.0


def column_wgrad_flops_per_token(m: ModelConfig) -> tuple[float, float]:
    """FLOP per token and layer of the weight-gradient GEMMs of the two column-parallel linears,
    ``(QKV, the MLP's first linear)``: ``2·h·(h + 2·kv)`` and ``2·h·ffn`` (``4·h·ffn`` gated, Megatron's fused
    gate and up projection), each the same as its forward. Each linear's input-gradient reduction hides
    behind its own weight-gradient GEMM (Megatron-LM's asynchronous all-reduce or reduce-scatter,
    Korthikanti et al. 2022, §6.2), so each GEMM's time bounds its own reduction."""
    h = m.hidden
    kv = m.kv_heads * (h // m.heads)
    return 2.0 * h * (h + 2 * kv), 2.0 * h * m.ffn * (2 if m.gated_ffn else 1)


def pp_message_nbytes(m: ModelConfig, micro_batch: int, tp: int = 1, split: bool = False) -> float:
    """Bytes each rank of a stage sends its neighbour per micro-batch, each way: the bf16 boundary activation
    ``b·s·h·2``, or ``b·s·h·2/tp`` when ``split`` (scatter/gather, Narayanan et al. 2021, §4.1, or sequence
    parallelism: each of the tp ranks sends its 1/tp).

    Raises:
        ValueError: tp not an int >= 1.
    """
    checks.integer("tp", tp)
    return 2.0 * micro_batch * m.seq * m.hidden / (tp if split else 1)


def dp_gradient_nbytes(m: ModelConfig, layout: Layout, grad_bytes: int = 2) -> float:
    """Bytes each GPU reduces over its DP group: the heavier pipeline stage's parameters / tp × grad_bytes
    (with ``grad_bytes = 2``: also the bf16 parameters a distributed optimizer all-gathers)."""
    if layout.pp == 1:
        p = stage_params(m, 1, "only")
    else:
        p = max(stage_params(m, layout.pp, "first", layout.interleave),
                stage_params(m, layout.pp, "last", layout.interleave))
    return p / layout.tp * grad_bytes


#: HBM bytes per logit (one token, one vocabulary entry of this tp rank) that the loss moves in the forward
#: pass, and in the backward pass; :func:`loss_bytes_per_token` says which passes they count.
LOSS_FORWARD_BYTES_PER_LOGIT = 38


LOSS_BACKWARD_BYTES_PER_LOGIT = 14


def memory_bound_bytes_per_token(m: ModelConfig, tp: int, sequence_parallel: bool = False,
                                 flash_attention: bool = True) -> tuple[float, float]:
    """HBM bytes per token of one layer's forward pass outside its GEMMs, on one tensor-parallel rank:
    ``(the layer without its attention core, the attention core)``.

    2-byte activations, each operation reading its inputs and writing its output once (the tensors of
    Korthikanti et al. 2022, §4.1): two norms ``8h``; two residual additions ``12h``, plus ``2h`` of 1-byte
    dropout masks when the model has dropout (``bias=True``); the MLP activation ``4·ffn`` (``6·ffn`` gated)
    ``/tp``; without FlashAttention, the softmax over ``a·s`` scores (``4·a·s``) and its dropout (``5·a·s``),
    ``/tp``. Norms and residuals run on every tp rank unless sequence parallelism splits them (§4.2.2).
    """
    h = m.hidden
    replicated = 8 * h + 12 * h + (2 * h if m.bias else 0)
    layer = replicated / (tp if sequence_parallel else 1) + (6 if m.gated_ffn else 4) * m.ffn / tp
    core = 0.0 if flash_attention else 9 * m.heads * m.seq / tp
    return layer, core


def loss_bytes_per_token(m: ModelConfig, tp: int) -> tuple[float, float]:
    """HBM bytes per token of the loss over the vocabulary on one of ``tp`` ranks, ``(forward, backward)``:
    :data:`LOSS_FORWARD_BYTES_PER_LOGIT` (38) and :data:`LOSS_BACKWARD_BYTES_PER_LOGIT` (14) times the
    ``ceil(V/tp)`` logits of the rank's vocabulary shard (under sequence parallelism every rank holds all the
    tokens).

    The passes of Megatron's vocabulary-parallel cross-entropy over fp32 logits
    (``megatron/core/tensor_parallel/cross_entropy.py``; the same in Megatron-DeepSpeed): forward, the cast to
    fp32 (2 + 4), the maximum (4), its subtraction (8), ``exp`` (8), the sum (4) and the division (8); backward,
    the multiplication by the loss gradient (8) and the cast back (4 + 2). The target-logit gather and the TP
    AllReduces of per-token scalars are left out. Book §11.2, the loss term.

    Raises:
        ValueError: ``tp`` not an int >= 1.
    """
    checks.integer("tp", tp)
    logits = -(-m.vocab // tp)
    return LOSS_FORWARD_BYTES_PER_LOGIT * logits, LOSS_BACKWARD_BYTES_PER_LOGIT * logits


def optimizer_step_bytes(params_on_gpu: float, state_bytes: int, grad_bytes: int, param_bytes: int) -> float:
    """HBM bytes of one Adam step over ``params_on_gpu`` parameters: read and write the optimizer state
    (``state_bytes`` per parameter), read the gradient, write the parameter."""
    return params_on_gpu * (2 * state_bytes + grad_bytes + param_bytes)
