"""In-network reduction (InfiniBand SHARP): a cost model only, since no laptop has such a switch.

With SHARP the switches add the buffers as they pass: each node sends its buffer up a tree of switches once
and receives the result once (Graham et al. 2016, "Scalable Hierarchical Aggregation Protocol (SHArP)",
COMHPC at SC16, §3): ``nbytes`` per direction instead of the ring's ``2(N-1)/N·nbytes``
(:func:`in_network_speedup_limit`, at most 2x), and a latency that grows with the switch tree's height.
:func:`in_network_all_reduce_seconds` prices it on a non-blocking fat tree of ``radix``-port switches
(:func:`switch_tree_levels`, :func:`fat_tree_down_ports`: half the ports down below the top level, all at
the top; 40-port HDR switches join 40, 800 and 16,000 endpoints in one, two and three levels).

Book: chapter 3, §3.8.
"""

from __future__ import annotations

from typing import Sequence

from commlab import checks, hardware
from commlab.collectives.common import check_cost_args

__all__ = ["HDR_SWITCH_PORTS", "NDR_SWITCH_PORTS", "fat_tree_down_ports", "fat_tree_endpoints",
           "switch_tree_levels", "in_network_all_reduce_seconds", "in_network_speedup_limit"]

#: Ports of NVIDIA's HDR InfiniBand switch (Quantum QM8700), from ``commlab/data/hardware.json``: 40.
HDR_SWITCH_PORTS = int(hardware.value("Quantum-QM8700", "ports"))
#: Ports of NVIDIA's NDR InfiniBand switch (Quantum-2 QM9700), from ``commlab/data/hardware.json``: 64.
NDR_SWITCH_PORTS = int(hardware.value("Quantum-2-QM9700", "ports"))


def _check_radix(radix: int) -> None:
    if checks.integer("radix (ports per switch)", radix, least=2) % 2:
        checks.fail("radix (ports per switch)", radix, "an even int >= 2")


def fat_tree_down_ports(radix: int, levels: int) -> tuple[int, ...]:
    """Down-facing ports of a switch at each level of a ``levels``-level fat tree of ``radix``-port
    switches, leaf level first: ``radix/2`` below the top, ``radix`` at the top.

    >>> fat_tree_down_ports(40, 2)
    (20, 40)

    Raises:
        ValueError: ``radix`` not an even int >= 2, or ``levels`` not an int >= 1.
    """
    _check_radix(radix)
    checks.integer("levels", levels)
    return (radix // 2,) * (levels - 1) + (radix,)


def fat_tree_endpoints(down_ports: Sequence[int]) -> int:
    """Endpoints a tree with these down-facing ports per level (leaf first) can join: their product."""
    reach = 1
    for k in down_ports:
        reach *= int(k)
    return reach


def switch_tree_levels(n: int, radix: int = HDR_SWITCH_PORTS) -> int:
    """Levels of the smallest fat tree of ``radix``-port switches that joins ``n`` endpoints:
    the least L with ``(radix/2)^(L-1)·radix >= n``.

    Raises:
        ValueError: ``n < 1`` or ``radix`` not an even int >= 2.
    """
    _check_radix(radix)
    checks.integer("n", n, note="endpoints")
    levels = 1
    while fat_tree_endpoints(fat_tree_down_ports(radix, levels)) < n:
        levels += 1
    return levels


def in_network_all_reduce_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float,
                                  switch_alpha_s: float, radix: int = HDR_SWITCH_PORTS) -> float:
    """α-β time of an AllReduce reduced inside the switches (SHARP-style), for ``n`` endpoints.

    ``2·levels·switch_alpha_s + 2·alpha_s + nbytes·beta_s_per_byte``: up and down the tree, one
    endpoint latency each way, and the buffer streamed through the endpoint's link once (reduction
    and broadcast are pipelined, so the two directions overlap). ``n == 1`` costs nothing.

    Args:
        nbytes: buffer size in bytes; n: endpoints (nodes or GPUs, one link each);
        alpha_s, beta_s_per_byte: the endpoint link (s, s/byte per direction);
        switch_alpha_s: added latency per switch level (s); radix: ports per switch (levels from
            :func:`switch_tree_levels`; default the 40-port HDR switch).

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
