"""Benchmarks of prefix caching (TTFT with a shared prefix, hit vs miss) and
speculative decoding (decode time per token at batch 1 and 16, n-gram and draft model,
acceptance rate, mean accepted length, measured vs predicted speed-up).

    python lab/bench_prefix_spec.py --device cuda --dtype bfloat16 \
        --model random:qwen3-30b-a3b:2 --draft-model random:qwen3-30b-a3b:1

Prints one table per part with the device name; the baselines (no cache, no speculation)
are measured in the same run. Random weights (``random:<preset>:<layers>``): the 1-layer
draft has the embeddings, LM head and first layer of the 2-layer target (each tensor is
drawn from a generator seeded by its name), but the target's second layer adds a random
residual update as large as the first's, so the two models' greedy tokens rarely agree
(alpha near 0: a property of random weights; a draft equal to the target gives alpha 1).
Greedy text of random weights tends to repeat, the workload the n-gram proposer is for.

Decode timing: each engine first decodes the measured batch once (``cold``: includes the
Triton compilations and CUDA graph captures of the shapes it meets, what a first request
pays), then again (``ms/token``, per sequence: the step latency). ``eager`` rows run the
verification (and draft) forwards without CUDA graphs, as before they had them. The
per-step columns split the host time of a step: the proposer, the runner's execute
(forward, sampling, verification; it waits for the GPU) and the rest (scheduling, KV
bookkeeping, outputs).
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


class _PhaseTimer:
    """Host seconds spent in the proposer and the runner's execute (instance attributes
    wrapped; the engine calls them through ``self``)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = {"propose": 0.0, "execute": 0.0}
        for name, owner in (("propose", engine.proposer), ("execute", engine.runner)):
            if owner is not None:
                setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name, fn):
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


def decode(engine: LLMEngine, prompts: list[list[int]], output_len: int, device: str,
           timer: _PhaseTimer | None = None) -> dict:
    """Decode time per output token of a batch (prefill excluded), speculation stats and
    the host time per step of each phase."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, params)
    before = engine.stats()
    seq_steps, steps, start = 0, 0, None  # (sequence, step) pairs after the first tokens
    while engine.has_unfinished_requests():
        outs = engine.step()
        if start is None:
            if outs and all(len(o.outputs[0].token_ids) >= 1 for o in outs):
                _sync(device)
                start, first_tokens = time.perf_counter(), engine.stats().generation_tokens_total
                phases = dict(timer.seconds) if timer else {}
            continue
        seq_steps += len(outs)
        steps += 1
    _sync(device)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    tokens = after.generation_tokens_total - first_tokens
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_step = {name: (timer.seconds[name] - phases[name]) / max(1, steps) * 1e3
                for name in phases} if timer else {}
    if per_step:
        per_step["other"] = elapsed / max(1, steps) * 1e3 - sum(per_step.values())
    return dict(ms_per_token=elapsed / max(1, tokens / len(prompts)) * 1e3,
                tokens_per_s=tokens / elapsed,
                alpha=accepted / drafts if drafts else None,
                tokens_per_step=tokens / max(1, seq_steps), per_step=per_step)


def _spec_configs(args) -> list[tuple[str, str, dict | None, bool]]:
    """(key, row name, speculative_config, eager verification) of ``--configs``."""
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3}
    draft = {"model": args.draft_model, "num_speculative_tokens": args.k}
    known = [("none", "no speculation", None, False),
             ("ngram-eager", f"ngram k={args.k} eager", ngram, True),
             ("ngram", f"ngram k={args.k}", ngram, False),
             ("draft-eager", f"draft k={args.k} eager", draft, True),
             ("draft", f"draft k={args.k}", draft, False)]
    chosen = [c for c in known if c[0] in args.configs and (args.draft_model or "draft" not in c[0])]
    unknown = set(args.configs) - {c[0] for c in known}
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {[c[0] for c in known]}")
    return chosen


def bench_spec(args) -> None:
    print(f"\nDecode, repetitive prompts (a 16-token pattern x 8), {args.output_len} greedy "
          f"tokens, {args.model}, draft {args.draft_model}, {args.dtype}, "
          f"{_device_name(args.device)}")
    print(f"{'batch':>5}  {'config':<20}{'cold':>9}{'ms/token':>10}{'speed-up':>10}{'alpha':>7}"
          f"{'tokens/step':>12}{'predicted':>10}{'tok/s':>9}   host ms/step: propose, execute, other")
    for batch in args.batches:
        baseline = None
        for _, name, spec, eager in _spec_configs(args):
            engine = _engine(args, speculative_config=spec)
            if eager:  # verification and draft forwards without CUDA graphs
                engine.runner.num_speculative_tokens = 0
                if hasattr(engine.proposer, "graphs"):
                    engine.proposer.graphs = []
            timer = _PhaseTimer(engine)
            rng = random.Random(batch)  # the same prompts for every config
            prompts = [[rng.randrange(engine.vocab_size) for _ in range(16)] * 8
                       for _ in range(batch)]
            decode(engine, prompts[:1], 8, args.device)  # warm up
            cold = decode(engine, prompts, args.output_len, args.device)
            result = decode(engine, prompts, args.output_len, args.device, timer)
            if args.profile:
                profiled = (engine, prompts)
            del engine
            baseline = baseline or result["ms_per_token"]
            alpha = result["alpha"]
            if alpha is None:
                predicted = 1.0
            elif alpha < 1:
                predicted = (1 - alpha ** (args.k + 1)) / (1 - alpha)
            else:
                predicted = args.k + 1.0
            phases = result["per_step"]
            print(f"{batch:>5}  {name:<20}{cold['ms_per_token']:>9.3f}{result['ms_per_token']:>10.3f}"
                  f"{baseline / result['ms_per_token']:>9.2f}x"
                  f"{'-' if alpha is None else f'{alpha:.2f}':>7}"
                  f"{result['tokens_per_step']:>12.2f}{predicted:>9.2f}x"
                  f"{result['tokens_per_s']:>9.0f}   "
                  + ", ".join(f"{phases[k]:.3f}" for k in ("propose", "execute", "other")))
            if args.profile:
                _profile(*profiled, f"batch {batch}, {name}", args.device)
            profiled = None
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


def _profile(engine: LLMEngine, prompts: list[list[int]], title: str, device: str) -> None:
    """torch.profiler tables (host ops by self CPU time, kernels by device time) of a
    32-token decode of ``prompts``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        decode(engine, prompts, 32, device)
    averages = prof.key_averages()
    print(f"\n-- profile: {title} (32 tokens) --")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=14))
    if device.startswith("cuda"):
        print(averages.table(sort_by="self_device_time_total", row_limit=10))


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
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler tables of each decode row")
    parser.add_argument("--configs", type=lambda s: s.split(","),
                        default=["none", "ngram-eager", "ngram", "draft-eager", "draft"],
                        help="decode rows: none, ngram-eager, ngram, draft-eager, draft")
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
