#!/usr/bin/env bash
# Disaggregation on one 4-GPU host (nvidia-h200-x4): correctness and benchmarks of the
# cuda_ipc and nccl transports (issue 4). From the repository root:
#   bash scripts/device_disagg.sh        (logs under $OUT, default ./out-disagg)
# Four files come back: summary.txt (environment, one line per step), tests.log,
# bench_comm.log, throughput.log. Every step has its own timeout, capped so the whole
# script ends within BUDGET_S; a failed or timed-out step is recorded and the next runs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-./out-disagg}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-530}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"

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
  echo; } > "$SUMMARY" 2>&1

# 1. comm between two GPU processes (cuda_ipc, nccl), then the runtime over nccl: bitwise
#    equal to one GPU, including attention on GPU 0 and experts on GPUs 1-3 (1-3-2, 1-3-4).
step comm_gpu_tests tests.log 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/comm/test_gpu.py
step disagg_nccl tests.log 170 python3 -m pytest -q -m gpu --timeout 120 -p no:cacheprovider \
  tests/megaserve/test_disaggregation_gpu.py -k nccl
# 2. M->N exchange on 4 GPUs (1x1, 1x3, 2x2, 3x1): cuda_ipc and nccl (ours) vs raw NCCL
#    isend/irecv, in the same processes.
step bench_comm bench_comm.log 120 python3 -m megaserve.cli bench comm --sizes 2K,64K,1M,8M \
  --iters 30 --warmup 5
# 3. decode throughput: attention on GPU 0, experts on GPUs 1-3, vs co-located (one GPU runs
#    attention and all experts, i.e. the per-GPU rate of co-located replicas), same model.
TP="python3 -m megaserve.cli bench throughput --model random:qwen3-30b-a3b:2 --dtype bfloat16
    --device cuda --attention-replicas 1 --expert-workers 3 --num-prompts 128 --input-len 128
    --output-len 64"
step tput_cuda_ipc_m2 throughput.log 110 $TP --microbatches 2 --transport cuda_ipc --baseline-layout 1,1,1
step tput_nccl_m2 throughput.log 80 $TP --microbatches 2 --transport nccl
step tput_cuda_ipc_m4 throughput.log 70 $TP --microbatches 4 --transport cuda_ipc
step tput_nccl_m4 throughput.log 70 $TP --microbatches 4 --transport nccl
# 4. the other transports' GPU layouts (validated before on 2 GPUs), as time allows.
step disagg_cuda_ipc_tcp tests.log 150 python3 -m pytest -q -m gpu --timeout 100 -p no:cacheprovider \
  tests/megaserve/test_disaggregation_gpu.py -k "cuda_ipc or (tcp and 1-3-2)"
echo "total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
