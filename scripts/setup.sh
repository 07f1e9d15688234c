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
# --no-compile, then one compileall on both cores: pip writes every .pyc on one core (about a
# minute of the two-minute install on 2 cores).  The .pyc must exist: where
# PYTHONDONTWRITEBYTECODE is set (as in CI) Python writes none on import, and each process would
# compile torch from source (measured: 6-9 s per `import torch`, the suite 50% slower).
.venv/bin/python -m pip install -q --no-compile "torch==${TORCH_VERSION:-2.13.0}"
# the torch pin again: the hf extra (transformers, accelerate) must not move it
.venv/bin/python -m pip install -q --no-compile -e ".[test,bench,hf]" "torch==${TORCH_VERSION:-2.13.0}"
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# a few files do not compile on this Python (e.g. torch's py312 test helpers): pip skips them too
.venv/bin/python -m compileall -q -j 0 "$site" commpress benchmarks tests examples >/dev/null 2>&1 || true
.venv/bin/python - <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("torch")
if not os.path.exists(importlib.util.cache_from_source(spec.origin)):
    sys.exit("setup.sh: torch has no .pyc after compileall: every import would compile it from source")
PY
