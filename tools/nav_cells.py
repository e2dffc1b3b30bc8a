"""Write the navigation cells between chapters and labs, from _toc.yml (the one place that pairs them).

Every lab (a file under ``labs/`` listed as a section of a chapter in ``_toc.yml``) gets, as its first cell, a
"Run this lab" box linking to its chapter and to the "Run the labs" page; every chapter with labs gets, as its
last cell, one sentence linking to them. Both are markdown cells: nothing is executed and no output changes.
The script is idempotent (the cells are found again by their ``commlab_nav`` metadata and rewritten), so run
it after adding a lab to the table of contents, or after a merge:

    .venv/bin/python tools/nav_cells.py          # write the cells
    .venv/bin/python tools/nav_cells.py --check  # exit 1 and name the notebooks whose cells are missing or stale

tests/test_book.py runs the check.
"""

import argparse
import pathlib
import re
import sys

import nbformat
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAB_BOX = "run-this-lab"
CHAPTER_LINK = "chapter-labs"

# One template for every lab; links are relative to labs/, so they work both in the built book (MyST turns
# them into document links) and in JupyterLab on a checkout (they open the files).
LAB_TEMPLATE = """:::{{admonition}} Run this lab
:class: tip
This lab goes with [{chapter_title}](../{chapter}.ipynb). It imports the course's package `commlab`, so it
needs the course installed from a checkout of its repository: [Run the labs](../book/run_the_labs.md) gives the two commands,
how to start JupyterLab, what each lab needs, and how to run a downloaded copy of this notebook. In a checkout:
`bash scripts/setup.sh --no-build`, then `.venv/bin/jupyter lab labs/`.
:::"""

CHAPTER_TEMPLATE = """**Lab.** Practise this chapter in {links}; [Run the labs](run_the_labs.md) says how to run it."""


def pairs(toc_path=ROOT / "_toc.yml"):
    """[(chapter file, [lab files])] for every chapter of the table of contents that has labs as sections."""
    toc = yaml.safe_load(toc_path.read_text())
    out = []
    for part in toc.get("parts", []):
        for chapter in part.get("chapters", []):
            labs = [s["file"] for s in chapter.get("sections", []) if s["file"].startswith("labs/")]
            if labs:
                out.append((chapter["file"], labs))
    return out


def title(path):
    """The first heading of a notebook, without the '#'."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.get("metadata", {}).get("commlab_nav") is None:
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise ValueError(f"{path} has no '# ' heading in its markdown cells")


def chapter_title(path):
    """'chapter 2, Ring ReduceScatter and AllGather' from the heading '# 2. Ring ReduceScatter and AllGather'."""
    heading = title(path)
    m = re.match(r"(\d+)\.\s+(.*)", heading)
    return f"chapter {m.group(1)}, {m.group(2)}" if m else heading


def _put(nb, kind, source, first):
    cells = [c for c in nb.cells if c.get("metadata", {}).get("commlab_nav") == kind]
    if cells:
        changed = cells[0].source != source
        cells[0].source = source
        return changed
    cell = nbformat.v4.new_markdown_cell(source)
    cell.metadata["commlab_nav"] = kind
    if nb.nbformat_minor < 5:
        cell.pop("id", None)
    else:
        cell["id"] = kind  # a fixed id: the same cell on every run and every branch
    if first:
        nb.cells.insert(0, cell)
    else:
        nb.cells.append(cell)
    return True


def cells_wanted():
    """{notebook path: [(kind, source, first)]}."""
    wanted = {}
    for chapter, labs in pairs():
        ch_path = ROOT / f"{chapter}.ipynb"
        box = LAB_TEMPLATE.format(chapter_title=chapter_title(ch_path), chapter=chapter)
        for lab in labs:
            wanted.setdefault(ROOT / f"{lab}.ipynb", []).append((LAB_BOX, box, True))
        links = ", ".join(f"[{title(ROOT / f'{lab}.ipynb')}](../{lab}.ipynb)" for lab in labs)
        wanted.setdefault(ch_path, []).append((CHAPTER_LINK, CHAPTER_TEMPLATE.format(links=links), False))
    return wanted


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; fail if a cell is missing or stale")
    args = parser.parse_args(argv)
    stale = []
    for path, cells in cells_wanted().items():
        nb = nbformat.read(path, as_version=4)
        changed = [_put(nb, kind, source, first) for kind, source, first in cells]
        if any(changed):
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                nbformat.write(nb, path)
    if args.check and stale:
        print("navigation cells missing or stale (run .venv/bin/python tools/nav_cells.py): " + ", ".join(stale))
        return 1
    print(("would update: " if args.check else "updated: ") + (", ".join(stale) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
