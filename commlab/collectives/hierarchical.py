"""Hierarchical (two-level) AllReduce: rings inside each node, a ring between nodes on 1/d of the data.

:func:`hierarchical_all_reduce` on ``nodes`` nodes of ``d`` ranks: ReduceScatter inside each node, then
d concurrent inter-node ring AllReduces (one per local index, each on 1/d of the vector), then AllGather
inside each node: the 2D-torus AllReduce of Mikami et al. 2018 (arXiv:1811.05233, §3), as Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE``. Only the middle step crosses nodes: ``2(nodes-1)/nodes · n`` bytes per
node in ``2(nodes-1)`` latencies, with the intra-node steps before and after it, not overlapped.
:func:`make_hierarchy_groups` creates the process groups (every rank, same placement).
:func:`hierarchical_all_reduce_seconds` prices it; :func:`ring_all_reduce_seconds_on` prices a flat,
pipelined ring over placed ranks, split over NCCL-style channels, for comparison.

Book: chapter 3, §3.7 (topology: nodes, NICs and the hierarchical algorithm).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from commlab.collectives.common import (as_int64, check_cost_args, check_counts, chunk_bounds, group_size_and_rank,
                                         ring_geometry, work_buffer, write_back)
from commlab.collectives.agreement import check_agreement
from commlab.collectives.ring import (all_gather_phase, reduce_scatter_phase, ring_all_reduce,
                                      ring_all_reduce_seconds)
from commlab.topology.emulated import EmulatedTopology
from commlab.topology.links import Link, flows_per_nic

__all__ = [
    "HierarchyGroups", "hierarchy_layout", "make_hierarchy_groups", "hierarchical_all_reduce",
    "hierarchical_all_reduce_seconds", "ring_all_reduce_seconds_on",
]


@dataclasses.dataclass(frozen=True)
class HierarchyGroups:
    """This rank's two process groups of a two-level hierarchy, and where it sits.

    Attributes:
        intra: the group of the ranks on this rank's node (group rank = local index).
        inter: the group of the ranks with this rank's local index, one per node (group rank = node index).
        node: index of this rank's node among the sorted node ids of the placement.
        local_index: this rank's position inside its node (its ranks sorted ascending).
        nodes: number of nodes. devices_per_node: ranks per node (d).
        placement: ``placement[rank]`` = node id of each global rank, as given.
        intra_ranks: global ranks of ``intra``, in group-rank order.
        inter_ranks: global ranks of ``inter``, in group-rank order.
    """

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    node: int
    local_index: int
    nodes: int
    devices_per_node: int
    placement: tuple[int, ...]
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]


def hierarchy_layout(placement: Sequence[int]) -> list[list[int]]:
    """The ranks of each node: ``layout[i]`` = global ranks on the i-th node (node ids sorted), ascending.

    Pure function (no communication); :func:`make_hierarchy_groups` builds its groups from it.

    Raises:
        ValueError: empty placement, a node id that is not a non-negative integer, or nodes holding
            different numbers of ranks (the message gives the count on each node).
    """
    if not len(placement):
        raise ValueError("placement is empty: give the node of every rank, placement[rank] = node")
    ids_given = [as_int64(p) for p in placement]
    if any(i < 0 for i in ids_given):
        raise ValueError(f"node ids must be non-negative integers, got {list(placement)}")
    placement = ids_given
    ids = sorted(set(placement))
    layout = [[r for r, node in enumerate(placement) if node == i] for i in ids]
    counts = {i: len(ranks) for i, ranks in zip(ids, layout)}
    if len(set(counts.values())) != 1:
        described = ", ".join(f"node {i}: {c}" for i, c in counts.items())
        raise ValueError(f"every node must hold the same number of ranks for a hierarchical AllReduce, got "
                         f"{described} (placement {placement})")
    return layout


def make_hierarchy_groups(placement: Sequence[int]) -> HierarchyGroups:
    """Create the intra-node and inter-node process groups and return this rank's two.

    Every rank must call it, with the same placement: it creates, in a fixed order, one intra-node group per
    node (node ids sorted) and then one inter-node group per local index, because ``dist.new_group`` must be
    called by all ranks for every group.

    Args:
        placement: ``placement[rank]`` = node id, for every global rank (length = world size), e.g.
            ``EmulatedTopology.placement`` or ``[r // devices_per_node for r in range(world_size)]``.
            Ranks of a node need not be contiguous.

    Raises:
        ValueError: the placement's length is not the world size, or nodes hold different numbers of ranks.
        RuntimeError: no process group is initialised.
    """
    world, _ = group_size_and_rank(None)
    normalized = tuple(([as_int64(p) for p in placement] + [-1] * world)[:world])
    problem = None
    if len(placement) != world:
        problem = (f"placement must give the node of each of the {world} ranks, got {len(placement)} "
                   f"entries: {list(placement)}")
    else:
        try:
            hierarchy_layout(placement)
        except ValueError as e:
            problem = str(e)
    # Agree before the first new_group: a rank that raised alone would leave the others waiting in it.
    check_agreement("make_hierarchy_groups", torch.empty(0), None, normalized, "placement", problem,
                    f"one node id per rank for all {world} ranks, the same number of ranks on every node")
    if problem:
        raise ValueError(problem)
    layout = hierarchy_layout(placement)
    d = len(layout[0])
    intra_groups = [dist.new_group(ranks) for ranks in layout]
    inter_layout = [[ranks[j] for ranks in layout] for j in range(d)]
    inter_groups = [dist.new_group(ranks) for ranks in inter_layout]
    me = dist.get_rank()
    node = next(i for i, ranks in enumerate(layout) if me in ranks)
    local = layout[node].index(me)
    return HierarchyGroups(intra=intra_groups[node], inter=inter_groups[local], node=node, local_index=local,
                           nodes=len(layout), devices_per_node=d, placement=tuple(int(p) for p in placement),
                           intra_ranks=tuple(layout[node]), inter_ranks=tuple(inter_layout[local]))


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierarchyGroups, *, inplace: bool = False,
                            check: bool = True, emulate: EmulatedTopology | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks: intra-node ring ReduceScatter, inter-node ring AllReduce, intra-node
    ring AllGather.

    Args:
        tensor: any shape, contiguous or not, a supported dtype; same element count and dtype on every rank.
        groups: this rank's groups from :func:`make_hierarchy_groups` (same placement on every rank).
        inplace: write the sum into ``tensor`` instead of a new tensor.
        check: first make all ranks agree on element count and dtype (one tiny all-gather over the world).
        emulate: an :class:`~commlab.topology.EmulatedTopology`, passed to every ring phase.

    Returns:
        The sum over all ranks, shape and dtype of ``tensor`` (``tensor`` itself when ``inplace``).

    Raises:
        CollectiveMismatchError: ranks disagree on element count or dtype (on every rank).
        TypeError: unsupported dtype.
    """
    intra = ring_geometry(groups.intra, None)
    if check:
        check_agreement("hierarchical_all_reduce", tensor, None, groups.placement, "placement")
    work = work_buffer(tensor, inplace)
    if work.numel() > 0:
        chunks = [work[a:b] for a, b in chunk_bounds(work.numel(), intra.size)]
        reduce_scatter_phase(chunks, intra, groups.intra, emulate)
        # The chunk is a view of ``work``, so the inter-node AllReduce writes straight into it.
        ring_all_reduce(chunks[intra.group_rank], groups.inter, inplace=True, check=False, emulate=emulate)
        all_gather_phase(chunks, intra, groups.intra, emulate)
    return write_back(tensor, work, inplace)


# ----------------------------------------------------------------------------- α-β cost, beside the code

def hierarchical_all_reduce_seconds(nbytes: float, nodes: int, devices_per_node: int, intra: Link,
                                    inter: Link, nics_per_node: int = 1) -> float:
    """α-β time of :func:`hierarchical_all_reduce` on ``nbytes`` bytes, ``nodes`` × ``devices_per_node`` ranks.

    With ``d = devices_per_node`` and ``M = nodes``::

        T = 2(d-1)·(α_intra + nbytes/d·β_intra)                      intra ReduceScatter + AllGather
          + 2(M-1)·α_inter + 2(M-1)/M · nbytes/d · β_inter · s       inter ring AllReduce of nbytes/d
        s = max(1, d / nics_per_node)

    The d inter-node rings run at the same time and share the node's NICs: with fewer NICs than rings,
    each NIC carries ``d / nics_per_node`` rings' bytes (assumes the traffic spreads evenly over the NICs).
    Source: Mikami et al. 2018, arXiv:1811.05233, section 3 (2D-torus AllReduce); the ring terms are
    those of :func:`~commlab.collectives.ring.ring_all_reduce_seconds`.

    Args:
        nbytes: bytes of the vector on each rank. intra, inter: the links (α in s, β in s/byte per direction).
        nics_per_node: NICs each node's inter-node traffic spreads over (>= 1).

    Raises:
        ValueError: a count < 1 or ``nbytes < 0``.
    """
    check_cost_args(nbytes)
    check_counts(nodes=nodes, devices_per_node=devices_per_node, nics_per_node=nics_per_node)
    d = devices_per_node
    share = flows_per_nic(d, nics_per_node)
    t_intra = ring_all_reduce_seconds(nbytes, d, intra.alpha_s, intra.beta_s_per_byte)
    t_inter = ring_all_reduce_seconds(nbytes / d, nodes, inter.alpha_s, inter.beta_s_per_byte * share)
    return t_intra + t_inter


def ring_all_reduce_seconds_on(nbytes: float, order: Sequence[int], placement: Sequence[int], intra: Link,
                               inter: Link, nics_per_node: int = 1, channels: int = 1) -> float:
    """α-β time of a flat ring AllReduce whose ring ``order`` runs over ranks placed on nodes, split over
    ``channels`` concurrent rings (NCCL's channels; book §3.7).

    Each channel runs ``order`` on ``nbytes/channels`` bytes, leaving a node through its own NIC while there
    are NICs enough. The ring is pipelined, so latency adds up along the path and bandwidth is that of the
    busiest link::

        T = (2(N-1) - s)·α_intra + s·α_inter + 2(N-1) · max(m·β_intra,  m/C · β_inter · q_u  over nodes u)
        m = nbytes/N,  s = 2(h-1) (0 on one node),  q_u = max(1, C·c_u / nics_per_node)

    with ``h`` the hops of the ring that cross nodes and ``c_u`` those that leave node u (1 in topology order,
    d when the order alternates nodes). The latency term is NCCL's (``src/graph/tuning.cc``, v2.30.7-1, lines
    404-412); commlab's own ring pays the network latency nearer ``2(N-1)`` times. Ingress contention is ignored.

    Args:
        nbytes: bytes of the vector on each rank.
        order: the ring, a permutation of the global ranks ``0..N-1``.
        placement: ``placement[rank]`` = node id, length N.
        intra, inter: links; nics_per_node: as in :func:`hierarchical_all_reduce_seconds`.
        channels: concurrent rings C (>= 1), each carrying ``nbytes/C``.

    Raises:
        ValueError: ``order`` not a permutation of ``range(len(placement))``, ``nbytes < 0``, or
            ``nics_per_node`` or ``channels`` < 1.
    """
    check_cost_args(nbytes)
    check_counts(nics_per_node=nics_per_node, channels=channels)
    order = [int(r) for r in order]
    n = len(placement)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of the {n} ranks of the placement, got {order}")
    if n == 1:
        return 0.0
    m = nbytes / n
    leaving: dict[int, int] = {}
    any_intra = False
    for i, src in enumerate(order):
        dst = order[(i + 1) % n]
        if placement[src] == placement[dst]:
            any_intra = True
        else:
            leaving[placement[src]] = leaving.get(placement[src], 0) + 1
    steps = 2 * (n - 1)
    crossing = sum(leaving.values())
    net_steps = 2 * (crossing - 1) if crossing else 0
    latency = (steps - net_steps) * intra.alpha_s + net_steps * inter.alpha_s
    per_step = m * intra.beta_s_per_byte if any_intra else 0.0
    for count in leaving.values():
        share = flows_per_nic(channels * count, nics_per_node)
        per_step = max(per_step, m / channels * inter.beta_s_per_byte * share)
    return latency + steps * per_step
