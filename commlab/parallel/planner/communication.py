"""Communication seconds of a layout's collectives and the overlap arithmetic: what hides beside what.

:func:`group_all_reduce_seconds` and :func:`dp_all_reduce_seconds` (α-β rings, hierarchical across nodes with
the NICs shared), :func:`tp_link`; the overlap rules, each written once: :func:`op_times` (one op's compute
with its TP and ZeRO-2/3 collectives beside it), :func:`send_times` (a pipeline send),
:func:`dp_exposed_seconds` (the once-per-step DP communication), :func:`backward_tp_hidden_seconds`;
:func:`chunk_ops` and :func:`dp_times` apply them to a :class:`StepCosts`, for the step time and the timeline
alike. Compute beside communication runs ``1/overlap_compute_slowdown`` as fast: an assumption (Lee et al.
2025, arXiv:2507.03114, measured it on NVLink collectives inside a node). Sources: Korthikanti et al. 2022
§6.2; Rajbhandari et al. 2020 §5.3. Book: chapter 11, §11.2; chapter 12, §12.4.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from commlab import checks
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner.counting import dp_gradient_nbytes, input_grad_share
from commlab.parallel.planner.memory import (Layout, ModelConfig, embedding_params, layer_params, stage_layers,
                                             stage_params)
from commlab.topology import Cluster, Link, flows_per_nic

__all__ = ["beside_seconds", "slowdown_seconds", "backward_tp_hidden_seconds", "dp_all_reduce_seconds",
           "group_all_reduce_seconds", "dp_exposed_seconds", "dp_last_bucket_share", "OpTimes", "op_times",
           "send_times", "fsdp_head_share", "fsdp_units", "tp_link", "StageCosts", "StepCosts", "chunk_ops",
           "dp_times"]


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


@dataclasses.dataclass(frozen=True)
class OpTimes:
    """One op (a chunk's forward, or its recomputation and backward, for one micro-batch) on its GPU's
    compute stream, seconds: the exposed AllGather it waits for (``wait_s``, ZeRO-3), its computation
    (``work_s``), the slowdown hidden communication adds (``slowdown_s``), exposed TP (``tp_exposed_s``), the
    exposed ReduceScatter after it (``reduce_exposed_s``); and what hides beside it (``*_hidden_s``)."""

    wait_s: float
    work_s: float
    slowdown_s: float
    tp_exposed_s: float
    reduce_exposed_s: float
    tp_hidden_s: float
    gather_hidden_s: float
    reduce_hidden_s: float

    @property
    def seconds(self) -> float:
        """The op's time on the compute stream: wait + work + slowdown + exposed TP + exposed ReduceScatter."""
        return self.wait_s + self.work_s + self.slowdown_s + self.tp_exposed_s + self.reduce_exposed_s


def op_times(work_s: float, tp_s: float = 0.0, tp_hidable_s: float = 0.0, gather_s: float = 0.0,
             gather_hidable_s: float = 0.0, reduce_s: float = 0.0, reduce_hidable_s: float = 0.0,
             slowdown: float = 1.0) -> OpTimes:
    """The overlap rule of one op (the step time sums it, the timeline lays it out; book §11.2).

    Of ``tp_s`` seconds of TP communication, ``tp_hidable_s`` may hide beside the op's ``work_s`` of
    compute (:func:`beside_seconds`); of its ZeRO-3 AllGather (``gather_s``, before the compute) and
    ReduceScatter (``reduce_s``, after it), ``gather_hidable_s`` and then ``reduce_hidable_s`` may hide
    beside the same compute, on their own link. What hides slows the compute (:func:`slowdown_seconds`);
    the rest is exposed.

    Raises:
        ValueError: a negative or non-finite time; a hidable part above its whole; a slowdown below 1.
    """
    for name, v, whole in (("work_s", work_s, math.inf), ("tp_s", tp_s, math.inf), ("gather_s", gather_s, math.inf),
                           ("reduce_s", reduce_s, math.inf), ("tp_hidable_s", tp_hidable_s, tp_s),
                           ("gather_hidable_s", gather_hidable_s, gather_s),
                           ("reduce_hidable_s", reduce_hidable_s, reduce_s)):
        if not (type(v) in (float, int) and 0 <= v < math.inf):
            checks.seconds(name, v)
        if v > whole * (1 + 1e-12):
            raise ValueError(f"{name}={v!r} s is more than the {whole!r} s it is part of")
    if not (type(slowdown) in (float, int) and slowdown >= 1):
        checks.number("slowdown", slowdown, least=1, note="1 = compute does not slow beside communication")
    window = slowdown * work_s  # what the compute, slowed, holds beside it (beside_seconds)
    tp_hidden = min(tp_hidable_s, window)
    g_hidden = min(gather_hidable_s, window)
    r_hidden = min(gather_hidable_s + reduce_hidable_s, window) - g_hidden
    slow = slowdown_seconds(tp_hidden, slowdown) + slowdown_seconds(g_hidden + r_hidden, slowdown)
    return OpTimes(max(0.0, gather_s - g_hidden), work_s, slow, max(0.0, tp_s - tp_hidden),
                   max(0.0, reduce_s - r_hidden), tp_hidden, g_hidden, r_hidden)


def send_times(message_s: float, overlap_pp: float, slowdown: float = 1.0) -> tuple[float, float]:
    """``(exposed, slowdown)`` seconds a pipeline send of ``message_s`` costs its sender's stream: the
    ``1 - overlap_pp`` share in series, and the hidden rest slows the sender's next compute
    (:func:`slowdown_seconds`). The message arrives ``message_s`` after it leaves, whatever hides."""
    checks.seconds("message_s", message_s)
    checks.share("overlap_pp", overlap_pp)
    return (1 - overlap_pp) * message_s, slowdown_seconds(overlap_pp * message_s, slowdown)


def fsdp_head_share(m: ModelConfig, layout: Layout) -> float:
    """Share of one GPU's ZeRO-3 / FSDP parameters whose forward AllGather and whose ReduceScatter no
    prefetch can hide (the embedding's and the first block's), for :func:`chunk_ops`.

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


def fsdp_units(m: ModelConfig, layout: Layout) -> int:
    """FSDP units on one GPU of the heaviest stage, each with its own AllGather and ReduceScatter (and their
    latency) every micro-batch: torchtitan's ``apply_fsdp`` wraps every block, the token embedding (first
    stage) and the final norm with the output layer (last stage): ``stage_layers + 2`` with one stage, ``+ 1``
    with several (the root holds nothing more). Book: chapter 12, §12.4."""
    return stage_layers(m.layers, layout.pp, layout.interleave) + (2 if layout.pp == 1 else 1)


def tp_link(layout: Layout, cluster: Cluster) -> tuple[Link, float]:
    """The link a TP group of ``layout.tp`` ranks uses and the share of it each rank gets: the intra-node link
    (share 1) when the group fits in a node, else the NIC shared by :func:`~commlab.topology.flows_per_nic`."""
    d = cluster.devices_per_node
    if layout.tp <= d and d % layout.tp == 0:
        return cluster.intra, 1.0
    return cluster.inter, flows_per_nic(d, cluster.nics_per_node)


# ----------------------------------------------------------------------------------------- per-op costs

@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per-micro-batch seconds of one GPU of a pipeline stage, one entry per model chunk (v of them).

    Attributes:
        forward_s, backward_s, recompute_s: computation of one micro-batch on the chunk.
        tp_forward_s, tp_backward_s, tp_recompute_s: the TP collectives of that computation, in full.
        tp_backward_hidden_s: of the backward's TP, what may hide behind its computation
            (:func:`~.communication.backward_tp_hidden_seconds` for each of the chunk's layers); None: the
            ``overlap_tp`` share of ``tp_backward_s``, as for the forward.

    Raises:
        ValueError: a negative or non-finite time; the tuples of unequal length or empty.
    """

    forward_s: tuple
    backward_s: tuple
    recompute_s: tuple = ()
    tp_forward_s: tuple = ()
    tp_backward_s: tuple = ()
    tp_recompute_s: tuple = ()
    tp_backward_hidden_s: tuple | None = None

    def __post_init__(self):
        v = len(self.forward_s)
        if v < 1:
            raise ValueError("a stage needs the costs of at least one chunk")
        for f in dataclasses.fields(self):
            if f.name == "tp_backward_hidden_s" and self.tp_backward_hidden_s is None:
                continue
            vals = getattr(self, f.name) or (0.0,) * v
            if len(vals) != v:
                raise ValueError(f"{f.name} has {len(vals)} chunks, forward_s has {v}")
            object.__setattr__(self, f.name, tuple(checks.seconds(f.name, x) for x in vals))

    @property
    def chunks(self) -> int:
        return len(self.forward_s)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Everything the step time and the replay need (seconds, shares), independent of how it was priced.

    Attributes:
        stages, micro_batches: one :class:`StageCosts` per pipeline stage (all with ``interleave`` chunks); m.
        pp_message_s: one pipeline message (activation forward or gradient backward), s.
        overlap_tp, overlap_pp: shares of TP and PP communication that may run beside compute.
        compute_slowdown: factor (>= 1) by which compute slows while communication runs beside it.
        dp_reduce: ``((kind, seconds), ...)`` of the gradient reduction (``dp_reduce_scatter``, then
            ``dp_all_gather`` for an AllReduce); dp_gather_s: the distributed optimizer's AllGather (0: none).
        overlap_dp_grad_reduce, overlap_dp_param_gather: their overlapped shares; optimizer_s: the step, s.
        dp_reduce_tail, dp_gather_head: shares (0..1) of the bucket reduced after the last backward
            (:func:`~.communication.dp_last_bucket_share`) and of the AllGather the first forward waits for.
        fsdp_gather_s, fsdp_reduce_s, fsdp_head_share: ZeRO-2/3 per-chunk AllGather (before each forward, and
            each backward if ``fsdp_gather_backward``) and ReduceScatter (after each backward), s, and the share
            no prefetch hides (:func:`~.communication.fsdp_head_share`); 0 where nothing is per micro-batch.

    Raises:
        ValueError: no stage, stages with different chunk counts, m < 1, a negative time, a share outside
            [0, 1], a slowdown below 1, an unknown DP kind.
    """

    stages: tuple
    micro_batches: int
    pp_message_s: float = 0.0
    overlap_tp: float = 0.0
    overlap_pp: float = 0.0
    compute_slowdown: float = 1.0
    dp_reduce: tuple = ()
    dp_gather_s: float = 0.0
    overlap_dp_grad_reduce: float = 0.0
    overlap_dp_param_gather: float = 0.0
    optimizer_s: float = 0.0
    dp_reduce_tail: float = 0.0
    dp_gather_head: float = 0.0
    fsdp_gather_s: float = 0.0
    fsdp_reduce_s: float = 0.0
    fsdp_head_share: float = 0.0
    fsdp_gather_backward: bool = True

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("a timeline needs at least one pipeline stage")
        if len({s.chunks for s in self.stages}) != 1:
            raise ValueError(f"every stage must hold the same number of chunks, got "
                             f"{[s.chunks for s in self.stages]}")
        checks.integer("micro_batches", self.micro_batches)
        for name in ("pp_message_s", "dp_gather_s", "optimizer_s", "fsdp_gather_s", "fsdp_reduce_s"):
            checks.seconds(name, getattr(self, name))
        for name in ("overlap_tp", "overlap_pp", "overlap_dp_grad_reduce", "overlap_dp_param_gather",
                     "dp_reduce_tail", "dp_gather_head", "fsdp_head_share"):
            object.__setattr__(self, name, checks.share(name, getattr(self, name)))
        checks.number("compute_slowdown", self.compute_slowdown, least=1)
        pieces = tuple((str(k), float(d)) for k, d in self.dp_reduce)
        for k, d in pieces:
            checks.one_of("dp_reduce kind", k, ("dp_reduce_scatter", "dp_all_gather"))
            checks.seconds(f"dp_reduce {k}", d)
        object.__setattr__(self, "dp_reduce", pieces)

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def interleave(self) -> int:
        return self.stages[0].chunks


def chunk_ops(costs: StepCosts, stage: int, chunk: int) -> tuple[OpTimes, OpTimes]:
    """The forward and the backward (recomputation first) of one chunk for one micro-batch, as
    :func:`~.communication.op_times` prices them: TP hides for ``overlap_tp`` (the backward for its
    ``tp_backward_hidden_s``), the ZeRO-3 AllGather for ``overlap_dp_param_gather`` and the ReduceScatter for
    ``overlap_dp_grad_reduce``, less the forward gather's and the ReduceScatter's head share."""
    sc, c = costs.stages[stage], chunk
    ov, slow, h = costs.overlap_tp, costs.compute_slowdown, costs.fsdp_head_share
    g, r = costs.fsdp_gather_s, costs.fsdp_reduce_s
    tb = ov * sc.tp_backward_s[c] if sc.tp_backward_hidden_s is None else sc.tp_backward_hidden_s[c]
    forward = op_times(sc.forward_s[c], sc.tp_forward_s[c], ov * sc.tp_forward_s[c], g,
                       costs.overlap_dp_param_gather * (1 - h) * g, 0.0, 0.0, slow)
    g = g if costs.fsdp_gather_backward else 0.0
    backward = op_times(sc.recompute_s[c] + sc.backward_s[c], sc.tp_recompute_s[c] + sc.tp_backward_s[c],
                        ov * sc.tp_recompute_s[c] + tb, g, costs.overlap_dp_param_gather * g, r,
                        costs.overlap_dp_grad_reduce * (1 - h) * r, slow)
    return forward, backward


def dp_times(costs: StepCosts, stage: int) -> tuple[float, float, float, float]:
    """``(gather exposed, gather hidden, reduce exposed, reduce hidden)`` seconds of the once-per-step DP
    communication of ZeRO 0-2 on one GPU of ``stage`` (:func:`~.communication.dp_exposed_seconds`): the
    AllGather beside the first micro-batch's forwards; the reduction, launched as the first chunk's last
    backward starts, beside the backwards from there: that one, and with v chunks the p of each other chunk
    that interleaved 1F1B's cool-down runs after it (Megatron-LM's order), ``(1 + (v-1)·p)/v`` of a
    micro-batch's backward."""
    sc, p, v = costs.stages[stage], costs.pp, costs.interleave
    slow = costs.compute_slowdown
    g_exp, g_hid = dp_exposed_seconds(0.0, 0.0, 0.0, costs.dp_gather_s, sum(sc.forward_s),
                                      costs.overlap_dp_param_gather, 0.0, costs.dp_gather_head, slow)
    window = (sum(sc.recompute_s) + sum(sc.backward_s)) * (1 + (v - 1) * p) / v
    r_exp, r_hid = dp_exposed_seconds(sum(d for _, d in costs.dp_reduce), window, costs.overlap_dp_grad_reduce,
                                      reduce_tail=costs.dp_reduce_tail, slowdown=slow)
    return g_exp, g_hid, r_exp, r_hid
