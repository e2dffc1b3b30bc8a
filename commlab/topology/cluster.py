"""Cluster descriptions: devices per node, NICs, the two link types (α, β), memory and peak FLOP/s.

Presets live in ``commlab/data/clusters.json``; each describes one *node type* (a DGX A100, a DGX H100, a PCIe
server), and the number of nodes is chosen when it is loaded::

    >>> from commlab.topology import load_preset
    >>> c = load_preset("dgx-h100-ndr", nodes=4)
    >>> c.world_size, c.intra.bytes_per_s, c.inter.bytes_per_s
    (32, 450000000000.0, 50000000000.0)

Every figure carries a ``source`` or a ``{"ref": "DEVICE.figure"}`` into ``commlab/data/hardware.json``
(chapter 1's device table); link latencies, not on datasheets, are NCCL's per-step constants (``_latency_note``).

Units: bytes/s **per direction**, α in s, β = 1/bandwidth in s/byte, memory in bytes (GB = 1e9), dense FLOP/s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from commlab import checks, data, hardware
from commlab.topology.links import Link

__all__ = ["Cluster", "DEFAULT_PATH", "load_preset", "list_presets"]

#: The presets file: ``clusters.json`` of the package data (a Traversable; see :mod:`commlab.data`).
DEFAULT_PATH = data.path("clusters.json")

# Which unit each field wants, and which units of commlab/data/hardware.json can be converted to it.
_CONVERT = {
    "bytes/s": {"bytes/s": 1.0, "bit/s": 1.0 / 8},
    "bytes": {"bytes": 1.0},
    "FLOP/s": {"FLOP/s": 1.0},
}


@dataclasses.dataclass
class Cluster:
    """``nodes`` identical nodes of ``devices_per_node`` devices.

    Attributes:
        name: the preset's name (or any label).
        nodes: number of nodes, >= 1; may be set after loading (``cluster.nodes = 16``).
        devices_per_node: accelerators per node, >= 1.
        nics_per_node: network adapters per node used for the compute fabric, >= 1.
        intra: the link between two devices of one node (α in s, β in s/byte per direction).
        inter: one NIC's link to the network (per direction); a node has ``nics_per_node`` of them.
        device_memory_bytes: memory of one device, bytes.
        peak_flop_per_s: dense peak FLOP/s of one device per dtype name (``"bf16"``, ``"fp16"``,
            ``"tf32"``, ``"fp8"`` where the device has it).
        device: the device's name in ``commlab/data/hardware.json`` (empty if none).
        description: one line for tables.
        sources: where each figure comes from, keyed by field (``"intra.bytes_per_s"``,
            ``"peak_flop_per_s.bf16"``, ...).

    Raises:
        ValueError: ``nodes``, ``devices_per_node`` or ``nics_per_node`` not an int >= 1; memory or a
            peak FLOP/s not a finite number > 0; ``intra``/``inter`` not a :class:`Link`. Setting ``nodes``
            to a bad value later raises the same error.
    """

    name: str
    nodes: int
    devices_per_node: int
    nics_per_node: int
    intra: Link
    inter: Link
    device_memory_bytes: float
    peak_flop_per_s: dict[str, float]
    device: str = ""
    description: str = ""
    sources: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        for field in ("devices_per_node", "nics_per_node"):
            checks.integer(field, getattr(self, field), where=f"cluster {self.name!r}")
        for field in ("intra", "inter"):
            if not isinstance(getattr(self, field), Link):
                raise ValueError(f"cluster {self.name!r}: {field} must be a Link, got {getattr(self, field)!r}")
        checks.number("device_memory_bytes", self.device_memory_bytes, above=0, where=f"cluster {self.name!r}")
        if not isinstance(self.peak_flop_per_s, dict):
            raise ValueError(f"cluster {self.name!r}: peak_flop_per_s must be a dict dtype -> FLOP/s")
        for dtype, v in self.peak_flop_per_s.items():
            checks.number(f"peak_flop_per_s.{dtype}", v, above=0, where=f"cluster {self.name!r}")
        self.peak_flop_per_s = {k: float(v) for k, v in self.peak_flop_per_s.items()}
        self.device_memory_bytes = float(self.device_memory_bytes)

    def __setattr__(self, key, value):
        # nodes is the one field meant to change after loading, so it is checked on every assignment.
        if key == "nodes":
            checks.integer("nodes", value, where=f"cluster {getattr(self, 'name', '?')!r}")
        super().__setattr__(key, value)

    @property
    def world_size(self) -> int:
        """Total devices: ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    @property
    def node_inter_bytes_per_s(self) -> float:
        """Bandwidth out of one node, bytes/s per direction: ``nics_per_node`` × the NIC's."""
        return self.nics_per_node * self.inter.bytes_per_s


# ----------------------------------------------------------------------------------------- the file

def _table(path: str | Path | None) -> dict:
    return data.load_table(path, "clusters.json")


def list_presets(path: str | Path | None = None) -> list[str]:
    """Names of the presets in ``path`` (default :data:`DEFAULT_PATH`), sorted."""
    return sorted(_table(path))


def load_preset(name: str, nodes: int = 1, path: str | Path | None = None,
                hardware_path: str | Path | None = None) -> Cluster:
    """The preset ``name`` as a :class:`Cluster` of ``nodes`` nodes.

    Args:
        name: a preset name (see :func:`list_presets`).
        nodes: number of nodes, >= 1.
        path: the presets file; default :data:`DEFAULT_PATH`.
        hardware_path: the device table that ``{"ref": ...}`` figures point into; default
            :data:`commlab.hardware.DEFAULT_PATH`.

    Raises:
        KeyError: unknown preset; the message lists the known ones.
        ValueError: ``nodes`` < 1, or a field of the preset that is missing, non-numeric, negative (zero
            for a bandwidth, memory or FLOP/s), lacks a ``source``, or refers to a figure that does not
            exist or has the wrong unit. The message names the preset and the field.
    """
    table = _table(path)
    if name not in table:
        raise KeyError(f"no cluster preset {name!r}; known presets: {sorted(table)}")
    checks.integer("nodes", nodes, where=f"cluster {name!r}")
    entry = table[name]
    if not isinstance(entry, dict):
        raise ValueError(f"preset {name!r}: must be a JSON object of fields, got {entry!r}")
    hw = hardware.load(hardware_path)
    sources: dict[str, str] = {}

    def get(node: dict, dotted: str):
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            raise ValueError(f"preset {name!r}: field {dotted!r} is missing")
        return node[last]

    def figure(dotted: str, unit: str | None, integer: bool = False, allow_zero: bool = False) -> float:
        fig = get(entry, dotted)
        if not isinstance(fig, dict):
            raise ValueError(f"preset {name!r}: field {dotted!r} must be an object with value and source "
                             f"(or a ref into hardware.json), got {fig!r}")
        if "ref" in fig:
            value, source = _resolve_ref(name, dotted, fig["ref"], unit, hw)
        else:
            if "value" not in fig:
                raise ValueError(f"preset {name!r}: field {dotted!r} has no value (nor a ref)")
            if not isinstance(fig.get("source"), str) or not fig["source"].strip():
                raise ValueError(f"preset {name!r}: field {dotted!r} has no source; every figure must "
                                 "name where it comes from (or say that it is an assumption)")
            value, source = fig["value"], fig["source"]
        if integer:
            checks.integer(f"field {dotted!r}", value, where=f"preset {name!r}")
        elif allow_zero:
            checks.number(f"field {dotted!r}", value, least=0, where=f"preset {name!r}")
        else:
            checks.number(f"field {dotted!r}", value, above=0, where=f"preset {name!r}")
        sources[dotted] = source
        return value

    def link(side: str) -> Link:
        bw = figure(f"{side}.bytes_per_s", "bytes/s")
        alpha = figure(f"{side}.alpha_s", None, allow_zero=True)
        return Link.from_bandwidth(float(bw), alpha_s=float(alpha), name=f"{name} {side}")

    flops = get(entry, "peak_flop_per_s")
    if not isinstance(flops, dict) or not flops:
        raise ValueError(f"preset {name!r}: field 'peak_flop_per_s' must map dtype names to figures")
    cluster = Cluster(
        name=name, nodes=nodes,
        devices_per_node=figure("devices_per_node", None, integer=True),
        nics_per_node=figure("nics_per_node", None, integer=True),
        intra=link("intra"), inter=link("inter"),
        device_memory_bytes=figure("device_memory_bytes", "bytes"),
        peak_flop_per_s={dtype: figure(f"peak_flop_per_s.{dtype}", "FLOP/s") for dtype in flops},
        device=str(entry.get("device", "")), description=str(entry.get("description", "")),
        sources=sources,
    )
    return cluster


def _resolve_ref(name: str, dotted: str, ref: Any, unit: str | None, hw: dict) -> tuple[float, str]:
    # Device names may contain dots ("PCIe-4.0-x16"), figure names do not: split at the last one.
    if not isinstance(ref, str) or "." not in ref:
        raise ValueError(f"preset {name!r}: field {dotted!r} has ref {ref!r}; write it as 'DEVICE.figure'")
    device, fig_name = ref.rsplit(".", 1)
    if device not in hw or fig_name not in hw[device]:
        raise ValueError(f"preset {name!r}: field {dotted!r} refers to {ref!r}, which is not in hardware.json "
                         f"(devices: {sorted(hw)})")
    entry = hw[device][fig_name]
    if unit is None or entry["unit"] not in _CONVERT.get(unit, {}):
        raise ValueError(f"preset {name!r}: field {dotted!r} wants {unit or 'a plain value'}, but {ref!r} is "
                         f"in {entry['unit']}")
    return float(entry["value"]) * _CONVERT[unit][entry["unit"]], f"{ref}: {entry['source']}"
