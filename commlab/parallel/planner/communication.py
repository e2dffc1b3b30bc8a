"""Collective seconds of a layout and the overlap arithmetic: what hides beside what, written once.

:func:`group_all_reduce_seconds` and :func:`dp_all_reduce_seconds` (α-β rings, hierarchical across nodes),
:func:`tp_link`; the overlap rules :func:`op_times` (one op with its TP and ZeRO-2/3 collectives beside it),
:func:`send_times`, :func:`dp_exposed_seconds`, :func:`backward_tp_hidden_seconds`; :func:`chunk_ops` and
:func:`dp_times` apply them to a :class:`StepCosts` for the step time and the timeline alike. Compute beside
communication runs ``1/overlap_compute_slowdown`` as fast: an assumption (Lee et al. 2025, arXiv:2507.03114,
measured inside a node). Sources: Korthikanti et al. 2022 §6.2; Rajbhandari et al. 2020 §5.3. Book: chapter 11,
§11.2; chapter 12, §12.4."""
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
    """Seconds of ``comm_s`` of communication that run beside ``work_s`` seconds of compute slowed ``slowdown``
    times (>= 1): ``min(comm_s, slowdown·work_s)``; the rest is exposed.

    Raises:
        ValueError: a negative or non-finite time; a slowdown below 1.
    """
    checks.seconds("comm_s", comm_s)
    checks.seconds("work_s", work_s)
    checks.number("slowdown", slowdown, least=1, note="1 = compute does not slow beside communication")
    return min(comm_s, slowdown * work_s)


def slowdown_seconds(beside_s: float, slowdown: float) -> float:
    """Seconds ``beside_s`` of compute beside communication add to the step: ``beside_s·(1 - 1/slowdown)``."""
    return beside_s * (1 - 1 / slowdown) if beside_s > 0 else 0.0


def backward_tp_hidden_seconds(one_s: float, sequence_parallel: bool, overlap_tp: float, overlap_tp_backward: float,
                               wgrad_s: Sequence[float], slowdown: float = 1.0) -> float:
    """Seconds of one layer's backward TP communication (two AllReduce-equivalents of ``one_s``, one micro-batch)
    that hide behind its compute.

    Each column-parallel input-gradient reduction (``input_grad_share·one_s``) hides for the larger of
    ``overlap_tp`` and ``overlap_tp_backward``, the latter at most its weight-gradient GEMM's time (``wgrad_s``:
    QKV's, the MLP's first linear's, s); the rest hides for ``overlap_tp`` only (Korthikanti et al. 2022 §6.2).

    Raises:
        ValueError: a negative time, a share outside [0, 1], not two ``wgrad_s``, a slowdown below 1.
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
    """α-β seconds of the DP gradient AllReduce of ``nbytes`` per GPU: :func:`group_all_reduce_seconds` over the
    dp ranks, stride tp·pp.

    Raises:
        ValueError: ``nbytes < 0``.
    """
    return group_all_reduce_seconds(nbytes, layout.dp, layout.tp * layout.pp, cluster)


def group_all_reduce_seconds(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    """α-β seconds of an AllReduce of ``nbytes`` per GPU over ``n`` ranks ``stride`` apart in rank order.

    One node: a ring on the intra-node link. Else hierarchical: a ring over the ``k`` members of a node, then a ring
    of ``nbytes/k`` across ``n/k`` nodes with every device of a node sending through its NICs at once.

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


def dp_exposed_seconds(reduce_s: float, reduce_window_s: float, reduce_overlap: float, gather_s: float = 0.0,
                       gather_window_s: float = 0.0, gather_overlap: float = 0.0, reduce_tail: float = 0.0,
                       gather_head: float = 0.0, slowdown: float = 1.0) -> tuple[float, float]:
    """``(exposed, hidden)`` seconds of the once-per-step DP communication.

    The reduction (``reduce_s``) hides up to ``reduce_overlap·(1 - reduce_tail)·reduce_s`` beside
    ``reduce_window_s`` (the last backward; ``reduce_tail``: the bucket reduced last); the AllGather
    (``gather_s``) up to ``gather_overlap·(1 - gather_head)·gather_s`` beside ``gather_window_s`` (the first
    forward), each window holding :func:`beside_seconds`.

    Raises:
        ValueError: a negative or non-finite time, a share outside [0, 1], a slowdown below 1.
    """
    for name, v in dict(reduce_s=reduce_s, reduce_window_s=reduce_window_s, gather_s=gather_s,
                        gather_window_s=gather_window_s).items():
        checks.seconds(name, v)
    for name, v in dict(reduce_overlap=reduce_overlap, gather_overlap=gather_overlap, reduce_tail=reduce_tail,
                        gather_head=gather_head).items():
        checks.share(name, v)
    hidden = (beside_seconds(reduce_overlap * (1 - reduce_tail) * reduce_s, reduce_window_s, slowdown)
              + beside_seconds(gather_overlap * (1 - gather_head) * gather_s, gather_window_s, slowdown))
    return reduce_s + gather_s - hidden, hidden


def dp_last_bucket_share(m: ModelConfig, layout: Layout, bucket_params: float) -> float:
    """Share (0..1) of a GPU's DP gradient in the bucket the backward completes last (and a distributed optimizer
    all-gathers first): buckets of ``bucket_params`` elements filled in reverse parameter order, one layer at a
    time (Megatron-Core ``param_and_grad_buffer.py``); 0 without buckets."""
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
    """One op (a chunk's forward, or its recomputation and backward, for one micro-batch) on the compute stream, s:
    the exposed AllGather it waits for, its compute, the slowdown, exposed TP and ReduceScatter, and what hides."""

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

    Of ``tp_s`` of TP, ``tp_hidable_s`` may hide beside ``work_s`` (:func:`beside_seconds`); of the ZeRO-3
    AllGather before it and the ReduceScatter after it, ``gather_hidable_s`` then ``reduce_hidable_s`` beside the
    same compute, on their own link. What hides slows the compute (:func:`slowdown_seconds`).

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
    """``(exposed, slowdown)`` seconds a pipeline send of ``message_s`` costs its sender: ``1 - overlap_pp`` of it
    in series, the rest slowing the next compute. It arrives ``message_s`` after it leaves."""
    checks.seconds("message_s", message_s)
    checks.share("overlap_pp", overlap_pp)
    return (1 - overlap_pp) * message_s, slowdown_seconds(overlap_pp * message_s, slowdown)


def fsdp_head_share(m: ModelConfig, layout: Layout) -> float:
    """Share of a GPU's ZeRO-3 parameters whose AllGather and ReduceScatter no prefetch hides: the embedding's and
    the first block's (torchtitan ``apply_fsdp`` units); with pp > 1 the heavier of the first and last stage's,
    an assumption that is pessimistic there (PyTorch's pipeline stages gather about once per step)."""
    block = layer_params(m)
    if layout.pp == 1:
        return min(1.0, (embedding_params(m) + block) / stage_params(m, 1, "only"))
    first = stage_params(m, layout.pp, "first", layout.interleave)
    last = stage_params(m, layout.pp, "last", layout.interleave)
    return min(1.0, (embedding_params(m) + block) / first if first >= last else block / last)


def fsdp_units(m: ModelConfig, layout: Layout) -> int:
    """FSDP units on one GPU of the heaviest stage, each with its own collectives every micro-batch (torchtitan
    ``apply_fsdp``: each block, the embedding, the norm with the output layer): ``stage_layers + 2`` (pp = 1)
    or ``+ 1``."""
    return stage_layers(m.layers, layout.pp, layout.interleave) + (2 if layout.pp == 1 else 1)


def tp_link(layout: Layout, cluster: Cluster) -> tuple[Link, float]:
    """``(link, share)`` of a TP group: the intra-node link (share 1) within a node, else the shared NIC."""
    d = cluster.devices_per_node
    if layout.tp <= d and d % layout.tp == 0:
        return cluster.intra, 1.0
    return cluster.inter, flows_per_nic(d, cluster.nics_per_node)


# ----------------------------------------------------------------------------------------- per-op costs

@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per-micro-batch seconds of one GPU of a pipeline stage, a tuple entry per model chunk.

    ``tp_backward_hidden_s``: the backward TP that may hide (:func:`backward_tp_hidden_seconds` per layer); None:
    ``overlap_tp`` of ``tp_backward_s``.

    Raises:
        ValueError: a negative or non-finite time; tuples of unequal length or empty.
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
    """Everything the step time and the replay need (seconds, shares), however it was priced.

    ``dp_reduce``: ``((kind, s), ...)`` of the once-per-step gradient reduction; ``dp_gather_s``: the distributed
    optimizer's AllGather; ``dp_reduce_tail``/``dp_gather_head``: :func:`dp_last_bucket_share`; ``fsdp_*``:
    ZeRO-2/3 per-chunk AllGather and ReduceScatter and the share no prefetch hides (:func:`fsdp_head_share`).

    Raises:
        ValueError: no stage, unequal chunk counts, m < 1, a negative time, a share outside [0, 1], a slowdown
            below 1, an unknown DP kind.
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
    """The forward and the backward (recomputation first) of one chunk for one micro-batch (:func:`op_times`)."""
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
    communication on one GPU of ``stage`` (:func:`dp_exposed_seconds`): the AllGather beside the first forwards,
    the reduction beside ``(1 + (v-1)·p)/v`` of a micro-batch's backward (interleaved 1F1B's cool-down)."""
    sc, p, v = costs.stages[stage], costs.pp, costs.interleave
    slow = costs.compute_slowdown
    g_exp, g_hid = dp_exposed_seconds(0.0, 0.0, 0.0, costs.dp_gather_s, sum(sc.forward_s),
                                      costs.overlap_dp_param_gather, 0.0, costs.dp_gather_head, slow)
    window = (sum(sc.recompute_s) + sum(sc.backward_s)) * (1 + (v - 1) * p) / v
    r_exp, r_hid = dp_exposed_seconds(sum(d for _, d in costs.dp_reduce), window, costs.overlap_dp_grad_reduce,
                                      reduce_tail=costs.dp_reduce_tail, slowdown=slow)
    return g_exp, g_hid, r_exp, r_hid
