"""Where a CPU decode step goes: the ``megaserve bench cpu`` workload (tiny random Mixtral,
64 requests x (64 prompt + 64 generated), greedy, float32) with every kernel of
:mod:`megaserve.kernels.cpu` timed inside ``LLMEngine.step`` (exclusive: a kernel called by
another counts once, in the outer one), the median over the batch's decode steps.
``--num-seqs`` changes the batch (how each kernel scales with rows); the kernels' ISA build
is the CPU's widest unless ``MEGASERVE_CPU_ISA`` (avx512, avx2, baseline) names another.
``--cpu-time`` times with this thread's CPU time instead of the wall clock: with
``--cpu-threads 1`` every kernel runs on this thread, and the numbers hardly move with the
load of a shared machine.

    python lab/cpu_decode_profile.py [--cpu-threads N] [--num-seqs 64] [--cpu-time]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

from megaserve import LLM, SamplingParams
from megaserve.bench import cpu as bench_cpu
from megaserve.engine import engine as engine_module
from megaserve.engine.gc_heap import frozen_heap
from megaserve.kernels import cpu as kernels_cpu
from megaserve.kernels import cpu_ext

KERNELS = ["linear", "rms_norm", "linear_rms_norm", "rotary_and_cache", "paged_attention",
           "route", "topk_route", "expert_ffn", "combine", "combine_residual", "log_softmax",
           "embed_tokens", "sample", "write_kv_cache", "silu_and_mul"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--cpu-time", action="store_true",
                        help="this thread's CPU time (use with --cpu-threads 1)")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    spent: collections.Counter = collections.Counter()
    depth = [0]

    def timed(name, fn):
        def call(*a, **kw):
            depth[0] += 1
            start = clock()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[name] += clock() - start
        return call

    for name in KERNELS:
        if hasattr(kernels_cpu, name):
            setattr(kernels_cpu, name, timed(name, getattr(kernels_cpu, name)))
    steps = []
    step = engine_module.LLMEngine.step

    def timed_step(self):
        spent.clear()
        start = clock()
        out = step(self)
        steps.append((clock() - start, dict(spent)))
        return out

    engine_module.LLMEngine.step = timed_step
    options = dict(model=str(bench_cpu.tiny_mixtral_path()), dtype="float32", device="cpu",
                   max_num_seqs=args.num_seqs, max_model_len=129)
    if args.cpu_threads:
        options["cpu_threads"] = args.cpu_threads
    with LLM(**options) as llm, frozen_heap():  # as a server runs (engine/gc_heap.py)
        bench_cpu.run_workload(llm, args.num_seqs, 64, 64, 0)  # warm-up
        steps.clear()
        rng = random.Random(1)
        prompts = [{"prompt_token_ids": [rng.randrange(512) for _ in range(64)]}
                   for _ in range(args.num_seqs)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        batch_s = time.perf_counter() - start
        threads = llm.engine.config.cpu_threads
    # The first steps prefill (64 prompt tokens a sequence, 2,048 a step, then a mixed
    # step); the last one finishes the requests.
    decode = steps[-(64 - 1):-1]
    prefill_ms = ", ".join(f"{1e3 * s[0]:.1f}" for s in steps[:-(64 - 1)])
    step_ms = statistics.median(s[0] for s in decode) * 1e3
    print(f"{cpu_ext.default_isa()} kernels, {args.num_seqs} sequences, threads {threads}: batch {batch_s:.3f} s, {len(steps)} steps; median decode step "
          f"{step_ms:.2f} ms over {len(decode)} steps; prefill steps {prefill_ms} ms")
    names = sorted({n for _, s in decode for n in s},
                   key=lambda n: -statistics.median(s.get(n, 0.0) for _, s in decode))
    first_ms, first = steps[0][0] * 1e3, steps[0][1]  # the first prefill step
    print(f"  {'':18s} {'decode':>10s} {'1st prefill':>12s}")
    total = 0.0
    for name in names:
        ms = statistics.median(s.get(name, 0.0) for _, s in decode) * 1e3
        total += ms
        print(f"  {name:18s} {ms:7.3f} ms {1e3 * first.get(name, 0.0):9.3f} ms")
    print(f"  {'outside kernels':18s} {step_ms - total:7.3f} ms "
          f"{first_ms - 1e3 * sum(first.values()):9.3f} ms")


if __name__ == "__main__":
    main()
