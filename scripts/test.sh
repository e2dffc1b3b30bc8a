#!/usr/bin/env bash
# Run the tests. Installs first if .venv is missing. Extra arguments go to pytest.
#   bash scripts/test.sh           everything: tests/ (two workers; the timing tests alone), nbval over every
#                                  notebook in book/ and labs/ (outputs compared), the strict book build and
#                                  the browser check
#   bash scripts/test.sh --fast    the fast lane for every edit: unit and small multi-process tests
#                                  (-m "not slow and not notebooks"), a few minutes on 2 cores
#   bash scripts/test.sh tests/test_ring.py -x    one file (no notebooks unless you name them)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import commlab, nbval, jupyter_book" 2>/dev/null; then
  bash scripts/setup.sh --no-build
fi
PYTEST=(.venv/bin/python -m pytest)
NBVAL=(--nbval --nbval-current-env --nbval-cell-timeout=300)
if [ "${1:-}" = "--fast" ]; then
  shift
  exec "${PYTEST[@]}" -m "not slow and not notebooks" "$@" tests
fi
for arg in "$@"; do  # paths named: run just those (with nbval, so that a named notebook is compared)
  if [ -e "${arg%%::*}" ]; then exec "${PYTEST[@]}" "${NBVAL[@]}" "$@"; fi
done
# Everything, in three runs; each runs even if one before failed, and the lane fails if any did.
#  1. tests/ that neither time the wall clock nor build the book, on two pytest-xdist workers, a file each:
#     most of them wait on processes (ranks, torchrun, timeouts), so two at once fill the two cores.
#  2. the `timing` tests, alone, so that nothing else runs beside their clocks.
#  3. the book's strict build with the browser check (one worker: one build), and nbval over every notebook,
#     a notebook to a worker (one kernel each), on two workers: a notebook's kernel keeps about one core busy.
# The workers take the longest files first (conftest.py's LONGEST_FILES, --no-loadscope-reorder).
BOOK=(tests/test_book.py tests/test_browser.py)
XDIST=(-n 2 --dist loadfile --no-loadscope-reorder)
status=0
"${PYTEST[@]}" "${XDIST[@]}" -m "not timing" "${BOOK[@]/#/--ignore=}" "$@" tests || status=1
"${PYTEST[@]}" -m timing "${BOOK[@]/#/--ignore=}" "$@" tests || status=1
"${PYTEST[@]}" "${XDIST[@]}" "${NBVAL[@]}" "$@" "${BOOK[@]}" book labs || status=1
exit $status
