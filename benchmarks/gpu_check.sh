#!/usr/bin/env bash
# GPU check of the CUDA backend (kernels/*.cu through CuPy), for machines lent a GPU.
#
#   bash benchmarks/gpu_check.sh            # from the repository root or anywhere
#
# 1. uses a Python that already has CUDA torch + CuPy, or makes a venv ($GPU_VENV, default
#    /tmp/commpress-gpu-venv) with torch (PyPI's Linux wheels are CUDA builds), the CuPy wheel of
#    torch's CUDA major (cupy-cuda12x / cupy-cuda13x) and this package [test];
# 2. compiles kernels/*.cu with NVRTC (what CuPy uses) and with nvcc when present;
# 3. runs the GPU-marked tests of tests/ops (parity with the reference, cuda:1, streams);
# 4. prints each op's GB/s, % of HBM peak, ratio to memcpy, and top-k vs torch.topk for 2**24 and
#    2**26 fp32 (benchmarks/gpu_kernels.py; JSON in results/gpu-kernels.json);
# 5. with 2 GPUs, trains with the DDP hook over NCCL (benchmarks/gpu_ddp.py).
# Every step runs under a timeout and is reported; the exit status is 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
failed=()
step() {  # step NAME SECONDS CMD...: run, report, remember a failure, go on
  local name=$1 secs=$2
  shift 2
  echo "=== gpu_check: $name"
  if timeout "$secs" "$@"; then
    echo "=== gpu_check: $name: ok"
  else
    local rc=$?
    [ "$rc" -eq 124 ] && echo "=== gpu_check: $name: TIMED OUT after ${secs}s" || echo "=== gpu_check: $name: FAILED (exit $rc)"
    failed+=("$name")
  fi
}
die() { echo "gpu_check: $*" >&2; exit 1; }

have_stack() {
  "$1" - <<'EOF' >/dev/null 2>&1
import torch, cupy
assert torch.cuda.is_available(), "torch without CUDA"
cupy.cuda.runtime.getDeviceCount()
EOF
}

command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: is there a GPU and a driver?"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv

if ! have_stack "$PY"; then
  VENV=${GPU_VENV:-/tmp/commpress-gpu-venv}
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV" || die "cannot create $VENV"
  fi
  PY="$VENV/bin/python"
  if ! have_stack "$PY"; then
    echo "gpu_check: installing torch (CUDA) and the matching CuPy"
    "$PY" -m pip install -q --upgrade pip || die "pip upgrade failed"
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 \
      || "$PY" -m pip install -q torch || die "cannot install torch"
    major=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])") \
      || die "cannot read torch's CUDA version"
    nvrtc_wheel="nvidia-cuda-nvrtc-cu12"
    [ "$major" = 12 ] || nvrtc_wheel="nvidia-cuda-nvrtc==${major}.*"
    "$PY" -m pip install -q "cupy-cuda${major}x>=13" "$nvrtc_wheel" \
      || die "cannot install cupy-cuda${major}x"
    have_stack "$PY" || die "torch + CuPy installed but CUDA is not usable from them"
  fi
fi
"$PY" -c "import commpress, hypothesis, pytest_timeout" >/dev/null 2>&1 \
  || "$PY" -m pip install -q -e ".[test]" || die "cannot install commpress[test]"

# CuPy finds NVRTC in the nvidia-* wheels (torch's, or the one installed above).
NV_LIBS=$("$PY" - <<'EOF'
import glob, os, site
dirs = []
for base in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += glob.glob(os.path.join(base, "nvidia", "*", "lib"))
print(":".join(dirs))
EOF
)
export LD_LIBRARY_PATH="${NV_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

"$PY" - <<'EOF' || die "the cuda backend is not usable (see above)"
import torch, cupy
from commpress.ops import cuda_backend as cb
print("torch", torch.__version__, "cuda", torch.version.cuda, "| cupy", cupy.__version__,
      "| NVRTC", cupy.cuda.nvrtc.getVersion(), "|", torch.cuda.device_count(), "x", torch.cuda.get_device_name())
problem = cb.nvrtc_problem()
if problem:
    raise SystemExit(f"NVRTC cannot compile: {problem}")
assert cb.available(), "cuda backend not available"
EOF

step "NVRTC compile (compute_80, compute_90)" 120 "$PY" kernels/nvrtc_check.py --arch 80 90
if command -v nvcc >/dev/null 2>&1; then
  step "nvcc compile (sm_80, sm_90)" 180 bash kernels/check.sh
fi
step "GPU tests (tests/ops, -m gpu)" 300 env HYPOTHESIS_PROFILE=ci \
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/ops
step "kernel bandwidth (2**24, 2**26 fp32)" 300 "$PY" -m benchmarks.gpu_kernels --sizes 24 26
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -ge 2 ]; then
  step "DDP hook on 2 GPUs (NCCL)" 300 "$PY" -m benchmarks.gpu_ddp --world 2
else
  echo "=== gpu_check: DDP hook on 2 GPUs: skipped ($ngpu GPU)"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all steps passed"
