#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), check the CUDA kernels without a GPU
# (kernels/host_check.sh), run the whole suite. Fails when a test fails or when none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash kernels/host_check.sh  # host build + TSan + NVRTC (+ nvcc) of kernels/*.cu
set +e
# two pytest workers (pytest-xdist), one file each at a time: alone, the suite keeps about one
# core busy (rank processes start, wait on each other, numba compiles on one thread)
HYPOTHESIS_PROFILE=ci .venv/bin/python -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$rc"
