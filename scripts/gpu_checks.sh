#!/usr/bin/env bash
# The GPU test files and the issue-16 benchmark in one device call (results under $OUT):
#   bash scripts/gpu_checks.sh [pytest files...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/megaserve/test_device_plane_gpu.py
    tests/megaserve/test_prefix_cache_gpu.py tests/megaserve/test_spec_decode_gpu.py
    tests/megaserve/test_kv_sizing_gpu.py tests/kernels/test_engine_cuda.py)
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    timeout 400 python -m pytest -q -m gpu -p no:cacheprovider --timeout 300 "$f" \
        > "$OUT/$name.log" 2>&1
    echo "$f rc=$? $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
done
