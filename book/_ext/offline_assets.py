"""Sphinx extension: the built book loads MathJax from its own ``_static`` folder, so it reads offline.

``scripts/setup.sh`` copies MathJax's browser build from the pinned ``mathjax`` npm package into
``_vendor/static/mathjax/`` (an ignored folder). Where that copy exists, this extension adds
``_vendor/static`` to ``html_static_path`` and points ``mathjax_path`` at it; where it does not (npm was
missing on the reader's machine), the book keeps Sphinx's default CDN address and the build prints a
warning. It is printed, not raised as a Sphinx warning, because the strict build (``-W``) would otherwise
fail for a reader without npm; CI checks the offline copy instead (scripts/setup.sh fails under CI=true
without it, and tests/test_browser.py fails any request that leaves 127.0.0.1).
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENDOR_STATIC = ROOT / "_vendor" / "static"
# The combined component Sphinx loads by default (TeX and MathML input, CommonHTML output).
MATHJAX = "mathjax/tex-mml-chtml.js"


def _serve_mathjax_locally(app, config) -> None:
    if (VENDOR_STATIC / MATHJAX).is_file():
        config.html_static_path = [*config.html_static_path, str(VENDOR_STATIC)]
        # A relative mathjax_path is taken relative to the output's _static folder.
        config.mathjax_path = MATHJAX
    else:
        print(f"\n!! WARNING: {VENDOR_STATIC / MATHJAX} is missing (run scripts/setup.sh with npm "
              "installed): this build loads MathJax from its CDN, so its maths needs a network\n",
              file=sys.stderr, flush=True)


def setup(app):
    app.connect("config-inited", _serve_mathjax_locally)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
