"""The course data that ships inside the package, and the one reader of it.

The JSON files beside this module are hardware figures (``hardware.json``), cluster presets
(``clusters.json``), NCCL's constants, model configs, software profiles, tables from papers, and chapter 8's
recorded runs (``experiments/``); each figure names its source. They are package data: a wheel carries them
(``[tool.setuptools.package-data]`` in pyproject.toml; ``tests/test_wheel.py`` checks it), so a
non-editable install reads them as a checkout does. Entry points:

* :func:`path` -- a packaged file as an :mod:`importlib.resources` Traversable;
* :func:`load_json` / :func:`load_table` -- a packaged file by name, or a user's file by path (the
  ``path=`` argument of the loaders across commlab), parsed once and cached;
* :func:`record_path` -- where a recorder (``python -m commlab experiments``) writes into the data.

Nothing else in commlab computes a path to its data from ``__file__``.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = ["path", "names", "load_json", "load_table", "record_path"]

def _parts(name: str) -> list[str]:
    if not isinstance(name, str) or not name.strip("/"):
        raise ValueError(f"name must be a file of the course data such as 'hardware.json', got {name!r}")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"name must be a relative path inside the course data, got {name!r}")
    return parts


def path(name: str) -> "Traversable":
    """The packaged file (or folder) ``name``: ``"hardware.json"``, ``"experiments/full.jsonl"``. A Traversable (a
    :class:`pathlib.Path` when the package is installed as files, as pip does).

    Raises:
        ValueError: ``name`` is empty or leaves the data folder (``..``).
    """
    return files(__name__).joinpath(*_parts(name))


def names() -> list[str]:
    """Every data file of the package, as ``"hardware.json"`` or ``"experiments/full.jsonl"``, sorted."""
    out = []

    def walk(node, prefix):
        for child in node.iterdir():
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, prefix + child.name + "/")
            elif not child.name.endswith((".py", ".pyc")):
                out.append(prefix + child.name)

    walk(files(__name__), "")
    return sorted(out)


def load_json(source: str | os.PathLike | None, name: str,
              prepare: Callable[[Any, str], Any] | None = None) -> Any:
    """The JSON at ``source`` (a user's file), or, with ``source=None``, the packaged file ``name``.

    ``prepare(parsed, where)`` (a validation, say; ``where`` is the file's name for messages) runs once,
    and its result is cached per file: callers read what is returned and must not change it.

    Raises:
        FileNotFoundError: no file at ``source``; json.JSONDecodeError: it is not JSON; whatever ``prepare``
        raises.
    """
    if source is None:
        return _load(None, name, prepare)
    if isinstance(source, (str, os.PathLike)):
        return _load(os.fspath(Path(source).resolve()), name, prepare)
    parsed = json.loads(source.read_text(encoding="utf-8"))  # another Traversable: read as it is, uncached
    return parsed if prepare is None else prepare(parsed, source.name)


@lru_cache(maxsize=64)
def _load(file: str | None, name: str, prepare) -> Any:
    if file is None:
        parsed, where = json.loads(path(name).read_text(encoding="utf-8")), _parts(name)[-1]
    else:
        with open(file, encoding="utf-8") as f:
            parsed, where = json.load(f), Path(file).name
    return parsed if prepare is None else prepare(parsed, where)


def _entries(table: Any, where: str) -> dict:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: the top level must be a JSON object keyed by entry name, "
                         f"got {type(table).__name__}")
    return {k: v for k, v in table.items() if not k.startswith("_")}


def load_table(source: str | os.PathLike | None, name: str) -> dict:
    """A table file (a JSON object keyed by entry name) as :func:`load_json` reads it, without its keys that
    start with ``_`` (notes to the reader such as ``_about``); cached, not to be changed.

    Raises:
        ValueError: the top level is not a JSON object; and what :func:`load_json` raises.
    """
    return load_json(source, name, _entries)


def record_path(name: str) -> Path:
    """Where a recorder writes the data file ``name`` (e.g. ``"experiments/full.jsonl"``): the file in the
    package's data folder, when the package is a source checkout (an editable install), so that new records
    are committed and ship with the next wheel.

    Raises:
        ValueError: the package is installed (from a wheel): its data is read-only there, so pass the
        recorder an explicit output file (``--out``).
    """
    target = path(name)
    here = Path(__file__).resolve().parent
    if not isinstance(target, Path) or not (here.parents[1] / "pyproject.toml").is_file():
        raise ValueError(f"commlab is installed from a wheel ({here}); its data is not written in place: "
                         f"give an output file (--out) for {name!r}")
    return target
