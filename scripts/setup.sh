#!/usr/bin/env bash
# Create .venv (Python 3.11+), install commlab and everything the course needs, then build the book with
# every notebook executed. The HTML lands in _build/html/index.html.
#   bash scripts/setup.sh            # install + build
#   bash scripts/setup.sh --no-build # install only
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
# torch first, pinned to the CPU build this course is tested with, unless a torch is already there
# (a CUDA build a cluster user installed, say): requirements.txt then only checks its version range.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "== installing torch"
  "${PIP[@]}" install -q "torch==2.13.0"
fi
echo "== installing requirements and commlab (editable)"
"${PIP[@]}" install -q -r requirements.txt
# The distribution is commlab-course; a distribution named "commlab" in this venv is either this course
# installed under its old name or PyPI's unrelated package of that name, and would shadow the import.
if "${PIP[@]}" show -q commlab >/dev/null 2>&1; then
  echo "== removing the distribution 'commlab' (old name of this course, or PyPI's unrelated package)"
  "${PIP[@]}" uninstall -q -y commlab
fi
"${PIP[@]}" install -q --no-deps -e .

# MathJax 3, served from the book itself so that _build/html reads offline (book/_ext/offline_assets.py
# points the build at it). Pinned by version and by the registry's integrity hash; unpacked into the
# ignored folder _vendor/. Without npm the book still builds, loading MathJax from its CDN (a warning
# says so); in CI (CI=true) a missing copy is an error, since CI must build the book offline.
MATHJAX_VERSION=3.2.2
MATHJAX_INTEGRITY=sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==
MATHJAX_DIR=_vendor/static/mathjax
if [ "$(cat "$MATHJAX_DIR/VERSION" 2>/dev/null)" != "$MATHJAX_VERSION" ]; then
  if command -v npm >/dev/null 2>&1 && bash scripts/vendor_mathjax.sh "$MATHJAX_VERSION" "$MATHJAX_INTEGRITY" "$MATHJAX_DIR"; then
    echo "== MathJax $MATHJAX_VERSION copied into $MATHJAX_DIR"
  elif [ "${CI:-}" = "true" ]; then
    echo "!! could not copy MathJax $MATHJAX_VERSION from npm: CI must build the book offline" >&2
    exit 1
  else
    echo "!! WARNING: npm is missing or failed: the book will load MathJax from its CDN (no maths offline)" >&2
  fi
fi

if [ "${1:-}" != "--no-build" ]; then
  bash scripts/build_book.sh
fi
