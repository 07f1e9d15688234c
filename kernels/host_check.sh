#!/usr/bin/env bash
# Checks of kernels/*.cu that need no GPU (CI runs it from scripts/test.sh, ~1 min):
#  1. builds the kernels for the host (kernels/host/build.py: g++ and kernels/host/cuda_shim.h);
#     the CUDA parity tests (tests/ops/test_ops_cuda_parity.py) then run them through the wrapper;
#  2. runs the kernels that use barriers, shuffles and atomics under ThreadSanitizer;
#  3. compiles every .cu with NVRTC for compute_80 and compute_90 (pip nvidia-cuda-nvrtc-cu12);
#  4. compiles with nvcc for sm_80 and sm_90 when nvcc exists (kernels/check.sh).
# Installs what is missing (g++ with apt-get, the NVRTC wheel into the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CXX=${CXX:-g++}
say() { echo "host_check: $*"; }

if ! command -v "$CXX" >/dev/null 2>&1; then
  say "installing g++"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; } >/dev/null; then
    echo "host_check: no $CXX and apt-get could not install g++ (needs root)" >&2
    exit 1
  fi
fi

lib=$("$PY" kernels/host/build.py)
say "host build $lib"

driver=$("$PY" kernels/host/build.py --tsan-driver)
TSAN_OPTIONS="halt_on_error=1 exitcode=66 ${TSAN_OPTIONS:-}" "$driver"

if ! "$PY" -c "import nvidia.cuda_nvrtc" >/dev/null 2>&1; then
  say "installing nvidia-cuda-nvrtc-cu12"
  "$PY" -m pip install -q "nvidia-cuda-nvrtc-cu12>=12.4"
fi
"$PY" kernels/nvrtc_check.py --arch 80 90

if command -v nvcc >/dev/null 2>&1; then
  bash kernels/check.sh
else
  say "nvcc not found: nvcc compile check skipped (NVRTC checked above)"
fi
