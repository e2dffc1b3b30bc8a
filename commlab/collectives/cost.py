"""Every AllReduce cost model side by side: predict, compare, find crossovers.

Each algorithm's formula lives beside its code (``ring.py``, ``halving_doubling.py``, ``tree.py``,
``hierarchical.py``, ``in_network.py``); this module gathers them behind :func:`predict_flat` (all ranks on
one link: ring, recursive doubling, halving-doubling, binomial tree, double binary tree),
:func:`predict_on_cluster` (nodes of several devices: rings in topology and round-robin order,
hierarchical, in-network) and :func:`fastest`. One (α, β) per link; NCCL's per-protocol model is
:mod:`commlab.collectives.nccl_model`. Times in seconds, sizes in bytes, α in s, β and γ in s/byte.

Book: chapter 3, §3.3-3.4 (flat), §3.7 (on a cluster), §3.9 (the calculator).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from commlab.collectives.common import check_counts
from commlab.collectives.halving_doubling import (recursive_doubling_all_reduce_seconds,
                                                  rhd_all_reduce_seconds)
from commlab.collectives.hierarchical import hierarchical_all_reduce_seconds, ring_all_reduce_seconds_on
from commlab.collectives.in_network import HDR_SWITCH_PORTS, in_network_all_reduce_seconds
from commlab.collectives.ring import ring_all_reduce_seconds
from commlab.collectives.tree import binomial_tree_all_reduce_seconds, double_binary_tree_all_reduce_seconds
from commlab.topology.links import Link, flows_per_nic
from commlab.topology.ring_order import topology_aware_ring

#: name -> f(nbytes, n, alpha_s, beta_s_per_byte, gamma_s_per_byte) for a single kind of link.
FLAT_ALGORITHMS: dict[str, Callable[..., float]] = {
    "ring": ring_all_reduce_seconds,
    "recursive doubling": recursive_doubling_all_reduce_seconds,
    "halving-doubling": rhd_all_reduce_seconds,
    "binomial tree": binomial_tree_all_reduce_seconds,
    "double binary tree": double_binary_tree_all_reduce_seconds,
}


def predict_flat(nbytes: float, n: int, link: Link, gamma_s_per_byte: float = 0.0,
                 algorithms: Sequence[str] | None = None) -> dict[str, float]:
    """Predicted AllReduce time (s) of each algorithm for ``nbytes`` bytes over ``n`` ranks on ``link``.

    Raises:
        KeyError: an unknown algorithm name (the message lists the known ones).
        ValueError: bad sizes, as each formula raises.
    """
    names = list(FLAT_ALGORITHMS) if algorithms is None else list(algorithms)
    unknown = [a for a in names if a not in FLAT_ALGORITHMS]
    if unknown:
        raise KeyError(f"unknown algorithms {unknown}; known: {list(FLAT_ALGORITHMS)}")
    return {a: FLAT_ALGORITHMS[a](nbytes, n, link.alpha_s, link.beta_s_per_byte, gamma_s_per_byte)
            for a in names}


def fastest(nbytes: float, n: int, link: Link, candidates: Sequence[str] = ("ring", "double binary tree"),
            gamma_s_per_byte: float = 0.0) -> str:
    """The candidate with the lowest predicted time: how NCCL's tuner picks between its algorithms
    (it predicts each one's time from latency and bandwidth tables and takes the minimum; NVIDIA/nccl
    ``src/graph/tuning.cc``). The default candidates are NCCL's two classic AllReduce algorithms. Here every
    algorithm shares the link's one (α, β); NCCL's tables differ per protocol as well
    (:func:`commlab.collectives.nccl_model.best`)."""
    if not candidates:
        raise ValueError("fastest needs at least one candidate algorithm")
    times = predict_flat(nbytes, n, link, gamma_s_per_byte, candidates)
    return min(times, key=times.get)


def crossover_nbytes(slower_small: Callable[[float], float], slower_large: Callable[[float], float],
                     lo: float = 1.0, hi: float = 2.0**40) -> float | None:
    """The message size (bytes) where two cost curves cross, found by bisection on a log scale.

    ``slower_small(s)`` and ``slower_large(s)`` give seconds for ``s`` bytes; the first is expected to be
    the slower one at small sizes (e.g. the ring, paying 2(n-1) latencies) and the faster one at large
    sizes. Returns None when they do not cross in ``[lo, hi]``.
    """
    def diff(s):
        return slower_small(s) - slower_large(s)

    d_lo, d_hi = diff(lo), diff(hi)
    if not (math.isfinite(d_lo) and math.isfinite(d_hi)) or d_lo <= 0 or d_hi > 0:
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(200):
        mid = (a + b) / 2
        if diff(math.exp(mid)) > 0:
            a = mid
        else:
            b = mid
    return math.exp(b)


def interleaved_placement(nodes: int, devices_per_node: int) -> list[int]:
    """``placement[rank]`` when ranks are dealt to nodes round-robin (rank r on node r % nodes): the
    numbering under which the default ring 0, 1, 2, ... crosses between nodes at every hop."""
    return [r % nodes for r in range(nodes * devices_per_node)]


def predict_on_cluster(nbytes: float, nodes: int, devices_per_node: int, intra: Link, inter: Link,
                       nics_per_node: int = 1, switch_alpha_s: float | None = None,
                       radix: int = HDR_SWITCH_PORTS, channels: int | None = None) -> dict[str, float]:
    """Predicted AllReduce time (s) of ``nbytes`` bytes on ``nodes`` × ``devices_per_node`` devices.

    Returns a dict with:

    * ``"ring, topology order"`` -- a ring visiting each node's devices consecutively, split over
      ``channels`` concurrent rings (default ``nics_per_node``: one per rail, each leaving the node through
      its own NIC, as NCCL lays out its channels and as chapter 1's
      :func:`~commlab.arithmetic.data_parallel_sync` assumes);
    * ``"ring, round-robin ranks"`` -- the ring 0, 1, 2, ... (same channels) when ranks are dealt to nodes
      round-robin, so that every hop crosses nodes and the node's NICs carry ``devices_per_node`` times
      the flows;
    * ``"hierarchical"`` -- intra-node ReduceScatter, inter-node ring AllReduce, intra-node AllGather;
    * ``"hierarchical + in-network"`` (when ``switch_alpha_s`` is given) -- the same with the inter-node
      step reduced in the switches (SHARP-style, a fat tree of ``radix``-port switches; each of a node's
      ``nics_per_node`` NICs streams its share once).

    The two rings are priced by :func:`~commlab.collectives.hierarchical.ring_all_reduce_seconds_on`
    (pipelined: only the hops that cross nodes pay the network latency).

    Raises:
        ValueError: bad counts or sizes.
    """
    check_counts(nodes=nodes, devices_per_node=devices_per_node, nics_per_node=nics_per_node)
    channels = nics_per_node if channels is None else channels
    check_counts(channels=channels)
    placement = [r // devices_per_node for r in range(nodes * devices_per_node)]
    out = {
        "ring, topology order": ring_all_reduce_seconds_on(nbytes, topology_aware_ring(placement), placement,
                                                           intra, inter, nics_per_node, channels),
        "ring, round-robin ranks": ring_all_reduce_seconds_on(
            nbytes, list(range(nodes * devices_per_node)), interleaved_placement(nodes, devices_per_node),
            intra, inter, nics_per_node, channels),
        "hierarchical": hierarchical_all_reduce_seconds(nbytes, nodes, devices_per_node, intra, inter,
                                                        nics_per_node),
    }
    if switch_alpha_s is not None:
        d = devices_per_node
        intra_part = 2 * (d - 1) * (intra.alpha_s + nbytes / d * intra.beta_s_per_byte) if d > 1 else 0.0
        # After the intra-node ReduceScatter each device holds nbytes/d; the node's d shards leave through
        # its NICs, max(1, d/nics) flows per NIC.
        share = nbytes / d * flows_per_nic(d, nics_per_node)
        out["hierarchical + in-network"] = intra_part + in_network_all_reduce_seconds(
            share, nodes, inter.alpha_s, inter.beta_s_per_byte, switch_alpha_s, radix)
    return out
