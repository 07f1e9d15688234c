#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), build the docs (mkdocs --strict), check the CUDA kernels without a GPU
# (kernels/host_check.sh), run the whole suite. Fails when a test fails or when none ran.
# Arguments go to pytest (and then only what they name runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The docs site (mkdocs.yml): its extra, then a strict build, so that a broken link, a missing anchor
# or an API object mkdocstrings cannot find fails CI. Not `-q`: under -q mkdocs counts no warnings
# and --strict passes anything. About 5 s.
.venv/bin/python -m pip install -q -e ".[docs]" "torch==${TORCH_VERSION:-2.13.0}"
docs_site=$(mktemp -d)
docs_log=$(mktemp)
if ! NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict -d "$docs_site" >"$docs_log" 2>&1; then
  grep -v '^INFO' "$docs_log" >&2
  echo "the docs build failed: .venv/bin/python -m mkdocs build --strict" >&2
  exit 1
fi
rm -rf "$docs_site" "$docs_log"
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider)
export HYPOTHESIS_PROFILE=ci
# The cost model's calibration (once per process group, hundreds of groups in the suite) with 3
# timed repetitions per size instead of the default 8: about 40 s less on 2 cores. The default's
# own behaviour is tested (tests/collectives/test_collectives_lowrank_costmodel.py).
export COMMPRESS_CALIBRATION_REPS="${COMMPRESS_CALIBRATION_REPS:-3}"
# The whole suite: the numba parity tests on ~1e6-element inputs compile most of the parallel
# kernels cold (about 2 minutes of one core; numba caches them for the rest). They start beside
# the host check, which keeps one core busy for about 20 s, and finish beside the others.
early=tests/ops/test_ops_numba_large.py
early_log=$(mktemp)
early_pid=
if [ "$#" -eq 0 ]; then
  "${PYTEST[@]}" "$early" >"$early_log" 2>&1 &
  early_pid=$!
  trap '[ -n "$early_pid" ] && kill "$early_pid" 2>/dev/null; rm -f "$early_log"' EXIT
fi
bash kernels/host_check.sh  # host build + TSan + NVRTC (+ nvcc) of kernels/*.cu
set +e
[ -n "$early_pid" ] && set -- --ignore="$early"
# two pytest workers (pytest-xdist), one file each at a time: alone, the suite keeps about one
# core busy (rank processes start, wait on each other, numba compiles on one thread)
"${PYTEST[@]}" -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
early_rc=0
if [ -n "$early_pid" ]; then
  wait "$early_pid"; early_rc=$?; early_pid=
  echo "== $early (started beside the host check)"; cat "$early_log"
fi
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
if [ "$rc" -eq 0 ] && [ "$early_rc" -ne 0 ]; then
  rc=$early_rc
fi
exit "$rc"
