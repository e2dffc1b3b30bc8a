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
from functools import lru_cache

from commlab import checks, hardware
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner.communication import (backward_tp_hidden_seconds, beside_seconds, dp_exposed_seconds,
                                                    dp_last_bucket_share, fsdp_exposed_seconds, fsdp_head_share,
                                                    group_all_reduce_seconds, slowdown_seconds, tp_link)
from commlab.parallel.planner.counting import (column_wgrad_flops_per_token, dp_gradient_nbytes,
                                               executed_flops_per_token, forward_flops_per_token,
                                               loss_bytes_per_token, model_flops_per_token, optimizer_step_bytes,
                                               pp_message_nbytes, tp_all_reduce_nbytes)
from commlab.parallel.planner.kernels import effective_fraction, kernel_model_gap
from commlab.parallel.planner.memory import Layout, ModelConfig, stage_layers, stage_params
from commlab.parallel.planner.software import SoftwareProfile, load_software
from commlab.topology import Cluster, flows_per_nic

__all__ = ["TimeBreakdown", "DEFAULT_ACHIEVABLE_FRACTION", "KERNELS", "AUTO", "compute_model", "loss_seconds",
           "step_time"]

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
    forward_share = forward_flops_per_token(m, L.flash_attention) / executed

    tp_total, recomputed = 0.0, 0
    if L.tp > 1:
        link, share = tp_link(L, cluster)
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
    forward, backward = loss_bytes_per_token(m, tp)
    hbm = _memory_bandwidth(device)
    if hbm is None:
        return 0.0, 0.0
    tokens = micro_batch * m.seq
    return forward * tokens / hbm, backward * tokens / hbm


def _kernel_terms(m: ModelConfig, layout: Layout, cluster: Cluster, dtype: str, executed: float,
                  sw: SoftwareProfile, grad_bytes: int) -> tuple[float, float]:
    """(share of peak from the kernels, optimizer-step seconds) of a layout on the cluster's device."""
    device = cluster.device
    try:
        hbm = hardware.value(device, "hbm_bytes_per_s")
    except (KeyError, ValueError):
        raise ValueError(f"the kernel model needs the memory bandwidth of the cluster's device {device!r} "
                         f"(hbm_bytes_per_s in commlab/data/hardware.json); it has none") from None
    fraction = effective_fraction(m, layout, device, cluster.peak_flop_per_s[dtype], hbm, executed)
    # The heaviest stage's parameters on one GPU: split by tp, and by dp under ZeRO (the optimizer then
    # updates only its shard).
    stage = "only" if layout.pp == 1 else "last"
    params = stage_params(m, layout.pp, stage, layout.interleave) / layout.tp
    if layout.zero_stage >= 1:
        params /= layout.dp
    opt = sw.optimizer
    seconds = optimizer_step_bytes(params, opt.state_bytes, grad_bytes, opt.param_bytes) / hbm
    return fraction, seconds
