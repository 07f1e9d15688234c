#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), check the CUDA kernels without a GPU
# (kernels/host_check.sh), run the whole suite. Fails when a test fails or when none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash kernels/host_check.sh  # host build + TSan + NVRTC (+ nvcc) of kernels/*.cu
set +e
HYPOTHESIS_PROFILE=ci .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$rc"
