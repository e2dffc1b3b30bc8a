"""Ring orders that respect a placement of ranks on nodes.

A ring AllReduce sends every chunk over every hop of the ring, so its time is set by the slowest hop. When
the ring alternates between nodes, every hop crosses the network and the ranks of a node all push through
the node's NIC at once; when it visits each node's ranks consecutively, only ``nodes`` hops cross (one
leaving each node), which is how NCCL builds its rings inside and across nodes.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["topology_aware_ring", "crossings"]


def topology_aware_ring(placement: Sequence[int]) -> list[int]:
    """A ring order over global ranks that visits each node's ranks consecutively.

    Args:
        placement: ``placement[rank]`` = node id of each global rank.

    Returns:
        The global ranks, grouped by node (nodes in order of their ids, ranks ascending inside a node); a
        permutation of ``range(len(placement))`` that crosses nodes exactly ``nodes`` times (0 for one node).
    """
    placement = [int(p) for p in placement]
    return sorted(range(len(placement)), key=lambda r: (placement[r], r))


def crossings(order: Sequence[int], placement: Sequence[int]) -> int:
    """Number of hops of the ring ``order`` (including the one back from the last rank to the first)
    whose two ends sit on different nodes.

    Raises:
        ValueError: ``order`` is not a permutation of ``range(len(placement))``.
    """
    order = [int(r) for r in order]
    if sorted(order) != list(range(len(placement))):
        raise ValueError(f"order must be a permutation of the {len(placement)} ranks of the placement, "
                         f"got {order}")
    n = len(order)
    return sum(placement[order[i]] != placement[order[(i + 1) % n]] for i in range(n))
