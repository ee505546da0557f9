"""Concurrent streaming clients against a running server, with an offline baseline.

    python -m megaserve.server.loadtest --server 127.0.0.1:50051 --clients 64

Sends ``--clients`` greedy streaming Generate calls at once (random token-id prompts from
a fixed seed, ``ignore_eos``), measures time to first token, inter-token latency, end-to-end
latency and throughput, then runs the same requests through ``LLM.generate`` in this
process (the baseline: the engine without the server) and checks the outputs are equal.
``--no-baseline`` skips that (a GPU that holds the server's engine has no room for a
second one: measure the offline engine with ``megaserve bench throughput`` before or after).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import statistics
import sys
import time

import grpc

from megaserve.server import generation_pb2 as pb
from megaserve.server.client import build_request


async def _one(channel: grpc.aio.Channel, request: pb.GenerateRequest) -> dict:
    call = channel.unary_stream("/megaserve.v1.Generation/Generate",
                                request_serializer=pb.GenerateRequest.SerializeToString,
                                response_deserializer=pb.GenerateResponse.FromString)
    start = time.perf_counter()
    stamps, ids = [], []
    async for r in call(request, timeout=600):
        if r.WhichOneof("response") == "chunk":
            stamps.append(time.perf_counter())
        elif r.WhichOneof("response") == "complete":
            ids = list(r.complete.output_ids)
    return {"ttft": stamps[0] - start, "e2e": stamps[-1] - start, "ids": ids,
            "itl": [(b - a) for a, b in zip(stamps, stamps[1:])]}


async def _run_clients(server: str, requests: list[pb.GenerateRequest]) -> tuple[list[dict], float]:
    async with grpc.aio.insecure_channel(server) as channel:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(channel, r) for r in requests))
        return results, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    """The q-th percentile; nan for no values (a stream whose tokens all came in one chunk,
    as on a busy machine, has no inter-token latency)."""
    if not values:
        return math.nan
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m megaserve.server.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True, help="gRPC host:port")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="runs of each; the median is shown")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="only the server's runs (no LLM.generate in this process)")
    args = p.parse_args(argv)
    if min(args.clients, args.prompt_len, args.max_tokens, args.repeat) < 1:
        print("loadtest: --clients, --prompt-len, --max-tokens and --repeat must be >= 1",
              file=sys.stderr)
        return 2
    import torch  # after argument checks: the baseline needs it

    from megaserve.server.client import generation_stub

    with grpc.insecure_channel(args.server) as channel:
        info = generation_stub(channel)["GetModelInfo"](pb.GetModelInfoRequest(), timeout=30)
    rng = random.Random(0)
    prompts = [[rng.randrange(info.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.clients)]
    kw = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    requests = [build_request(ids, stream=True, **kw) for ids in prompts]
    runs = sorted((asyncio.run(_run_clients(args.server, requests)) for _ in range(args.repeat)),
                  key=lambda run: run[1])
    results, wall = runs[len(runs) // 2]  # the median run by wall time

    base_wall, equal = None, None
    if args.baseline:
        base_wall, equal = _baseline(info, prompts, kw, args.repeat, results)
    tokens = args.clients * args.max_tokens
    itl = [x for r in results for x in r["itl"]]
    device = f"{info.device} ({platform.processor() or platform.machine()}, " \
             f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()})"
    print(f"device: {device}; model {info.model_name}; {args.clients} clients, prompt "
          f"{args.prompt_len} tokens, {args.max_tokens} generated each (greedy); "
          f"median of {args.repeat} runs")
    print(f"{'run':<28}{'tok/s':>10}{'wall s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}{'e2e p50':>9}")
    ttft = [r["ttft"] for r in results]
    e2e = [r["e2e"] for r in results]
    print(f"{'server, gRPC streams':<28}{tokens / wall:>10.1f}{wall:>9.2f}"
          f"{_pct(ttft, 50) * 1e3:>8.0f}ms{_pct(ttft, 99) * 1e3:>8.0f}ms"
          f"{_pct(itl, 50) * 1e3:>7.0f}ms{_pct(itl, 99) * 1e3:>7.0f}ms{_pct(e2e, 50):>8.2f}s")
    if base_wall is None:
        return 0
    print(f"{'baseline, LLM.generate':<28}{tokens / base_wall:>10.1f}{base_wall:>9.2f}")
    print(f"outputs bitwise equal to the baseline: {equal}")
    return 0 if equal else 1


def _baseline(info, prompts: list[list[int]], kw: dict, repeat: int,
              results: list[dict]) -> tuple[float, bool]:
    """The same requests through ``LLM.generate`` with the server's settings (as
    GetModelInfo reports them): (median wall seconds, outputs equal to the server's)."""
    from megaserve import LLM, SamplingParams

    with LLM(model=info.model_name, dtype=info.dtype, device=info.device,
             max_num_seqs=len(prompts), max_model_len=info.max_model_len) as llm:
        walls = []
        for _ in range(repeat):
            start = time.perf_counter()
            offline = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                                   SamplingParams(**kw))
            walls.append(time.perf_counter() - start)
    equal = all(r["ids"] == o.outputs[0].token_ids for r, o in zip(results, offline))
    return statistics.median(walls), equal


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
