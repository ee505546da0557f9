#!/usr/bin/env bash
# Decode A/B in one device call: `bash lab/device/ab_decode.sh NAME[:VAR=VALUE] ...`
# runs `megaserve bench decode` of $MODEL (default random:qwen3-30b-a3b:48) at $BATCHES
# (default 64,256) once per argument, with that argument's variable set (NAME alone: none;
# "bf16" in NAME: no --quantization), each JSON under $OUT (its log too where the run
# failed: the device tool brings back few files); PROFILE=N profiled steps (kernel tables
# in the JSONs). After each fp8 run fp8_bench's decode summary of it (against the first
# bf16 run before it, else against its roofline), all in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
source lab/device/setup.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
base=
for spec in "$@"; do
    name=${spec%%:*}; envs=(); [ "$spec" != "$name" ] && envs=("${spec#*:}")
    quant=(--quantization fp8); [[ $name == *bf16* ]] && quant=()
    t0=$SECONDS
    env "${envs[@]}" timeout "${DECODE_S:-150}" python -m megaserve.cli bench decode \
        --model "${MODEL:-random:qwen3-30b-a3b:48}" --dtype bfloat16 --batches "${BATCHES:-64,256}" \
        --steps "${STEPS:-8}" --warmup-steps 2 --profile-steps "${PROFILE:-0}" --prefill-len 0 \
        --matmul-seconds 0 --matmul-n 4096 --json-out "$OUT/$name.json" "${quant[@]}" \
        > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    [ "$rc" = 0 ] && rm -f "$OUT/$name.log"
    if [[ $name == *bf16* ]]; then [ -z "$base" ] && base=$name; continue; fi
    if [ -n "$base" ]; then args=(--decode-json "$OUT/$base.json"); else args=(--decode-roofline); fi
    python -m megaserve.kernels.fp8_bench "${args[@]}" "$OUT/$name.json" >> "$OUT/summary.txt" 2>&1
done
