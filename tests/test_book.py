"""The book: every notebook is executed and error-free as stored, listed in the table of contents, and
the whole book builds strictly.

The notebooks themselves are executed and their outputs compared by nbval (``--nbval`` in pytest's
options collects every ``.ipynb`` under ``book/`` and ``labs/``). The build here therefore renders the
stored outputs (``execute_notebooks: "off"``) instead of executing every notebook a second time: nbval has
just shown that a fresh execution reproduces them. That build is made once per session by the
``built_book`` fixture (tests/book_build.py), which tests/test_browser.py reads as well.
``scripts/build_book.sh`` is the reader's build, with execution forced.
"""

import json
import pathlib

import pytest

from tests.book_build import toc_files as _toc_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for p in list(ROOT.glob("book/**/*.ipynb")) + list(ROOT.glob("labs/**/*.ipynb"))
                   if ".ipynb_checkpoints" not in p.parts and "_build" not in p.parts)


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_is_stored_executed_without_errors(path):
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, "a notebook without code cells belongs in a .md file"
    unexecuted = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unexecuted, f"code cells {unexecuted} were never executed (run tools/nbtools.py execute)"
    errors = [i for i, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert not errors, f"code cells {errors} hold error outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_nbval_markers_are_cell_tags_not_comments(path):
    # A reader sees a cell's source, not its metadata: nbval's markers live in the cell's tags
    # (nbval-ignore-output, ...). `python tools/nbtools.py tag-ignore PATH` moves a leading
    # "# NBVAL_IGNORE_OUTPUT" comment into that tag.
    cells = json.loads(path.read_text())["cells"]
    marked = [i for i, c in enumerate(cells)
              if c["cell_type"] == "code" and any(line.lstrip().startswith("# NBVAL_")
                                                  for line in "".join(c["source"]).splitlines())]
    assert not marked, f"code cells {marked} carry an NBVAL_ comment: run tools/nbtools.py tag-ignore {path.name}"


def test_every_page_is_in_the_table_of_contents():
    listed = set(_toc_files())
    pages = {str(p.relative_to(ROOT).with_suffix("")) for p in NOTEBOOKS}
    pages |= {str(p.relative_to(ROOT).with_suffix("")) for p in ROOT.glob("book/**/*.md")}
    assert pages - listed == set()
    missing = [f for f in listed if not any((ROOT / f).with_suffix(s).exists() for s in (".md", ".ipynb"))]
    assert missing == []


@pytest.mark.notebooks
def test_book_builds_strictly(built_book):
    assert built_book.returncode == 0, built_book.log
    html = built_book.html
    for page in _toc_files():
        assert (html / page).with_suffix(".html").exists(), page
    lab = (html / "labs" / "lab02_ring_reduce_scatter_all_gather.html").read_text()
    assert "<img" in lab and "all checks passed" in lab, "the lab's plots and checks should be in the HTML"
