#!/usr/bin/env bash
# Build the Jupyter Book with every notebook executed. Strict: a failing cell, a broken reference or any
# Sphinx warning fails the build (exit code != 0). Extra arguments go to jupyter-book.
set -euo pipefail
cd "$(dirname "$0")/.."
# On x86-64 the notebooks run on ATen's AVX2 kernels, as for their stored outputs
# (tools/nbtools.py pin_cpu_kernels says why).
case "$(uname -m)" in
  x86_64|amd64) export ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-avx2} ;;
esac
.venv/bin/jupyter-book build . -W -n --keep-going "$@"
echo "== the book is in _build/html/index.html"
