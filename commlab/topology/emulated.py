"""Run collectives on one machine as if the ranks sat in several nodes joined by a slow network.

:class:`EmulatedTopology` places ranks on nodes (contiguous blocks by default). Before a rank sends to
another node it waits as long as the message would take through its node's NIC, a resource shared by the
node's ranks (its busy-until time in shared memory, inherited by the forked ranks), so concurrent messages
leaving one node queue, and each pays the inter-node α. Messages inside a node use the real transport (plus
an ``intra`` link if given); ingress contention is not modelled. Choose the emulated bandwidth well below
the machine's own (about 1 GB/s between processes on a laptop). Create it in the parent before
:func:`commlab.launch` (fork shares the NIC state); it is not for real clusters.

Book: chapter 8, §8.7; lab 3, section 6 (a slow inter-node link, on one laptop).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Sequence

from commlab.topology.links import Link


class EmulatedTopology:
    """``nodes`` × ``devices_per_node`` ranks with an emulated inter-node link.

    Args:
        nodes: number of emulated nodes (>= 1).
        devices_per_node: ranks per node (>= 1); the world size must be ``nodes * devices_per_node``.
        inter: the inter-node link of each node's NIC (α in s, β in s/byte, per direction).
        intra: optional extra delay for messages inside a node (default: none, the real transport).
        placement: ``placement[rank]`` = node of each global rank; default ``rank // devices_per_node``.

    Raises:
        ValueError: sizes < 1, or a placement that does not put exactly ``devices_per_node`` ranks on
            each of the ``nodes`` nodes.
    """

    def __init__(self, nodes: int, devices_per_node: int, inter: Link, intra: Link | None = None,
                 placement: Sequence[int] | None = None):
        if nodes < 1 or devices_per_node < 1:
            raise ValueError(f"nodes and devices_per_node must be >= 1, got {nodes}, {devices_per_node}")
        self.nodes = nodes
        self.devices_per_node = devices_per_node
        self.world_size = nodes * devices_per_node
        self.inter = inter
        self.intra = intra
        if placement is None:
            placement = [r // devices_per_node for r in range(self.world_size)]
        placement = [int(p) for p in placement]
        counts = [placement.count(n) for n in range(nodes)]
        if len(placement) != self.world_size or any(c != devices_per_node for c in counts):
            raise ValueError(f"placement must put {devices_per_node} of the {self.world_size} ranks on each of "
                             f"{nodes} nodes, got {placement}")
        self.placement = tuple(placement)
        # One "NIC busy until" time per node (time.monotonic is system-wide on Linux, so it can be shared).
        self._busy_until = mp.get_context("fork").Array("d", nodes)

    def __repr__(self):
        return (f"EmulatedTopology({self.nodes} nodes x {self.devices_per_node} ranks, inter={self.inter}, "
                f"intra={self.intra})")

    def node_of(self, rank: int) -> int:
        """Node of global rank ``rank``."""
        return self.placement[rank]

    def ranks_on(self, node: int) -> list[int]:
        """Global ranks placed on ``node``, ascending."""
        return [r for r, n in enumerate(self.placement) if n == node]

    def crosses_nodes(self, src: int, dst: int) -> bool:
        return self.placement[src] != self.placement[dst]

    def reset(self) -> None:
        """Forget queued NIC time (between independent measurements)."""
        with self._busy_until.get_lock():
            for i in range(self.nodes):
                self._busy_until[i] = 0.0

    def delay_s(self, src: int, dst: int, nbytes: int) -> float:
        """Reserve the link for a message ``src -> dst`` of ``nbytes`` bytes; return the seconds to wait.

        Inter-node: the message occupies the source node's NIC for ``nbytes·β`` after the messages
        already queued on it, and arrives α later. Intra-node: ``intra.seconds(nbytes)`` or 0.
        """
        if not self.crosses_nodes(src, dst):
            return 0.0 if self.intra is None else self.intra.seconds(nbytes)
        node = self.placement[src]
        now = time.monotonic()
        with self._busy_until.get_lock():
            start = max(now, self._busy_until[node])
            end = start + nbytes * self.inter.beta_s_per_byte
            self._busy_until[node] = end
        return end - now + self.inter.alpha_s

    def wait_before_send(self, src: int, dst: int, nbytes: int) -> None:
        """Sleep for :meth:`delay_s` (called by the sender, just before it posts the real send).

        Waits under a microsecond are skipped: a sleep call itself costs tens of microseconds, so a link
        fast enough to delay nothing (as the base runs of chapter 8's slow-link check use) adds nothing.
        """
        d = self.delay_s(src, dst, nbytes)
        if d > 1e-6:
            time.sleep(d)

    # ------------------------------------------------------------------ the model of the emulation itself

    def predict_ring_seconds(self, nbytes: float, order: Sequence[int], local: Link) -> float:
        """Predicted time of a ring AllReduce of ``nbytes`` in ring ``order`` on this emulated topology.

        Each of the 2(N-1) steps moves ``nbytes/N`` per hop over the real transport (``local``: the
        machine's own α and β, e.g. from :func:`commlab.bench.calibrate.calibrate`); if any hop crosses
        nodes the step also waits for the emulated link, where the ``k`` crossing hops that leave the busiest
        node queue on its NIC: ``inter.α + k·(nbytes/N)·inter.β``.

        Raises:
            ValueError: ``order`` is not a permutation of the topology's ranks.
        """
        n = self.world_size
        if sorted(order) != list(range(n)):
            raise ValueError(f"order must be a permutation of 0..{n - 1}, got {list(order)}")
        if n == 1:
            return 0.0
        m = nbytes / n
        leaving = [0] * self.nodes
        for i, src in enumerate(order):
            dst = order[(i + 1) % n]
            if self.crosses_nodes(src, dst):
                leaving[self.placement[src]] += 1
        k = max(leaving)
        step = local.seconds(m) + (self.inter.alpha_s + k * m * self.inter.beta_s_per_byte if k else 0.0)
        return 2 * (n - 1) * step

    def predict_hierarchical_seconds(self, nbytes: float, local: Link) -> float:
        """Predicted time of :func:`commlab.collectives.hierarchical_all_reduce` on this topology.

        Intra-node ring ReduceScatter and AllGather over the ``d`` ranks of a node: ``2(d-1)`` steps of
        ``nbytes/d`` on the real transport. Between them, ``d`` inter-node rings run at once (one per local
        index), each all-reducing ``nbytes/d`` over the nodes: ``2(nodes-1)`` steps of
        ``m = nbytes/(d·nodes)``, in which the ``d`` rings' messages queue on each node's NIC.
        """
        d, nodes = self.devices_per_node, self.nodes
        intra = 2 * (d - 1) * local.seconds(nbytes / d) if d > 1 else 0.0
        if nodes == 1:
            return intra
        m = nbytes / (d * nodes)
        step = local.seconds(m) + self.inter.alpha_s + d * m * self.inter.beta_s_per_byte
        return intra + 2 * (nodes - 1) * step

    def round_robin_ring(self) -> list[int]:
        """A ring order that crosses nodes at every hop: one rank of each node in turn
        (``[0, 4, 1, 5, 2, 6, 3, 7]`` on 2 × 4): what a ring that ignores the topology can end up as."""
        per_node = [self.ranks_on(n) for n in range(self.nodes)]
        return [per_node[n][i] for i in range(self.devices_per_node) for n in range(self.nodes)]

