#!/usr/bin/env bash
# Create .venv (if missing) and install commpress with its test and benchmark extras.
# Needs only Python >= 3.10. torch is pinned to the CPU wheel used in CI; pyproject
# keeps a range (torch>=2.8) so users with GPUs keep their own build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# pip compiles every installed file to .pyc (about a minute): keep it.  Where PYTHONDONTWRITEBYTECODE
# is set (as in CI) Python writes none on import, and with --no-compile each process would
# compile torch from source (measured: 6-9 s per `import torch`, the suite 50% slower)
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# the torch pin again: the hf extra (transformers, accelerate) must not move it
.venv/bin/python -m pip install -q -e ".[test,bench,hf]" "torch==${TORCH_VERSION:-2.13.0}"
