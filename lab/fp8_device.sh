#!/usr/bin/env bash
# Issue 35's GPU run in one device call (results under $OUT). On a 2-GPU machine the two
# halves below run side by side; on one GPU they run one after the other on GPU 0, and
# PARTS picks them (default "decode tests": one call each on one GPU).
#   GPU 0: bf16 vs fp8 decode of random:qwen3-30b-a3b:48 at batch 1, 64, 256, 1024 (fp8
#          once per "moe/linear" pair in $LAUNCHES: decode launches of the expert FFN and
#          the linears as $MEGASERVE_FP8_MOE / $MEGASERVE_FP8_LINEAR take them, "default"
#          the built-in plan; launches never change a bit; PROFILE=N: N profiled steps in
#          the first fp8 run's JSON, its top kernels), then (DS_LAYERS > 0)
#          random:deepseek-v3:$DS_LAYERS fp8 decode at batch 64 and 256.
#   GPU 1: the FP8 GPU tests (MLA_TEST=1: and the MLA / DeepSeek engine ones), then the FP8 GEMM benchmark
#          (SWEEP=1: and the launch sweep).
# Each step has its own time limit; summary.txt has one rc line per step.
#   LAUNCHES="default/default" PROFILE=2 SWEEP=1 MLA_TEST=1 DS_LAYERS=13 bash lab/fp8_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source lab/device/setup.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
}
decode() {  # decode NAME MODEL BATCHES PROFILE_STEPS [extra flags]
    local name=$1 model=$2 batches=$3 prof=$4; shift 4
    step "$name" "${DECODE_S:-110}" python -m megaserve.cli bench decode --model "$model" \
        --dtype bfloat16 --batches "$batches" --steps 8 --warmup-steps 2 --profile-steps "$prof" \
        --prefill-len 0 --matmul-seconds 0 --matmul-n 4096 --json-out "$OUT/$name.json" "$@"
}
gpus=$(nvidia-smi -L | wc -l)
decode_half() {
    export CUDA_VISIBLE_DEVICES=0
    decode decode_bf16 random:qwen3-30b-a3b:48 1,64,256,1024 0
    prof=${PROFILE:-0}
    for launch in ${LAUNCHES:-default/default}; do  # expert-FFN launch/linear launch
        moe=${launch%/*} lin=${launch#*/} tag=${launch//[,\/]/_}
        [ "$moe" = default ] && moe= ; [ "$lin" = default ] && lin=
        MEGASERVE_FP8_MOE=$moe MEGASERVE_FP8_LINEAR=$lin DECODE_S=${FP8_S:-150} decode \
            "decode_fp8_$tag" random:qwen3-30b-a3b:48 1,64,256,1024 "$prof" --quantization fp8
        prof=0
        python -m megaserve.kernels.fp8_bench --decode-json "$OUT/decode_bf16.json" \
            "$OUT/decode_fp8_$tag.json" > "$OUT/decode_summary_$tag.txt" 2>&1
    done
    if [ "${DS_LAYERS:-0}" -gt 0 ]; then
        DECODE_S=${DS_S:-200} decode decode_ds_fp8 "random:deepseek-v3:$DS_LAYERS" 64,256 0 \
            --quantization fp8
        python -m megaserve.kernels.fp8_bench --decode-roofline "$OUT/decode_ds_fp8.json" \
            > "$OUT/decode_ds_summary.txt" 2>&1
    fi
}
tests_half() {
    export CUDA_VISIBLE_DEVICES=$(( gpus > 1 ? 1 : 0 ))
    step fp8_gpu_tests "${TEST_S:-150}" python -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_fp8_gpu.py
    [ -z "${MLA_TEST:-}" ] || step mla_gpu_tests 150 python -m pytest -q -m gpu \
        -p no:cacheprovider tests/kernels/test_mla_gpu.py tests/megaserve/test_deepseek_gpu.py
    step fp8_bench "${BENCH_S:-200}" python -m megaserve.kernels.fp8_bench \
        --gemm-sizes 64 256 4096 --batches 1 64 256 1024 ${SWEEP:+--sweep}
}
if [ "$gpus" -gt 1 ]; then
    decode_half & tests_half & wait
else
    for part in ${PARTS:-decode tests}; do "${part}_half"; done
fi
