#!/usr/bin/env bash
# GPU check of commpress on one GPU (about 5 minutes, at most ~8), for machines lent a GPU.
#
#   bash benchmarks/gpu_check.sh [--out DIR]            # on a GPU machine
#   bash benchmarks/gpu_check.sh --dry-run [--out DIR]  # anywhere: CPU stands in (CI runs this)
#
# 1. uses a Python that already has CUDA torch + CuPy, or makes a venv ($GPU_VENV, default
#    /tmp/commpress-gpu-venv) with torch, the CuPy wheel of torch's CUDA major and commpress[test];
# 2. compiles kernels/*.cu with NVRTC (what CuPy uses);
# 3. runs the GPU-marked tests of tests/ops (bitwise parity of every kernel, cuda:1, streams);
# 4. kernels: every op at 2**20..2**26 fp32: GB/s, % of the HBM peak (read from the device),
#    ratio to a torch memcpy; top-k vs torch.topk (benchmarks/gpu_kernels.py);
# 5. sync: a steady-state DDP step of every compressor under set_sync_debug_mode("error");
# 6. shared: DDP with the hook on 2 ranks sharing the GPU over gloo, CUDA tensors, overlap on
#    (identity bitwise equal to plain DDP; topk, blockquant, powersgd train, replicas equal);
# 7. nccl: the same on 2 GPUs over NCCL (skipped with one GPU)        (5-7: benchmarks/gpu_ddp.py);
# 8. report: DIR/gpu-check.json and DIR/gpu-check.txt, the table of results and goals
#    (benchmarks/gpu_report.py; DIR defaults to results/gpu-check).
# Every step runs under a timeout and is reported; the exit status is 1 if any failed, and the
# last lines say what.  --dry-run: steps 4-8 on CPU with the host build of kernels/*.cu standing
# in for the GPU and small sizes (1-3 run in CI through kernels/host_check.sh and tests/ops).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT=results/gpu-check
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) OUT=$2; shift ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT/steps.txt" "$OUT/gpu-check.txt"
START=$SECONDS
failed=()
step() {  # step NAME SECONDS CMD...: run, report, remember a failure, go on
  local name=$1 secs=$2 rc=0
  shift 2
  echo "=== gpu_check: $name"
  timeout "$secs" "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "=== gpu_check: $name: ok ($((SECONDS - START)) s so far)"
    printf '%s\tok\n' "$name" >>"$OUT/steps.txt"
  else
    local why="FAILED (exit $rc)"
    [ "$rc" -eq 124 ] && why="TIMED OUT after ${secs}s"
    echo "=== gpu_check: $name: $why"
    printf '%s\t%s\n' "$name" "$why" >>"$OUT/steps.txt"
    failed+=("$name")
  fi
}
skipped() { echo "=== gpu_check: $1: skipped ($2)"; printf '%s\tskipped (%s)\n' "$1" "$2" >>"$OUT/steps.txt"; }
die() { echo "gpu_check: $*" >&2; exit 1; }
finish() {
  local rc=0
  "$PY" -m benchmarks.gpu_report "$OUT" || rc=1
  if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED steps: ${failed[*]}"
    rc=1
  fi
  [ "$rc" -eq 0 ] && echo "gpu_check: all steps passed ($((SECONDS - START)) s)"
  exit "$rc"
}

if [ "$DRY" -eq 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  echo "gpu_check: DRY RUN on CPU ($PY): the host build of kernels/*.cu stands in for the GPU"
  skipped "NVRTC compile" "dry run: kernels/host_check.sh compiles with NVRTC and nvcc in CI"
  skipped "GPU tests (tests/ops, -m gpu)" "dry run: their host twins run in CI"
  step "kernels, sync, shared, nccl" 300 "$PY" -m benchmarks.gpu_check --dry-run --out "$OUT"
  finish
fi

PY=${PYTHON:-python3}

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

step "NVRTC compile (compute_80, compute_90)" 40 "$PY" kernels/nvrtc_check.py --arch 80 90
step "GPU tests (tests/ops, -m gpu)" 120 env HYPOTHESIS_PROFILE=ci \
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/ops
step "kernels (2**20..2**26)" 120 "$PY" -m benchmarks.gpu_check --step kernels --out "$OUT"
step "sync check (every compressor)" 60 "$PY" -m benchmarks.gpu_check --step sync --out "$OUT"
step "DDP, 2 ranks on one GPU (gloo)" 120 "$PY" -m benchmarks.gpu_check --step shared --out "$OUT"
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -ge 2 ]; then
  step "DDP, 2 GPUs (NCCL)" 120 "$PY" -m benchmarks.gpu_check --step nccl --out "$OUT"
else
  "$PY" -m benchmarks.gpu_check --step nccl --out "$OUT" >/dev/null 2>&1 || true  # writes "skipped"
  skipped "DDP, 2 GPUs (NCCL)" "$ngpu GPU"
fi
finish
