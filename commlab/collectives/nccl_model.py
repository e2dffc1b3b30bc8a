"""NCCL's own cost model of an AllReduce: every (algorithm, protocol) pair has its own latency and bandwidth.

NCCL's tuner fills a latency and a bandwidth for each algorithm and protocol (LL, LL128, Simple) and runs
the pair with the smallest ``latency + bytes / bandwidth``. This module re-states that model for Ring, Tree,
NVLS and NVLSTree from its constants (``commlab/data/nccl_tuning.json``, from NVIDIA/nccl
``src/graph/tuning.cc`` at tag v2.30.7-1). Entry points: :class:`NcclSystem` (nodes, GPUs per node ``ppn``,
``C`` channels of bandwidth ``B``, and an optional :class:`NvlsGraph`), :func:`pair_model` (the bandwidth
and latency rules, with that file's line numbers), :func:`all_reduce_seconds` (the time rule),
:func:`enabled_algorithms`, :func:`all_reduce_table` and :func:`best`.

Left out: the topology search (the caller gives channels and their speeds; :meth:`NcclSystem.from_cluster`
sets the tree's ``bwIntra`` equal to its channel bandwidth, where NCCL's search on two nodes may raise it),
``latencyInter``, unbalanced trees, aggregated calls, CollNet, NVLS across nodes (it needs CollNet), PAT,
Blackwell and tuner plugins. A prediction, not a measurement. Book: chapter 3, §3.5.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Sequence

from commlab import checks, data

__all__ = ["DEFAULT_PATH", "PROTOCOLS", "ALGORITHMS", "NVLS_ALGORITHMS", "GPUS", "CPUS", "INTRA_LINKS", "load_tuning",
           "NvlsGraph", "NcclSystem", "PairModel", "pair_model", "all_reduce_seconds", "enabled_algorithms",
           "all_reduce_table", "best", "protocol_switches"]

#: The constants: ``nccl_tuning.json`` of the package data (a Traversable; see :mod:`commlab.data`).
DEFAULT_PATH = data.path("nccl_tuning.json")

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("Ring", "Tree")
#: Reduction inside the NVSwitch: NVLS on one node, NVLSTree (NVLS inside, a tree between nodes) on several.
NVLS_ALGORITHMS = ("NVLS", "NVLSTree")
#: GPU generations the constants distinguish (NCCL's compute-capability index: 7.x, 8.x, 9.x).
GPUS = ("Volta", "Ampere", "Hopper")
#: CPU vendors the constants distinguish (they select the multi-node LL cap and the network post overhead).
CPUS = ("Intel", "AMD")
#: Intra-node link kinds: NCCL's NVLink and PCI latency rows.
INTRA_LINKS = ("NVLink", "PCI")


def _pinned(path: str | Path | None) -> dict:
    # The cached tables themselves (read-only here): the model runs in loops over message sizes.
    return data.load_json(path, "nccl_tuning.json")["pinned"]


def load_tuning(path: str | Path | None = None) -> dict:
    """The whole constants file (``pinned`` tables, ``presets``, ``history``, ``nvlink_per_link_gbps``) as a
    dict; a copy, so that a caller's edits do not leak into the next call.

    Raises:
        FileNotFoundError: no such file.
    """
    return copy.deepcopy(data.load_json(path, "nccl_tuning.json"))


@dataclasses.dataclass(frozen=True)
class NvlsGraph:
    """What NCCL's topology search found for NVLink SHARP (its NVLS graph, used by NVLS and NVLSTree).

    Attributes:
        channels: the graph's channels (>= 1), one per head GPU; NCCL skips NVLS below 2 (tuning.cc line 309).
        intra_bytes_per_s: ``bwIntra``, one channel's NVLink bandwidth, bytes/s (> 0).
        inter_bytes_per_s: ``bwInter``, one channel's bandwidth out of the node (or, on one node, the second
            pass's raised figure), bytes/s (> 0).

    Raises:
        ValueError: a count that is not an int >= 1 or a bandwidth that is not a finite number > 0.
    """

    channels: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float

    def __post_init__(self):
        checks.integer("channels", self.channels, where="NvlsGraph")
        for f in ("intra_bytes_per_s", "inter_bytes_per_s"):
            checks.number(f, getattr(self, f), above=0, where="NvlsGraph")


@dataclasses.dataclass(frozen=True)
class NcclSystem:
    """What NCCL's model needs to know about a communicator.

    Attributes:
        nodes: nodes it spans (>= 1). gpus_per_node: ranks per node (>= 1), NCCL's ``ppn``.
        channels: NCCL channels (>= 1): rings (or trees) that each carry a share of the buffer at once.
        channel_bytes_per_s: bandwidth of one channel, bytes/s per direction (> 0): the bus bandwidth is
            ``channels × channel_bytes_per_s``.
        intra_link: ``"NVLink"`` or ``"PCI"``: which intra-node latency row applies; LL128 is only enabled
            over NVLink (tuning.cc lines 518-535).
        gpu: ``"Volta"``, ``"Ampere"`` or ``"Hopper"``. cpu: ``"Intel"`` or ``"AMD"``.
        ll128: allow LL128 where NCCL would (``NCCL_PROTO=^LL128`` sets it False).
        tree_intra_bytes_per_s: the tree graph's ``bwIntra`` per channel, bytes/s, which NCCL uses instead of
            ``channel_bytes_per_s`` on one or two nodes (tuning.cc line 306); None: equal to it. (A ring's
            search keeps ``bwIntra = bwInter``, so the rule changes nothing for the Ring.)
        nvls: the NVLS graph where NCCL has one (NVSwitch, Hopper, ``NCCL_NVLS_ENABLE`` not 0); None: none.

    Raises:
        ValueError: a count that is not an int >= 1, a bandwidth that is not a finite number > 0, a name
            outside the allowed ones (the message lists them), or an NVLS graph off Hopper or NVLink.
    """

    nodes: int
    gpus_per_node: int
    channels: int
    channel_bytes_per_s: float
    intra_link: str = "NVLink"
    gpu: str = "Hopper"
    cpu: str = "Intel"
    ll128: bool = True
    tree_intra_bytes_per_s: float | None = None
    nvls: NvlsGraph | None = None

    def __post_init__(self):
        for f in ("nodes", "gpus_per_node", "channels"):
            checks.integer(f, getattr(self, f), where="NcclSystem")
        checks.number("channel_bytes_per_s", self.channel_bytes_per_s, above=0, where="NcclSystem")
        if self.tree_intra_bytes_per_s is not None:
            checks.number("tree_intra_bytes_per_s", self.tree_intra_bytes_per_s, above=0, where="NcclSystem")
        checks.one_of("intra_link", self.intra_link, INTRA_LINKS)
        checks.one_of("gpu", self.gpu, GPUS)
        checks.one_of("cpu", self.cpu, CPUS)
        if self.nvls is not None:
            if not isinstance(self.nvls, NvlsGraph):
                checks.fail("nvls", self.nvls, "an NvlsGraph or None", where="NcclSystem")
            if self.gpu != "Hopper" or self.intra_link != "NVLink":
                checks.fail("nvls", self.nvls, "None off Hopper GPUs joined by NVLink",
                            note="NCCL searches an NVLS graph only on NVSwitch systems of compute capability "
                                 "9.0 and later, src/graph/search.cc line 1124", where="NcclSystem")

    @property
    def ranks(self) -> int:
        """``nodes × gpus_per_node``."""
        return self.nodes * self.gpus_per_node

    @property
    def bus_bytes_per_s(self) -> float:
        """``channels × channel_bytes_per_s``, bytes/s: the Simple ring's bus bandwidth."""
        return self.channels * self.channel_bytes_per_s

    @classmethod
    def from_cluster(cls, cluster, nodes: int | None = None, gpus_per_node: int | None = None,
                     channels: int | None = None, intra_bytes_per_s: float | None = None,
                     nvls: bool = False, path: str | Path | None = None) -> "NcclSystem":
        """The system of a :class:`~commlab.topology.Cluster` preset, NCCL's way.

        Across nodes: by default one channel per NIC (one per rail on a DGX), each at the NIC's speed, so
        the bus bandwidth is ``min(channels, nics) × NIC`` -- the node's NICs together -- unless a GPU's
        intra-node link is slower than that (then the channels share it). Inside one node: ``channels`` (default: as many as the node has NICs) share the GPU's
        intra-node bandwidth. The GPU generation, CPU vendor and link kind come from the ``presets``
        section of ``commlab/data/nccl_tuning.json``. On one or two nodes NCCL prices the Tree with its graph's
        ``bwIntra``, which its search may raise above ``bwInter`` on two nodes; this leaves
        ``tree_intra_bytes_per_s`` unset (equal to the channel bandwidth): pass it to an NcclSystem yourself.

        Args:
            cluster: a Cluster (its ``name`` must be in that section). nodes, gpus_per_node: default the
                cluster's. channels: default ``cluster.nics_per_node``. intra_bytes_per_s: the GPU's
                intra-node bandwidth, default ``cluster.intra.bytes_per_s`` (the datasheet's line rate; NCCL's
                own figure for NVLink is lower, see ``nvlink_per_link_gbps``). nvls: attach the preset's NVLS
                graph (``nvls_graph``: channels, ``bwIntra``, ``bwInter`` on one node or several), as NCCL does by
                default where the hardware has it; off by default.

        Raises:
            KeyError: the cluster is not in the presets section (build an NcclSystem directly instead).
            ValueError: as the constructor; ``nvls`` True where the preset has no NVLS graph, or for a part of
                a node (the graph is recorded for full nodes).
        """
        presets = {k: v for k, v in load_tuning(path)["presets"].items() if not k.startswith("_")}
        if cluster.name not in presets:
            raise KeyError(f"no NCCL description of cluster {cluster.name!r} (known: {sorted(presets)}); "
                           "build NcclSystem(nodes=..., gpus_per_node=..., channels=..., channel_bytes_per_s=..., "
                           "gpu=..., cpu=..., intra_link=...) yourself")
        p = presets[cluster.name]
        nodes = cluster.nodes if nodes is None else nodes
        ppn = cluster.devices_per_node if gpus_per_node is None else gpus_per_node
        channels = cluster.nics_per_node if channels is None else channels
        intra = cluster.intra.bytes_per_s if intra_bytes_per_s is None else intra_bytes_per_s
        checks.integer("channels", channels, where="NcclSystem")
        if nodes > 1:
            # A channel leaves the node through one NIC; more channels than NICs share them.
            bus = min(min(channels, cluster.nics_per_node) * cluster.inter.bytes_per_s, intra)
        else:
            bus = intra
        graph = None
        if checks.flag("nvls", nvls, where="NcclSystem.from_cluster"):
            if "nvls_graph" not in p:
                checks.fail("nvls", nvls, "False", note=f"the preset {cluster.name!r} has no NVLS graph (NVLS needs "
                            "NVSwitch and Hopper)", where="NcclSystem.from_cluster")
            if ppn != cluster.devices_per_node:
                checks.fail("gpus_per_node", ppn, f"{cluster.devices_per_node} with nvls=True", note="the preset's "
                            "NVLS graph is for full nodes; build an NvlsGraph for a part of one",
                            where="NcclSystem.from_cluster")
            g = p["nvls_graph"]
            inter = g["inter_gbps"]["one_node" if nodes == 1 else "more_nodes"]
            graph = NvlsGraph(g["channels"], g["intra_gbps"] * 1e9, inter * 1e9)
        return cls(nodes=nodes, gpus_per_node=ppn, channels=channels, channel_bytes_per_s=bus / channels,
                   intra_link=p["intra_link"], gpu=p["gpu"], cpu=p["cpu"], nvls=graph)


@dataclasses.dataclass(frozen=True)
class PairModel:
    """One (algorithm, protocol) pair's constants for a system: the size-independent part of its cost.

    Attributes:
        algorithm, protocol: the pair. latency_s: latency of one call, s (before the Ring/Simple plateau
        factor). bus_bytes_per_s: bus bandwidth, bytes/s. alg_bytes_per_s: algorithm bandwidth, bytes/s of
        buffer (before the Tree's size correction).
    """

    algorithm: str
    protocol: str
    latency_s: float
    bus_bytes_per_s: float
    alg_bytes_per_s: float


def _index2(nodes: int) -> int:
    # NCCL's column: one node, two nodes, more (lines 267, 272-276).
    return 0 if nodes == 1 else 1 if nodes == 2 else 2


def _ll_max_gbps(t: dict, s: NcclSystem) -> float:
    # One node: by GPU generation; several: by CPU vendor (lines 268-272).
    table = t["ll_max_bus_gbps"]
    if s.nodes == 1:
        return table["one_node"][s.gpu]
    return table["two_nodes" if s.nodes == 2 else "more_nodes"][s.cpu]


def pair_model(system: NcclSystem, algorithm: str = "Ring", protocol: str = "Simple",
               path: str | Path | None = None) -> PairModel:
    """Latency and bandwidths of one (algorithm, protocol) pair on ``system``, by NCCL's rules (tuning.cc lines).

    For ``N = nodes·ppn`` ranks and ``C`` channels of bandwidth ``B``:

    * **bus bandwidth** ``C·B``, then (lines 326-340): Ring LL ``min(llMax, 0.5·C·B)``; Ring LL128
      ``min(0.92·C·B, C·ll128Max)``; Ring Simple ``C·B``; Tree ``min(0.92·C·B, C·treeMax)`` and then
      LL ``min(·/3.8, llMax)`` or LL128 ``min(·×120/128, C·treeLL128Max)`` (7/9 on one node);
    * **algorithm bandwidth** (lines 376-382): Ring ``bus·N/(2(N-1))`` (nccl-tests' busbw turned back
      into bytes per second of buffer), Tree ``bus/2``;
    * **latency** (lines 384-424): a base latency per call, plus for the Ring ``2(N-1)`` steps of which
      ``2(nodes-1)`` pay the network latency and the others the intra-node one (once the ring spans
      nodes, at least the network post overhead: 1 µs on Intel, 2 µs on AMD hosts, 3x for Simple); for
      the Tree ``2((ppn-1)·intra + floor(log2 nodes)·net)``. With one GPU per node the ring's network
      latency is the Tree's (lines 385-388);
    * on one or two nodes the Tree's ``B`` is ``system.tree_intra_bytes_per_s`` when set (line 306);
    * **NVLS, NVLSTree** (Simple only, from ``system.nvls``: ``C'`` channels, ``bwIntra``, ``bwInter``; lines
      307-324, 379, 424-428): per channel ``min(2·0.85·bwIntra·(C'-1)/C', bwInter [x2 for NVLSTree on 2
      nodes], NVLSTree's per-channel cap)``, bus ``C'`` times that, algorithm bandwidth as the Ring's;
      latency: NVLS the NVLink one (25 µs); NVLSTree that plus ``2·floor(log2 nodes)`` network ones (20.9 µs).
      NVLS runs on one node only (across nodes it needs CollNet, lines 504-506), NVLSTree on several (502).

    Raises:
        ValueError: an unknown algorithm or protocol, or LL128 where it is not enabled (PCI, or
            ``system.ll128`` False), or a system of one rank (NCCL models nothing there); NVLS or NVLSTree
            where NCCL would not run it (no NVLS graph, fewer than 2 of its channels, the wrong node count, or
            a protocol other than Simple).
    """
    checks.one_of("algorithm", algorithm, ALGORITHMS + NVLS_ALGORITHMS)
    checks.one_of("protocol", protocol, PROTOCOLS)
    if algorithm in NVLS_ALGORITHMS:
        return _nvls_pair(system, algorithm, protocol, path)
    if protocol == "LL128" and not (system.ll128 and system.intra_link == "NVLink"):
        raise ValueError("LL128 is not enabled on this system: NCCL enables it only over NVLink "
                         "(tuning.cc lines 518-535), and system.ll128 is the NCCL_PROTO=^LL128 switch")
    n = system.ranks
    if n < 2:
        raise ValueError("an AllReduce of one rank costs nothing: NCCL's model needs at least 2 ranks")
    t = _pinned(path)
    c = system.channels
    col = _index2(system.nodes)
    bus = system.bus_bytes_per_s / 1e9  # GB/s, the unit of the tables
    if algorithm == "Tree" and system.nodes <= 2 and system.tree_intra_bytes_per_s is not None:
        bus = c * system.tree_intra_bytes_per_s / 1e9  # bwIntra on one or two nodes (line 306)
    if algorithm == "Ring":
        if protocol == "LL":
            bus = min(_ll_max_gbps(t, system), bus * t["ring_ll_fraction"])
        elif protocol == "LL128":
            bus = min(bus * t["ring_ll128_fraction"], c * t["ring_ll128_per_channel_max_gbps"][system.gpu])
        alg = bus * n / (2 * (n - 1))
    else:
        bus = min(bus * t["tree_fraction"], c * t["tree_per_channel_max_gbps"][system.gpu][col])
        if protocol == "LL":
            bus = min(bus / t["tree_ll_divisor"], _ll_max_gbps(t, system))
        elif protocol == "LL128":
            frac = t["tree_ll128_fraction"]["one_node" if system.nodes == 1 else "more_nodes"]
            bus = min(bus * frac, c * t["tree_ll128_per_channel_max_gbps"][system.gpu][col])
        alg = bus * t["tree_alg_ratio"]

    hw = t["hw_latency_us"]
    intra = hw[system.intra_link][algorithm][protocol]
    # With one GPU per node every hop is exposed: the Tree's network latency (lines 385-388).
    inter = hw["NET"]["Tree" if system.gpus_per_node == 1 else algorithm][protocol]
    lat = t["base_latency_us"][algorithm][protocol]
    if algorithm == "Ring":
        if system.nodes > 1:
            overhead = t["net_overhead_us"][system.cpu]
            if protocol == "Simple":
                overhead *= t["net_overhead_simple_factor"]
            intra = max(intra, overhead)
        steps = 2 * (n - 1)
        net_steps = 0 if system.nodes == 1 else 2 * (system.nodes - 1)
        lat += (steps - net_steps) * intra + net_steps * inter
    else:
        levels = int(math.floor(math.log2(system.nodes)))
        lat += 2 * ((system.gpus_per_node - 1) * intra + levels * inter)
    return PairModel(algorithm, protocol, lat * 1e-6, bus * 1e9, alg * 1e9)


def _nvls_unavailable(system: NcclSystem, algorithm: str, path) -> str:
    # Why NCCL would not run this NVLS algorithm on system ('' if it would).
    g = system.nvls
    if g is None:
        return "the system has no NVLS graph (NcclSystem.nvls is None)"
    if system.gpus_per_node < 2:
        return "NCCL enables NVLS only with 2 or more GPUs per node (src/transport/nvls.cc line 262)"
    if g.channels < _pinned(path)["nvls"]["min_channels"]:
        return f"its NVLS graph has {g.channels} channel; NCCL needs 2 (tuning.cc line 309)"
    if algorithm == "NVLS" and system.nodes > 1:
        return "NVLS across nodes needs CollNet (IB SHARP), which this model leaves out (tuning.cc lines 504-506)"
    if algorithm == "NVLSTree" and system.nodes == 1:
        return "NCCL disables NVLSTree on one node (tuning.cc line 502)"
    return ""


def _nvls_pair(system: NcclSystem, algorithm: str, protocol: str, path) -> PairModel:
    # NVLS and NVLSTree: tuning.cc lines 301, 307-324, 379, 424-428.
    if protocol != "Simple":
        raise ValueError(f"{algorithm} runs the Simple protocol only (tuning.cc line 301), got protocol {protocol!r}")
    why = _nvls_unavailable(system, algorithm, path)
    if why:
        raise ValueError(f"{algorithm} is not enabled on this system: {why}")
    n = system.ranks
    nv = _pinned(path)["nvls"]
    g = system.nvls
    c = g.channels
    intra = g.intra_bytes_per_s / 1e9 * nv["efficiency"][system.gpu] * (c - 1) / c * nv["all_reduce_intra_factor"]
    inter = g.inter_bytes_per_s / 1e9
    bw = min(intra, inter)
    if algorithm == "NVLSTree":
        if system.nodes <= 2:
            bw = min(intra, inter * nv["tree_two_node_inter_factor"])
        bw = min(bw, nv["tree_per_channel_max_gbps"][system.gpu][_index2(system.nodes)])
    bus = c * bw
    alg = bus * n / (2 * (n - 1))
    intra_lat = nv["hw_latency_us"]["NVLink"][algorithm]
    inter_lat = nv["hw_latency_us"]["NET"][algorithm]  # ppn >= 2 here, so not the Tree's (lines 386-388)
    if algorithm == "NVLS":
        lat = intra_lat  # replaces the base latency (line 425); one node only here
    else:
        lat = nv["base_latency_us"][algorithm] + intra_lat + 2 * int(math.floor(math.log2(system.nodes))) * inter_lat
    return PairModel(algorithm, protocol, lat * 1e-6, bus * 1e9, alg * 1e9)


def all_reduce_seconds(nbytes: float, system: NcclSystem, algorithm: str = "Ring", protocol: str = "Simple",
                       path: str | Path | None = None) -> float:
    """NCCL's predicted time (s) of one AllReduce of ``nbytes`` bytes per rank with one pair.

    ``latency + nbytes / algbw`` (tuning.cc lines 630-655), with the multi-node Ring/Simple latency
    multiplied by 1.4 on Ampere and later (1.9 before) once each channel's share per rank reaches 64 bytes,
    and the Tree's bandwidth by a size-dependent correction between 0.4 and 1 (NVLSTree's is applied from
    Blackwell on, lines 643-646, so not here). One rank: 0.

    Raises:
        ValueError: ``nbytes`` negative or not finite; what :func:`pair_model` raises.
    """
    checks.number("nbytes", nbytes, least=0)
    if system.ranks == 1:
        return 0.0
    t = _pinned(path)
    pm = pair_model(system, algorithm, protocol, path)
    lat, bw = pm.latency_s, pm.alg_bytes_per_s
    if (algorithm == "Ring" and protocol == "Simple" and system.nodes > 1
            and nbytes / (system.channels * system.ranks) >= t["ring_simple_plateau_min_bytes_per_channel_and_rank"]):
        lat *= t["ring_simple_plateau_factor"][system.gpu]
    if algorithm == "Tree":
        index = int(nbytes) >> 6
        index = index.bit_length() - 1  # floor(log2), -1 below 64 bytes (NCCL's log2Down)
        corr = t["tree_correction"][protocol]
        if 0 <= index < 23:
            bw *= corr[index]
    return lat + nbytes / bw


def _enabled(system: NcclSystem, protocols: Sequence[str] | None) -> list[str]:
    if protocols is None:
        return [p for p in PROTOCOLS if p != "LL128" or (system.ll128 and system.intra_link == "NVLink")]
    for p in protocols:
        checks.one_of("protocol", p, PROTOCOLS)
    return list(protocols)


def enabled_algorithms(system: NcclSystem, path: str | Path | None = None) -> tuple[str, ...]:
    """The AllReduce algorithms NCCL would consider on ``system``: Ring and Tree, then NVLS on one node or
    NVLSTree on several where ``system.nvls`` is a graph of at least 2 channels (tuning.cc lines 309, 501-506).
    """
    return ALGORITHMS + tuple(a for a in NVLS_ALGORITHMS if not _nvls_unavailable(system, a, path))


def all_reduce_table(nbytes: float, system: NcclSystem, algorithms: Sequence[str] | None = None,
                     protocols: Sequence[str] | None = None, path: str | Path | None = None) -> dict[tuple[str, str], float]:
    """``{(algorithm, protocol): seconds}`` for every requested pair (default: :func:`enabled_algorithms`, with
    every protocol NCCL enables on ``system``; NVLS and NVLSTree with Simple only).

    Raises:
        ValueError: as :func:`all_reduce_seconds`.
    """
    if algorithms is None:
        algorithms = enabled_algorithms(system, path)
    for a in algorithms:
        checks.one_of("algorithm", a, ALGORITHMS + NVLS_ALGORITHMS)
    protos = _enabled(system, protocols)
    return {(a, p): all_reduce_seconds(nbytes, system, a, p, path)
            for a in algorithms for p in protos if a in ALGORITHMS or p == "Simple"}


def best(nbytes: float, system: NcclSystem, algorithms: Sequence[str] | None = None,
         protocols: Sequence[str] | None = None, path: str | Path | None = None) -> tuple[str, str, float]:
    """The pair NCCL's model would pick for ``nbytes`` (the minimum of :func:`all_reduce_table`; by default
    over :func:`enabled_algorithms`), as ``(algorithm, protocol, seconds)``.

    Raises:
        ValueError: as :func:`all_reduce_seconds`, or no algorithm/protocol to choose from.
    """
    table = all_reduce_table(nbytes, system, algorithms, protocols, path)
    if not table:
        raise ValueError("no (algorithm, protocol) pair to choose from")
    (a, p), s = min(table.items(), key=lambda kv: kv[1])
    return a, p, s


def protocol_switches(system: NcclSystem, algorithm: str = "Ring", protocols: Sequence[str] | None = None,
                      lo: float = 1.0, hi: float = 2.0**36, path: str | Path | None = None) -> list[tuple[float, str, str]]:
    """Message sizes (bytes) at which the fastest protocol of ``algorithm`` changes, between ``lo`` and
    ``hi``, as ``[(nbytes, slower-from-here protocol, faster-from-here protocol), ...]`` in increasing size.

    Found on a grid of 16 points per doubling, then refined by bisection to 1 part in 1e6.

    Raises:
        ValueError: as :func:`all_reduce_seconds`; ``lo`` not in (0, hi).
    """
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo!r}, hi={hi!r}")
    protos = _enabled(system, protocols)
    if algorithm in NVLS_ALGORITHMS:
        protos = [p for p in protos if p == "Simple"]  # NVLS runs Simple only: no switch

    def winner(s: float) -> str:
        return min(protos, key=lambda p: all_reduce_seconds(s, system, algorithm, p, path))

    points = int(math.ceil(math.log2(hi / lo) * 16)) + 1
    grid = [lo * (hi / lo) ** (i / (points - 1)) for i in range(points)]
    out = []
    prev = winner(grid[0])
    for a, b in zip(grid, grid[1:]):
        w = winner(b)
        if w != prev:
            x, y = a, b
            while y / x > 1 + 1e-6:
                mid = math.sqrt(x * y)
                if winner(mid) == prev:
                    x = mid
                else:
                    y = mid
            out.append((y, prev, winner(y)))
            prev = winner(y)
    return out
