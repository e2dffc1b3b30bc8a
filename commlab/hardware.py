"""Vendor figures for devices and links, read from the package data ``hardware.json`` (:mod:`commlab.data`).

The file is a flat JSON object: device or link name -> figure name -> ``{"value", "unit", "source"}``.
Keys that start with ``_`` are notes for the reader and are skipped. Values are in the units the
rest of commlab uses (FLOP/s, bytes, bytes/s, bit/s, and ``count`` for ports or links; 1 GB = 1e9 bytes), and each figure names the
datasheet it comes from, so that a number in the book can be traced back.

>>> from commlab import hardware
>>> hardware.value("H100-SXM", "nvlink_per_direction_bytes_per_s")
450000000000.0
"""

from __future__ import annotations

from pathlib import Path

from commlab import checks, data

__all__ = ["DEFAULT_PATH", "UNITS", "load", "figure", "value", "devices"]

#: Where the figures live: ``hardware.json`` of the package data (a Traversable; see :mod:`commlab.data`).
DEFAULT_PATH = data.path("hardware.json")

#: Units a figure may carry; anything else is refused so that a typo cannot pass silently.
UNITS = frozenset({"FLOP/s", "bytes", "bytes/s", "bit/s", "count"})

_FIELDS = ("value", "unit", "source")


def _validate(table: dict, where: str) -> dict:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: the top level must be a JSON object keyed by device name")
    devices = {}
    for device, figures in table.items():
        if device.startswith("_"):
            continue
        if not isinstance(figures, dict) or not figures:
            raise ValueError(f"{where}: {device!r} must map figure names to entries, got {figures!r}")
        for name, entry in figures.items():
            label = f"{where}: {device}.{name}"
            if not isinstance(entry, dict):
                raise ValueError(f"{label} must be an object with fields {list(_FIELDS)}, got {entry!r}")
            missing = [field for field in _FIELDS if field not in entry]
            if missing:
                raise ValueError(f"{label} lacks field(s) {missing}; every figure needs {list(_FIELDS)}")
            checks.number(f"{label}.value", entry["value"], above=0)
            if entry["unit"] not in UNITS:
                raise ValueError(f"{label}.unit must be one of {sorted(UNITS)}, got {entry['unit']!r}")
            if not isinstance(entry["source"], str) or not entry["source"].strip():
                raise ValueError(f"{label}.source must name the datasheet the figure comes from")
        devices[device] = figures
    return devices


def load(path: str | Path | None = None) -> dict:
    """Read and check the hardware table; returns ``{device: {figure: {"value", "unit", "source"}}}``.

    Args:
        path: a JSON file in the format above; default (None) :data:`DEFAULT_PATH`.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if an entry lacks ``value``, ``unit`` or ``source``, or has a non-positive
            value or an unknown unit.
    """
    # A copy, so that a caller who edits the result does not change what the next caller reads.
    table = data.load_json(path, "hardware.json", _validate)
    return {device: {name: dict(entry) for name, entry in figs.items()} for device, figs in table.items()}


def devices(path: str | Path | None = None) -> list[str]:
    """Names of the devices and links in the table, sorted."""
    return sorted(load(path))


def figure(device: str, name: str, path: str | Path | None = None) -> dict:
    """One figure as ``{"value", "unit", "source"}``.

    Raises:
        KeyError: if the device or the figure is not in the table; the message lists what is.
    """
    table = load(path)
    if device not in table:
        raise KeyError(f"no device {device!r} in the hardware table; known: {sorted(table)}")
    if name not in table[device]:
        raise KeyError(f"{device!r} has no figure {name!r}; it has: {sorted(table[device])}")
    return table[device][name]


def value(device: str, name: str, path: str | Path | None = None) -> float:
    """The numeric value of one figure, as a float, in the unit its entry states.

    Raises:
        KeyError: as :func:`figure`.
    """
    return float(figure(device, name, path)["value"])
