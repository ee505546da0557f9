"""``megaserve bench throughput``: offline generation throughput of the engine.

Runs N random-token requests through ``LLM.generate`` (ignore_eos, fixed output length)
after a warm-up, and prints requests/s, generated tokens/s and, on GPUs, tokens/s per GPU
(the ratio column compares that, or tokens/s on CPU). ``--baseline-layout R,E,m`` first
measures another placement (transport inproc when R = E = 1) in the same run.
``--model random:<preset>:<layers>`` benchmarks random weights of a real model's shape
(drawn directly on the device unless ``--random-weights file``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from megaserve.bench.devices import device_name
from megaserve.entrypoints.generate_cli import add_runtime_flags, runtime_options


def _num_gpus(options: dict) -> int:
    """GPUs a layout occupies: workers are spread round-robin over the visible GPUs."""
    device = str(options.get("device", "cpu"))
    if not device.startswith("cuda"):
        return 0
    import torch

    workers = options["attention_replicas"] + options["expert_workers"]
    single = (options["attention_replicas"], options["expert_workers"], options["transport"]) == (1, 1, "inproc")
    return 1 if single or device != "cuda" else min(workers, torch.cuda.device_count())


def _run(options: dict, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:
    import torch

    from megaserve import LLM, SamplingParams

    rng = random.Random(seed)
    with LLM(**options) as llm:
        vocab = llm.engine.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]}
                   for _ in range(num_prompts)]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        # Warm-up: the whole workload once, so kernel compilation (Triton JIT per launch
        # shape) and allocator growth stay out of the timed run.
        llm.generate(prompts, params)
        if str(options.get("device", "cpu")).startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        if str(options.get("device", "cpu")).startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    # Disaggregated layouts: how large expert GEMMs got (warm-up and timed run together).
    expert_stats = list(getattr(llm.engine, "expert_stats", {}).values())
    del llm
    if str(options.get("device", "cpu")).startswith("cuda"):
        import gc

        gc.collect()
        torch.cuda.empty_cache()  # the next engine (--profile-out) sizes its KV pool from free memory
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    gemms = sum(s.gemms for s in expert_stats)
    rows_per_gemm = sum(s.rows for s in expert_stats) / gemms if gemms else None
    return {"seconds": elapsed, "requests_per_s": num_prompts / elapsed,
            "tokens_per_s": generated / elapsed, "generated": generated,
            "rows_per_gemm": rows_per_gemm}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaserve bench throughput", description=__doc__)
    add_runtime_flags(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-layout", default=None,
                        help="R,E,m of a second layout measured in the same run, e.g. 1,1,1")
    parser.add_argument("--profile-out", default=None, metavar="FILE",
                        help="also write planner measurements (decode step time per batch size; co-located "
                             "layout, --model random:<preset>:<layers>) for 'megaserve plan calibrate'")
    parser.add_argument("--profile-batches", default="1,8,32,64,128,256",
                        help="batch sizes measured for --profile-out (default 1,8,32,64,128,256)")
    parser.add_argument("--profile-gpu", default=None, help="planner GPU name for --profile-out (default: guessed)")
    parser.add_argument("--random-weights", default="device", choices=["device", "file"],
                        help="random:<preset> weights drawn on the device (default) or written as a safetensors file")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    try:
        options = runtime_options(args)
    except ValueError as e:
        print(f"megaserve bench: {e}", file=sys.stderr)
        return 2
    if args.model.startswith("random:"):
        from megaserve.bench.random_model import resolve_random_model

        try:
            options["model"] = str(resolve_random_model(args.model, args.random_weights))
        except ValueError as e:
            print(f"megaserve bench: {e}", file=sys.stderr)
            return 2
    if args.profile_out:
        from megaserve.bench.profile_out import planner_model

        try:
            planner_model(args.model)
            batches = [int(x) for x in args.profile_batches.split(",")]
        except ValueError as e:
            print(f"megaserve bench: {e}", file=sys.stderr)
            return 2
        if (options["attention_replicas"], options["expert_workers"]) != (1, 1):
            print("megaserve bench: --profile-out measures the co-located layout (1 attention replica, 1 expert "
                  "worker)", file=sys.stderr)
            return 2
    runs = [("this layout", options)]
    if args.baseline_layout:
        try:
            r, e, m = (int(x) for x in args.baseline_layout.split(","))
        except ValueError:
            print("megaserve bench: --baseline-layout must be R,E,m integers", file=sys.stderr)
            return 2
        baseline = {**options, "attention_replicas": r, "expert_workers": e, "microbatches": m}
        if (r, e) == (1, 1):
            baseline["transport"] = "inproc"
        runs.insert(0, ("baseline", baseline))
    print(f"device: {device_name(args.device)}  model: {args.model}  "
          f"prompts: {args.num_prompts} x ({args.input_len} in, {args.output_len} out)")
    print(f"{'run':<12} {'R':>2} {'E':>2} {'m':>2} {'transport':<9} {'GPUs':>4} {'req/s':>8} "
          f"{'tok/s':>9} {'tok/s/GPU':>9} {'ratio':>6} {'rows/GEMM':>9}")
    base = None
    for name, opts in runs:
        try:
            result = _run(opts, args.num_prompts, args.input_len, args.output_len, args.seed)
        except ValueError as e:
            print(f"megaserve bench: {e}", file=sys.stderr)
            return 2
        gpus = _num_gpus(opts)
        per_unit = result["tokens_per_s"] / max(1, gpus)
        base = base or per_unit
        print(f"{name:<12} {opts['attention_replicas']:>2} {opts['expert_workers']:>2} "
              f"{opts['microbatches']:>2} {opts['transport']:<9} {gpus:>4} {result['requests_per_s']:>8.2f} "
              f"{result['tokens_per_s']:>9.1f} {per_unit:>9.1f} {per_unit / base:>6.2f} "
              f"{_fmt(result['rows_per_gemm']):>9}")
    if args.profile_out:
        from megaserve.bench import profile_out

        runs = profile_out.collect(args.profile_out, args, options, device_name(args.device), batches)
        for r in runs:
            if "step_ms" in r:
                print(f"profile: batch {r['batch']:>4}: decode step {r['step_ms']:8.3f} ms (median of "
                      f"{r['timed_steps']}, min {r['step_ms_min']:.3f}, max {r['step_ms_max']:.3f}), "
                      f"{r['tok_s']:9.1f} tok/s")
            else:
                print(f"profile: {r['num_prompts']} fresh prompts (no prefix-cache hits), prefill included: "
                      f"{r['tok_s']:9.1f} tok/s")
        print(f"wrote {args.profile_out}")
    return 0
