"""Authoring helpers for the course's notebooks: build from cells, execute in place, check outputs.

``python tools/nbtools.py execute PATH...`` runs notebooks top to bottom with the current interpreter's
kernel and stores their outputs, which nbval then compares on every test run.

Two kernel families: stored outputs come from ATen's AVX2 kernels (x86-64), nbval's runs from its scalar
``default`` ones (the root conftest.py), so every test run compares across CPUs' rounding. A compared
cell therefore prints only what rounding cannot move (counts, bytes, booleans, values at the text's
precision); losses, accuracies and rounding errors go in ``nbval-ignore-output`` cells beside an assert.

``python tools/nbtools.py tag-ignore PATH...`` moves nbval's output-ignoring marker out of the code the
reader sees: each code cell whose first line is the comment ``# NBVAL_IGNORE_OUTPUT`` loses that line and
gets nbval's cell tag ``nbval-ignore-output`` instead (same effect for nbval; the book shows no marker).
"""

from __future__ import annotations

import os
import platform
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


STORED_CPU_KERNELS = "avx2"   # ATen kernels of the stored outputs (x86-64 only; elsewhere the machine's own)
TESTED_CPU_KERNELS = "default"  # ATen kernels of nbval's runs: scalar code, valid on every CPU


def pin_cpu_kernels(capability: str) -> None:
    """Set ``ATEN_CPU_CAPABILITY`` to ``capability`` for the notebook kernels started from now on (they inherit
    the environment), and for this process if torch is not imported yet, unless it is already set: an
    explicit value always wins, so ``ATEN_CPU_CAPABILITY=avx2 pytest --nbval ...`` tests on the stored
    outputs' own kernels.

    ATen picks its vectorised kernels by the CPU, and they round sums differently; so do thread counts.
    Outputs stored under pinned AVX2 kernels on one machine still differed on others, so nbval runs
    another family than the stored outputs': a cell whose output rounding can move fails on every test
    run, not first on a reader's CPU. ``avx2`` is an x86-64 value (elsewhere torch would warn into the
    outputs); ``default`` is valid everywhere."""
    if capability != "default" and platform.machine().lower() not in ("x86_64", "amd64"):
        return
    os.environ.setdefault("ATEN_CPU_CAPABILITY", capability)


def execute(path: str, timeout: int = 300) -> None:
    pin_cpu_kernels(STORED_CPU_KERNELS)
    nb = nbformat.read(path, as_version=4)
    # record_timing=False: per-cell timestamps would make every re-execution a diff of every cell.
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": _dir(path)}}).execute()
    nbformat.write(nb, path)


IGNORE_COMMENT = "# NBVAL_IGNORE_OUTPUT"
IGNORE_TAG = "nbval-ignore-output"  # nbval's metadata tag for the comment above (nbval/plugin.py)


def tag_ignore(path: str) -> int:
    """Replace a leading ``# NBVAL_IGNORE_OUTPUT`` line of each code cell by the ``nbval-ignore-output``
    tag (other tags kept, outputs untouched). Returns the number of cells changed; rewrites the file
    only if there was one."""
    nb = nbformat.read(path, as_version=4)
    changed = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        first, _, rest = cell.source.partition("\n")
        if first.strip() != IGNORE_COMMENT:
            continue
        cell.source = rest
        tags = list(cell.metadata.get("tags", []))
        if IGNORE_TAG not in tags:
            tags.append(IGNORE_TAG)
        cell.metadata["tags"] = tags
        changed += 1
    if changed:
        nbformat.write(nb, path)
    return changed


def _dir(path: str) -> str:
    import os
    return os.path.dirname(os.path.abspath(path))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("execute", "tag-ignore"):
        sys.exit("usage: python tools/nbtools.py execute NOTEBOOK...\n"
                 "       python tools/nbtools.py tag-ignore NOTEBOOK...")
    for p in sys.argv[2:]:
        if sys.argv[1] == "execute":
            print(f"executing {p}", flush=True)
            execute(p)
        else:
            print(f"{p}: {tag_ignore(p)} cells now tagged {IGNORE_TAG}", flush=True)
