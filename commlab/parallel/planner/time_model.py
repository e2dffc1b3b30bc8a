"""Time of one training step of a 3D-parallel layout: compute, loss, TP, PP, bubble, DP and slowdown terms.

:func:`step_time` returns a :class:`TimeBreakdown` (seconds on one GPU's critical path) for a model
(:class:`~.memory.ModelConfig`), a layout (:class:`~.memory.Layout`), a cluster
(:class:`~commlab.topology.Cluster`: α in s, β in s/byte per direction), a global batch (sequences) and a
software profile (:class:`~.software.SoftwareProfile`). Compute is priced by one share of peak
(:data:`DEFAULT_ACHIEVABLE_FRACTION`) or by kernels (:data:`KERNELS`; :data:`AUTO` picks per device:
:func:`compute_model`). Executed FLOP (:func:`executed_flops_per_token`) and published model FLOP
(:func:`model_flops_per_step`, :data:`FLOP_DEFINITIONS`) are kept apart. Terms are summed, not scheduled;
:mod:`~.timeline` replays them. Sources: Kaplan et al. 2020; Shoeybi et al. 2019 §3; Narayanan et al. 2021
§2.2, §3.2, §4.1; Korthikanti et al. 2022 §5, §6.2; Rajbhandari et al. 2020 §5.3; PaLM App. B; Lee et al.
2025 (arXiv:2507.03114). Book: chapter 11, §11.2 and §11.4; chapter 12, §12.4.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import lru_cache

from commlab import checks
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner.memory import (Layout, ModelConfig, embedding_params, layer_params, parameter_count,
                                             stage_layers,
                                             stage_params)
from commlab.parallel.planner.software import SoftwareProfile, check_recompute_policy, load_software
from commlab.topology import Cluster, Link, flows_per_nic

__all__ = ["TimeBreakdown", "DEFAULT_ACHIEVABLE_FRACTION", "FLOP_DEFINITIONS", "model_flops_per_token",
           "executed_flops_per_token", "attention_flops_per_token", "megatron_eq3_flops", "megatron_2024_flops",
           "korthikanti_eq7_flops",
           "model_flops_per_step",
           "tp_all_reduce_nbytes", "input_grad_share", "column_wgrad_flops_per_token", "backward_tp_hidden_seconds",
           "pp_message_nbytes",
           "dp_gradient_nbytes", "dp_all_reduce_seconds",
           "dp_exposed_seconds", "dp_last_bucket_share", "fsdp_exposed_seconds", "fsdp_head_share",
           "group_all_reduce_seconds",
           "loss_seconds", "step_time",
           "KERNELS", "AUTO", "compute_model", "beside_seconds", "slowdown_seconds"]

#: Share of dense peak FLOP/s the model's matrix multiplications achieve (why 0.5: book §11.2).
DEFAULT_ACHIEVABLE_FRACTION = 0.5

#: ``achievable_fraction="kernels"``: price compute from the layer's kernels instead of one share of peak
#: (:mod:`~commlab.parallel.planner.kernels`: GEMM efficiency by shape, memory-bound operations, the
#: optimizer step).
KERNELS = "kernels"

#: ``achievable_fraction="auto"``, the default of every planner function and of ``python -m commlab plan``:
#: :data:`KERNELS` where the device has what the kernel model needs (:func:`~.kernels.kernel_model_gap`),
#: else :data:`DEFAULT_ACHIEVABLE_FRACTION` (:func:`compute_model` resolves it).
AUTO = "auto"


def compute_model(achievable_fraction: float | str, device: str, dtype: str = "bf16") -> float | str:
    """What compute is priced with on ``device``: for :data:`AUTO`, :data:`KERNELS` where
    :func:`~.kernels.kernel_model_gap` finds nothing missing for ``dtype``, else
    :data:`DEFAULT_ACHIEVABLE_FRACTION`; :data:`KERNELS` and a share of peak in (0, 1] as given.

    Raises:
        ValueError: :data:`KERNELS` where the device lacks what the kernel model needs for ``dtype`` (the
            message says what); anything else that is not :data:`AUTO` or a share in (0, 1].
    """
    from commlab.parallel.planner.kernels import kernel_model_gap
    if isinstance(achievable_fraction, str) and achievable_fraction in (AUTO, KERNELS):
        gap = kernel_model_gap(device, dtype)
        if achievable_fraction == AUTO:
            return KERNELS if gap is None else DEFAULT_ACHIEVABLE_FRACTION
        if gap is not None:
            raise ValueError(f"achievable_fraction={KERNELS!r}: the kernel model cannot price {dtype} on {device!r}: "
                             f"{gap}; pass a share of peak, or {AUTO!r} to fall back to "
                             f"{DEFAULT_ACHIEVABLE_FRACTION}")
        return KERNELS
    if not checks.is_number(achievable_fraction) or not 0 < achievable_fraction <= 1:
        raise ValueError(f"achievable_fraction must be in (0, 1], {KERNELS!r} or {AUTO!r}, got "
                         f"{achievable_fraction!r}")
    return achievable_fraction

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


@dataclasses.dataclass(frozen=True)
class TimeBreakdown:
    """One step, seconds, and what it yields.

    Attributes:
        compute_s: matrix multiplications of all micro-batches on one GPU (executed FLOP).
        tp_s, pp_s: TP communication and pipeline sends/receives of all micro-batches left on the critical
            path; tp_hidden_s, pp_hidden_s: the parts hidden behind compute.
        bubble_s: pipeline fill and drain.
        dp_s: the gradient ReduceScatter + AllGather (or AllReduce) in full (ZeRO-3: per micro-batch), split
            into dp_reduce_scatter_s and dp_all_gather_s; dp_exposed_s: the part not hidden.
        micro_batches, tokens_per_step, gpus: m, global batch × sequence length, tp·pp·dp.
        model_flop_per_step: ``(6·P + 12·L·h·s) × tokens`` FLOP; executed_flop_per_step: what the GPUs run.
        overlap_slowdown_s: what compute loses while hidden communication shares the GPU.
        software: the software profile's name.
        optimizer_s: the optimizer step (kernel model only; 0 otherwise).
        compute_fraction: the share of peak the executed FLOP run at.
        loss_s: the vocabulary cross-entropy on a last-stage GPU (0 without the device's memory bandwidth).
    """

    compute_s: float
    tp_s: float
    pp_s: float
    bubble_s: float
    dp_s: float
    dp_exposed_s: float
    micro_batches: int
    tokens_per_step: int
    model_flop_per_step: float
    gpus: int
    tp_hidden_s: float = 0.0
    pp_hidden_s: float = 0.0
    dp_reduce_scatter_s: float = 0.0
    dp_all_gather_s: float = 0.0
    overlap_slowdown_s: float = 0.0
    executed_flop_per_step: float = 0.0
    software: str = ""
    optimizer_s: float = 0.0
    compute_fraction: float = 0.0
    loss_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Step time, s: compute + loss + overlap slowdown + exposed TP + exposed PP + bubble + exposed DP +
        the optimizer step."""
        return (self.compute_s + self.loss_s + self.overlap_slowdown_s + self.tp_s + self.pp_s + self.bubble_s
                + self.dp_exposed_s + self.optimizer_s)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput, tokens/s."""
        return self.tokens_per_step / self.total_s

    @property
    def model_flop_per_s_per_gpu(self) -> float:
        """Achieved model FLOP/s per GPU (``"model"`` definition): model FLOP per step / step time / GPUs."""
        return self.model_flop_per_step / self.total_s / self.gpus

    def flop_per_s_per_gpu(self, flop_per_step: float) -> float:
        """FLOP/s per GPU in another accounting (e.g. :func:`model_flops_per_step`), given its FLOP per step."""
        return flop_per_step / self.total_s / self.gpus

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total_s=self.total_s, tokens_per_s=self.tokens_per_s,
                 model_flop_per_s_per_gpu=self.model_flop_per_s_per_gpu)
        return d


# ----------------------------------------------------------------------------------------- FLOP

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
    when causal (the masked blocks are skipped), backward 2.5 times the forward (its kernel recomputes
    the scores).
    """
    fwd = 4.0 * m.seq * m.hidden
    if not flash_attention:
        return fwd, 2.0 * fwd
    if causal:
        fwd /= 2.0
    return fwd, 2.5 * fwd


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


def _forward_flops_per_token(m: ModelConfig, flash_attention: bool, causal: bool = True) -> float:
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


# ----------------------------------------------------------------------------------------- bytes

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


def beside_seconds(comm_s: float, work_s: float, slowdown: float = 1.0) -> float:
    """Seconds of ``comm_s`` of communication that run beside ``work_s`` seconds of compute (its time alone),
    when compute runs ``1/slowdown`` as fast beside communication (the profile's ``overlap_compute_slowdown``):
    ``min(comm_s, slowdown·work_s)``. The compute then takes ``beside·(1 - 1/slowdown)`` longer
    (:func:`slowdown_seconds`); a compute entirely beside communication takes ``slowdown`` times as long,
    the slowdown Lee et al. 2025 (arXiv:2507.03114) measure, and what of ``comm_s`` is left runs exposed.

    Raises:
        ValueError: a negative or non-finite time; a slowdown below 1.
    """
    checks.seconds("comm_s", comm_s)
    checks.seconds("work_s", work_s)
    checks.number("slowdown", slowdown, least=1, note="1 = compute does not slow beside communication")
    return min(comm_s, slowdown * work_s)


def slowdown_seconds(beside_s: float, slowdown: float) -> float:
    """What ``beside_s`` seconds of compute beside communication add to the step: compute runs ``1/slowdown``
    as fast there, so ``beside_s·(1 - 1/slowdown)``."""
    return beside_s * (1 - 1 / slowdown) if beside_s > 0 else 0.0


def backward_tp_hidden_seconds(one_s: float, sequence_parallel: bool, overlap_tp: float, overlap_tp_backward: float,
                               wgrad_s: Sequence[float], slowdown: float = 1.0) -> float:
    """Seconds of one layer's backward TP communication (two AllReduce-equivalents of ``one_s`` each, for one
    micro-batch) that hide behind its computation.

    Each column-parallel linear's input-gradient reduction, ``c = input_grad_share·one_s``, hides for the
    larger of ``overlap_tp`` (``--tp-comm-overlap``, which needs sequence parallelism; the caller passes 0
    without it) and ``overlap_tp_backward`` (the asynchronous reduction), the latter at most that linear's
    weight-gradient time (``wgrad_s``: QKV's, then the MLP's first linear's, seconds), which ``slowdown``
    (:func:`beside_seconds`) stretches; the rest of the backward's bytes (the AllGathers under sequence
    parallelism) hide for ``overlap_tp`` only.

    Raises:
        ValueError: a negative or non-finite time, a share outside [0, 1], not two weight-gradient times, a
            slowdown below 1.
    """
    wgrad_s = tuple(wgrad_s)
    if len(wgrad_s) != 2:
        raise ValueError(f"wgrad_s must give two times (QKV, the MLP's first linear), got {wgrad_s!r}")
    for name, v in (("one_s", one_s), ("wgrad_s[0]", wgrad_s[0]), ("wgrad_s[1]", wgrad_s[1])):
        checks.seconds(name, v)
    for name, v in (("overlap_tp", overlap_tp), ("overlap_tp_backward", overlap_tp_backward)):
        checks.share(name, v)
    c = input_grad_share(sequence_parallel) * one_s
    per_linear = sum(max(overlap_tp * c, beside_seconds(overlap_tp_backward * c, w, slowdown)) for w in wgrad_s)
    return per_linear + overlap_tp * (2 * one_s - 2 * c)


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


def dp_all_reduce_seconds(nbytes: float, layout: Layout, cluster: Cluster) -> float:
    """α-β time (seconds) of the DP gradient AllReduce of ``nbytes`` bytes per GPU.

    The DP group is strided by tp·pp, so ``k = devices_per_node // (tp·pp)`` of its members share a node
    (at least 1). One node: a ring on the intra-node link. Otherwise hierarchical: a ring AllReduce over the k
    members of a node (standing in for the ReduceScatter + AllGather pair of
    :func:`~commlab.collectives.hierarchical.hierarchical_all_reduce_seconds`; same bytes), then a ring of
    ``nbytes/k`` across the ``dp/k`` nodes with every device of a node sending through its NICs at once.

    Raises:
        ValueError: ``nbytes < 0``.
    """
    return group_all_reduce_seconds(nbytes, layout.dp, layout.tp * layout.pp, cluster)


def group_all_reduce_seconds(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    """α-β time of an AllReduce of ``nbytes`` per GPU over ``n`` ranks ``stride`` apart in the rank order
    (the model of :func:`dp_all_reduce_seconds`, for any such group: the DP group has stride tp·pp, an HSDP
    shard group the same, its replica group tp·pp·dp_shard).

    Raises:
        ValueError: ``nbytes < 0``; ``n`` or ``stride`` not an int >= 1.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    for name, v in (("n", n), ("stride", stride)):
        checks.integer(name, v)
    if n == 1:
        return 0.0
    d = cluster.devices_per_node
    k = d // stride if (stride < d and d % stride == 0) else 1
    if n <= k:
        return ring_all_reduce_seconds(nbytes, n, cluster.intra.alpha_s, cluster.intra.beta_s_per_byte)
    k = math.gcd(k, n)
    t_intra = ring_all_reduce_seconds(nbytes, k, cluster.intra.alpha_s, cluster.intra.beta_s_per_byte)
    share = flows_per_nic(d, cluster.nics_per_node)
    t_inter = ring_all_reduce_seconds(nbytes / k, n // k, cluster.inter.alpha_s,
                                      cluster.inter.beta_s_per_byte * share)
    return t_intra + t_inter


def _check_times_and_shares(times: dict[str, float], shares: dict[str, float]) -> None:
    """The argument check of the overlap functions: every time finite and >= 0 s, every share in [0, 1]."""
    for name, v in times.items():
        checks.seconds(name, v)
    for name, v in shares.items():
        checks.share(name, v)


def dp_exposed_seconds(reduce_s: float, reduce_window_s: float, reduce_overlap: float, gather_s: float = 0.0,
                       gather_window_s: float = 0.0, gather_overlap: float = 0.0, reduce_tail: float = 0.0,
                       gather_head: float = 0.0, slowdown: float = 1.0) -> tuple[float, float]:
    """``(exposed, hidden)`` seconds of the DP communication.

    The gradient reduction (``reduce_s``) may hide up to ``reduce_overlap × (1 - reduce_tail) × reduce_s``
    behind ``reduce_window_s`` (the last micro-batch's backward pass): ``reduce_tail`` is the share in the
    bucket reduced last, which the backward completes only as it ends. The parameter all-gather
    (``gather_s``) may hide up to ``gather_overlap × (1 - gather_head) × gather_s`` behind ``gather_window_s``
    (the first micro-batch's forward pass): ``gather_head`` is the share gathered first, which that forward
    waits for. What does not fit in its window, and the share not overlapped, is exposed. ``slowdown``
    (>= 1, the profile's ``overlap_compute_slowdown``): compute beside communication runs ``1/slowdown`` as
    fast, so a window of ``w`` seconds of compute holds up to ``slowdown·w`` of it (:func:`beside_seconds`;
    the caller charges the ``hidden·(1 - 1/slowdown)`` this costs), as in the step timeline's replay.

    Raises:
        ValueError: a time that is negative or not finite, an overlap, tail or head share outside [0, 1], a
            slowdown below 1.
    """
    _check_times_and_shares(dict(reduce_s=reduce_s, reduce_window_s=reduce_window_s, gather_s=gather_s,
                                 gather_window_s=gather_window_s),
                            dict(reduce_overlap=reduce_overlap, gather_overlap=gather_overlap,
                                 reduce_tail=reduce_tail, gather_head=gather_head))
    hidden = (beside_seconds(reduce_overlap * (1 - reduce_tail) * reduce_s, reduce_window_s, slowdown)
              + beside_seconds(gather_overlap * (1 - gather_head) * gather_s, gather_window_s, slowdown))
    return reduce_s + gather_s - hidden, hidden


def dp_last_bucket_share(m: ModelConfig, layout: Layout, bucket_params: float) -> float:
    """Share (0..1) of a GPU's DP gradient (:func:`dp_gradient_nbytes`) in the bucket the backward pass
    completes last -- and that a distributed optimizer all-gathers first.

    Buckets of about ``bucket_params`` elements are filled over the parameters in reverse order (Megatron-Core
    ``megatron/core/distributed/param_and_grad_buffer.py``; PyTorch DDP likewise): on one tp rank, the output
    layer (pp = 1), then the first chunk's ``ceil(L/(pp·v))`` layers from the last, one whole layer at a time,
    then the embedding. ``bucket_params <= 0`` (no buckets in the profile): share 0, so that the overlap share
    alone says what hides. Book: §11.2, the DP term.
    """
    if bucket_params <= 0:
        return 0.0
    tp = layout.tp
    layer = layer_params(m) / tp
    embedding = embedding_params(m) / tp
    sizes = ([(m.vocab * m.hidden if not m.tied_embeddings else 0) / tp] if layout.pp == 1 else [])
    sizes += [layer] * (m.layers if layout.pp == 1 else math.ceil(m.layers / (layout.pp * layout.interleave)))
    open_bucket = 0.0
    for n in sizes:
        open_bucket += n
        if open_bucket >= bucket_params:
            open_bucket = 0.0
    return min(1.0, (open_bucket + embedding) / dp_gradient_nbytes(m, layout, 1))


def fsdp_exposed_seconds(gather_s: float, reduce_s: float, forward_s: float, backward_s: float,
                         gather_overlap: float, reduce_overlap: float, head_share: float = 0.0,
                         slowdown: float = 1.0) -> tuple[float, float]:
    """``(exposed, hidden)`` seconds of one micro-batch's ZeRO-3 / FSDP communication.

    ``gather_s``: one AllGather of the parameters; it runs twice, before the forward pass (hidden up to
    ``gather_overlap × gather_s``, at most ``forward_s``) and before the backward pass; ``reduce_s``: the
    ReduceScatter of the gradients after it. The backward AllGather (``gather_overlap``) and the
    ReduceScatter (``reduce_overlap``) hide behind ``backward_s`` together: three ring passes over the
    parameter bytes, where plain data parallelism's AllReduce makes two (Rajbhandari et al. 2020, §5.3).
    ``head_share`` of the forward AllGather (the first units' parameters, gathered before any compute can
    start) and of the ReduceScatter (the same units' gradients, reduced after the last compute) is exposed
    whatever the overlap (:func:`fsdp_head_share`); the rest hides as above, in windows that ``slowdown``
    stretches (:func:`beside_seconds`).

    Raises:
        ValueError: a time that is negative or not finite, an overlap or head share outside [0, 1], a slowdown
            below 1.
    """
    _check_times_and_shares(dict(gather_s=gather_s, reduce_s=reduce_s, forward_s=forward_s, backward_s=backward_s),
                            dict(gather_overlap=gather_overlap, reduce_overlap=reduce_overlap, head_share=head_share))
    hidden = (beside_seconds(gather_overlap * (1 - head_share) * gather_s, forward_s, slowdown)
              + beside_seconds(gather_overlap * gather_s + reduce_overlap * (1 - head_share) * reduce_s, backward_s,
                               slowdown))
    return 2 * gather_s + reduce_s - hidden, hidden


def fsdp_head_share(m: ModelConfig, layout: Layout) -> float:
    """Share of one GPU's ZeRO-3 / FSDP parameters whose forward AllGather and whose ReduceScatter no
    prefetch can hide (the embedding's and the first block's), for :func:`fsdp_exposed_seconds`.

    Units as torchtitan's ``apply_fsdp`` (``torchtitan/models/llama3/infra/parallelize.py``): the token
    embedding, each block, the final norm with the output layer, the root. With pipeline stages, the heavier
    of the first stage (the embedding and a block) and the last (a block). Pessimistic for pp > 1, where
    PyTorch's pipeline stages gather and reduce-scatter about once per step, not per micro-batch. Book: §12.4.
    """
    block = layer_params(m)
    if layout.pp == 1:
        return min(1.0, (embedding_params(m) + block) / stage_params(m, 1, "only"))
    first = stage_params(m, layout.pp, "first", layout.interleave)
    last = stage_params(m, layout.pp, "last", layout.interleave)
    return min(1.0, (embedding_params(m) + block) / first if first >= last else block / last)


def _tp_link(layout: Layout, cluster: Cluster) -> tuple[Link, float]:
    d = cluster.devices_per_node
    if layout.tp <= d and d % layout.tp == 0:
        return cluster.intra, 1.0
    return cluster.inter, flows_per_nic(d, cluster.nics_per_node)


# ----------------------------------------------------------------------------------------- the step

def step_time(m: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int,
              achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
              dtype: str = "bf16", grad_bytes: int | None = None,
              software: SoftwareProfile | str | None = None) -> TimeBreakdown:
    """Predicted time of one training step (seconds), term by term (book §11.2).

    Args:
        m: the model (its ``seq`` is the training sequence length).
        layout: tp, pp, dp, micro-batch, recomputation policy, interleaving, ZeRO stage, sequence parallelism,
            FlashAttention.
        cluster: links, devices and NICs per node, peak FLOP/s per dtype (its ``nodes`` is not used: the
            layout says how many GPUs run).
        global_batch: sequences per step; must be a multiple of ``dp·micro_batch``.
        achievable_fraction: share of peak the matmuls sustain, in (0, 1]; or :data:`KERNELS` to price
            compute from the layout's kernels (:func:`~.kernels.effective_fraction`) and add the optimizer
            step (:func:`~.kernels.optimizer_step_bytes` over the GPU's memory bandwidth); or :data:`AUTO`
            (the default): the kernel model where the device has it, else 0.5 (:func:`compute_model`).
        dp_overlap: if given, replaces both DP overlap shares of the profile (0..1).
        dtype: key of ``cluster.peak_flop_per_s``.
        grad_bytes: if given, replaces the profile's bytes per gradient element (2 or 4).
        software: a :class:`~.software.SoftwareProfile` or the name of one in ``commlab/data/software.json``;
            None = :data:`~.software.DEFAULT_SOFTWARE` (nothing overlapped).

    Raises:
        ValueError: ``global_batch`` not a positive multiple of ``dp·micro_batch``; a fraction out of
            range; ``dtype`` not in the cluster's peak table; an unknown software profile; with
            :data:`KERNELS`, a cluster whose device has no GEMM table or memory bandwidth, or no share of the
            microbenchmark rates (:func:`~.kernels.in_stack_share`).
    """
    checks.integer("global_batch", global_batch, note="sequences per step")
    if global_batch % (layout.dp * layout.micro_batch):
        raise ValueError(f"global_batch={global_batch} sequences is not a multiple of dp·micro_batch = "
                         f"{layout.dp}·{layout.micro_batch}; choose a micro-batch or dp that divides it")
    achievable_fraction = compute_model(achievable_fraction, cluster.device, dtype)  # checks it, too
    kernels = achievable_fraction == KERNELS
    if dp_overlap is not None and not 0 <= dp_overlap <= 1:
        raise ValueError(f"dp_overlap must be in [0, 1], got {dp_overlap!r}")
    if dtype not in cluster.peak_flop_per_s:
        raise ValueError(f"cluster {cluster.name!r} has no peak FLOP/s for dtype {dtype!r}; it has "
                         f"{sorted(cluster.peak_flop_per_s)}")
    sw = load_software(software)
    g_bytes = sw.grad_bytes if grad_bytes is None else grad_bytes
    if g_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (bf16) or 4 (fp32), got {g_bytes!r}")
    ov_grad = sw.overlap_dp_grad_reduce if dp_overlap is None else dp_overlap
    ov_param = sw.overlap_dp_param_gather if dp_overlap is None else dp_overlap

    L = layout
    micro = global_batch // (L.dp * L.micro_batch)
    tokens = global_batch * m.seq
    gpus = L.gpus
    layers_per_stage = stage_layers(m.layers, L.pp, L.interleave)
    imbalance = layers_per_stage * L.pp / m.layers
    executed = executed_flops_per_token(m, L.recompute, L.flash_attention, True, L.recompute_every)
    optimizer = 0.0
    if kernels:
        fraction, optimizer = _kernel_terms(m, L, cluster, dtype, executed, sw, g_bytes)
    else:
        fraction = achievable_fraction
    rate = cluster.peak_flop_per_s[dtype] * fraction
    compute = executed * tokens / (gpus * rate) * imbalance
    forward_share = _forward_flops_per_token(m, L.flash_attention) / executed

    tp_total, recomputed = 0.0, 0
    if L.tp > 1:
        link, share = _tp_link(L, cluster)
        one = ring_all_reduce_seconds(tp_all_reduce_nbytes(m, L.micro_batch), L.tp, link.alpha_s,
                                      link.beta_s_per_byte * share)
        recomputed = {"full": layers_per_stage, "every-k": layers_per_stage // L.recompute_every}.get(L.recompute, 0)
        tp_total = one * (4 * layers_per_stage + 2 * recomputed) * micro
    # Megatron overlaps TP communication with the GEMMs only under sequence parallelism (validate_args in
    # megatron/training/arguments.py asserts it): without it the profile's share does not apply.
    overlap_tp = sw.overlap_tp if L.sequence_parallel else 0.0
    slow = sw.overlap_compute_slowdown
    tp_backward, backward_hidden = 0.0, 0.0
    if L.tp > 1:
        tp_backward = 2 * one * layers_per_stage * micro
        # Each layer's column-parallel weight gradients, in this model's seconds (one micro-batch, one GPU).
        per_flop = compute / (executed * layers_per_stage * micro / m.layers)
        wgrad = tuple(f * per_flop for f in column_wgrad_flops_per_token(m))
        backward_hidden = layers_per_stage * micro * backward_tp_hidden_seconds(
            one, L.sequence_parallel, overlap_tp, sw.overlap_tp_backward, wgrad, slow)
    tp_hidden = beside_seconds(overlap_tp * (tp_total - tp_backward) + backward_hidden, compute, slow)

    pp_total = 0.0
    if L.pp > 1:
        if L.tp * L.pp <= cluster.devices_per_node:
            link, share = cluster.intra, 1.0
        else:
            link, share = cluster.inter, flows_per_nic(min(L.tp, cluster.devices_per_node), cluster.nics_per_node)
        split = sw.pp_scatter_gather or L.sequence_parallel
        one = link.alpha_s + pp_message_nbytes(m, L.micro_batch, L.tp, split) * link.beta_s_per_byte * share
        pp_total = 2 * one * micro * L.interleave
    pp_hidden = min(sw.pp_overlap(L.interleave) * pp_total, slow * compute - tp_hidden)
    tp_s, pp_s = tp_total - tp_hidden, pp_total - pp_hidden

    loss = micro * sum(loss_seconds(m, L.micro_batch, L.tp, cluster.device))

    # ZeRO's ReduceScatter and AllGather run over the shard group (all of dp, or HSDP's dp_shard ranks);
    # HSDP then all-reduces each rank's 1/dp_shard gradient shard across the replica groups.
    shard, stride = L.shard_ranks, L.tp * L.pp
    grad_bytes_gpu = dp_gradient_nbytes(m, L, g_bytes)
    grad_ar = group_all_reduce_seconds(grad_bytes_gpu, shard if L.zero_stage >= 1 else L.dp, stride, cluster)
    replica_ar = group_all_reduce_seconds(grad_bytes_gpu / shard, L.replicas, stride * shard, cluster)
    per_micro = compute / micro
    if L.zero_stage >= 3:  # FSDP: per micro-batch, AllGather before forward and backward, ReduceScatter after
        one_rs = grad_ar / 2 + replica_ar  # FSDP2's HSDP all-reduces after every backward's ReduceScatter
        one_ag = group_all_reduce_seconds(dp_gradient_nbytes(m, L, 2), shard, stride, cluster) / 2
        exposed, hidden = fsdp_exposed_seconds(one_ag, one_rs, per_micro * forward_share,
                                               per_micro * (1 - forward_share), ov_param, ov_grad,
                                               fsdp_head_share(m, L), slow)
        rs, ag, dp_exposed, dp_hidden = micro * one_rs, micro * 2 * one_ag, micro * exposed, micro * hidden
    else:
        if L.zero_stage >= 1:  # distributed optimizer: ReduceScatter the gradients, AllGather the bf16 params
            rs = grad_ar / 2 + replica_ar
            ag = group_all_reduce_seconds(dp_gradient_nbytes(m, L, 2), shard, stride, cluster) / 2
            reduce_s, gather_s = rs, ag
        else:  # AllReduce = ReduceScatter + AllGather of the gradients, both during the backward pass
            rs = ag = grad_ar / 2
            reduce_s, gather_s = grad_ar, 0.0
        tail = dp_last_bucket_share(m, L, sw.bucket_params(L.dp)) if ov_grad or ov_param else 1.0
        dp_exposed, dp_hidden = dp_exposed_seconds(reduce_s, per_micro * (1 - forward_share), ov_grad,
                                                   gather_s, per_micro * forward_share, ov_param, tail, tail, slow)
    slowdown = slowdown_seconds(tp_hidden + pp_hidden + dp_hidden, slow)
    # The bubble idles a stage for (p-1)/(v m) of its per-micro-batch work: the compute and what of TP and PP
    # is exposed, and the slowdown that hidden TP, PP and ZeRO-3's per-op collectives add to each op (the DP
    # reduction of ZeRO 0-2 slows only the step's last backward pass).
    per_op_slowdown = slowdown_seconds(tp_hidden + pp_hidden + (dp_hidden if L.zero_stage >= 3 else 0.0), slow)
    bubble = (L.pp - 1) / (L.interleave * micro) * (compute + tp_s + pp_s + loss + per_op_slowdown)
    return TimeBreakdown(compute_s=compute, tp_s=tp_s, pp_s=pp_s, bubble_s=bubble, dp_s=rs + ag,
                         dp_exposed_s=dp_exposed, micro_batches=micro, tokens_per_step=tokens,
                         model_flop_per_step=model_flops_per_token(m) * tokens, gpus=gpus,
                         tp_hidden_s=tp_hidden, pp_hidden_s=pp_hidden, dp_reduce_scatter_s=rs, dp_all_gather_s=ag,
                         overlap_slowdown_s=slowdown, executed_flop_per_step=executed * tokens, software=sw.name,
                         optimizer_s=optimizer, compute_fraction=fraction, loss_s=loss)


@lru_cache(maxsize=32)
def _memory_bandwidth(device: str) -> float | None:
    """The device's ``hbm_bytes_per_s`` from ``commlab/data/hardware.json``, bytes/s; None where it has none."""
    from commlab import hardware
    try:
        return hardware.value(device, "hbm_bytes_per_s")
    except KeyError:
        return None


def loss_seconds(m: ModelConfig, micro_batch: int, tp: int, device: str) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one micro-batch's loss over the vocabulary on a last-stage GPU:
    :func:`~.kernels.loss_bytes_per_token` × ``micro_batch·s`` tokens over the device's memory bandwidth
    (bytes/s, ``hbm_bytes_per_s`` in ``commlab/data/hardware.json``); ``(0.0, 0.0)`` for a device without one.

    Raises:
        ValueError: ``tp`` not an int >= 1.
    """
    from commlab.parallel.planner.kernels import loss_bytes_per_token
    forward, backward = loss_bytes_per_token(m, tp)
    hbm = _memory_bandwidth(device)
    if hbm is None:
        return 0.0, 0.0
    tokens = micro_batch * m.seq
    return forward * tokens / hbm, backward * tokens / hbm


def _kernel_terms(m: ModelConfig, layout: Layout, cluster: Cluster, dtype: str, executed: float,
                  sw: SoftwareProfile, grad_bytes: int) -> tuple[float, float]:
    """(share of peak from the kernels, optimizer-step seconds) of a layout on the cluster's device."""
    from commlab import hardware
    from commlab.parallel.planner import kernels
    device = cluster.device
    try:
        hbm = hardware.value(device, "hbm_bytes_per_s")
    except (KeyError, ValueError):
        raise ValueError(f"the kernel model needs the memory bandwidth of the cluster's device {device!r} "
                         f"(hbm_bytes_per_s in commlab/data/hardware.json); it has none") from None
    fraction = kernels.effective_fraction(m, layout, device, cluster.peak_flop_per_s[dtype], hbm, executed)
    # The heaviest stage's parameters on one GPU: split by tp, and by dp under ZeRO (the optimizer then
    # updates only its shard).
    stage = "only" if layout.pp == 1 else "last"
    params = stage_params(m, layout.pp, stage, layout.interleave) / layout.tp
    if layout.zero_stage >= 1:
        params /= layout.dp
    opt = sw.optimizer
    seconds = kernels.optimizer_step_bytes(params, opt.state_bytes, grad_bytes, opt.param_bytes) / hbm
    return fraction, seconds
