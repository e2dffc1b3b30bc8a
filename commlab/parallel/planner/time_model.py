"""Time of one training step of a 3D-parallel layout: compute, TP, PP, bubble and DP terms.

:func:`step_time` returns a :class:`TimeBreakdown` (seconds) for a model (:class:`~.memory.ModelConfig`),
a layout (:class:`~.memory.Layout`), a cluster (:class:`~commlab.topology.Cluster`: links with α in s
and β in s/byte per direction, devices and NICs per node, peak FLOP/s) and a global batch (sequences).

The terms, per step, on the critical path of one GPU:

* **compute** = executed FLOP / (tp·pp·dp GPUs × peak FLOP/s × ``achievable_fraction``). Executed FLOP
  per token: ``6·P + 12·L·h·s`` (weights: 2 FLOP per parameter forward, 4 backward, Kaplan et al. 2020;
  attention scores and context: Chowdhery et al. 2022, PaLM, Appendix B), plus ``2·P + 4·L·h·s`` with
  full recomputation (one more forward). Multiplied by ``stage_layers·pp/L`` when the layers do not divide
  evenly (the heaviest stage, ``ceil(L/(pp·v))·v`` layers, sets the pace).
* **TP**: per layer and micro-batch, 4 AllReduces of the ``b·s·h·2``-byte activation (2 forward, 2
  backward; 6 with recomputation, whose forward repeats its 2), each a ring over the tp ranks on the
  link the group uses (inside a node when tp divides ``devices_per_node``), with that link's (α, β): the
  presets give the Simple protocol's pair, the one NCCL's own model (:mod:`commlab.collectives.nccl_model`)
  picks for messages this large. The message is the whole activation on every rank: the bytes are
  **not** divided by tp -- only the per-rank share of a ring, 2(t-1)/t of them, depends on t (Shoeybi et
  al. 2019, §3; Narayanan et al. 2021, §3.2: ``8bsh(t-1)/t`` per layer and micro-batch). Not overlapped
  with compute.
* **PP**: per micro-batch (and per interleaved chunk), one ``b·s·h·2``-byte send forward and one backward
  between neighbouring stages, on the inter-node link when stages cross nodes (the tp ranks of a stage
  send at once, sharing the node's NICs).
* **bubble**: ``(pp-1)/(v·m)`` of the per-micro-batch work (Narayanan et al. 2021, §2.2.1-2.2.2), with m
  micro-batches per step and v interleaved chunks; :func:`commlab.parallel.pipeline.bubble_fraction`
  gives the same as a fraction of the whole step.
* **DP**: an AllReduce (or, with ZeRO-1, ReduceScatter + AllGather: the same bytes) of the GPU's
  gradient shard, ``stage params / tp × grad_bytes``, over the dp ranks: a ring inside the node for the
  members that share it, then a ring across nodes in which all of a node's devices send at once through
  its NICs (the NIC sharing of :func:`commlab.collectives.hierarchical.hierarchical_all_reduce_seconds`).
  ``dp_overlap`` (0..1) of it may hide behind the backward pass of the last micro-batch.

``achievable_fraction`` (default :data:`DEFAULT_ACHIEVABLE_FRACTION` = 0.5) is the one calibration constant:
the share of dense peak that the matrix multiplications of a large transformer sustain. Half of peak is
the order that Megatron-LM reports for its whole step, communication and bubble included (44-52 % of A100
peak, Narayanan et al. 2021, Table 1) and that Llama 3 reports as MFU on H100 (38-43 %, §3.3.2); the
kernels themselves must therefore run somewhat above it. It is a single global number, not fitted per
model: the planner's validation (:func:`~commlab.parallel.planner.search.validate_published`) reports
how far that takes it.

What is left out (see the book): overlap of TP communication with compute (possible when the matrix
multiplications are split into pieces whose AllReduces overlap the next piece's compute), partial
recomputation (only none or full), the scatter/gather optimisation of PP sends (Narayanan et al. 2021,
§4.1), context parallelism, kernel-efficiency changes with the GEMM shapes (small micro-batches or large
tp are not penalised), optimizer step time, data loading, stragglers.
"""

from __future__ import annotations

import dataclasses
import math

from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.parallel.planner.memory import Layout, ModelConfig, parameter_count, stage_layers, stage_params
from commlab.topology import Cluster, Link

__all__ = ["TimeBreakdown", "DEFAULT_ACHIEVABLE_FRACTION", "model_flops_per_token", "executed_flops_per_token",
           "megatron_eq3_flops", "tp_all_reduce_nbytes", "pp_message_nbytes", "dp_gradient_nbytes",
           "dp_all_reduce_seconds", "step_time"]

#: Share of dense peak FLOP/s the model's matrix multiplications achieve (see the module docstring).
DEFAULT_ACHIEVABLE_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class TimeBreakdown:
    """One step, seconds, and what it yields.

    Attributes:
        compute_s: matrix multiplications of all micro-batches on one GPU.
        tp_s: tensor-parallel AllReduces of all micro-batches.
        pp_s: pipeline sends and receives of all micro-batches.
        bubble_s: pipeline fill and drain.
        dp_s: the gradient AllReduce (ZeRO-1: ReduceScatter + AllGather), in full.
        dp_exposed_s: the part of ``dp_s`` not hidden behind the backward pass.
        micro_batches: micro-batches per step m.
        tokens_per_step: global batch × sequence length.
        model_flop_per_step: ``(6·P + 12·L·h·s) × tokens`` (recomputation not counted), FLOP.
        gpus: tp·pp·dp.
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

    @property
    def total_s(self) -> float:
        """Step time, s: compute + TP + PP + bubble + exposed DP."""
        return self.compute_s + self.tp_s + self.pp_s + self.bubble_s + self.dp_exposed_s

    @property
    def tokens_per_s(self) -> float:
        """Training throughput, tokens/s."""
        return self.tokens_per_step / self.total_s

    @property
    def model_flop_per_s_per_gpu(self) -> float:
        """Achieved model FLOP/s per GPU: model FLOP per step / step time / GPUs."""
        return self.model_flop_per_step / self.total_s / self.gpus

    def flop_per_s_per_gpu(self, flop_per_step: float) -> float:
        """FLOP/s per GPU in another accounting (e.g. :func:`megatron_eq3_flops`), given its FLOP per step."""
        return flop_per_step / self.total_s / self.gpus

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total_s=self.total_s, tokens_per_s=self.tokens_per_s,
                 model_flop_per_s_per_gpu=self.model_flop_per_s_per_gpu)
        return d


# ----------------------------------------------------------------------------------------- FLOP

def model_flops_per_token(m: ModelConfig) -> float:
    """Model FLOP per token of a training step, no recomputation: ``6·P + 12·L·h·s`` (P with embeddings;
    the input-embedding lookup is not a matmul, a small over-count). PaLM's MFU accounting (Chowdhery et
    al. 2022, Appendix B)."""
    return 6.0 * parameter_count(m) + 12.0 * m.layers * m.hidden * m.seq


def executed_flops_per_token(m: ModelConfig, recompute: bool) -> float:
    """FLOP per token the GPUs execute: model FLOP, plus one more forward (``2·P + 4·L·h·s``) with full
    recomputation."""
    extra = 2.0 * parameter_count(m) + 4.0 * m.layers * m.hidden * m.seq if recompute else 0.0
    return model_flops_per_token(m) + extra


def megatron_eq3_flops(m: ModelConfig, global_batch: int) -> float:
    """FLOP per iteration as Megatron-LM reports them (Narayanan et al. 2021, Eq. 3, which assumes activation
    recomputation): ``96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))``. Their teraFLOP/s per GPU = this / time / n."""
    B, s, L, h, V = global_batch, m.seq, m.layers, m.hidden, m.vocab
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


# ----------------------------------------------------------------------------------------- bytes

def tp_all_reduce_nbytes(m: ModelConfig, micro_batch: int) -> float:
    """Bytes of one TP AllReduce: the bf16 activation ``b·s·h·2``, the same on every rank whatever tp is."""
    return 2.0 * micro_batch * m.seq * m.hidden


def pp_message_nbytes(m: ModelConfig, micro_batch: int) -> float:
    """Bytes one stage sends its neighbour per micro-batch, each way: ``b·s·h·2`` (bf16)."""
    return 2.0 * micro_batch * m.seq * m.hidden


def dp_gradient_nbytes(m: ModelConfig, layout: Layout, grad_bytes: int = 2) -> float:
    """Bytes each GPU reduces over its DP group: the heavier pipeline stage's parameters / tp × grad_bytes."""
    if layout.pp == 1:
        p = stage_params(m, 1, "only")
    else:
        p = max(stage_params(m, layout.pp, "first", layout.interleave),
                stage_params(m, layout.pp, "last", layout.interleave))
    return p / layout.tp * grad_bytes


def _nic_share(cluster: Cluster, senders_per_node: int) -> float:
    """How many flows each NIC carries when ``senders_per_node`` devices of a node send across nodes at once."""
    return max(1.0, senders_per_node / cluster.nics_per_node)


def dp_all_reduce_seconds(nbytes: float, layout: Layout, cluster: Cluster) -> float:
    """α-β time of the DP gradient AllReduce of ``nbytes`` bytes per GPU.

    The DP group of a rank is strided by tp·pp (TP innermost, then PP). ``k = devices_per_node // (tp·pp)``
    of its members share a node (k = 1 when tp·pp >= devices_per_node). If the whole group fits in one
    node, a ring on the intra-node link; otherwise the hierarchical algorithm: a ring AllReduce over the k
    members of a node, then a ring of ``nbytes/k`` across the ``dp/k`` nodes during which all
    ``devices_per_node`` devices of each node send at once through its ``nics_per_node`` NICs (each NIC
    carries ``max(1, devices_per_node/nics)`` flows). (The first ring stands in for the ReduceScatter +
    AllGather pair of :func:`~commlab.collectives.hierarchical.hierarchical_all_reduce_seconds`; it moves
    the same bytes.)

    Raises:
        ValueError: ``nbytes < 0``.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    dp = layout.dp
    if dp == 1:
        return 0.0
    d = cluster.devices_per_node
    block = layout.tp * layout.pp
    k = d // block if (block < d and d % block == 0) else 1
    if dp <= k:
        return ring_all_reduce_seconds(nbytes, dp, cluster.intra.alpha_s, cluster.intra.beta_s_per_byte)
    k = math.gcd(k, dp)
    t_intra = ring_all_reduce_seconds(nbytes, k, cluster.intra.alpha_s, cluster.intra.beta_s_per_byte)
    share = _nic_share(cluster, d)
    t_inter = ring_all_reduce_seconds(nbytes / k, dp // k, cluster.inter.alpha_s,
                                      cluster.inter.beta_s_per_byte * share)
    return t_intra + t_inter


def _tp_link(layout: Layout, cluster: Cluster) -> tuple[Link, float]:
    d = cluster.devices_per_node
    if layout.tp <= d and d % layout.tp == 0:
        return cluster.intra, 1.0
    return cluster.inter, _nic_share(cluster, d)


# ----------------------------------------------------------------------------------------- the step

def step_time(m: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int,
              achievable_fraction: float = DEFAULT_ACHIEVABLE_FRACTION, dp_overlap: float = 0.0,
              dtype: str = "bf16", grad_bytes: int = 2) -> TimeBreakdown:
    """Predicted time of one training step (seconds), term by term (see the module docstring).

    Args:
        m: the model (its ``seq`` is the training sequence length).
        layout: tp, pp, dp, micro-batch, recomputation, interleaving.
        cluster: links, devices and NICs per node, peak FLOP/s per dtype (its ``nodes`` is not used: the
            layout says how many GPUs run).
        global_batch: sequences per step; must be a multiple of ``dp·micro_batch``.
        achievable_fraction: share of peak the matmuls sustain, in (0, 1].
        dp_overlap: share (0..1) of the DP AllReduce that may overlap the last micro-batch's backward
            pass; 0 = not overlapped (Megatron-LM 2021), 1 = hidden up to that backward time.
        dtype: key of ``cluster.peak_flop_per_s``.
        grad_bytes: bytes per gradient element in the DP reduction (2 bf16, 4 fp32).

    Raises:
        ValueError: ``global_batch`` not a positive multiple of ``dp·micro_batch``; a fraction out of
            range; ``dtype`` not in the cluster's peak table.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be an int >= 1 (sequences per step), got {global_batch!r}")
    if global_batch % (layout.dp * layout.micro_batch):
        raise ValueError(f"global_batch={global_batch} sequences is not a multiple of dp·micro_batch = "
                         f"{layout.dp}·{layout.micro_batch}; choose a micro-batch or dp that divides it")
    if not 0 < achievable_fraction <= 1:
        raise ValueError(f"achievable_fraction must be in (0, 1], got {achievable_fraction!r}")
    if not 0 <= dp_overlap <= 1:
        raise ValueError(f"dp_overlap must be in [0, 1], got {dp_overlap!r}")
    if dtype not in cluster.peak_flop_per_s:
        raise ValueError(f"cluster {cluster.name!r} has no peak FLOP/s for dtype {dtype!r}; it has "
                         f"{sorted(cluster.peak_flop_per_s)}")
    L = layout
    micro = global_batch // (L.dp * L.micro_batch)
    tokens = global_batch * m.seq
    gpus = L.gpus
    layers_per_stage = stage_layers(m.layers, L.pp, L.interleave)
    imbalance = layers_per_stage * L.pp / m.layers
    rate = cluster.peak_flop_per_s[dtype] * achievable_fraction
    compute = executed_flops_per_token(m, L.recompute) * tokens / (gpus * rate) * imbalance

    tp_s = 0.0
    if L.tp > 1:
        link, share = _tp_link(L, cluster)
        one = ring_all_reduce_seconds(tp_all_reduce_nbytes(m, L.micro_batch), L.tp, link.alpha_s,
                                      link.beta_s_per_byte * share)
        per_layer = 6 if L.recompute else 4
        tp_s = one * per_layer * layers_per_stage * micro

    pp_s = 0.0
    if L.pp > 1:
        if L.tp * L.pp <= cluster.devices_per_node:
            link, share = cluster.intra, 1.0
        else:
            link, share = cluster.inter, _nic_share(cluster, min(L.tp, cluster.devices_per_node))
        one = link.alpha_s + pp_message_nbytes(m, L.micro_batch) * link.beta_s_per_byte * share
        pp_s = 2 * one * micro * L.interleave

    bubble = (L.pp - 1) / (L.interleave * micro) * (compute + tp_s + pp_s)
    dp_s = dp_all_reduce_seconds(dp_gradient_nbytes(m, L, grad_bytes), L, cluster)
    backward_last = compute / micro * (2.0 / 3.0)
    dp_exposed = max(0.0, dp_s - min(dp_overlap * dp_s, backward_last))
    return TimeBreakdown(compute_s=compute, tp_s=tp_s, pp_s=pp_s, bubble_s=bubble, dp_s=dp_s,
                         dp_exposed_s=dp_exposed, micro_batches=micro, tokens_per_step=tokens,
                         model_flop_per_step=model_flops_per_token(m) * tokens, gpus=gpus)
