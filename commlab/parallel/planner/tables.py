"""The planner's data tables (``data/models.json``, ``data/software.json``, ``data/published_layouts.json``,
``data/gemm_efficiency.json``, ``data/attention_speed.json``): each file read once per path, its keys that
start with ``_`` (notes about the table, such as ``_about``) dropped."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

__all__ = ["read_table"]


@lru_cache(maxsize=8)
def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    return {k: v for k, v in table.items() if not k.startswith("_")}


def read_table(path: str | Path | None, default: Path) -> dict:
    """The entries of the JSON table at ``path`` (None: ``default``), cached per resolved path: callers read
    it and must not change it.

    Raises:
        OSError: the file cannot be read; json.JSONDecodeError: it is not JSON.
    """
    return _read(str(Path(path or default).resolve()))
