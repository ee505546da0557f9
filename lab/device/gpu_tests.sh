#!/usr/bin/env bash
# GPU tests in one device call, one log per group (results under $OUT, default /tmp/out):
#   bash lab/device/gpu_tests.sh [pytest files...]
#   bash lab/device/gpu_tests.sh runtime [group...]
# With no arguments: the single-GPU engine tests (device plane, prefix cache, speculative
# decoding, KV sizing, the CUDA engine), one file at a time. `runtime`: every GPU test of the
# disaggregated runtime (device plane, co-located EP, disaggregation, the exchange kernels) in
# priority groups (RUNTIME_GROUPS below; name groups to run only those). Each group is one
# pytest run, not -x, with a per-test limit (TEST_LIMIT, default 170 s; faulthandler dumps
# the stacks of a test still running 15 s before it) and the whole call's budget
# (BUDGET, default 480 s from the script's start): a group starts only with >= 60 s left,
# gets what is left. When a test's faulthandler dump appears, and 20 s before the group's
# end, every process of the group that catches SIGUSR1 (device_workers, device_engine:
# faulthandler) dumps its Python stacks into the same log. Every process a
# group started is killed when it ends. Three files (the device tool returns at most 8):
# runtime.log (every group's output, appended as it runs), gpu.txt (the GPUs, then one line
# per group: rc, seconds since the start, pytest's last line), verdicts.txt (one line per
# test).
set -uo pipefail
cd "$(dirname "$0")/../.."
source lab/device/setup.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"

P=tests/megaserve/test_device_plane_gpu.py
E=tests/megaserve/test_colocated_ep_gpu.py
D=tests/megaserve/test_disaggregation_gpu.py
declare -A RUNTIME_GROUPS=(
    [kernels]="tests/kernels/test_plane_gpu.py"
    [attn2]="$P::test_two_attention_processes_on_gpu0_experts_on_gpu1_are_bitwise \
$P::test_two_attention_processes_steady_decode_never_synchronises \
$P::test_a_killed_expert_process_mid_stream_on_gpus_streams_complete_bitwise"
    [ep]="$E::test_colocated_ep_steady_decode_never_synchronises \
$E::test_colocated_ep_on_the_device_plane_equals_one_gpu"
    [across]="$P::test_device_plane_across_gpus_is_bitwise_colocated \
$P::test_steady_decode_across_gpus_never_synchronises"
    [disagg]="$D -k not(tcp)"
    [disaggtcp]="$D -k tcp"
    [plane1]="$P::test_device_plane_is_bitwise_colocated \
$P::test_decode_steps_have_no_host_sync_and_constant_host_messages \
$P::test_a_lost_expert_worker_is_a_typed_error_not_a_hang"
    [eptcp]="$E::test_colocated_ep_over_two_gpus_equals_one_gpu"
    # steady decode of every role under sync-debug "error", and the 2 + 2 cuda_ipc layout
    [steady]="$E::test_colocated_ep_steady_decode_never_synchronises \
$P::test_steady_decode_across_gpus_never_synchronises \
$P::test_two_attention_processes_steady_decode_never_synchronises \
$D::test_disaggregated_gpus_equal_single_gpu[2-2-4-cuda_ipc]"
)
RUNTIME_ORDER=(kernels attn2 ep across disagg plane1 eptcp disaggtcp)

start=$SECONDS
budget=${BUDGET:-480}
test_limit=${TEST_LIMIT:-170}

dump_workers() {  # pgid: SIGUSR1 to the group's processes that catch it (faulthandler)
    local d mask
    for d in /proc/[0-9]*; do
        [ "${d#/proc/}" != "$1" ] || continue
        [ "$(awk '{print $5}' "$d/stat" 2>/dev/null)" = "$1" ] || continue
        mask=$(awk '/^SigCgt/{print $2}' "$d/status" 2>/dev/null)
        [ -n "$mask" ] && (( 0x$mask & 0x200 )) && kill -USR1 "${d#/proc/}" 2>/dev/null
    done
}

run_group() {  # name, pytest arguments...
    local name=$1; shift
    local left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 60 ]; then
        echo "$name skipped: ${left}s left" | tee -a "$OUT/gpu.txt"; return
    fi
    local log="$OUT/runtime.log"
    echo "===== group $name: $* (${left}s left)" >> "$log"
    local from; from=$(wc -l < "$log")
    setsid python -m pytest -q -rfEsxp -m gpu -p no:cacheprovider --timeout "$test_limit" \
        -o faulthandler_timeout=$((test_limit - 15)) "$@" >> "$log" 2>&1 &
    local pid=$!
    (   # a test's faulthandler dump (15 s before its limit): its worker processes' stacks
        # too; 20 s before the group's end: stacks, then the whole group killed
        seen=0; until_s=$((SECONDS + left - 20))
        while [ $SECONDS -lt $until_s ]; do
            sleep 2
            n=$(tail -n +"$from" "$log" | grep -c "^Timeout (")
            if [ "$n" -gt "$seen" ]; then seen=$n; dump_workers "$pid"; fi
        done
        dump_workers "$pid"
        sleep 10; kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    ) & local watcher=$!
    wait "$pid"; local rc=$?
    kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null
    kill -KILL -- "-$pid" 2>/dev/null  # processes the group left behind
    echo "$name rc=$rc $((SECONDS - start))s $(tail -n +"$from" "$log" | tail -1)" \
        | tee -a "$OUT/gpu.txt"
}

if [ "${1:-}" = runtime ]; then
    shift
    groups=("$@"); [ ${#groups[@]} -gt 0 ] || groups=("${RUNTIME_ORDER[@]}")
    for g in "${groups[@]}"; do
        # shellcheck disable=SC2086  # node ids split on whitespace
        run_group "$g" ${RUNTIME_GROUPS[$g]}
    done
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/runtime.log" > "$OUT/verdicts.txt"
    exit 0
fi

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
