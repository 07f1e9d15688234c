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
# --no-compile: no .pyc for every installed file up front (a minute on 2 cores for torch,
# transformers and the rest); Python writes them for the modules it imports, on first import
.venv/bin/python -m pip install -q --no-compile "torch==${TORCH_VERSION:-2.13.0}"
# the torch pin again: the hf extra (transformers, accelerate) must not move it
.venv/bin/python -m pip install -q --no-compile -e ".[test,bench,hf]" "torch==${TORCH_VERSION:-2.13.0}"
