#!/usr/bin/env bash
# Disaggregation across the GPUs of one host (nvidia-h200-x2): the device data plane.
# From the repository root:  bash lab/device/disagg.sh PHASE   (results under $OUT)
#   profile: nccl diagnosis, bench device-plane at batch 256 (traces) and 1024
#   tests:   the device plane's GPU tests (bitwise across GPUs, cuda_ipc and nccl)
#   bench:   the benchmark table of docs/results/disaggregation.md
#   trace:   kernel timelines of one GPU, EP over 2 and 1 + 1 (lab/stream_busy.py's summary)
#   speed:   the split's cost (plane kernels, bitwise across GPUs, tick vs NCCL, batch 256 A/B)
#   speed2:  batch 1024, m = 3 and Qwen3-235B-A22B (LAYERS_235B layers, default 20)
#   layouts: megaserve bench device-layouts (PARTS="30b 235b": one call each): Qwen3-30B-A3B:48 at 256 and 1024
#            sequences per replica (one GPU, EP over 2, DP over 2, 1+1 at m = 1, 2, 3), then
#            Qwen3-235B-A22B:LAYERS_235B (default 26: experts <= 90% of 141 GB), EP over 2
#            vs 1+1 at equal sequences, 64 and 2048 prompt tokens; JSON under $OUT
# Every step has its own timeout, capped so the whole script ends within BUDGET_S; a failed
# or timed-out step is recorded in summary.txt and the next one runs.
set -u
cd "$(dirname "$0")/../.."
source lab/device/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-./out-disagg}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-560}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
PHASE=${1:-profile}
MODEL=${MODEL:-random:qwen3-30b-a3b:48}

step() {  # step NAME LOG TIMEOUT_S CMD...: run CMD, appending to $OUT/LOG, within min(TIMEOUT_S, time left)
  local name=$1 log="$OUT/$2" limit=$3; shift 3
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "$name: SKIPPED (budget spent)" | tee -a "$SUMMARY"; return; fi
  (( limit > left )) && limit=$left
  echo "===== $name: $* (limit ${limit}s)" >> "$log"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$SUMMARY"
}

{ nvidia-smi --query-gpu=index,name,memory.used --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo; } >> "$SUMMARY" 2>&1

BENCH="python3 -m megaserve.cli bench device-plane --model $MODEL --input-len 64 --output-len 256"
case $PHASE in
profile)
  step nccl_diag nccl.log 100 python3 lab/device/nccl_plane_diag.py 1
  TR=/tmp/traces; mkdir -p $TR/b256
  MEGASERVE_EXPERT_TRACE=$TR/b256 step bench_b256 bench.log 260 $BENCH --num-prompts 256 \
    --max-num-seqs 256 --layouts cuda_ipc:1,cuda_ipc:2 --trace-dir $TR/b256
  step bench_b1024 bench.log 220 $BENCH --num-prompts 1024 --max-num-seqs 1024 \
    --layouts cuda_ipc:1
  tar czf "$OUT/traces.tgz" -C $TR . ;;
check)  # tests and benchmarks of a change, one call
  step nccl_diag nccl.log 60 python3 lab/device/nccl_plane_diag.py 1
  step tests_gpu tests.log 220 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 \
    tests/megaserve/test_device_plane_gpu.py -k "across or never_synchronises or no_host_sync or lost or inproc-1-1-1"
  TR=/tmp/traces; mkdir -p $TR/b256
  MEGASERVE_EXPERT_TRACE=$TR/b256 step bench_b256 bench.log 150 $BENCH --num-prompts 256 \
    --max-num-seqs 256 --layouts cuda_ipc:1,cuda_ipc:2 --trace-dir $TR/b256
  step bench_b1024 bench.log 150 $BENCH --num-prompts 1024 --max-num-seqs 1024 --layouts cuda_ipc:1
  tar czf "$OUT/traces.tgz" -C $TR . ;;
tests)
  step tests_gpu tests.log 500 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 \
    tests/megaserve/test_device_plane_gpu.py tests/comm/test_gpu.py ;;
speed)  # the split's cost, one call: plane kernels, bitwise across GPUs, batch 256, Qwen3-235B
  KW=MEGASERVE_PLANE_KERNEL_WAIT=1 SW=MEGASERVE_PLANE_KERNEL_WAIT=0  # kernel / stream wait
  step kernels tests.log 35 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 30 \
    tests/kernels/test_plane_gpu.py
  MEGASERVE_PLANE_KERNEL_WAIT=1 step tests_kw tests.log 75 python3 -m pytest -q -m gpu \
    -p no:cacheprovider --timeout 70 tests/megaserve/test_device_plane_gpu.py \
    -k "across_gpus_is_bitwise and cuda_ipc and (1-1 or 3-2)"
  step bench_b256 bench.log 190 $BENCH --num-prompts 256 --max-num-seqs 256 --layouts \
    cuda_ipc:1@$KW,colocated:1+async,cuda_ipc:1+async@$KW,cuda_ipc:1@$SW,cuda_ipc:3@$KW
  step bench_235b bench.log 110 python3 -m megaserve.cli bench device-plane \
    --model random:qwen3-235b-a22b:${LAYERS_235B:-22} --input-len 64 --output-len 256 \
    --num-prompts 256 --max-num-seqs 256 --kv-cache-memory-bytes $((8 << 30)) \
    --layouts cuda_ipc:1@$KW
  step tick plane_tick.log 30 python3 -m megaserve.cli bench plane-tick --tokens 1024 --reduce --nccl ;;
speed3)  # the in-process layouts with the kernel wait (the default), batch 1024
  step tests_inproc tests.log 90 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 60 \
    tests/megaserve/test_device_plane_gpu.py -k "is_bitwise_colocated and (inproc-1-1-1 or inproc-1-2-2 or cuda_ipc-2-1-2)"
  step bench_b1024 bench.log 130 $BENCH --num-prompts 1024 --max-num-seqs 1024 \
    --layouts cuda_ipc:1 ;;
speed2)  # batch 1024 and Qwen3-235B-A22B (LAYERS_235B layers, default 20)
  KW=MEGASERVE_PLANE_KERNEL_WAIT=${KERNEL_WAIT:-1}
  step bench_b1024 bench.log 170 $BENCH --num-prompts 1024 --max-num-seqs 1024 \
    --layouts cuda_ipc:1@$KW,colocated:1+async,cuda_ipc:1+async@$KW
  step bench_m3 bench.log 100 $BENCH --num-prompts 256 --max-num-seqs 256 \
    --layouts cuda_ipc:3@$KW,cuda_ipc:2@$KW
  step bench_235b bench.log 200 python3 -m megaserve.cli bench device-plane \
    --model random:qwen3-235b-a22b:${LAYERS_235B:-20} --input-len 64 --output-len 256 \
    --num-prompts 256 --max-num-seqs 256 --kv-cache-memory-bytes $((8 << 30)) \
    --layouts cuda_ipc:1@$KW,colocated:1+async,cuda_ipc:1+async@$KW ;;
layouts)  # the per-GPU comparison of docs/results/disaggregation.md "Layouts", one call
  # Each layout in a process of its own with its own limit (a layout that hangs costs only
  # that), the baseline first; then one table and JSON per model (--merge).
  DL="python3 -m megaserve.bench.device_layouts"
  # This run's Python processes (the bench and the workers it spawns inherit the marker):
  # only they are signalled, whatever else runs on the machine.
  export MEGASERVE_BENCH_RUN="disagg-$$-$START"
  ours() { for e in /proc/[0-9]*/environ; do
      grep -qz "^MEGASERVE_BENCH_RUN=$MEGASERVE_BENCH_RUN\$" "$e" 2>/dev/null || continue
      p=${e#/proc/}; p=${p%/environ}  # python by argv[0] (not `timeout ... python3 ...`)
      tr '\0' '\n' < "/proc/$p/cmdline" 2>/dev/null | head -1 | grep -q python && echo "$p"
    done; }
  cleanup() { for p in $(ours); do kill -9 "$p" 2>/dev/null; done; }  # what a killed step left
  stacks() {  # 12 s before a layout's limit: this run's Python stacks (py-spy where installed,
    # into stacks.txt; else SIGUSR1, which the device workers' faulthandler writes to layouts.log)
    (( $1 > 0 )) || return 0; sleep "$1"
    for p in $(ours); do
      if command -v py-spy > /dev/null; then
        { echo "== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-120)"
          timeout 20 py-spy dump --pid "$p"; } >> "$OUT/stacks.txt" 2>&1
      else kill -USR1 "$p" 2>/dev/null; fi
    done; }
  layout() {  # layout TAG NAME LIMIT ARGS...: one layout in a process of its own, stacks at a hang
    local tag=$1 name=$2 limit=$3; shift 3
    stacks $((limit - 12)) & local watcher=$!
    step "$tag-$name" layouts.log "$limit" $DL "$@" --baseline "$name" --layouts "" \
      --stacks-after $((limit - 10)) --json "$OUT/l$tag-${name/:/}.json"
    kill $watcher 2>/dev/null; wait $watcher 2>/dev/null; cleanup; }
  # PARTS picks the models (default both; give each its own call: EP's start-up captures
  # every decode graph and expert graph (c, P) up to 1,024 sequences, and at 30B:48 it had
  # not served a row within 235 s in the call of docs/results/disaggregation.md "Per GPU").
  A30="--model $MODEL --cases 64x256,64x1024 --whole 64x256"
  files=()
  [[ " ${PARTS:-30b 235b} " == *" 30b "* ]] && {
  for spec in ${LAYOUTS_30B:-colocated=60 ep:2=230 split:1=70 split:3=60 split:2=60 dp:2=90}; do
    name=${spec%=*}; files+=("$OUT/l30b-${name/:/}.json")
    layout 30b "$name" "${spec#*=}" $A30
  done
  step 30b-table layouts.log 30 $DL --merge "${files[@]}" --json "$OUT/l30b.json" --measurements "$OUT/m30b.json"; }
  A235="--model random:qwen3-235b-a22b:${LAYERS_235B:-26} --cases ${CASES_235B:-64x1024,2048x256} --batch-is total
    --whole none --kv-cache-memory-bytes $((36 << 30))"
  files=()
  [[ " ${PARTS:-30b 235b} " == *" 235b "* ]] && {
  for spec in ${LAYOUTS_235B:-ep:2=150 split:1=120 split:2=100}; do
    name=${spec%=*}; files+=("$OUT/l235b-${name/:/}.json")
    layout 235b "$name" "${spec#*=}" $A235
  done
  step 235b-table layouts.log 30 $DL --merge "${files[@]}" --json "$OUT/l235b.json" --measurements "$OUT/m235b.json"; }
  ;;
trace)  # kernel timelines (megaserve/runtime/step_trace.py) of 3 steady steps per case and
  # process: one GPU, EP over 2, 1 + 1 at m = 1; lab/stream_busy.py's summary, traces.tgz
  TR=/tmp/traces; rm -rf $TR
  for spec in ${LAYOUTS_TRACE:-colocated=70 ep:2=200 split:1=80}; do
    name=${spec%=*}; mkdir -p "$TR/${name/:/}"
    MEGASERVE_EXPERT_TRACE="$TR/${name/:/}" step "trace-$name" layouts.log "${spec#*=}" \
      python3 -m megaserve.bench.device_layouts --model $MODEL --cases ${CASES:-64x256,64x1024} \
      --whole none --baseline "$name" --layouts "" --json "$TR/rows-${name/:/}.json"
  done
  python3 lab/stream_busy.py $TR/*/*.json > "$OUT/stream_busy.txt" 2>&1
  tar czf "$OUT/traces.tgz" -C $TR . ;;
bench)
  step bench_b256 bench.log 250 $BENCH --num-prompts 256 --max-num-seqs 256 --layouts cuda_ipc:1,cuda_ipc:2,cuda_ipc:3
  step bench_b1024 bench.log 250 $BENCH --num-prompts 1024 --max-num-seqs 1024 --layouts cuda_ipc:1 ;;
esac
echo "total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
