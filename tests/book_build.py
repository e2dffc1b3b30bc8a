"""The strict build of the book from its stored outputs, shared by tests/test_book.py and
tests/test_browser.py through the session-scoped ``built_book`` fixture (tests/conftest.py), so that one
test session builds the book once.

The build renders the stored outputs (``execute_notebooks: "off"``): nbval executes every notebook and
compares its outputs in the same test run. ``scripts/build_book.sh`` is the reader's build, with execution
forced.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class BookBuild:
    returncode: int
    log: str  # the end of jupyter-book's stdout and stderr
    html: pathlib.Path  # the built site's root (index.html, book/, labs/, _static/)


def toc_files() -> list[str]:
    """Every page of ``_toc.yml`` in reading order (root first), as paths without suffix relative to the repository."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def visit(entries):  # in reading order: a chapter, then its sections
        for entry in entries:
            if "file" in entry:
                files.append(entry["file"])
            visit(entry.get("parts", []) + entry.get("chapters", []) + entry.get("sections", []))

    visit(toc.get("parts", []) + toc.get("chapters", []))
    return files


def build_strictly(workdir: pathlib.Path, timeout: int = 900) -> BookBuild:
    """Build the book into ``workdir`` with ``-W -n --keep-going`` (any Sphinx warning fails it)."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    # jupyter-book resolves local extension folders against the config file's folder: this copy lives in
    # workdir, so they are made absolute.
    local = config.get("sphinx", {}).get("local_extensions") or {}
    for name, path in local.items():
        local[name] = str(ROOT / path)
    cfg = workdir / "_config.yml"
    cfg.write_text(yaml.safe_dump(config, allow_unicode=True))
    out = workdir / "build"
    jb = pathlib.Path(sys.executable).with_name("jupyter-book")
    proc = subprocess.run([str(jb), "build", str(ROOT), "--config", str(cfg), "--path-output", str(out),
                           "-W", "-n", "--keep-going"], capture_output=True, text=True, timeout=timeout)
    return BookBuild(proc.returncode, proc.stdout[-6000:] + proc.stderr[-6000:], out / "_build" / "html")
