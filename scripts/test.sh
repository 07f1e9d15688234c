#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), compile-check the CUDA kernels when
# nvcc exists, run the whole suite. Fails when a test fails or when none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if command -v nvcc >/dev/null 2>&1 && ls kernels/*.cu >/dev/null 2>&1; then
  bash kernels/check.sh
fi
set +e
HYPOTHESIS_PROFILE=ci .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$rc"
