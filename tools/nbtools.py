"""Authoring helpers for the course's notebooks: build from cells, execute in place, check outputs.

``python tools/nbtools.py execute PATH...`` runs notebooks top to bottom with the current interpreter's
kernel and stores their outputs, which nbval then compares on every test run.
"""

from __future__ import annotations

import sys

import nbformat
from nbclient import NotebookClient


def md(text: str):
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, hidden: bool = False, tags: tuple[str, ...] = ()):
    cell = nbformat.v4.new_code_cell(text.strip("\n"))
    tags = list(tags)
    if hidden:
        # Folded in the book (Jupyter Book's hide-input) and in JupyterLab (source_hidden).
        tags.append("hide-input")
        cell.metadata["jupyter"] = {"source_hidden": True}
    if tags:
        cell.metadata["tags"] = tags
    return cell


def write(path: str, cells) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, path)


def execute(path: str, timeout: int = 300) -> None:
    nb = nbformat.read(path, as_version=4)
    # record_timing=False: per-cell timestamps would make every re-execution a diff of every cell.
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": _dir(path)}}).execute()
    nbformat.write(nb, path)


def _dir(path: str) -> str:
    import os
    return os.path.dirname(os.path.abspath(path))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "execute":
        sys.exit("usage: python tools/nbtools.py execute NOTEBOOK...")
    for p in sys.argv[2:]:
        print(f"executing {p}", flush=True)
        execute(p)
