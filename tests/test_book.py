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
import sys

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


def test_chapters_and_labs_link_each_other():
    """Every lab of the table of contents opens with the "Run this lab" box and every chapter with labs ends
    with a link to them (tools/nav_cells.py writes both from _toc.yml)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import nav_cells

    assert nav_cells.main(["--check"]) == 0, "run .venv/bin/python tools/nav_cells.py"
    labs = [lab for _, chapter_labs in nav_cells.pairs() for lab in chapter_labs]
    assert len(labs) >= 8
    for lab in labs:
        first = json.loads((ROOT / f"{lab}.ipynb").read_text())["cells"][0]
        assert "run_the_labs.md" in "".join(first["source"]), lab
    # The home page lists every lab, and "Run the labs" says what each needs: both tables are written by hand.
    for page in ("book/intro.md", "book/run_the_labs.md"):
        text = (ROOT / page).read_text()
        assert [lab for lab in labs if f"../{lab}" not in text] == [], f"labs missing from {page}'s table"


def test_glossary_defines_the_terms_the_chapters_lean_on():
    """The terms a newcomer meets before their chapter explains them are glossary entries (a {glossary}
    directive, so each is in the index and can be linked with {term})."""
    text = (ROOT / "book" / "glossary.md").read_text()
    blocks = [b.split("\n:::", 1)[0] for b in text.split(":::{glossary}\n")[1:]]
    terms = {line.strip().lower() for b in blocks for line in b.splitlines() if line and not line.startswith(" ")}
    wanted = {"gloo", "nccl", "rank", "process", "approximation rank", "bucket", "future", "comm hook",
              "communication hook", "isend / irecv", "point-to-point", "process group", "micro-batch", "bubble",
              "error feedback", "busbw", "algbw", "torchrun", "ddp (distributeddataparallel)"}
    assert wanted - terms == set()


@pytest.mark.notebooks
def test_book_builds_strictly(built_book):
    assert built_book.returncode == 0, built_book.log
    html = built_book.html
    for page in _toc_files():
        assert (html / page).with_suffix(".html").exists(), page
    lab = (html / "labs" / "lab02_ring_reduce_scatter_all_gather.html").read_text()
    assert "<img" in lab and "all checks passed" in lab, "the lab's plots and checks should be in the HTML"
