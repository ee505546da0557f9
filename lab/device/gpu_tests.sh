#!/usr/bin/env bash
# GPU test files in one device call, one log each (results under $OUT, default /tmp/out):
#   bash lab/device/gpu_tests.sh [pytest files...]
# With no files: the single-GPU engine tests (device plane, prefix cache, speculative
# decoding, KV sizing, the CUDA engine). summary.txt has one line per file: rc and pytest's
# last line.
set -uo pipefail
cd "$(dirname "$0")/../.."
source lab/device/setup.sh
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
