"""The arithmetic of compute versus communication in data-parallel training (chapter 1).

Every function here is pure and cheap: it takes sizes, counts and rates and returns a size or a
time. Conventions, used throughout commlab:

* sizes are in **bytes** (``nbytes``); ``GB`` means 10**9 bytes, ``GiB`` means 2**30 bytes;
* times are in **seconds**;
* bandwidths are in **bytes/s per direction**: convert vendors' bidirectional sums (NVLink 4's
  900 GB/s) with :func:`per_direction_bytes_per_s`, ports' Gb/s with :func:`gbit_per_s_to_bytes_per_s`;
* work is in **FLOP** and compute rates in **FLOP/s**.

Sources: ring costs, Patarasuk & Yuan (2009) and Thakur et al. (2005); 6·P·T training FLOP, Kaplan
et al. (2020); 16 bytes/parameter of mixed-precision Adam, Rajbhandari et al. (2020). Full references:
``book/references.bib``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from commlab import checks

__all__ = [
    "GB",
    "GiB",
    "TB",
    "ADAM_STATE_BYTES_PER_PARAM",
    "MIXED_PRECISION_ADAM_BYTES_PER_PARAM",
    "gbit_per_s_to_bytes_per_s",
    "per_direction_bytes_per_s",
    "bytes_to_gb",
    "bytes_to_gib",
    "ring_allreduce_bytes_per_rank",
    "ring_reduce_scatter_bytes_per_rank",
    "ring_all_gather_bytes_per_rank",
    "transfer_seconds",
    "gradient_sync_seconds",
    "training_flops",
    "compute_seconds",
    "break_even_tokens_per_gpu",
    "exposed_comm_fraction",
    "weight_bytes",
    "gpus_to_hold",
    "SyncEstimate",
    "data_parallel_sync",
    "SOURCE_EXAMPLE",
    "source_article_example",
]

#: One gigabyte, as vendors and this course use it: 10**9 bytes.
GB = 1e9
#: One gibibyte, as ``nvidia-smi`` and most memory allocators report it: 2**30 bytes.
GiB = float(2**30)
#: One terabyte: 10**12 bytes.
TB = 1e12

#: Bytes of Adam's optimizer state per parameter in mixed precision: FP32 master weights, momentum and
#: variance, 4 + 4 + 4 (the K = 12 of Rajbhandari et al. 2020, ZeRO, section 3.1).
ADAM_STATE_BYTES_PER_PARAM = 12

#: Bytes of model and optimizer state per parameter for mixed-precision Adam: BF16/FP16 weights (2) and
#: gradients (2) plus :data:`ADAM_STATE_BYTES_PER_PARAM`. This is the "16 Psi" of Rajbhandari et al.
#: (2020, ZeRO); activations and workspace come on top.
MIXED_PRECISION_ADAM_BYTES_PER_PARAM = 2 + 2 + ADAM_STATE_BYTES_PER_PARAM


# --------------------------------------------------------------------------- units


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    """Convert a link rate in gigabits per second (10**9 bit/s) to bytes per second.

    Network ports are quoted in bits: InfiniBand HDR is 200 Gb/s per port per direction, which is
    200e9 / 8 = 25e9 bytes/s. The result is a line rate; what a collective achieves is lower.

    Raises:
        ValueError: if ``gbit_per_s`` is negative or not a finite number.
    """
    return checks.number("gbit_per_s", gbit_per_s, least=0) * 1e9 / 8


def per_direction_bytes_per_s(bidirectional_total_bytes_per_s: float) -> float:
    """Bandwidth in one direction of a symmetric full-duplex link whose vendor figure sums both.

    NVIDIA quotes NVLink 4 on H100 SXM as 900 GB/s: 450 GB/s out of the GPU plus 450 GB/s into it
    (NVIDIA H100 Tensor Core GPU datasheet, 2022). A ring collective is limited by what each GPU
    can *send*, so the per-direction figure is the one to divide bytes by.

    Raises:
        ValueError: if the bandwidth is negative or not a finite number.
    """
    return checks.number("bidirectional_total_bytes_per_s", bidirectional_total_bytes_per_s, least=0) / 2


def bytes_to_gb(nbytes: float) -> float:
    """Bytes to gigabytes (10**9 bytes), the unit of datasheets and of this course's prose."""
    return checks.number("nbytes", nbytes) / GB


def bytes_to_gib(nbytes: float) -> float:
    """Bytes to gibibytes (2**30 bytes), the unit ``nvidia-smi`` and PyTorch's allocator print."""
    return checks.number("nbytes", nbytes) / GiB


# --------------------------------------------------------------------------- ring collectives


def ring_reduce_scatter_bytes_per_rank(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring ReduceScatter of an ``nbytes`` buffer.

    The buffer is cut into ``n`` chunks of ``nbytes / n``; in each of ``n - 1`` steps every rank
    passes one chunk to its successor, so each rank sends ``(n - 1) / n * nbytes``
    (Patarasuk & Yuan, 2009). With ``n == 1`` nothing is sent.

    Args:
        nbytes: size in bytes of the whole buffer each rank starts with.
        n: number of ranks in the ring (>= 1).

    Raises:
        ValueError: if ``nbytes`` is negative or ``n`` < 1.
    """
    nbytes = checks.number("nbytes", nbytes, least=0)
    n = checks.integer("n", n)
    return (n - 1) / n * nbytes


def ring_all_gather_bytes_per_rank(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring AllGather whose *result* is ``nbytes`` on every rank.

    Each rank starts with one ``nbytes / n`` shard and forwards ``n - 1`` shards, so it sends
    ``(n - 1) / n * nbytes``, the same as a ReduceScatter of the full buffer.

    Raises:
        ValueError: if ``nbytes`` is negative or ``n`` < 1.
    """
    return ring_reduce_scatter_bytes_per_rank(nbytes, n)


def ring_allreduce_bytes_per_rank(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring AllReduce of an ``nbytes`` buffer.

    A ring AllReduce is a ReduceScatter followed by an AllGather, so each rank sends
    ``2 * (n - 1) / n * nbytes`` (Patarasuk & Yuan, 2009; Thakur, Rabenseifner & Gropp, 2005).
    This is within a factor ``(n - 1) / n`` of twice the buffer, whatever ``n`` is: the per-rank
    traffic does not shrink when more ranks join.

    Example: 140 GB of gradients all-reduced over 64 ranks means ``2 * 63/64 * 140e9`` =
    275.625e9 bytes sent by every rank.

    Raises:
        ValueError: if ``nbytes`` is negative or ``n`` < 1.
    """
    return 2 * ring_reduce_scatter_bytes_per_rank(nbytes, n)


def transfer_seconds(nbytes: float, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """Time to move ``nbytes`` over a link: ``latency_s + nbytes / bytes_per_s`` (the alpha-beta model).

    Args:
        nbytes: bytes sent in one direction.
        bytes_per_s: link bandwidth in bytes/s **per direction** (> 0).
        latency_s: fixed start-up cost alpha in seconds (>= 0).

    Raises:
        ValueError: on negative sizes or latency, or a bandwidth that is not > 0.
    """
    nbytes = checks.number("nbytes", nbytes, least=0)
    bytes_per_s = checks.number("bytes_per_s", bytes_per_s, above=0)
    latency_s = checks.number("latency_s", latency_s, least=0)
    return latency_s + nbytes / bytes_per_s


def gradient_sync_seconds(grad_bytes: float, n: int, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """Time of a ring AllReduce of ``grad_bytes`` over ``n`` ranks on links of ``bytes_per_s``.

    ``2 * (n - 1) * latency_s + 2 * (n - 1) / n * grad_bytes / bytes_per_s``: a ring has
    ``2 * (n - 1)`` sequential steps, each paying the latency once, and every rank sends the bytes of
    :func:`ring_allreduce_bytes_per_rank` over its one outgoing link (Thakur, Rabenseifner & Gropp, 2005).

    Args:
        grad_bytes: gradient bytes held by each rank (e.g. 2 bytes/parameter in BF16).
        n: ranks in the ring (>= 1).
        bytes_per_s: bandwidth of each rank's link to its successor, bytes/s **per direction**.
        latency_s: per-step latency alpha in seconds (default 0: bandwidth term only).

    Raises:
        ValueError: if ``grad_bytes`` < 0, ``n`` < 1, ``bytes_per_s`` <= 0 or ``latency_s`` < 0.
    """
    sent = ring_allreduce_bytes_per_rank(grad_bytes, n)
    latency_s = checks.number("latency_s", latency_s, least=0)
    return 2 * (n - 1) * latency_s + transfer_seconds(sent, bytes_per_s)


# --------------------------------------------------------------------------- compute


def training_flops(params: float, tokens: float) -> float:
    """FLOP to train a dense transformer of ``params`` parameters on ``tokens`` tokens: ``6 * P * T``.

    Forward pass about 2 FLOP per parameter per token (one multiply and one add), backward pass
    about twice that (Kaplan et al., 2020; also used by Narayanan et al., 2021). Attention over the
    sequence and activation recomputation add to this; the approximation ignores them.

    Raises:
        ValueError: if ``params`` or ``tokens`` is negative.
    """
    return 6 * checks.number("params", params, least=0) * checks.number("tokens", tokens, least=0)


def compute_seconds(flops: float, peak_flop_per_s: float, mfu: float) -> float:
    """Seconds to perform ``flops`` on a device of ``peak_flop_per_s`` at model FLOP utilisation ``mfu``.

    Args:
        flops: work in FLOP (>= 0).
        peak_flop_per_s: the device's dense peak in FLOP/s for the data type used (> 0); use the
            dense figure, not the datasheet's "with sparsity" one, which is twice as large.
        mfu: achieved fraction of that peak, in (0, 1].

    Raises:
        ValueError: if ``flops`` < 0, ``peak_flop_per_s`` <= 0, or ``mfu`` is outside (0, 1].
    """
    flops = checks.number("flops", flops, least=0)
    peak_flop_per_s = checks.number("peak_flop_per_s", peak_flop_per_s, above=0)
    mfu = checks.number("mfu", mfu, above=0, most=1, note="a fraction of peak")
    return flops / (peak_flop_per_s * mfu)


def break_even_tokens_per_gpu(comm_seconds: float, params: float, peak_flop_per_s: float, mfu: float) -> float:
    """Tokens per GPU per step at which compute time equals ``comm_seconds``.

    Solves ``6 * params * tokens / (peak_flop_per_s * mfu) == comm_seconds`` for ``tokens``. Above
    this many tokens per GPU per step, computing takes longer than the (fixed) gradient
    synchronisation; below it, communication dominates the step.

    Raises:
        ValueError: if ``comm_seconds`` < 0, ``params`` <= 0, ``peak_flop_per_s`` <= 0, or ``mfu``
            is outside (0, 1].
    """
    comm_seconds = checks.number("comm_seconds", comm_seconds, least=0)
    params = checks.number("params", params, above=0)
    seconds_per_token = compute_seconds(training_flops(params, 1), peak_flop_per_s, mfu)
    return comm_seconds / seconds_per_token


def exposed_comm_fraction(compute_s: float, comm_s: float, overlap: float = 0.0) -> float:
    """Fraction of a training step spent waiting for communication.

    ``overlap`` is the fraction of the communication that runs concurrently with computation; the
    hidden part cannot exceed the compute time. The step then lasts
    ``compute_s + exposed`` with ``exposed = comm_s - min(overlap * comm_s, compute_s)``, and the
    function returns ``exposed / step``. With ``overlap=0`` this is ``comm_s / (compute_s + comm_s)``.

    Raises:
        ValueError: on negative times, or ``overlap`` outside [0, 1].
    """
    compute_s = checks.number("compute_s", compute_s, least=0)
    comm_s = checks.number("comm_s", comm_s, least=0)
    overlap = checks.share("overlap", overlap, note="a fraction of the communication")
    exposed = comm_s - min(overlap * comm_s, compute_s)
    step = compute_s + exposed
    return 0.0 if step == 0 else exposed / step


# --------------------------------------------------------------------------- memory


def weight_bytes(params: float, bytes_per_param: float) -> float:
    """Bytes to store ``params`` values of ``bytes_per_param`` bytes each (2 for BF16, 4 for FP32).

    Raises:
        ValueError: if either argument is negative.
    """
    return checks.number("params", params, least=0) * checks.number("bytes_per_param", bytes_per_param, least=0)


def gpus_to_hold(nbytes: float, gpu_memory_bytes: float) -> int:
    """Smallest number of GPUs whose memory adds up to at least ``nbytes``.

    A lower bound: it assumes the data splits perfectly and that the whole memory is free for it
    (no activations, no CUDA context, no fragmentation).

    Raises:
        ValueError: if ``nbytes`` < 0 or ``gpu_memory_bytes`` <= 0.
    """
    nbytes = checks.number("nbytes", nbytes, least=0)
    gpu_memory_bytes = checks.number("gpu_memory_bytes", gpu_memory_bytes, above=0)
    return math.ceil(nbytes / gpu_memory_bytes)


# --------------------------------------------------------------------------- a whole cluster


@dataclass(frozen=True)
class SyncEstimate:
    """What one step of data-parallel synchronisation costs on a cluster (see :func:`data_parallel_sync`).

    Attributes:
        tp: tensor-parallel degree (GPUs of one node that share each layer).
        dp: data-parallel degree (model replicas).
        zero_stage: ZeRO sharding stage (0 = plain data parallelism).
        nics_per_node: network ports each node sends through.
        grad_bytes_per_gpu: gradient bytes each GPU holds (bytes).
        bytes_per_gpu: bytes each GPU sends per step for the data-parallel collectives (bytes).
        internode_bytes_per_node: bytes each node sends into the network per step (bytes).
        internode_seconds: time for that traffic through the node's NICs (seconds).
        nvlink_seconds: time of the busiest intra-node NVLink transfer (seconds; 0 if none).
        seconds: estimated time of the synchronisation, the larger of the two (seconds).
    """

    tp: int
    dp: int
    zero_stage: int
    nics_per_node: int
    grad_bytes_per_gpu: float
    bytes_per_gpu: float
    internode_bytes_per_node: float
    internode_seconds: float
    nvlink_seconds: float
    seconds: float

    def as_dict(self) -> dict:
        """The fields as a plain dict, e.g. for a table."""
        return asdict(self)


def data_parallel_sync(
    params: float,
    *,
    tp: int,
    nodes: int,
    gpus_per_node: int,
    nics_per_node: int,
    nic_bytes_per_s: float,
    nvlink_bytes_per_s: float,
    bytes_per_grad: float = 2,
    zero_stage: int = 0,
) -> SyncEstimate:
    """Estimate the per-step data-parallel communication of a model on ``nodes`` x ``gpus_per_node`` GPUs.

    Layout: TP of degree ``tp`` (a divisor of ``gpus_per_node``) inside each node, DP of degree
    ``dp = nodes * gpus_per_node / tp``; each GPU ring-all-reduces its ``params / tp`` gradients.
    Each GPU sends ``f * (dp - 1) / dp * grad_bytes_per_gpu``, ``f = 2`` (AllReduce, ZeRO 1-2) or
    ``f = 3`` (ZeRO 3, Rajbhandari et al. 2020); a node sends ``tp`` times that into the network.
    Time, latency ignored: ``max(internode_bytes_per_node / (nics_per_node * nic_bytes_per_s),
    bytes_per_gpu / nvlink_bytes_per_s)``, the second term only when a ring has two members in one
    node; NIC traffic is assumed spread evenly over the node's NICs. Derivation: chapter 1, section 1.4.

    Args:
        params: number of model parameters.
        tp, nodes, gpus_per_node, nics_per_node: the layout's counts (each >= 1).
        nic_bytes_per_s, nvlink_bytes_per_s: one NIC's / one GPU's NVLink bytes/s per direction.
        bytes_per_grad: bytes per gradient value (2 for BF16).
        zero_stage: 0 (plain data parallelism), 1, 2 or 3.

    Returns:
        A :class:`SyncEstimate`.

    Raises:
        ValueError: on a count < 1, a ``tp`` that does not divide ``gpus_per_node``, a negative
            size, a bandwidth that is not > 0, or a ``zero_stage`` outside 0-3.
    """
    params = checks.number("params", params, least=0)
    nodes = checks.integer("nodes", nodes)
    gpus_per_node = checks.integer("gpus_per_node", gpus_per_node)
    tp = checks.integer("tp", tp)
    nics_per_node = checks.integer("nics_per_node", nics_per_node)
    nic_bytes_per_s = checks.number("nic_bytes_per_s", nic_bytes_per_s, above=0)
    nvlink_bytes_per_s = checks.number("nvlink_bytes_per_s", nvlink_bytes_per_s, above=0)
    bytes_per_grad = checks.number("bytes_per_grad", bytes_per_grad, least=0)
    if gpus_per_node % tp:
        raise ValueError(
            f"tp={tp} must divide gpus_per_node={gpus_per_node}: this model keeps tensor parallelism "
            f"inside a node; choose tp among {[d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]}"
        )
    checks.one_of("zero_stage", zero_stage, (0, 1, 2, 3))

    dp = nodes * gpus_per_node // tp
    grad_bytes_per_gpu = params * bytes_per_grad / tp
    passes = 3 if zero_stage == 3 else 2
    bytes_per_gpu = passes * ring_reduce_scatter_bytes_per_rank(grad_bytes_per_gpu, dp)

    internode_bytes_per_node = tp * bytes_per_gpu if nodes > 1 else 0.0
    internode_seconds = internode_bytes_per_node / (nics_per_node * nic_bytes_per_s)
    ring_members_per_node = gpus_per_node // tp
    nvlink_seconds = bytes_per_gpu / nvlink_bytes_per_s if ring_members_per_node > 1 else 0.0

    return SyncEstimate(
        tp=tp,
        dp=dp,
        zero_stage=zero_stage,
        nics_per_node=nics_per_node,
        grad_bytes_per_gpu=grad_bytes_per_gpu,
        bytes_per_gpu=bytes_per_gpu,
        internode_bytes_per_node=internode_bytes_per_node,
        internode_seconds=internode_seconds,
        nvlink_seconds=nvlink_seconds,
        seconds=max(internode_seconds, nvlink_seconds),
    )


#: The cluster and model of the source article's worked example (its section 1): a 70-billion
#: parameter model with BF16 gradients on 8 nodes of 8 GPUs, InfiniBand HDR (200 Gb/s = 25e9 bytes/s
#: per port per direction) between nodes and NVLink 4 (450e9 bytes/s per direction) inside them.
SOURCE_EXAMPLE = {
    "params": 70e9,
    "bytes_per_grad": 2,
    "nodes": 8,
    "gpus_per_node": 8,
    "nic_bytes_per_s": gbit_per_s_to_bytes_per_s(200),
    "nvlink_bytes_per_s": per_direction_bytes_per_s(900e9),
}

_SOURCE_LAYOUTS = {"dp64": 1, "tp8xdp8": 8}


def source_article_example(layout: str = "tp8xdp8", nics_per_node: int = 1, zero_stage: int = 0) -> SyncEstimate:
    """Re-derive the source article's 70B example (see :data:`SOURCE_EXAMPLE`) for one layout.

    Args:
        layout: ``"dp64"`` (pure data parallelism over all 64 GPUs, every GPU holds all 140 GB of
            gradients) or ``"tp8xdp8"`` (tensor parallelism over the 8 GPUs of a node, data
            parallelism over the 8 nodes; each GPU holds 17.5 GB).
        nics_per_node: 1 (one NIC shared by the node's 8 GPUs) or up to 8 (one rail NIC per GPU).
        zero_stage: 0-3, see :func:`data_parallel_sync`.

    Raises:
        ValueError: on an unknown layout, or the errors of :func:`data_parallel_sync`.
    """
    if layout not in _SOURCE_LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_SOURCE_LAYOUTS)}, got {layout!r}")
    return data_parallel_sync(
        tp=_SOURCE_LAYOUTS[layout], nics_per_node=nics_per_node, zero_stage=zero_stage, **SOURCE_EXAMPLE
    )
