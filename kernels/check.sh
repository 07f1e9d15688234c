#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc for the architectures we ship (sm_80, sm_90).
# Fails on the first compiler error.  CI runs it when nvcc exists.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
shopt -s nullglob
sources=(*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "kernels/check.sh: no .cu files" >&2
  exit 1
fi
for src in "${sources[@]}"; do
  for arch in 80 90; do
    "$NVCC" -std=c++14 -arch="sm_${arch}" --cubin -Werror all-warnings \
      -o "$tmp/${src%.cu}.sm_${arch}.cubin" "$src"
  done
  echo "kernels/check.sh: $src compiles for sm_80 and sm_90"
done
