#!/usr/bin/env bash
# A server streaming to many clients against the offline engine, on one GPU, one call:
#   bash lab/device/serving_load.sh [CLIENTS] [LAYERS] [server flags...]   (results under $OUT)
# The server (`megaserve serve`, default settings) gets CLIENTS concurrent greedy gRPC
# streams of 64-token random prompts, 128 tokens each (megaserve.server.loadtest
# --no-baseline: a GPU holding the server's engine has no room for a second one); then,
# with the server gone, the same shape through LLM.generate (megaserve bench throughput).
# OFFLINE=0 skips the offline run. A GPU image without the server's packages needs them
# installed first (from wheels carried with the run).
set -uo pipefail
cd "$(dirname "$0")/../.."
source lab/device/setup.sh
CLIENTS=${1:-1024}
LAYERS=${2:-48}
shift $(( $# < 2 ? $# : 2 ))
OUT=${OUT:-/tmp/serving_load}
mkdir -p "$OUT"
MODEL=$(python3 -c "from megaserve.bench.random_model import resolve_random_model as r; print(r('random:qwen3-30b-a3b:$LAYERS'))")
python3 -m megaserve.cli serve --model "$MODEL" --dtype bfloat16 --device cuda \
    --grpc-port 50551 --http-port 18551 "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 120); do
    curl -sf http://127.0.0.1:18551/health > /dev/null && break
    kill -0 $SERVER 2> /dev/null || { echo "the server exited:"; tail -20 "$OUT/server.log"; exit 1; }
    sleep 2
done
timeout 400 python3 -m megaserve.server.loadtest --server 127.0.0.1:50551 --clients "$CLIENTS" \
    --prompt-len 64 --max-tokens 128 --repeat 3 --no-baseline 2>&1 | tee "$OUT/loadtest.log"
kill -INT $SERVER; wait $SERVER
[ "${OFFLINE:-1}" = 0 ] && exit 0
timeout 300 python3 -m megaserve.cli bench throughput --dtype bfloat16 --device cuda \
    --model "random:qwen3-30b-a3b:$LAYERS" --num-prompts "$CLIENTS" --input-len 64 \
    --output-len 128 2>&1 | tee "$OUT/offline.log" | tail -5
