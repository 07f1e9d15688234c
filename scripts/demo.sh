#!/usr/bin/env bash
# The main job: install (scripts/setup.sh), then the training sweep's demonstration plan:
# 2 ranks one core each on an emulated 1 Gbit/s (digits) and 100 Mbit/s (char LM) cluster when
# this machine allows network namespaces (root, ip, tc), loopback otherwise; a click model with large
# embedding tables at 1 Gbit/s (the lossless row-sparse path against DDP, PyTorch's fp16 hook and the
# lossy configs; about 1.5-2 minutes of the total); 4 ranks in a
# table of their own; a verdict table; then the low-bandwidth part (LM at 10 Mbit/s: DDP, blockquant 4-bit,
# PostLocalSGD, DiLoCo dense / SparseLoCo / streaming).  About 8 minutes on 2 idle cores.
# Extra arguments replace the plan, e.g. `bash scripts/demo.sh --world-size 4 --net 1gbit` (full sweep).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--demo)
exec .venv/bin/python -m benchmarks sweep "${args[@]}"
