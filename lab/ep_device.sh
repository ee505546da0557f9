#!/bin/bash
# Device-plane roles as processes on nvidia-h200-x2: GPU tests, then the layout
# bench. Usage (repository root, after lab/device/setup.sh): bash lab/ep_device.sh
# check|bench256|bench1024 [seconds]. Writes to $OUT when set.
set -o pipefail
mode=${1:-check}
limit=${2:-200}
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv
export MEGASERVE_BENCH_RUN="ep-device-$$-$(date +%s)"  # inherited by this run's processes only
stacks() {  # this run's worker processes' Python stacks (faulthandler on SIGUSR1), on a hang
    sleep "$1"
    for e in /proc/[0-9]*/environ; do
        grep -qz "^MEGASERVE_BENCH_RUN=$MEGASERVE_BENCH_RUN\$" "$e" 2>/dev/null || continue
        p=${e#/proc/}; p=${p%/environ}
        grep -q multiprocessing.spawn "/proc/$p/cmdline" 2>/dev/null && kill -USR1 "$p" 2>/dev/null
    done
}
if [ "$mode" = check ]; then
    stacks "${STACKS_AT:-$((limit - 20))}" & watcher=$!
    timeout "$limit" python3 -m pytest -x -q -p no:cacheprovider -o faulthandler_timeout=$((limit - 15)) \
        ${TESTS:-"tests/megaserve/test_colocated_ep_gpu.py::test_colocated_ep_on_the_device_plane_equals_one_gpu" \
        "tests/megaserve/test_device_plane_gpu.py::test_two_attention_processes_on_gpu0_experts_on_gpu1_are_bitwise" \
        "tests/megaserve/test_colocated_ep_gpu.py::test_colocated_ep_steady_decode_never_synchronises"} \
        2>&1 | tee "$out/check.log"
    kill $watcher 2>/dev/null
fi
if [ "$mode" = bench256 ] || [ "$mode" = bench1024 ]; then
    n=${mode#bench}
    stacks $((limit - 20)) & watcher=$!
    timeout "$limit" python3 -m megaserve.bench.device_layouts --model random:qwen3-30b-a3b:48 \
        --cases "64x$n" --whole "64x$n" --output-len 256 --stacks-after $((limit - 10)) \
        --layouts "${LAYOUTS:-ep:2,attn2:1}" --json "$out/bench$n.json" 2>&1 | tee "$out/bench$n.log"
    kill $watcher 2>/dev/null
fi
