#!/usr/bin/env bash
# GPU check for the CUDA backend (kernels/*.cu through CuPy), for machines lent a GPU.
#
#   bash benchmarks/gpu_check.sh            # from the repository root or anywhere
#
# 1. uses a Python that already has CUDA torch + CuPy, or makes a venv ($GPU_VENV, default /tmp/commpress-gpu-venv) and installs
#    torch (PyPI's Linux wheels are CUDA builds), cupy-cuda12x and this package [test];
# 2. compiles kernels/*.cu with nvcc when present (kernels/check.sh);
# 3. runs the GPU-marked parity tests (tests/ops/test_ops_cuda_parity.py);
# 4. runs the kernel benchmark on the GPU (2**24 fp32) and writes results/kernels-*/.
# Each step has a timeout so the whole check stays under 5 minutes once installed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
have_stack() {
  "$1" - <<'EOF' 2>/dev/null
import torch, cupy
assert torch.cuda.is_available(), "torch without CUDA"
cupy.cuda.runtime.getDeviceCount()
EOF
}

if ! have_stack "$PY"; then
  VENV=${GPU_VENV:-/tmp/commpress-gpu-venv}
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV" || exit 1
  fi
  PY="$VENV/bin/python"
  if ! have_stack "$PY"; then
    echo "gpu_check: installing torch (CUDA) and cupy-cuda12x"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
      || "$PY" -m pip install -q torch || exit 1
    "$PY" -m pip install -q "cupy-cuda12x>=13" || exit 1
  fi
fi
"$PY" -c "import commpress, hypothesis, pytest_timeout" 2>/dev/null \
  || "$PY" -m pip install -q -e ".[test]" || exit 1

# CuPy finds NVRTC from the nvidia-* wheels torch installed.
NV_LIBS=$("$PY" - <<'EOF'
import glob, os, site
dirs = []
for base in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += glob.glob(os.path.join(base, "nvidia", "*", "lib"))
print(":".join(dirs))
EOF
)
export LD_LIBRARY_PATH="${NV_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| cupy', cupy.__version__, '|', torch.cuda.get_device_name())"

rc=0
if command -v nvcc >/dev/null 2>&1; then
  timeout 120 bash kernels/check.sh || rc=1
fi
HYPOTHESIS_PROFILE=ci timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/ops -rs || rc=1
timeout 150 "$PY" -m benchmarks kernels --device cuda --repeat 20 --ref-repeat 3 || rc=1
echo "gpu_check: exit $rc"
exit $rc
