#!/usr/bin/env bash
# Issue 13's runs on a machine with several GPUs (nvidia-h200-x2 / -x4 / -x8), one call:
#   bash scripts/multi_gpu_runs.sh            (results under $OUT, default /tmp/multi_gpu)
# Run in part on nvidia-h200-x2 in session 19 (step 1's cuda_ipc tests and a shorter step 2:
# docs/benchmarks.md, "Across two GPUs"); single-GPU dry runs of each step are there too.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 MEGASERVE_CACHE=${MEGASERVE_CACHE:-/tmp/msc}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/multi_gpu}
mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
echo "GPUs: $N"

# 1. Correctness: attention on GPU 0, expert workers on the others over cuda_ipc (device
#    data plane), bitwise equal to the single-GPU engine, greedy and seeded; the host plane
#    over cuda_ipc and nccl (test_disaggregation_gpu.py).
timeout 900 python3 -m pytest -q -p no:cacheprovider tests/megaserve/test_device_plane_gpu.py \
    tests/megaserve/test_disaggregation_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -5

# 2. Decode per GPU: co-located (one GPU, CUDA graphs) against 1 attention GPU + (N-1)
#    expert GPUs on the device data plane (tokens/s of the split row / N = per GPU).
#    24 layers: the 48-layer random checkpoint (61 GB) does not fit the 64 GiB disk of x1/x2.
timeout 1500 python3 -m megaserve.cli bench device-plane --model random:qwen3-30b-a3b:24 \
    --num-prompts 256 --input-len 64 --output-len 256 --expert-workers $((N - 1)) \
    --layouts cuda_ipc:1,cuda_ipc:2,cuda_ipc:4 --flag-rtt 2>&1 | tee "$OUT/bench_device_plane.log" | tail -12

# 3. Transport against NCCL send/recv of the same bytes, same processes.
timeout 900 python3 -m megaserve.cli bench comm --help > /dev/null && \
    timeout 900 python3 -m megaserve.cli bench comm 2>&1 | tee "$OUT/bench_comm.log" | tail -20
