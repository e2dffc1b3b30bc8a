"""Communication of context and sequence parallelism side by side: bytes sent per rank and α-β time.

``K = b·h_kv·(s/N)·d·e`` bytes is one rank's K block (V the same), ``Q = b·h·(s/N)·d·e`` its q block, ``K'``
the dK block as it travels (float32 for half-precision inputs); α in s/message, β in s/byte, single port.

=============== ================================= ============================== ================
method          bytes per rank, forward           backward                       K/V held
=============== ================================= ============================== ================
ring attention  ``(N-1)·2K``                      ``(N-1)·2K + N·2K'``           2 blocks
all-gathered    ``(N-1)·2K`` (AllGather)          ``(N-1)·2K`` (ReduceScatter)   whole seq
Ulysses         ``(N-1)/N·(2Q+2K)`` (2 AllToAll)  the same                       whole seq, h/N
=============== ================================= ============================== ================

Entry points: ``*_nbytes``/``*_seconds`` per method, :func:`compare_context_parallel` (``exposed_s``),
:func:`fastest_context_parallel`, :func:`sequence_parallel_vs_tp`. Book: chapter 13, §13.1 and §13.2.
"""

from __future__ import annotations

import dataclasses

from commlab.collectives.common import check_cost_args, check_counts
from commlab.collectives.all_to_all import all_to_all_seconds
from commlab.collectives.ring import (ring_all_gather_seconds, ring_all_reduce_seconds, ring_bytes_sent_per_rank,
                                      ring_reduce_scatter_seconds)

__all__ = ["METHODS", "ring_attention_nbytes", "all_gather_attention_nbytes", "ulysses_nbytes",
           "ring_attention_seconds", "all_gather_attention_seconds", "ulysses_seconds", "CPCost",
           "compare_context_parallel", "fastest_context_parallel", "sequence_parallel_vs_tp"]

METHODS = ("ring", "all-gather", "ulysses")


def _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads):
    kv_heads = heads if kv_heads is None else kv_heads
    check_counts(batch=batch, seq=seq, heads=heads, head_dim=head_dim, n=n, element_nbytes=element_nbytes,
                 kv_heads=kv_heads)
    if seq % n:
        raise ValueError(f"seq ({seq}) must be a multiple of n ({n}): each rank holds seq / n tokens")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) (grouped-query attention)")
    tokens = batch * (seq // n) * head_dim * element_nbytes
    return heads * tokens, kv_heads * tokens   # Q, K bytes of one rank's block


def ring_attention_nbytes(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int, *,
                          kv_heads: int | None = None) -> dict[str, int]:
    """Bytes one rank sends in ring attention (:func:`commlab.parallel.context.ring_attention`).

    Returns:
        ``{"forward": (N-1)·2K, "backward": (N-1)·2K + N·2K'}`` (module notation; ``K' = K · max(e, 4) / e``, the
        dK/dV accumulators travel in at least float32; 0 and 0 for N = 1).

    Raises:
        ValueError: a count not an int >= 1, ``seq`` not a multiple of ``n``, ``heads`` not a multiple of
            ``kv_heads``.
    """
    _, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads)
    k_grad = k * max(element_nbytes, 4) // element_nbytes
    return {"forward": (n - 1) * 2 * k, "backward": (n - 1) * 2 * k + (n * 2 * k_grad if n > 1 else 0)}


def all_gather_attention_nbytes(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int, *,
                                kv_heads: int | None = None) -> dict[str, int]:
    """Bytes one rank sends with all-gathered K/V (:func:`commlab.parallel.context.all_gather_attention`) on a
    ring: ``{"forward": (N-1)·2K, "backward": (N-1)·2K}`` (AllGather, then ReduceScatter of the gradients).

    Raises:
        ValueError: as :func:`ring_attention_nbytes`.
    """
    _, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads)
    one = round(ring_bytes_sent_per_rank(2 * k * n, n, "all_gather"))
    return {"forward": one, "backward": one}


def ulysses_nbytes(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int, *,
                   kv_heads: int | None = None) -> dict[str, float]:
    """Bytes one rank sends in DeepSpeed-Ulysses (:func:`commlab.parallel.context.ulysses_attention`):
    ``(N-1)/N · (2Q + 2K)`` each way (q, k, v out in one AllToAll, the output back in another; the gradients
    the same in reverse; the pairwise AllToAll keeps 1/N of each tensor at home).

    Raises:
        ValueError: as :func:`ring_attention_nbytes`, or ``kv_heads`` (``heads``) not a multiple of ``n``.
    """
    q, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads)
    _ulysses_feasible(heads, heads if kv_heads is None else kv_heads, n, raise_=True)
    one = (n - 1) / n * (2 * q + 2 * k)
    return {"forward": one, "backward": one}


def _ulysses_feasible(heads, kv_heads, n, raise_=False) -> str | None:
    why = None
    if kv_heads % n or heads % n:
        why = (f"Ulysses needs heads ({heads}) and kv_heads ({kv_heads}) to be multiples of N = {n} "
               "(each rank attends with heads / N of them)")
    if why and raise_:
        raise ValueError(why)
    return why


def ring_attention_seconds(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int,
                           alpha_s: float, beta_s_per_byte: float, *, kv_heads: int | None = None) -> dict[str, float]:
    """α-β time of ring attention's transfers on one rank, nothing overlapped.

    ``forward = (N-1)·(2α + 2K·β)`` (K and V are two messages a step); ``backward = (N-1)·(2α + 2K·β) +
    N·(2α + 2K'·β)``.

    Raises:
        ValueError: as :func:`ring_attention_nbytes`, or a negative or non-finite α/β.
    """
    check_cost_args(0, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte)
    nb = ring_attention_nbytes(batch, seq, heads, head_dim, n, element_nbytes, kv_heads=kv_heads)
    back_msgs = 2 * (n - 1) + (2 * n if n > 1 else 0)
    return {"forward": 2 * (n - 1) * alpha_s + nb["forward"] * beta_s_per_byte,
            "backward": back_msgs * alpha_s + nb["backward"] * beta_s_per_byte}


def all_gather_attention_seconds(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int,
                                 alpha_s: float, beta_s_per_byte: float, *,
                                 kv_heads: int | None = None) -> dict[str, float]:
    """α-β time of all-gathered K/V: a ring AllGather of ``2K·N`` bytes forward, ``(N-1)·α + (N-1)·2K·β``
    (:func:`commlab.collectives.ring_all_gather_seconds`); a ring ReduceScatter of the same size backward.

    Raises:
        ValueError: as :func:`ring_attention_seconds`.
    """
    _, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads)
    return {"forward": ring_all_gather_seconds(2 * k * n, n, alpha_s, beta_s_per_byte),
            "backward": ring_reduce_scatter_seconds(2 * k * n, n, alpha_s, beta_s_per_byte)}


def ulysses_seconds(batch: int, seq: int, heads: int, head_dim: int, n: int, element_nbytes: int,
                    alpha_s: float, beta_s_per_byte: float, *, kv_heads: int | None = None) -> dict[str, float]:
    """α-β time of Ulysses' two pairwise AllToAlls each way (:func:`commlab.collectives.all_to_all_seconds`):
    ``2·(N-1)·α + (N-1)/N · (2Q + 2K)·β`` forward, the same backward.

    Raises:
        ValueError: as :func:`ulysses_nbytes`, or a negative or non-finite α/β.
    """
    q, k = _blocks(batch, seq, heads, head_dim, n, element_nbytes, kv_heads)
    _ulysses_feasible(heads, heads if kv_heads is None else kv_heads, n, raise_=True)
    one = (all_to_all_seconds(q + 2 * k, n, alpha_s, beta_s_per_byte)
           + all_to_all_seconds(q, n, alpha_s, beta_s_per_byte))
    return {"forward": one, "backward": one}


@dataclasses.dataclass(frozen=True)
class CPCost:
    """One method's communication for one attention layer, forward + backward, on one rank.

    Attributes:
        method: one of :data:`METHODS`. feasible: False when the method cannot run this shape (``why`` says).
        nbytes: bytes sent (forward + backward). seconds: α-β time of those transfers.
        exposed_s: what the attention arithmetic does not hide: the ring overlaps each step's transfer with
            that step's block (``max(0, transfer - compute)`` per step); the AllGather and the AllToAlls are
            not overlapped (their results are needed before the arithmetic starts), so all of ``seconds``.
        kv_nbytes_held: K/V bytes one rank holds during the forward pass (the ring: the block it computes with
            and the one arriving; the others: the whole sequence, of ``h_kv / N`` heads for Ulysses).
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
                             attention_seconds: float = 0.0) -> list[CPCost]:
    """The three methods of :data:`METHODS` for one attention layer, side by side.

    Args:
        batch, seq, heads, head_dim, n, element_nbytes, kv_heads: the shape (module notation).
        alpha_s, beta_s_per_byte: the CP group's link.
        attention_seconds: one rank's attention arithmetic, forward + backward, for its queries over the whole
            sequence (load-balanced or non-causal: the same on every rank); the ring hides up to
            ``attention_seconds / (2N)`` behind each of its steps forward and backward. 0 hides nothing.

    Returns:
        One :class:`CPCost` per method, in :data:`METHODS` order (Ulysses with ``feasible=False`` and NaN
        costs when the heads do not divide by N).

    Raises:
        ValueError: as :func:`ring_attention_seconds`, or a negative ``attention_seconds``.
    """
    check_cost_args(0, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, attention_seconds=attention_seconds)
    kvh = heads if kv_heads is None else kv_heads
    args = (batch, seq, heads, head_dim, n, element_nbytes)
    _, k = _blocks(*args, kv_heads)
    rows = []
    ring_s = ring_attention_seconds(*args, alpha_s, beta_s_per_byte, kv_heads=kv_heads)
    ring_b = ring_attention_nbytes(*args, kv_heads=kv_heads)
    step_compute = attention_seconds / (2 * n)
    fwd_step = ring_s["forward"] / (n - 1) if n > 1 else 0.0
    exposed = (n - 1) * max(0.0, fwd_step - step_compute)
    if n > 1:   # backward: N-1 steps carry K/V and dK/dV, the last only dK/dV
        k_grad = k * max(element_nbytes, 4) / element_nbytes
        both = 4 * alpha_s + (2 * k + 2 * k_grad) * beta_s_per_byte
        exposed += (n - 1) * max(0.0, both - step_compute) + max(0.0, 2 * alpha_s + 2 * k_grad * beta_s_per_byte
                                                                 - step_compute)
    rows.append(CPCost("ring", True, None, sum(ring_b.values()), sum(ring_s.values()), exposed,
                       2 * 2 * k if n > 1 else 2 * k))
    ag_s = all_gather_attention_seconds(*args, alpha_s, beta_s_per_byte, kv_heads=kv_heads)
    rows.append(CPCost("all-gather", True, None, sum(all_gather_attention_nbytes(*args, kv_heads=kv_heads).values()),
                       sum(ag_s.values()), sum(ag_s.values()), 2 * k * n))
    why = _ulysses_feasible(heads, kvh, n)
    if why:
        rows.append(CPCost("ulysses", False, why, float("nan"), float("nan"), float("nan"), float("nan")))
    else:
        u_s = ulysses_seconds(*args, alpha_s, beta_s_per_byte, kv_heads=kv_heads)
        rows.append(CPCost("ulysses", True, None, sum(ulysses_nbytes(*args, kv_heads=kv_heads).values()),
                           sum(u_s.values()), sum(u_s.values()), 2 * k))  # h_kv/N heads, whole seq
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
