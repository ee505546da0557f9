"""Where a 4k-token prefill's GPU time goes, on a CUDA device (the prefill target is in
docs/performance.md).

Prefills ``--prompts`` fresh prompts of ``--prompt-len`` tokens (one token out each) twice
(the first compiles every shape), then once more under torch.profiler, each engine step
labelled like a decode step so :func:`megaserve.bench.gpu_profile.summarize_trace` reduces
the trace: GPU busy fraction, top kernels by time. Prints one JSON object, also written to
``--out``; the FLOP rate uses :func:`megaserve.bench.roofline.prefill_flops_per_token`.

    source lab/device/setup.sh
    python lab/prefill_profile.py --model random:qwen3-30b-a3b:8 --out $OUT/prefill.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megaserve import LLM, SamplingParams
from megaserve.bench import roofline
from megaserve.bench.decode import measure_matmul_flops
from megaserve.bench.gpu_profile import STEP_LABEL, summarize_trace
from megaserve.bench.random_model import resolve_random_model


def _prefill(engine, rng: random.Random, num: int, prompt_len: int, tag: str,
             label: bool) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"{tag}-{i}", [rng.randrange(engine.vocab_size) for _ in range(prompt_len)],
                           params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = 0
    while done < num:
        if label:
            with record_function(STEP_LABEL):
                done += sum(out.finished for out in engine.step())
                torch.cuda.synchronize()
        else:
            done += sum(out.finished for out in engine.step())
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-30b-a3b:8")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    matmul = measure_matmul_flops("cuda", 8192)
    model = str(resolve_random_model(args.model, "device"))
    llm = LLM(model=model, dtype="bfloat16", device="cuda", max_model_len=args.prompt_len + 8,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.prompts)
    engine, cfg = llm.engine, llm.engine.model_config
    rng = random.Random(0)
    _prefill(engine, rng, args.prompts, args.prompt_len, "warm", False)
    seconds = _prefill(engine, rng, args.prompts, args.prompt_len, "timed", False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _prefill(engine, rng, args.prompts, args.prompt_len, "profiled", True)
    trace = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(trace)
    summary = summarize_trace(trace, num_top=20)
    Path(trace).unlink()
    tok_s = args.prompts * args.prompt_len / seconds
    flops = roofline.prefill_flops_per_token(cfg, args.prompt_len) * tok_s
    report = {"model": args.model, "layers": cfg.num_layers, "seconds": seconds, "tok_s": tok_s,
              "tflops": flops / 1e12, "of_matmul": flops / matmul,
              "matmul_tflops": matmul / 1e12, "profile": summary}
    llm.shutdown()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
