"""Communication seconds of a layout's collectives and the overlap arithmetic: what hides beside what.

:func:`group_all_reduce_seconds` and :func:`dp_all_reduce_seconds` (α-β rings, hierarchical across nodes with
the NICs shared), :func:`tp_link` (the link a TP group uses); :func:`beside_seconds` and
:func:`slowdown_seconds` (communication beside compute, which runs slower there: an assumption, the profile's
``overlap_compute_slowdown``), :func:`backward_tp_hidden_seconds`, :func:`dp_exposed_seconds` with
:func:`dp_last_bucket_share`, :func:`fsdp_exposed_seconds` with :func:`fsdp_head_share`. Each overlap rule is
written here once; the step time and the timeline both call it. Sources: Korthikanti et al. 2022 §6.2;
Rajbhandari et al. 2020 §5.3; Lee et al. 2025 (arXiv:2507.03114). Book: chapter 11, §11.2; chapter 12, §12.4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from commlab import checks
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner.counting import dp_gradient_nbytes, input_grad_share
from commlab.parallel.planner.memory import Layout, ModelConfig, embedding_params, layer_params, stage_params
from commlab.topology import Cluster, Link, flows_per_nic

__all__ = ["beside_seconds", "slowdown_seconds", "backward_tp_hidden_seconds", "dp_all_reduce_seconds",
           "group_all_reduce_seconds", "dp_exposed_seconds", "dp_last_bucket_share",
           "fsdp_exposed_seconds", "fsdp_head_share", "tp_link"]


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


def tp_link(layout: Layout, cluster: Cluster) -> tuple[Link, float]:
    """The link a TP group of ``layout.tp`` ranks uses and the share of it each rank gets: the intra-node link
    (share 1) when the group fits in a node, else the NIC shared by :func:`~commlab.topology.flows_per_nic`."""
    d = cluster.devices_per_node
    if layout.tp <= d and d % layout.tp == 0:
        return cluster.intra, 1.0
    return cluster.inter, flows_per_nic(d, cluster.nics_per_node)
