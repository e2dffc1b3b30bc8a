"""Seconds of one training step of a 3D-parallel layout, and the per-op costs the step timeline replays.

:func:`step_costs` prices one micro-batch's ops on one GPU of every pipeline stage (:class:`StepCosts`);
:func:`step_time` sums them for a pipeline whose stages are all as heavy as the heaviest (:class:`TimeBreakdown`).
What hides beside what is decided by :mod:`~.communication` for the sum and the replay alike. Compute is priced
by one share of peak (:data:`DEFAULT_ACHIEVABLE_FRACTION`) or by kernels (:data:`KERNELS`; :data:`AUTO` picks).
Sources: Narayanan et al. 2021 §2.2, §3.2; Korthikanti et al. 2022 §5, §6.2; Rajbhandari et al. 2020 §5.3.
Book: chapter 11, §11.2 and §11.7; chapter 12, §12.4."""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from commlab import checks, hardware
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner.communication import (StageCosts, StepCosts, backward_tp_hidden_seconds, chunk_ops,
                                                    dp_last_bucket_share, dp_times, fsdp_head_share, fsdp_units,
                                                    group_all_reduce_seconds, send_times, slowdown_seconds, tp_link)
from commlab.parallel.planner.counting import (attention_flops_per_token, column_wgrad_flops_per_token,
                                               dp_gradient_nbytes, executed_flops_per_token, forward_flops_per_token,
                                               loss_bytes_per_token, model_flops_per_token, optimizer_step_bytes,
                                               pp_message_nbytes, tp_all_reduce_nbytes)
from commlab.parallel.planner.kernels import effective_fraction, kernel_model_gap
from commlab.parallel.planner.memory import Layout, ModelConfig, layer_params, stage_layers, stage_params
from commlab.parallel.planner.software import SoftwareProfile, load_software
from commlab.topology import Cluster, flows_per_nic

__all__ = ["TimeBreakdown", "DEFAULT_ACHIEVABLE_FRACTION", "KERNELS", "AUTO", "chunk_layers", "compute_model",
           "loss_seconds", "step_costs", "step_time", "sum_of_terms"]

#: Share of dense peak FLOP/s the model's matrix multiplications achieve (why 0.5: book §11.2).
DEFAULT_ACHIEVABLE_FRACTION = 0.5

#: ``achievable_fraction="kernels"``: price compute from the layer's kernels (:mod:`~.kernels`).
KERNELS = "kernels"
#: ``achievable_fraction="auto"`` (the default): :data:`KERNELS` where the device has the data, else
#: :data:`DEFAULT_ACHIEVABLE_FRACTION` (:func:`compute_model`).
AUTO = "auto"


def compute_model(achievable_fraction: float | str, device: str, dtype: str = "bf16") -> float | str:
    """What prices compute on ``device``: :data:`AUTO` gives :data:`KERNELS` where :func:`~.kernels.kernel_model_gap`
    finds nothing missing for ``dtype``, else :data:`DEFAULT_ACHIEVABLE_FRACTION`; others as given.

    Raises:
        ValueError: :data:`KERNELS` where the device lacks what it needs (says what); not :data:`AUTO` and not a
            share in (0, 1].
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
    """One step on one GPU's critical path, seconds, and what it yields.

    ``compute_s``: the matmuls of all micro-batches; ``tp_s``, ``pp_s``, ``dp_exposed_s``: exposed communication
    (``*_hidden_s`` the hidden parts; ``dp_s`` the DP/ZeRO traffic in full, split into ReduceScatter and AllGather);
    ``bubble_s``: fill and drain; ``overlap_slowdown_s``: what hidden communication costs compute; ``loss_s``,
    ``optimizer_s``: the cross-entropy and the optimizer step; ``compute_fraction``: share of peak of the
    executed FLOP; ``model_flop_per_step``: ``(6·P + 12·L·h·s) × tokens``."""

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
        """Step time, s: compute, loss, slowdown, exposed TP, PP and DP, bubble and optimizer step."""
        return (self.compute_s + self.loss_s + self.overlap_slowdown_s + self.tp_s + self.pp_s + self.bubble_s
                + self.dp_exposed_s + self.optimizer_s)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput, tokens/s."""
        return self.tokens_per_step / self.total_s

    @property
    def model_flop_per_s_per_gpu(self) -> float:
        """Model FLOP/s per GPU (``"model"`` definition)."""
        return self.model_flop_per_step / self.total_s / self.gpus

    def flop_per_s_per_gpu(self, flop_per_step: float) -> float:
        """FLOP/s per GPU for ``flop_per_step`` in another accounting (:func:`~.counting.model_flops_per_step`)."""
        return flop_per_step / self.total_s / self.gpus


def chunk_layers(layers: int, pp: int, interleave: int = 1) -> list[list[int]]:
    """Layers of each chunk of each stage, ``out[s][c]`` for virtual stage ``c·pp + s``: ``ceil(L/(pp·v))`` each, the
    surplus taken off virtual stages 0, ``pp·v - 1``, 1, ... (the stages with the embedding and the output layer,
    as Llama 3 405B, Llama 3 paper §3.3.2).

    Raises:
        ValueError: as :func:`~.memory.stage_layers`.
    """
    stage_layers(layers, pp, interleave)  # validates
    n = pp * interleave
    per = [math.ceil(layers / n)] * n
    order = [i // 2 if i % 2 == 0 else n - 1 - i // 2 for i in range(n)]
    for k in order[:sum(per) - layers]:
        per[k] -= 1
    return [[per[c * pp + s] for c in range(interleave)] for s in range(pp)]


# ----------------------------------------------------------------------------------------- pricing

def step_costs(m: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int,
               software: SoftwareProfile | str | None = None, achievable_fraction: float | str = AUTO,
               dp_overlap: float | None = None, dtype: str = "bf16", grad_bytes: int | None = None,
               optimizer_s: float | None = None, uniform: bool = False) -> tuple[StepCosts, TimeBreakdown]:
    """``(StepCosts, TimeBreakdown)`` of a plan (arguments as :func:`step_time`): each stage with its own layers
    (:func:`chunk_layers`), or with ``uniform=True`` every chunk as the heaviest stage's average, as
    :func:`step_time` sums. ``optimizer_s``: the optimizer step, s (None: the time model's).

    Raises:
        ValueError: what :func:`step_time` raises.
    """
    p = _price(m, layout, cluster, global_batch, software, achievable_fraction, dp_overlap, dtype, grad_bytes)
    return _costs(p, uniform, optimizer_s), _breakdown(p)


def step_time(m: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int,
              achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
              dtype: str = "bf16", grad_bytes: int | None = None,
              software: SoftwareProfile | str | None = None) -> TimeBreakdown:
    """Predicted seconds of one training step, term by term (book §11.2): the ops of :func:`step_costs`
    (``uniform=True``) summed by :func:`sum_of_terms`.

    ``achievable_fraction``: a share of peak in (0, 1], :data:`KERNELS` or :data:`AUTO` (:func:`compute_model`);
    ``dp_overlap``: replaces both DP overlap shares; ``grad_bytes``: the profile's (2 or 4) unless given;
    ``software``: a :class:`~.software.SoftwareProfile` or its name (None: nothing overlapped).

    Raises:
        ValueError: ``global_batch`` not a positive multiple of ``dp·micro_batch``; a fraction out of range;
            ``dtype`` not in the cluster's peak table; an unknown profile; :data:`KERNELS` on a device without
            what the kernel model needs.
    """
    return _breakdown(_price(m, layout, cluster, global_batch, software, achievable_fraction, dp_overlap, dtype,
                             grad_bytes))


@dataclasses.dataclass(frozen=True)
class _Prices:
    """What :func:`_price` finds for a plan (seconds per micro-batch on one GPU unless said)."""

    m: ModelConfig
    layout: Layout
    sw: SoftwareProfile
    micro: int
    tokens: int
    executed: float
    fraction: float
    sec_per_flop: float  # per executed FLOP on one GPU, per token of the micro-batch on that GPU
    optimizer_s: float
    loss_s: tuple
    tp_one_s: float
    pp_message_s: float
    ov_grad: float
    ov_param: float
    dp_reduce: tuple
    dp_gather_s: float
    fsdp_gather_s: float
    fsdp_reduce_s: float


def _price(m, layout, cluster, global_batch, software, achievable_fraction, dp_overlap, dtype, grad_bytes) -> _Prices:
    """The plan's prices (arguments and errors as :func:`step_time`)."""
    checks.integer("global_batch", global_batch, note="sequences per step")
    L = layout
    if global_batch % (L.dp * L.micro_batch):
        raise ValueError(f"global_batch={global_batch} sequences is not a multiple of dp·micro_batch = "
                         f"{L.dp}·{L.micro_batch}; choose a micro-batch or dp that divides it")
    achievable_fraction = compute_model(achievable_fraction, cluster.device, dtype)  # checks it, too
    if dp_overlap is not None:
        checks.share("dp_overlap", dp_overlap)
    if dtype not in cluster.peak_flop_per_s:
        raise ValueError(f"cluster {cluster.name!r} has no peak FLOP/s for dtype {dtype!r}; it has "
                         f"{sorted(cluster.peak_flop_per_s)}")
    sw = load_software(software)
    g_bytes = sw.grad_bytes if grad_bytes is None else grad_bytes
    checks.one_of("grad_bytes", g_bytes, (2, 4), note="bf16 or fp32")
    micro = global_batch // (L.dp * L.micro_batch)
    executed = executed_flops_per_token(m, L.recompute, L.flash_attention, True, L.recompute_every)
    optimizer = 0.0
    if achievable_fraction == KERNELS:
        fraction, optimizer = _kernel_terms(m, L, cluster, dtype, executed, sw, g_bytes)
    else:
        fraction = achievable_fraction
    # Seconds per FLOP on one GPU: the tp ranks split each matmul, so a token costs 1/tp of its FLOP there.
    sec_per_flop = L.micro_batch * m.seq / L.tp / (cluster.peak_flop_per_s[dtype] * fraction)

    tp_one = 0.0
    if L.tp > 1:
        link, share = tp_link(L, cluster)
        tp_one = ring_all_reduce_seconds(tp_all_reduce_nbytes(m, L.micro_batch), L.tp, link.alpha_s,
                                         link.beta_s_per_byte * share)
    pp_one = 0.0
    if L.pp > 1:
        if L.tp * L.pp <= cluster.devices_per_node:
            link, share = cluster.intra, 1.0
        else:
            link, share = cluster.inter, flows_per_nic(min(L.tp, cluster.devices_per_node), cluster.nics_per_node)
        split = sw.pp_scatter_gather or L.sequence_parallel
        pp_one = link.alpha_s + pp_message_nbytes(m, L.micro_batch, L.tp, split) * link.beta_s_per_byte * share

    # ZeRO's ReduceScatter and AllGather run over the shard group (all of dp, or HSDP's dp_shard ranks);
    # HSDP then all-reduces each rank's 1/dp_shard gradient shard across the replica groups. ZeRO-2 and -3
    # run them every micro-batch, one per FSDP unit (fsdp_units: each pays its latency), the others once.
    shard, stride = L.shard_ranks, L.tp * L.pp
    units = fsdp_units(m, L) if L.zero_stage >= 2 else 1

    def ring(nbytes, n, apart):  # AllReduce seconds of nbytes per GPU, in `units` collectives
        return units * group_all_reduce_seconds(nbytes / units, n, apart, cluster)

    grad = dp_gradient_nbytes(m, L, g_bytes)
    grad_ar = ring(grad, shard if L.zero_stage >= 1 else L.dp, stride)
    reduce_scatter = grad_ar / 2 + ring(grad / shard, L.replicas, stride * shard)
    gather = ring(dp_gradient_nbytes(m, L, 2), shard, stride) / 2
    fsdp_g = fsdp_r = 0.0
    reduce, dp_gather = (), 0.0
    if L.zero_stage >= 2:  # per micro-batch: ReduceScatter after each backward (DeepSpeed engine.py; FSDP2)
        fsdp_r = reduce_scatter
        if L.zero_stage == 3 or sw.zero2_reshard_after_backward:  # AllGather before each forward (ZeRO-3:
            fsdp_g = gather                                          # and each backward)
        else:  # DeepSpeed's stage 2: the parameters AllGathered once, after the optimizer step
            dp_gather = group_all_reduce_seconds(dp_gradient_nbytes(m, L, 2), shard, stride, cluster) / 2
    elif L.zero_stage == 1:  # distributed optimizer: ReduceScatter the gradients, AllGather the bf16 params
        reduce, dp_gather = (("dp_reduce_scatter", reduce_scatter),), gather
    else:  # AllReduce = ReduceScatter + AllGather of the gradients, both during the backward pass
        reduce = (("dp_reduce_scatter", grad_ar / 2), ("dp_all_gather", grad_ar / 2))
    return _Prices(m, L, sw, micro, global_batch * m.seq, executed, fraction, sec_per_flop, optimizer,
                   loss_seconds(m, L.micro_batch, L.tp, cluster.device), tp_one, pp_one,
                   sw.overlap_dp_grad_reduce if dp_overlap is None else dp_overlap,
                   sw.overlap_dp_param_gather if dp_overlap is None else dp_overlap,
                   reduce, dp_gather, fsdp_g, fsdp_r)


def _costs(p: _Prices, uniform: bool, optimizer_s: float | None) -> StepCosts:
    """The :class:`StepCosts` of priced plan ``p`` (see :func:`step_costs`)."""
    m, L, sw = p.m, p.layout, p.sw
    v, heavy, sec = L.interleave, stage_layers(m.layers, L.pp, L.interleave), p.sec_per_flop
    att_f, att_b = attention_flops_per_token(m, L.flash_attention, True)
    lp = layer_params(m)
    rec_layer = p.executed - executed_flops_per_token(m, "none", L.flash_attention)
    every = {"full": 1, "every-k": L.recompute_every}.get(L.recompute)
    rec_tp = 0.0 if every is None else (heavy // every) / heavy
    overlap_tp = sw.overlap_tp if L.sequence_parallel else 0.0  # Megatron's --tp-comm-overlap needs SP
    wgrad = tuple(w * sec for w in column_wgrad_flops_per_token(m))
    tp_hidden = (backward_tp_hidden_seconds(p.tp_one_s, L.sequence_parallel, overlap_tp, sw.overlap_tp_backward, wgrad,
                                            sw.overlap_compute_slowdown) if L.tp > 1 else 0.0)
    loss_f, loss_b = p.loss_s
    if uniform:  # the heaviest stage's FLOP (the output layer spread over the stages), the whole loss
        fwd = forward_flops_per_token(m, L.flash_attention)
        n = heavy / v
        chunk = ((fwd * heavy / m.layers / v * sec + loss_f / v,), ((p.executed - fwd - rec_layer) * heavy
                 / m.layers / v * sec + loss_b / v,), (rec_layer * heavy / m.layers / v * sec,),
                 (2 * n * p.tp_one_s,), (2 * n * p.tp_one_s,), (2 * n * rec_tp * p.tp_one_s,), (n * tp_hidden,))
        stages = [StageCosts(*(x * v for x in chunk))] * L.pp
    else:
        out_f, out_b = 2.0 * m.vocab * m.hidden * sec, 4.0 * m.vocab * m.hidden * sec  # never recomputed
        stages = []
        for s, counts in enumerate(chunk_layers(m.layers, L.pp, v)):
            cols = [[] for _ in range(7)]
            for c, n in enumerate(counts):
                last = (c * L.pp + s) == L.pp * v - 1
                for col, x in zip(cols, ((2 * lp + att_f) * n * sec + (out_f + loss_f if last else 0.0),
                                         (4 * lp + att_b) * n * sec + (out_b + loss_b if last else 0.0),
                                         rec_layer / m.layers * n * sec, 2 * n * p.tp_one_s, 2 * n * p.tp_one_s,
                                         2 * n * rec_tp * p.tp_one_s, n * tp_hidden)):
                    col.append(x)
            stages.append(StageCosts(*map(tuple, cols)))
    fsdp = L.zero_stage >= 2
    tail = dp_last_bucket_share(m, L, sw.bucket_params(L.dp))
    return StepCosts(stages=tuple(stages), micro_batches=p.micro, pp_message_s=p.pp_message_s, overlap_tp=overlap_tp,
                     overlap_pp=sw.pp_overlap(v), compute_slowdown=sw.overlap_compute_slowdown,
                     dp_reduce=p.dp_reduce, dp_gather_s=p.dp_gather_s, overlap_dp_grad_reduce=p.ov_grad,
                     overlap_dp_param_gather=p.ov_param if L.zero1 else 0.0,
                     optimizer_s=p.optimizer_s if optimizer_s is None else optimizer_s,
                     dp_reduce_tail=tail, dp_gather_head=tail,
                     fsdp_gather_s=p.fsdp_gather_s / v, fsdp_reduce_s=p.fsdp_reduce_s / v,
                     fsdp_head_share=fsdp_head_share(m, L) if fsdp else 0.0, fsdp_gather_backward=L.zero_stage >= 3)


def _breakdown(p: _Prices) -> TimeBreakdown:
    return sum_of_terms(_costs(p, True, None), p.micro * sum(p.loss_s),
                        tokens_per_step=p.tokens, model_flop_per_step=model_flops_per_token(p.m) * p.tokens,
                        gpus=p.layout.gpus, executed_flop_per_step=p.executed * p.tokens, software=p.sw.name,
                        compute_fraction=p.fraction)


def sum_of_terms(costs: StepCosts, loss_s: float = 0.0, **fields) -> TimeBreakdown:
    """The step time of ``costs``, its first stage taken for every stage: ``m`` micro-batches of every chunk's ops
    and sends, the bubble ``(p-1)/v`` of one micro-batch's (Narayanan et al. 2021 §2.2), the DP communication
    (:func:`~.communication.dp_times`) and the optimizer step. ``loss_s``: the part of the work that is the loss;
    ``fields``: the :class:`TimeBreakdown` fields about the plan."""
    m, pp, v, slow = costs.micro_batches, costs.pp, costs.interleave, costs.compute_slowdown
    ops = [op for c in range(v) for op in chunk_ops(costs, 0, c)]
    send_x, send_slow = send_times(costs.pp_message_s, costs.overlap_pp, slow) if pp > 1 else (0.0, 0.0)
    sends = 2 * v if pp > 1 else 0
    per_micro = sum(op.seconds for op in ops) + sends * (send_x + send_slow)
    g_exp, g_hid, r_exp, r_hid = dp_times(costs, 0)
    rs = sum(d for k, d in costs.dp_reduce if k == "dp_reduce_scatter") + m * v * costs.fsdp_reduce_s
    ag = (sum(d for k, d in costs.dp_reduce if k == "dp_all_gather") + costs.dp_gather_s
          + (1 + costs.fsdp_gather_backward) * m * v * costs.fsdp_gather_s)
    fields = {"tokens_per_step": 0, "model_flop_per_step": 0.0, "gpus": 1, **fields}
    return TimeBreakdown(
        compute_s=m * sum(op.work_s for op in ops) - loss_s, loss_s=loss_s,
        tp_s=m * sum(op.tp_exposed_s for op in ops), tp_hidden_s=m * sum(op.tp_hidden_s for op in ops),
        pp_s=m * sends * send_x, pp_hidden_s=m * sends * costs.overlap_pp * costs.pp_message_s,
        bubble_s=(pp - 1) / v * per_micro, dp_s=rs + ag, dp_reduce_scatter_s=rs, dp_all_gather_s=ag,
        dp_exposed_s=m * sum(op.wait_s + op.reduce_exposed_s for op in ops) + g_exp + r_exp,
        overlap_slowdown_s=(m * (sum(op.slowdown_s for op in ops) + sends * send_slow)
                            + slowdown_seconds(g_hid + r_hid, slow)),
        micro_batches=m, optimizer_s=costs.optimizer_s, **fields)


@lru_cache(maxsize=32)
def _memory_bandwidth(device: str) -> float | None:
    """The device's ``hbm_bytes_per_s`` in ``commlab/data/hardware.json``, bytes/s; None where it has none."""
    try:
        return hardware.value(device, "hbm_bytes_per_s")
    except (KeyError, ValueError):
        return None


def loss_seconds(m: ModelConfig, micro_batch: int, tp: int, device: str) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one micro-batch's vocabulary cross-entropy on a last-stage GPU:
    :func:`~.counting.loss_bytes_per_token` × tokens / the device's ``hbm_bytes_per_s``; (0, 0) without one.

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
    device, hbm = cluster.device, _memory_bandwidth(cluster.device)
    if hbm is None:
        raise ValueError(f"the kernel model needs the memory bandwidth of the cluster's device {device!r} "
                         f"(hbm_bytes_per_s in commlab/data/hardware.json); it has none")
    fraction = effective_fraction(m, layout, device, cluster.peak_flop_per_s[dtype], hbm, executed)
    # The heaviest stage's parameters on one GPU: split by tp, and under ZeRO by its shard group (HSDP: dp_shard).
    stage = "only" if layout.pp == 1 else "last"
    params = stage_params(m, layout.pp, stage, layout.interleave) / layout.tp
    if layout.zero_stage >= 1:
        params /= layout.shard_ranks
    opt = sw.optimizer
    seconds = optimizer_step_bytes(params, opt.state_bytes, grad_bytes, opt.param_bytes) / hbm
    return fraction, seconds
