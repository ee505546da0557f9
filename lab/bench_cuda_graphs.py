"""Decode throughput of the engine with CUDA graphs on vs off, same engine, same run.

Usage: ``PYTHONPATH=. python3 lab/bench_cuda_graphs.py [--models M ...]``.
For each model and batch size n: n requests of ``--input-len`` random tokens generate
``--output-len`` tokens each (greedy, ignore_eos), run to completion through
``LLMEngine.step``; tok/s = generated tokens / seconds. Graphs are toggled on one engine
(``runner.cuda_graphs``), after a warm-up of each mode; timed runs alternate off/on
``--repeats`` times and the outputs of the two modes are checked bitwise equal.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    _sync()
    start = time.perf_counter()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    _sync()
    elapsed = time.perf_counter() - start
    outs = [(done[k].outputs[0].token_ids, done[k].outputs[0].logprobs) for k in sorted(done)]
    return elapsed, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["random:qwen3-30b-a3b:2", "builtin:tiny-moe"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 30, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for model in args.models:
        path = model
        if model.startswith("random:"):
            from megaserve.bench.random_model import resolve_random_model

            path = str(resolve_random_model(model))
        engine = LLMEngine(EngineConfig(model=path, device=args.device,
                                        dtype="bfloat16" if args.device == "cuda" else "float32",
                                        max_num_seqs=max(args.batches)))
        rng = random.Random(0)
        for n in args.batches:
            prompts = [[rng.randrange(engine.vocab_size) for _ in range(args.input_len)]
                       for _ in range(n)]
            results: dict[bool, list[float]] = {False: [], True: []}
            outputs = {}
            for rep in range(args.repeats + 1):  # rep 0: warm-up of both modes
                for graphs in (False, True):
                    engine.runner.cuda_graphs = graphs
                    seconds, outs = _generate(engine, prompts, args.output_len)
                    outputs[graphs] = outs
                    if rep:
                        results[graphs].append(n * args.output_len / seconds)
            equal = outputs[False] == outputs[True]
            off, on = max(results[False]), max(results[True])
            print(f"{model:<24} n={n:<3} in={args.input_len} out={args.output_len}  "
                  f"eager {off:9.1f} tok/s  graphs {on:9.1f} tok/s  ratio {on / off:5.2f}  "
                  f"runs off {[round(x) for x in results[False]]} on {[round(x) for x in results[True]]}  "
                  f"bitwise-equal {equal}", flush=True)
        graphs = engine.runner.decode_graphs
        print(f"  captured sizes: {graphs.captured_sizes if graphs else None}", flush=True)


if __name__ == "__main__":
    main()
