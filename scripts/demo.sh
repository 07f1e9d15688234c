#!/usr/bin/env bash
# The main job: install (scripts/setup.sh), then the compression-ratio training sweep.
# Extra arguments go to the sweep, e.g. `bash scripts/demo.sh --net 1gbit` (full mode).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--quick)
exec .venv/bin/python -m benchmarks sweep "${args[@]}"
