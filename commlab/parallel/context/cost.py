"""Communication of context and sequence parallelism side by side: bytes sent per rank and α-β time.

``K = b·h_kv·(s/N)·d·e`` bytes is one rank's K block (V the same), ``Q = b·h·(s/N)·d·e`` its q block, ``K'``
the dK block as it travels (float32 for half-precision inputs); α in s/message, β in s/byte, single port.
With ``tp`` > 1 beside CP, ``h`` and ``h_kv`` are one TP shard's heads, so every figure is per GPU. Per rank,
forward / backward: ring attention ``(N-1)·2K`` / ``(N-1)·2K + N·2K'``, holding 2 K/V blocks; all-gathered
K/V ``(N-1)·2K`` each way (AllGather, ReduceScatter), holding the whole sequence; Ulysses ``(N-1)/N·(2Q+2rK)``
each way (two AllToAlls), with K and V grown by ``r = N·kvn/h_kv`` for the ``kvn`` K/V heads each rank's
query heads use (:func:`commlab.parallel.context.ulysses.kv_heads_per_rank`).

Entry points: ``*_nbytes``/``*_seconds`` per method, :func:`compare_context_parallel` (``exposed_s``; the
attention's backward :data:`ATTENTION_BACKWARD_OVER_FORWARD` times its forward), :func:`fastest_context_parallel`,
:func:`sequence_parallel_vs_tp`. Book: chapter 13, §13.1 and §13.2 (the table of the three methods).
"""

from __future__ import annotations

import dataclasses

from commlab.collectives.common import check_cost_args, check_counts
from commlab.collectives.all_to_all import all_to_all_seconds, two_level_all_to_all_seconds
from commlab.collectives.ring import (ring_all_gather_seconds, ring_all_reduce_seconds, ring_bytes_sent_per_rank,
                                      ring_reduce_scatter_seconds)
from commlab.parallel.context.ulysses import kv_heads_per_rank

__all__ = ["METHODS", "ATTENTION_BACKWARD_OVER_FORWARD", "ring_attention_nbytes", "all_gather_attention_nbytes",
           "ulysses_nbytes", "ring_attention_seconds", "all_gather_attention_seconds", "ulysses_seconds", "CPCost",
           "compare_context_parallel", "fastest_context_parallel", "sequence_parallel_vs_tp"]

METHODS = ("ring", "all-gather", "ulysses")

#: Attention's backward time over its forward time: 2.5, FlashAttention-2's accounting (the backward recomputes
#: the scores: 5 matmuls against the forward's 2; Dao-AILab/flash-attention
#: ``benchmarks/benchmark_flash_attention.py``), as the planner's ``attention_flops_per_token`` uses. Splits
#: ``attention_seconds`` in :func:`compare_context_parallel`.
ATTENTION_BACKWARD_OVER_FORWARD = 2.5


def _heads_per_gpu(heads, kv_heads, tp):
    """(query heads, K/V heads) one TP rank holds: ``heads / tp``; ``kv_heads / tp``, or 1 (replicated) when tp
    is a multiple of ``kv_heads`` (Megatron-LM's GQA under TP)."""
    check_counts(heads=heads, kv_heads=kv_heads, tp=tp)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) (grouped-query attention)")
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(f"tp ({tp}) must divide heads ({heads}), and divide kv_heads ({kv_heads}) or be a multiple "
                         "of it (each TP rank holds whole heads; K/V heads are replicated when tp exceeds them)")
    return heads // tp, max(1, kv_heads // tp)


def _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp=1):
    kv_heads = heads if kv_heads is None else kv_heads
    check_counts(batch=batch, seq=seq, head_dim=head_dim, n=n, element_nbytes=element_nbytes)
    heads, kv_heads = _heads_per_gpu(heads, kv_heads, tp)
    if seq % n:
        raise ValueError(f"seq ({seq}) must be a multiple of n ({n}): each rank holds seq / n tokens")
    tokens = batch * (seq // n) * head_dim * element_nbytes
    return heads * tokens, kv_heads * tokens   # Q, K bytes of one GPU's block


def ring_attention_nbytes(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int, *,
                          kv_heads: int | None = None, tp: int = 1) -> dict[str, int]:
    """Bytes one GPU sends in ring attention (:func:`commlab.parallel.context.ring_attention`).

    Args:
        batch, seq, heads, head_dim, n, element_nbytes, kv_heads: the shape (module notation; ``kv_heads`` None:
            ``heads``). tp: the TP size beside CP: the GPU holds ``heads / tp`` query heads and
            ``max(1, kv_heads / tp)`` K/V heads.

    Returns:
        ``{"forward": (N-1)·2K, "backward": (N-1)·2K + N·2K'}`` (module notation; ``K' = K · max(e, 4) / e``, the
        dK/dV accumulators travel in at least float32; 0 and 0 for N = 1).

    Raises:
        ValueError: a count not an int >= 1, ``seq`` not a multiple of ``n``, ``heads`` not a multiple of
            ``kv_heads``, ``tp`` not dividing ``heads`` (or neither dividing nor a multiple of ``kv_heads``).
    """
    _, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp)
    k_grad = k * max(element_nbytes, 4) // element_nbytes
    return {"forward": (n - 1) * 2 * k, "backward": (n - 1) * 2 * k + (n * 2 * k_grad if n > 1 else 0)}


def all_gather_attention_nbytes(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int, *,
                                kv_heads: int | None = None, tp: int = 1) -> dict[str, int]:
    """Bytes one GPU sends with all-gathered K/V (:func:`commlab.parallel.context.all_gather_attention`) on a
    ring: ``{"forward": (N-1)·2K, "backward": (N-1)·2K}`` (AllGather, then ReduceScatter of the gradients).

    Raises:
        ValueError: as :func:`ring_attention_nbytes`.
    """
    _, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp)
    one = round(ring_bytes_sent_per_rank(2 * k * n, n, "all_gather"))
    return {"forward": one, "backward": one}


def _ulysses_blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp):
    """(Q, rK): one GPU's q block and the K bytes it sends in one AllToAll, ``N·kvn`` heads of s/N tokens;
    ValueError when N does not divide the query heads of a TP shard."""
    q, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp)
    h, h_kv = _heads_per_gpu(heads, heads if kv_heads is None else kv_heads, tp)
    why = _ulysses_feasible(h, n)
    if why:
        raise ValueError(why)
    return q, k // h_kv * n * kv_heads_per_rank(h, h_kv, n)


def ulysses_nbytes(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int, *,
                   kv_heads: int | None = None, tp: int = 1) -> dict[str, float]:
    """Bytes one GPU sends in DeepSpeed-Ulysses (:func:`commlab.parallel.context.ulysses_attention`):
    ``(N-1)/N · (2Q + 2rK)`` each way (q, k, v out in one AllToAll, the output back in another; the gradients
    the same in reverse; the pairwise AllToAll keeps 1/N of each tensor at home). ``r = N·kvn / h_kv``: each
    rank is sent the ``kvn`` K/V heads its query heads use (``r = N / h_kv`` when ``h_kv`` divides N).

    Raises:
        ValueError: as :func:`ring_attention_nbytes`, or ``heads / tp`` not a multiple of ``n``.
    """
    q, rk = _ulysses_blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp)
    one = (n - 1) / n * (2 * q + 2 * rk)
    return {"forward": one, "backward": one}


def _ulysses_feasible(heads, n) -> str | None:
    if heads % n:
        return (f"Ulysses needs the query heads ({heads} per GPU) to be a multiple of N = {n} (each rank attends "
                "with heads / N of them and is sent the K/V heads those use)")
    return None


def ring_attention_seconds(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int,
                           alpha_s: float, beta_s_per_byte: float, *, kv_heads: int | None = None,
                           tp: int = 1) -> dict[str, float]:
    """α-β time of ring attention's transfers on one GPU, nothing overlapped.

    ``forward = (N-1)·(2α + 2K·β)`` (K and V are two messages a step); ``backward = (N-1)·(2α + 2K·β) +
    N·(2α + 2K'·β)``.

    Raises:
        ValueError: as :func:`ring_attention_nbytes`, or a negative or non-finite α/β.
    """
    check_cost_args(0, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte)
    nb = ring_attention_nbytes(batch, seq, heads, head_dim, n, element_nbytes, kv_heads=kv_heads, tp=tp)
    back_msgs = 2 * (n - 1) + (2 * n if n > 1 else 0)
    return {"forward": 2 * (n - 1) * alpha_s + nb["forward"] * beta_s_per_byte,
            "backward": back_msgs * alpha_s + nb["backward"] * beta_s_per_byte}


def all_gather_attention_seconds(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int,
                                 alpha_s: float, beta_s_per_byte: float, *,
                                 kv_heads: int | None = None, tp: int = 1) -> dict[str, float]:
    """α-β time of all-gathered K/V: a ring AllGather of ``2K·N`` bytes forward, ``(N-1)·α + (N-1)·2K·β``
    (:func:`commlab.collectives.ring_all_gather_seconds`); a ring ReduceScatter of the same size backward.

    Raises:
        ValueError: as :func:`ring_attention_seconds`.
    """
    _, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp)
    return {"forward": ring_all_gather_seconds(2 * k * n, n, alpha_s, beta_s_per_byte),
            "backward": ring_reduce_scatter_seconds(2 * k * n, n, alpha_s, beta_s_per_byte)}


def ulysses_seconds(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int,
                    alpha_s: float, beta_s_per_byte: float, *, kv_heads: int | None = None, tp: int = 1,
                    intra: tuple[int, float, float] | None = None) -> dict[str, float]:
    """α-β time of Ulysses' two pairwise AllToAlls each way (:func:`commlab.collectives.all_to_all_seconds`):
    ``2·(N-1)·α + (N-1)/N · (2Q + 2rK)·β`` forward, the same backward.

    Args:
        intra: None when the whole group shares one link (α, β); ``(ranks_per_node, α_intra, β_intra)`` when
            it spans nodes: (α, β) is then the NIC's and each AllToAll is
            :func:`commlab.collectives.all_to_all.two_level_all_to_all_seconds`.

    Raises:
        ValueError: as :func:`ulysses_nbytes`, or a negative or non-finite α/β.
    """
    q, rk = _ulysses_blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads, tp)
    if intra is None:
        def a2a(nbytes):
            return all_to_all_seconds(nbytes, n, alpha_s, beta_s_per_byte)
    else:
        def a2a(nbytes):
            return two_level_all_to_all_seconds(nbytes, n, intra[0], intra[1], intra[2], alpha_s, beta_s_per_byte)
    one = a2a(q + 2 * rk) + a2a(q)
    return {"forward": one, "backward": one}


@dataclasses.dataclass(frozen=True)
class CPCost:
    """One method's communication for one attention layer, forward + backward, on one GPU.

    Attributes:
        method: one of :data:`METHODS`. feasible: False when the method cannot run this shape (``why`` says).
        nbytes: bytes sent (forward + backward). seconds: α-β time of those transfers.
        exposed_s: what the attention arithmetic does not hide: the ring overlaps each step's transfer with
            that step's block (``max(0, transfer - compute)`` per step); the AllGather and the AllToAlls are
            not overlapped (their results are needed before the arithmetic starts), so all of ``seconds``.
        kv_nbytes_held: K/V bytes one GPU holds during the forward pass (the ring: the block it computes with
            and the one arriving; the all-gather: the whole sequence; Ulysses: the whole sequence of
            ``kvn = r·h_kv / N`` heads).
    """

    method: str
    feasible: bool
    why: str | None
    nbytes: float
    seconds: float
    exposed_s: float
    kv_nbytes_held: float


def compare_context_parallel(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int,
                             alpha_s: float, beta_s_per_byte: float, *, kv_heads: int | None = None,
                             attention_seconds: float = 0.0, tp: int = 1,
                             intra: tuple[int, float, float] | None = None) -> list[CPCost]:
    """The three methods of :data:`METHODS` for one attention layer, side by side, per GPU.

    Args:
        batch, seq, heads, head_dim, n, element_nbytes, kv_heads: the shape (module notation).
        alpha_s, beta_s_per_byte: the CP group's link (across nodes: the NIC's, which bounds a ring's step).
        attention_seconds: one GPU's attention arithmetic, forward + backward, for its queries over the whole
            sequence (load-balanced or non-causal: the same on every rank); split as forward : backward =
            1 : :data:`ATTENTION_BACKWARD_OVER_FORWARD`, and the ring hides up to ``1/N`` of each pass's share
            behind each of its steps of that pass. 0 hides nothing.
        tp: the TP size beside CP (every figure per TP shard: ``heads / tp`` query heads, ``max(1, kv_heads /
            tp)`` K/V heads).
        intra: ``(ranks_per_node, α_intra, β_intra)`` when the group spans nodes: Ulysses' AllToAlls are then
            priced two-level (:func:`ulysses_seconds`); None: one link.

    Returns:
        One :class:`CPCost` per method, in :data:`METHODS` order (Ulysses with ``feasible=False`` and NaN
        costs when N does not divide the query heads of a TP shard).

    Raises:
        ValueError: as :func:`ring_attention_seconds`, or a negative ``attention_seconds``.
    """
    check_cost_args(0, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, attention_seconds=attention_seconds)
    args = (batch, seq, heads, head_dim, n, element_nbytes)
    _, k = _blocks(*args, kv_heads, tp)
    rows = []
    ring_s = ring_attention_seconds(*args, alpha_s, beta_s_per_byte, kv_heads=kv_heads, tp=tp)
    ring_b = ring_attention_nbytes(*args, kv_heads=kv_heads, tp=tp)
    forward_share = 1.0 / (1.0 + ATTENTION_BACKWARD_OVER_FORWARD)
    fwd_compute = attention_seconds * forward_share / n                 # per ring step
    bwd_compute = attention_seconds * (1.0 - forward_share) / n
    fwd_step = ring_s["forward"] / (n - 1) if n > 1 else 0.0
    exposed = (n - 1) * max(0.0, fwd_step - fwd_compute)
    if n > 1:   # backward: N-1 steps carry K/V and dK/dV, the last only dK/dV
        k_grad = k * max(element_nbytes, 4) / element_nbytes
        both = 4 * alpha_s + (2 * k + 2 * k_grad) * beta_s_per_byte
        exposed += (n - 1) * max(0.0, both - bwd_compute) + max(0.0, 2 * alpha_s + 2 * k_grad * beta_s_per_byte
                                                                - bwd_compute)
    rows.append(CPCost("ring", True, None, sum(ring_b.values()), sum(ring_s.values()), exposed,
                       2 * 2 * k if n > 1 else 2 * k))
    ag_s = all_gather_attention_seconds(*args, alpha_s, beta_s_per_byte, kv_heads=kv_heads, tp=tp)
    rows.append(CPCost("all-gather", True, None,
                       sum(all_gather_attention_nbytes(*args, kv_heads=kv_heads, tp=tp).values()),
                       sum(ag_s.values()), sum(ag_s.values()), 2 * k * n))
    why = _ulysses_feasible(_heads_per_gpu(heads, heads if kv_heads is None else kv_heads, tp)[0], n)
    if why:
        rows.append(CPCost("ulysses", False, why, float("nan"), float("nan"), float("nan"), float("nan")))
    else:
        _, rk = _ulysses_blocks(*args, kv_heads, tp)
        u_s = ulysses_seconds(*args, alpha_s, beta_s_per_byte, kv_heads=kv_heads, tp=tp, intra=intra)
        rows.append(CPCost("ulysses", True, None, sum(ulysses_nbytes(*args, kv_heads=kv_heads, tp=tp).values()),
                           sum(u_s.values()), sum(u_s.values()), 2 * rk))  # kvn heads, whole seq
    return rows


def fastest_context_parallel(*args, **kwargs) -> tuple[str, list[CPCost]]:
    """The feasible method of :func:`compare_context_parallel` (same arguments) with the least exposed
    communication, ties going to the one holding less K/V; returns ``(method, rows)``."""
    rows = compare_context_parallel(*args, **kwargs)
    best = min((r for r in rows if r.feasible), key=lambda r: (r.exposed_s, r.kv_nbytes_held))
    return best.method, rows


def sequence_parallel_vs_tp(batch: int, seq: int, hidden: int, element_nbytes: int, tp: int,
                            alpha_s: float, beta_s_per_byte: float) -> dict[str, dict[str, float]]:
    """One TP block's communication per pass, Megatron TP (an all-reduce) beside sequence parallelism (an
    all-gather before the block and a reduce-scatter after it; Korthikanti et al. 2022, §4.2.2, Figure 5).

    Both move the ``X = batch · seq · hidden · e``-byte activation on a ring: the all-reduce sends
    ``2 (t-1)/t · X`` bytes in ``2 (t-1)`` messages, the all-gather and reduce-scatter ``(t-1)/t · X`` each in
    ``t-1`` messages each -- the same bytes and the same α-β time (``2(t-1)·α + 2(t-1)/t·X·β``, without the
    reduction's arithmetic); sequence parallelism's gain is the activation memory it divides by t.

    Returns:
        ``{"tp": {"nbytes": ..., "seconds": ...}, "sp": {...}}``, per rank, per block and per pass.

    Raises:
        ValueError: a count not an int >= 1 (``tp`` included) or a bad α/β.
    """
    check_counts(batch=batch, seq=seq, hidden=hidden, element_nbytes=element_nbytes, tp=tp)
    x = batch * seq * hidden * element_nbytes
    return {"tp": {"nbytes": ring_bytes_sent_per_rank(x, tp, "all_reduce"),
                   "seconds": ring_all_reduce_seconds(x, tp, alpha_s, beta_s_per_byte)},
            "sp": {"nbytes": ring_bytes_sent_per_rank(x, tp, "all_gather") + ring_bytes_sent_per_rank(x, tp,
                                                                                                     "reduce_scatter"),
                   "seconds": ring_all_gather_seconds(x, tp, alpha_s, beta_s_per_byte)
                   + ring_reduce_scatter_seconds(x, tp, alpha_s, beta_s_per_byte)}}
