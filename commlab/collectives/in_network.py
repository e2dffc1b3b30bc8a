"""In-network reduction (InfiniBand SHARP): a cost model only, since no laptop has such a switch.

With SHARP the switches add the buffers as they pass: each node sends its buffer up a tree of
switches once and receives the reduced result once (Graham et al. 2016, "Scalable Hierarchical
Aggregation Protocol (SHArP): A Hardware Architecture for Efficient Data Reduction", COMHPC workshop at
SC16, §3). Compared with a ring AllReduce:

* bandwidth term: each node's link carries ``nbytes`` in each direction instead of ``2(N-1)/N·nbytes``,
  so at most about 2x faster for large messages (the factor approaches 2 as N grows);
* latency term: the reduction climbs and descends the switch tree, whose height grows as
  ``ceil(log_radix N)``. That is much flatter than the ring's 2(N-1) steps, but it is not O(1): it grows
  with the cluster, one switch level at a time.
"""

from __future__ import annotations

from commlab.collectives._common import check_cost_args

def switch_tree_levels(n: int, radix: int = 40) -> int:
    """Levels of a switch tree joining ``n`` endpoints, each switch having ``radix`` ports facing down
    (towards the endpoints; in a fat tree that is half of a switch's ports).

    Raises:
        ValueError: ``n < 1`` or ``radix < 2``.
    """
    if n < 1 or radix < 2:
        raise ValueError(f"need n >= 1 and radix >= 2, got n={n}, radix={radix}")
    levels, reach = 1, radix
    while reach < n:
        levels += 1
        reach *= radix
    return levels


def in_network_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                                  switch_alpha_s: float, radix: int = 40) -> float:
    """α-β time of an AllReduce reduced inside the switches (SHARP-style), for ``n`` endpoints.

    ``2·levels·switch_alpha_s + 2·alpha_s + nbytes·beta_s_per_byte``: up and down the tree, one
    endpoint latency each way, and the buffer streamed through the endpoint's link once (reduction
    and broadcast are pipelined, so the two directions overlap). ``n == 1`` costs nothing.

    Args:
        nbytes: buffer size in bytes; n: endpoints (nodes or GPUs, one link each);
        alpha_s, beta_s_per_byte: the endpoint link (s, s/byte per direction);
        switch_alpha_s: added latency per switch level (s); radix: down-facing ports per switch.

    Raises:
        ValueError: bad ``n``/``radix``, negative sizes or times.
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte, switch_alpha_s=switch_alpha_s)
    if n == 1:
        return 0.0
    levels = switch_tree_levels(n, radix)
    return 2 * levels * switch_alpha_s + 2 * alpha_s + nbytes * beta_s_per_byte


def in_network_speedup_limit(n: int) -> float:
    """Bandwidth-term ratio ring / in-network for ``n`` ranks: ``2(n-1)/n`` (at most 2).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 2 * (n - 1) / n if n > 1 else 1.0
