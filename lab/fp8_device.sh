#!/usr/bin/env bash
# Issue 35's GPU run in one device call (results under $OUT): the FP8 and MLA GPU tests,
# bf16 vs fp8 decode of random:qwen3-30b-a3b:48, the FP8 GEMM benchmark (and launch sweep
# with SWEEP=1), and, where the MLA GPU test passed, random:deepseek-v3:$DS_LAYERS fp8
# decode (DS_LAYERS=0: skipped). Each step has its own time limit; summary.txt has rc lines.
#   bash lab/fp8_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
}
step fp8_gpu_tests "${TEST_S:-150}" python -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/test_fp8_gpu.py
step mla_gpu_tests 90 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mla_gpu.py
mla_ok=$(grep -c "^mla_gpu_tests rc=0 " "$OUT/summary.txt")
step fp8_bench "${BENCH_S:-150}" python -m megaserve.kernels.fp8_bench --gemm-sizes 64 256 4096 \
    --batches 1 64 256 1024 ${SWEEP:+--sweep}
decode() {  # decode NAME MODEL BATCHES [extra flags]
    local name=$1 model=$2 batches=$3; shift 3
    step "$name" "${DECODE_S:-110}" python -m megaserve.cli bench decode --model "$model" \
        --dtype bfloat16 --batches "$batches" --steps 8 --warmup-steps 2 --profile-steps 0 \
        --prefill-len 0 --matmul-seconds 0 --matmul-n 4096 --json-out "$OUT/$name.json" "$@"
}
decode decode_fp8 random:qwen3-30b-a3b:48 1,64,256,1024 --quantization fp8
decode decode_bf16 random:qwen3-30b-a3b:48 1,64,256,1024
python -m megaserve.kernels.fp8_bench --decode-json "$OUT/decode_bf16.json" "$OUT/decode_fp8.json" \
    > "$OUT/decode_summary.txt" 2>&1
if [ "${DS_LAYERS:-0}" -gt 0 ] && [ "$mla_ok" = 1 ]; then
    decode decode_ds_fp8 "random:deepseek-v3:$DS_LAYERS" 64,256 --quantization fp8
fi
