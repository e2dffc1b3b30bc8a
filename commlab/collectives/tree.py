"""Tree AllReduce: a binomial-tree reduce to a root, then a binomial-tree broadcast, from point-to-point messages.

The binomial tree (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), sections 4.1 and 4.3): number the ranks relative to the root,
``v = (rank - root) mod N``. Rank ``v`` receives from its children ``v + 1, v + 2, v + 4, ...`` (while the
offset is below the lowest set bit of ``v``, and below N), then sends to its parent ``v - lowbit(v)``.
The broadcast runs the same edges backwards. Each phase takes ``ceil(log2 N)`` steps and sends the whole
vector on each edge, so the tree is latency-friendly but moves ``ceil(log2 N)`` times more bytes through
the root than the ring moves per rank.

Alongside the implemented binomial tree, this module gives the cost of the *pipelined* trees that NCCL
uses for large messages (cost functions only; see :func:`double_binary_tree_all_reduce_seconds`).

Low precision: as in :mod:`commlab.collectives.ring` (partial sums in the input dtype).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives import p2p
from commlab.collectives.common import (as_int64, ceil_log2, check_cost_args, global_rank, ring_geometry, work_buffer,
                                         write_back)
from commlab.collectives.agreement import check_agreement
from commlab.topology.emulated import EmulatedTopology

__all__ = [
    "tree_all_reduce", "binomial_tree",
    "binomial_tree_all_reduce_seconds", "pipelined_binary_tree_all_reduce_seconds",
    "double_binary_tree_all_reduce_seconds", "optimal_pipeline_chunks",
]


# ------------------------------------------------------------------------------------ the schedule

def binomial_tree(rank: int, n: int, root: int = 0) -> tuple[int | None, list[int]]:
    """Parent and children of group rank ``rank`` in the binomial tree over ``n`` ranks rooted at ``root``.

    Returns:
        ``(parent, children)`` in group ranks: ``parent`` is None for the root; ``children`` are in the
        order the reduce receives from them (smallest subtree first, the one that finishes first). The
        broadcast sends to them in the reverse order, so the deepest subtree starts first.

    Raises:
        ValueError: ``rank`` or ``root`` outside ``0..n-1``.
    """
    if not (0 <= rank < n and 0 <= root < n):
        raise ValueError(f"rank and root must be in 0..{n - 1}, got rank={rank}, root={root}")
    v = (rank - root) % n
    lowbit = v & -v if v else 1 << n.bit_length()
    children, mask = [], 1
    while mask < lowbit and v + mask < n:
        children.append((v + mask + root) % n)
        mask <<= 1
    parent = None if v == 0 else (v - lowbit + root) % n
    return parent, children


# ------------------------------------------------------------------------------------ the collective

def tree_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *, root: int = 0,
                    inplace: bool = False, check: bool = True,
                    emulate: EmulatedTopology | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group: binomial-tree reduce to ``root``, then binomial-tree broadcast.

    Args:
        tensor: any shape, contiguous or not, a supported dtype; same element count and dtype on every rank.
        group: process group (default: the world).
        root: group rank at the top of the tree (same on every rank).
        inplace: write the sum into ``tensor`` instead of a new tensor.
        check: first make all ranks agree on element count, dtype and root (one tiny all-gather; a
            different root is reported as differing orders).
        emulate: an :class:`~commlab.topology.EmulatedTopology` that delays messages crossing nodes.

    Returns:
        The sum, shape and dtype of ``tensor`` (``tensor`` itself when ``inplace``).

    Raises:
        ValueError: ``root`` outside the group. CollectiveMismatchError: ranks disagree on element count,
        dtype or root (on every rank). TypeError: unsupported dtype.
    """
    geom = ring_geometry(group, None)
    n = geom.size
    root_ok = 0 <= as_int64(root) < n
    problem = None if root_ok else f"root must be a group rank in 0..{n - 1}, got {root!r}"
    if check:
        check_agreement("tree_all_reduce", tensor, group, (as_int64(root),), "root", problem,
                        f"a group rank in 0..{n - 1}")
    if problem:
        raise ValueError(f"tree_all_reduce: {problem}")
    work = work_buffer(tensor, inplace)
    if n > 1 and work.numel() > 0:
        parent, children = binomial_tree(geom.group_rank, n, root)
        # Every message through commlab.collectives.p2p, one group per step. The reduce receives one child
        # at a time (into one scratch buffer, added in the same order as always); the broadcast sends to
        # all children in one group, so that NCCL progresses them together.
        if children:
            scratch = torch.empty_like(work)
            for child in children:
                p2p.exchange(recvs=[(scratch, global_rank(group, child))], group=group).wait()
                work.add_(scratch)
        if parent is not None:
            p2p.exchange(sends=[(work, global_rank(group, parent))], group=group, emulate=emulate).wait()
            p2p.exchange(recvs=[(work, global_rank(group, parent))], group=group).wait()
        if children:
            p2p.exchange(sends=[(work, global_rank(group, child)) for child in reversed(children)], group=group,
                         emulate=emulate).wait()
    return write_back(tensor, work, inplace)


# ----------------------------------------------------------------------------- α-β cost, beside the code

def binomial_tree_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                                     gamma_s_per_byte: float = 0.0) -> float:
    """α-β-γ time of :func:`tree_all_reduce`: ``2·ceil(log2 n)·(α + nbytes·β) + ceil(log2 n)·nbytes·γ``.

    Reduce ``ceil(log2 n)·(α + nbytes·β + nbytes·γ)`` plus broadcast ``ceil(log2 n)·(α + nbytes·β)``
    (Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1), sections 4.1 and 4.3): the root's ``ceil(log2 n)``
    children arrive one after another, each carrying the whole vector.

    Args:
        nbytes: bytes of the vector on each rank. n: ranks (>= 1).
        alpha_s (s), beta_s_per_byte (s/byte, per direction), gamma_s_per_byte (s/byte of additions).

    Raises:
        ValueError: ``n < 1`` or ``nbytes < 0``.
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, gamma_s_per_byte=gamma_s_per_byte)
    steps = ceil_log2(n)
    return steps * (2 * (alpha_s + nbytes * beta_s_per_byte) + nbytes * gamma_s_per_byte)


# Pipelined trees (cost only). The model, derived here because papers state it asymptotically:
#
# * The vector is cut into k chunks; a phase (reduce, then broadcast) is a pipeline over the tree's depth
#   D, so it takes D + k - 1 steps. D is bounded by ceil(log2 n) for both a binary tree of n nodes and the
#   two trees of the double binary tree; we use that bound.
# * In a step a rank exchanges one chunk with each tree neighbour. Messages to different neighbours go out
#   together and share one latency α (NCCL posts them concurrently); their bytes share the rank's link
#   (one port per direction), so the step costs α + (bytes the busiest rank sends or receives)·β.
# * Single pipelined binary tree: an interior rank receives two chunks of n/k (reduce) and sends two
#   (broadcast): reduce step α + 2(n/k)(β + γ), broadcast step α + 2(n/k)β. Bandwidth limit 4nβ.
# * Double binary tree (Sanders, Speck & Träff 2009, "Two-tree algorithms for full bandwidth broadcast,
#   reduction and scan", Parallel Computing 35(12), sections 2-3): each tree carries half the vector, and
#   every rank is interior in at most one tree and a leaf in the other. Reduce: it receives two chunks of
#   n/(2k) in its interior tree and sends one up in each tree -- n/k bytes each way, n/k bytes added;
#   broadcast: the mirror image. Step α + (n/k)β (+ (n/k)γ in the reduce), bandwidth limit 2nβ + nγ: each
#   of reduce and broadcast costs about nβ, so the AllReduce matches the ring's 2(n-1)/n·nβ while its
#   latency term grows as log n instead of n. Sanders et al. give nβ + O(α log p + sqrt(nαβ log p)) for
#   one reduce or broadcast, which the optimum over k below reproduces.
# * Reduce and broadcast are counted one after the other; NCCL overlaps them, which saves at most the
#   D - 1 pipeline fill steps of one phase.
#
#   T(k) = (D + k - 1)·(2α + c·(n/k)·(2β + γ)),  c = 1 (double tree) or 2 (single tree)
#
# Minimising over k: T = (D-1)·2α + c·n(2β+γ) + [k·2α + (D-1)·c·n(2β+γ)/k], so
# k* = sqrt((D-1)·c·n·(2β+γ) / (2α)), and with k* the time is (sqrt((D-1)·2α) + sqrt(c·n·(2β+γ)))².

def _pipelined_tree_seconds(nbytes, n, alpha_s, beta, gamma, chunks, c):
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta, gamma_s_per_byte=gamma)
    if n == 1:
        return 0.0
    depth = ceil_log2(n)
    per_chunk_bytes = c * nbytes * (2 * beta + gamma)
    if chunks is None:
        chunks = optimal_pipeline_chunks(nbytes, n, alpha_s, beta, gamma, trees=2 if c == 1 else 1)
        if chunks == math.inf:  # α = 0: infinitely fine pipelining reaches the bandwidth limit
            return per_chunk_bytes
    checks.integer("chunks", chunks, note="or None to choose the best")
    return (depth + chunks - 1) * (2 * alpha_s + per_chunk_bytes / chunks)


def optimal_pipeline_chunks(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                            gamma_s_per_byte: float = 0.0, trees: int = 2) -> int | float:
    """The number of pipeline chunks k that minimises the pipelined-tree AllReduce time (model above).

    ``k* = sqrt((D-1)·c·nbytes·(2β+γ) / (2α))`` with ``D = ceil(log2 n)``, ``c = 1`` for ``trees=2``
    (double binary tree) and ``c = 2`` for ``trees=1``; the better of its floor and ceiling, at least 1.

    Returns:
        an int >= 1, or ``math.inf`` when ``α = 0`` and there is something to pipeline (then finer is
        always better).

    Raises:
        ValueError: ``trees`` not 1 or 2, ``n < 1`` or ``nbytes < 0``.
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, gamma_s_per_byte=gamma_s_per_byte)
    if trees not in (1, 2):
        raise ValueError(f"trees must be 1 (pipelined binary tree) or 2 (double binary tree), got {trees!r}")
    c = 1 if trees == 2 else 2
    depth = ceil_log2(n)
    b = c * nbytes * (2 * beta_s_per_byte + gamma_s_per_byte)
    if depth <= 1 or b == 0:
        return 1
    if alpha_s == 0:
        return math.inf
    k_star = math.sqrt((depth - 1) * b / (2 * alpha_s))
    candidates = {max(1, math.floor(k_star)), max(1, math.ceil(k_star))}
    return min(candidates, key=lambda k: ((depth + k - 1) * (2 * alpha_s + b / k), k))


def pipelined_binary_tree_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                                             gamma_s_per_byte: float = 0.0, chunks: int | None = None) -> float:
    """Model time of an AllReduce over one pipelined binary tree (reduce, then broadcast), ``k`` chunks.

    ``T = (ceil(log2 n) + k - 1)·(2α + 2·(nbytes/k)·(2β + γ))``; the bandwidth limit is ``4·nbytes·β``,
    twice the ring's, because an interior rank sends (and receives) every chunk twice. The derivation and
    its assumptions are in the comment above this function in the source.

    Args:
        nbytes, n, alpha_s, beta_s_per_byte, gamma_s_per_byte: as :func:`binomial_tree_all_reduce_seconds`.
        chunks: pipeline chunks k (int >= 1); None picks :func:`optimal_pipeline_chunks` (``trees=1``).

    Raises:
        ValueError: bad ``n``, ``nbytes`` or ``chunks``.
    """
    return _pipelined_tree_seconds(nbytes, n, alpha_s, beta_s_per_byte, gamma_s_per_byte, chunks, c=2)


def double_binary_tree_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                                          gamma_s_per_byte: float = 0.0, chunks: int | None = None) -> float:
    """Model time of NCCL's double-binary-tree AllReduce (cost only), with ``k`` pipeline chunks.

    ``T = (ceil(log2 n) + k - 1)·(2α + (nbytes/k)·(2β + γ))``: each of the two trees carries half the
    vector in k chunks; per step the busiest rank sends and receives ``nbytes/k`` bytes in reduce and again
    in broadcast. With the best k the time approaches ``2·nbytes·β + nbytes·γ`` (the ring's bandwidth) plus
    a latency that grows with ``log2 n``. Source: Sanders, Speck & Träff 2009, "Two-tree algorithms for full
    bandwidth broadcast, reduction and scan", Parallel Computing 35(12), sections 2-3; the k-chunk step
    model and its assumptions are in the comment above this function in the source.

    Args:
        nbytes, n, alpha_s, beta_s_per_byte, gamma_s_per_byte: as :func:`binomial_tree_all_reduce_seconds`.
        chunks: pipeline chunks k (int >= 1); None picks :func:`optimal_pipeline_chunks` (``trees=2``).

    Raises:
        ValueError: bad ``n``, ``nbytes`` or ``chunks``.
    """
    return _pipelined_tree_seconds(nbytes, n, alpha_s, beta_s_per_byte, gamma_s_per_byte, chunks, c=1)
