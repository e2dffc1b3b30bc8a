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
"${PIP[@]}" install -q --no-deps -e .

if [ "${1:-}" != "--no-build" ]; then
  bash scripts/build_book.sh
fi
