#!/usr/bin/env bash
# Run every test: unit and multi-process tests, nbval over every notebook (outputs compared), and a
# strict book build. Installs first if .venv is missing. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import commlab, nbval, jupyter_book" 2>/dev/null; then
  bash scripts/setup.sh --no-build
fi
exec .venv/bin/python -m pytest "$@"
