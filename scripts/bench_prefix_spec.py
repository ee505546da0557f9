"""Benchmarks of issue 16: prefix caching (TTFT with a shared prefix, hit vs miss) and
speculative decoding (decode time per token at batch 1 and 16, n-gram and draft model,
acceptance rate, mean accepted length, measured vs predicted speed-up).

    python scripts/bench_prefix_spec.py --device cuda --dtype bfloat16 \
        --model random:qwen3-30b-a3b:2 --draft-model random:qwen3-30b-a3b:1

Prints one table per part with the device name; the baselines (no cache, no speculation)
are measured in the same run. Random weights (``random:<preset>:<layers>``): the 1-layer
draft shares the embeddings, LM head and first layer of the 2-layer target (one random
stream writes them in order), so it agrees with the target part of the time; greedy text
of random weights tends to repeat, the workload the n-gram proposer is for.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.sampling_params import SamplingParams


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine(args, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                  max_model_len=args.max_model_len, max_num_seqs=32,
                                  max_num_batched_tokens=4096, num_kv_blocks=args.num_kv_blocks,
                                  **overrides))


def _finish(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def ttft(engine: LLMEngine, request_id: str, prompt: list[int], device: str) -> float:
    """Seconds from add_request to the first token of a request running alone."""
    _sync(device)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    _finish(engine)
    _sync(device)
    return time.perf_counter() - start


def bench_prefix(args) -> None:
    rng = random.Random(0)
    rows = []
    cached, plain = _engine(args), _engine(args, enable_prefix_caching=False)
    vocab = cached.vocab_size
    warm = [rng.randrange(vocab) for _ in range(args.prefix_len + 16)]
    for engine in (cached, plain):  # compile / warm up both
        ttft(engine, "warm", warm, args.device)
    miss, hit, base = [], [], []
    for i in range(args.repeats):
        prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
        first = prefix + [rng.randrange(vocab) for _ in range(16)]
        second = prefix + [rng.randrange(vocab) for _ in range(16)]
        miss.append(ttft(cached, f"m{i}", first, args.device))
        hit.append(ttft(cached, f"h{i}", second, args.device))
        base.append(ttft(plain, f"b{i}", second, args.device))
    rows.append(("no prefix cache", statistics.median(base)))
    rows.append(("cache miss", statistics.median(miss)))
    rows.append(("cache hit", statistics.median(hit)))
    print(f"\nTTFT, {args.prefix_len}-token shared prefix + 16 own tokens, {args.model}, "
          f"{args.dtype}, {_device_name(args.device)} (median of {args.repeats})")
    print(f"{'case':<18}{'TTFT ms':>10}{'vs no cache':>14}")
    for name, value in rows:
        print(f"{name:<18}{value * 1e3:>10.2f}{rows[0][1] / value:>13.2f}x")


def decode(engine: LLMEngine, prompts: list[list[int]], output_len: int, device: str) -> dict:
    """Decode time per output token of a batch (prefill excluded), and speculation stats."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, params)
    before = engine.stats()
    seq_steps, start = 0, None  # (sequence, step) pairs after the first tokens
    while engine.has_unfinished_requests():
        outs = engine.step()
        if start is None:
            if outs and all(len(o.outputs[0].token_ids) >= 1 for o in outs):
                _sync(device)
                start, first_tokens = time.perf_counter(), engine.stats().generation_tokens_total
            continue
        seq_steps += len(outs)
    _sync(device)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    tokens = after.generation_tokens_total - first_tokens
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return dict(ms_per_token=elapsed / max(1, tokens / len(prompts)) * 1e3,
                alpha=accepted / drafts if drafts else None,
                tokens_per_step=tokens / max(1, seq_steps))


def bench_spec(args) -> None:
    configs = [("no speculation", None),
               (f"ngram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k,
                                      "prompt_lookup_max": 3})]
    if args.draft_model:
        configs.append((f"draft k={args.k}", {"model": args.draft_model,
                                              "num_speculative_tokens": args.k}))
    print(f"\nDecode, repetitive prompts (a 16-token pattern x 8), {args.output_len} greedy "
          f"tokens, {args.model}, {args.dtype}, {_device_name(args.device)}")
    print(f"{'batch':>5}  {'config':<16}{'ms/token':>10}{'speed-up':>10}{'alpha':>8}"
          f"{'tokens/step':>13}{'predicted':>11}")
    for batch in args.batches:
        baseline = None
        for name, spec in configs:
            engine = _engine(args, speculative_config=spec)
            rng = random.Random(batch)  # the same prompts for every config
            prompts = [[rng.randrange(engine.vocab_size) for _ in range(16)] * 8
                       for _ in range(batch)]
            decode(engine, prompts[:1], 8, args.device)  # warm up
            result = decode(engine, prompts, args.output_len, args.device)
            del engine
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            baseline = baseline or result["ms_per_token"]
            alpha = result["alpha"]
            if alpha is None:
                predicted = 1.0
            elif alpha < 1:
                predicted = (1 - alpha ** (args.k + 1)) / (1 - alpha)
            else:
                predicted = args.k + 1.0
            print(f"{batch:>5}  {name:<16}{result['ms_per_token']:>10.3f}"
                  f"{baseline / result['ms_per_token']:>9.2f}x"
                  f"{'-' if alpha is None else f'{alpha:.2f}':>8}"
                  f"{result['tokens_per_step']:>13.2f}{predicted:>10.2f}x")


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-kv-blocks", type=int, default=4096,
                        help="KV pool per engine (two engines are alive at once)")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--only", choices=["prefix", "spec"], default=None)
    args = parser.parse_args(argv)
    from megaserve.bench.random_model import resolve_random_model

    for name in ("model", "draft_model"):  # random:<preset>:<layers> checkpoints
        value = getattr(args, name)
        if value and value.startswith("random:"):
            setattr(args, name, str(resolve_random_model(value)))
    if args.only != "spec":
        bench_prefix(args)
    if args.only != "prefix":
        bench_spec(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
