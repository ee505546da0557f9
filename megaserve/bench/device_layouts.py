"""``megaserve bench device-layouts``: multi-GPU layouts of one host against one GPU.

Every layout serves the same workload (greedy, ``--input-len`` in, ``--output-len`` out);
the co-located single-process engine on one GPU (CUDA graphs) is measured first in the
same run as the baseline, and each layout's tok/s is reported whole and per GPU::

    megaserve bench device-layouts --model random:qwen3-30b-a3b:48 --num-prompts 256 \\
        --max-num-seqs 256 --layouts ep:2,attn2:1,dp:2

Layouts (``--layouts``, comma-separated):

* ``ep:N``: co-located expert parallelism over N GPUs on the device plane
  (``data_parallel_size=N, enable_expert_parallel=True, transport="cuda_ipc"``: process i
  on GPU i is attention replica i and expert worker i);
* ``dp:N``: N whole engines, one per GPU (data parallelism, no exchange);
* ``attnR:E``: R attention replica processes on GPU 0, E expert processes on GPUs 1..E
  (device plane, cuda_ipc, lockstep);
* ``split:m``: one attention replica on GPU 0 + one expert process on GPU 1, m
  micro-batches (the device plane's one-process front-end).

Per layout: tok/s of the whole workload (prefill included) over its wall time, per GPU,
the ratio per GPU to one GPU, and the steady decode step (10 steps after 6, every
sequence decoding).
"""

from __future__ import annotations

import argparse
import gc
import time


def _workload(vocab: int, num_prompts: int, input_len: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]}
            for _ in range(num_prompts)]


def _run_all(engine, prompts, params, tag: str) -> tuple[float, int, int]:
    """(wall s, generated tokens, steps) of serving ``prompts`` to the end."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p["prompt_token_ids"], params)
    start = time.perf_counter()
    generated = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        steps += 1
    return time.perf_counter() - start, generated, steps


def _steady_ms(engine, prompts, params) -> float:
    """Wall ms per decode step with every sequence of ``prompts`` decoding."""
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p["prompt_token_ids"], params)
    for _ in range(6):
        engine.step()
    start, steps = time.perf_counter(), 10
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - start) / steps * 1e3
    for i in range(len(prompts)):
        engine.abort_request(f"s{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def layout_config(name: str, base: dict):
    """(EngineConfig, GPUs used) of a ``--layouts`` entry; ValueError for an unknown one."""
    from megaserve.engine.config import EngineConfig

    kind, _, arg = name.partition(":")
    if kind == "colocated":
        return EngineConfig(**base, device="cuda:0"), 1
    if kind == "ep":
        n = int(arg)
        return EngineConfig(**base, device="cuda", data_parallel_size=n,
                            enable_expert_parallel=True, transport="cuda_ipc"), n
    if kind == "dp":
        n = int(arg)
        return EngineConfig(**base, device="cuda", data_parallel_size=n, transport="tcp"), n
    if kind.startswith("attn") and kind[4:].isdigit():
        r, e = int(kind[4:]), int(arg)
        return EngineConfig(**base, device="cuda", attention_replicas=r, expert_workers=e,
                            transport="cuda_ipc", attention_gpus=(0,) * r,
                            expert_gpus=tuple(range(1, 1 + e))), 1 + e
    if kind == "split":
        return EngineConfig(**base, device="cuda", disaggregate=True, transport="cuda_ipc",
                            microbatches=int(arg or 1)), 2
    raise ValueError(f"unknown layout {name!r}: use colocated, ep:N, dp:N, attnR:E or split:m")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaserve bench device-layouts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3-30b-a3b:48")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=16 << 30)
    parser.add_argument("--layouts", default="ep:2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    from megaserve import SamplingParams
    from megaserve.runtime.factory import make_engine

    if not torch.cuda.is_available():
        print("megaserve bench device-layouts: needs a CUDA GPU")
        return 2
    from megaserve.bench.random_model import model_path

    model = model_path(args.model)
    base = dict(model=model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rows = []
    for name in ["colocated", *args.layouts.split(",")]:
        config, gpus = layout_config(name, base)
        started = time.perf_counter()
        engine = make_engine(config)
        start_s = time.perf_counter() - started
        try:
            warm = _workload(engine.vocab_size, args.num_prompts, args.input_len, args.seed + 1)
            _run_all(engine, warm, warm_params, "w")  # prefill shapes, decode graphs
            prompts = _workload(engine.vocab_size, args.num_prompts, args.input_len, args.seed)
            wall, generated, steps = _run_all(engine, prompts, params, "t")
            steady = _steady_ms(engine, prompts, params)
        finally:
            engine.shutdown()
        row = {"layout": name, "engine": type(engine).__name__, "gpus": gpus,
               "tok_s": generated / wall, "tok_s_gpu": generated / wall / gpus,
               "steps": steps, "steady_ms": steady, "start_s": start_s}
        rows.append(row)
        print("measured", row, flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    base_gpu = rows[0]["tok_s_gpu"]
    print(f"device: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}  model: "
          f"{args.model} {args.dtype}  {args.num_prompts} x ({args.input_len} in + "
          f"{args.output_len} out), greedy, max_num_seqs {args.max_num_seqs}")
    print(f"{'layout':<10} {'GPUs':>4} {'tok/s':>9} {'tok/s/GPU':>9} {'per GPU vs 1':>12} "
          f"{'steady ms/step':>14} {'start s':>7}")
    for r in rows:
        print(f"{r['layout']:<10} {r['gpus']:>4} {r['tok_s']:>9.0f} {r['tok_s_gpu']:>9.0f} "
              f"{r['tok_s_gpu'] / base_gpu:>11.2f}x {r['steady_ms']:>14.2f} {r['start_s']:>7.0f}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
