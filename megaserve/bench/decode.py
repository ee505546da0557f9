"""``megaserve bench decode``: decode and prefill against the memory and compute rooflines.

In one process, on one device:

1. baselines: HBM bandwidth from a device-to-device copy (bytes read + written / time),
   and the bf16 matmul rate of ``torch.matmul`` at 8192^3 (cuBLAS), both measured here:
   the best of ten products, and the rate held over ``--matmul-seconds`` of products back
   to back (a card under its power cap runs second-long compute below its short best);
2. per batch size B of ``--batches``: B requests are prefilled, ``--warmup-steps`` decode
   steps run (CUDA graphs are captured here), then ``--steps`` decode steps are timed one
   by one, each synchronised (median reported), then ``--steps`` more back to back with one
   synchronisation at the end (``steady ms`` = their wall time / steps: what a serving loop
   sees, where the host's work between steps may overlap the device's, e.g. with
   ``--async-scheduling``). The step must move :func:`roofline.decode_bytes` (attention
   weights, the experts hit, KV read and written, LM head); time at the roofline =
   bytes / measured bandwidth; achieved = roofline time / median step time, and
   ``steady`` the same for the back-to-back steps (their bytes at their longer context);
3. ``--profile-steps`` more decode steps under ``torch.profiler`` (Chrome trace reduced by
   :mod:`megaserve.bench.gpu_profile`: top kernels, GPU busy fraction, host gaps);
4. prefill: ``--prefill-prompts`` prompts of ``--prefill-len`` tokens (one generated
   token), after a warm-up with other prompts: tokens/s and FLOP/s against the datasheet
   bf16 peak and both measured matmul rates.

``--model random:<preset>:auto`` takes as many layers as fit in memory next to
``--reserve-gib`` for KV, activations and graphs (the table says how many).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megaserve.bench import roofline
from megaserve.bench.devices import device_name
from megaserve.engine.config import default_max_num_batched_tokens
from megaserve.engine.gc_heap import frozen_heap
from megaserve.entrypoints.generate_cli import add_runtime_flags, runtime_options

logger = logging.getLogger(__name__)

ELT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Sizes not given on the command line, by device kind: on a GPU they reach the rooflines
# (an 8192^3 matmul, a 4,096-token prefill); on a CPU they finish in seconds (the GPU sizes
# ran for minutes there without a line of output).
SIZE_DEFAULTS = {
    "cuda": {"batches": "1,64,256", "prefill_len": 4096, "copy_mib": 1024, "matmul_n": 8192},
    "cpu": {"batches": "1,8,32", "prefill_len": 128, "copy_mib": 256, "matmul_n": 512},
}


def _fill_size_defaults(args: argparse.Namespace, device: str) -> None:
    """Set every size flag left at None to ``device``'s default (SIZE_DEFAULTS)."""
    defaults = SIZE_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def measure_copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> float:
    """Bytes/s of ``dst.copy_(src)`` counting bytes read and written (best of ``iters``)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = _best_time(device, lambda: dst.copy_(src), iters)
    return 2 * nbytes / best


def measure_matmul_flops(device: str, n: int, iters: int = 10) -> float:
    """FLOP/s of an ``n x n x n`` bf16 ``torch.matmul`` (best of ``iters``)."""
    import torch

    a, b = _matmul_operands(device, n)
    torch.matmul(a, b)
    best = _best_time(device, lambda: torch.matmul(a, b), iters)
    return 2 * n**3 / best


def measure_held_matmul_flops(device: str, n: int, seconds: float) -> float:
    """FLOP/s of ``n x n x n`` bf16 ``torch.matmul`` run back to back for about ``seconds``,
    timed as one run: the rate a second-long compute phase (a prefill window) can hold."""
    import torch

    a, b = _matmul_operands(device, n)
    count = max(1, round(seconds / _best_time(device, lambda: torch.matmul(a, b), 3)))

    def run() -> None:
        for _ in range(count):
            torch.matmul(a, b)

    return 2 * n**3 * count / _best_time(device, run, 1)


def _matmul_operands(device: str, n: int):
    """Two random ``[n, n]`` bf16 matrices on ``device``."""
    import torch

    return (torch.randn(n, n, device=device).bfloat16(),
            torch.randn(n, n, device=device).bfloat16())


def _best_time(device: str, fn, iters: int) -> float:
    import torch

    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _add(engine, rng: random.Random, num: int, prompt_len: int, max_tokens: int, tag: str) -> list[str]:
    from megaserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(num)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(engine.vocab_size) for _ in range(prompt_len)], params)
    return ids


def decode_tokens(batch: int, input_len: int, max_num_batched_tokens: int, warmup: int,
                  steps: int, extra_steps: int) -> int:
    """``max_tokens`` of a decode run's requests.

    Requests prefilled early decode during the later prefill steps: the margin keeps every
    one running through the timed and profiled steps (a finishing one would shrink the
    batch and capture new graph sizes inside the window); they are aborted afterwards. The
    engine's ``max_model_len`` must hold ``input_len`` + this many tokens, or the earliest
    requests stop at that length inside the window instead.
    """
    margin = 8 + -(-batch * input_len // max_num_batched_tokens)
    return margin + warmup + 2 * steps + extra_steps


def decode_run(engine, device: str, batch: int, input_len: int, warmup: int, steps: int,
               extra_steps: int, rng: random.Random) -> tuple[dict, list[str]]:
    """Prefill ``batch`` requests, then time decode steps of all of them together.

    Returns the timings and the request ids, which stay running for ``extra_steps`` more
    steps (profile_decode) until the caller aborts them.
    """
    max_tokens = decode_tokens(batch, input_len, engine.config.max_num_batched_tokens,
                               warmup, steps, extra_steps)
    ids = _add(engine, rng, batch, input_len, max_tokens, f"b{batch}")
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked by the scheduler) until every request has a token
        started.update(out.request_id for out in engine.step())
    for _ in range(warmup):
        engine.step()
    _sync(device)
    times, short = [], 0
    with frozen_heap():  # as the server runs (megaserve/engine/gc_heap.py)
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = engine.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            short += len(outs) != batch
        t0 = time.perf_counter()
        for _ in range(steps):  # back to back: the host's work may overlap the device's
            engine.step()
        _sync(device)
        steady = (time.perf_counter() - t0) / steps
    graphs = getattr(getattr(engine, "runner", None), "decode_graphs", None)
    return {"batch": batch, "steps": steps, "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
            "steady_step_ms": steady * 1e3,
            "steps_not_full_batch": short,
            # KV tokens each sequence attends to, averaged over the synchronised steps
            "mean_context": input_len + 1 + warmup + (steps - 1) / 2,
            # the same for the back-to-back steps, which follow the synchronised ones
            "mean_context_steady": input_len + 1 + warmup + steps + (steps - 1) / 2,
            "cuda_graph_sizes": list(graphs.captured_sizes) if graphs is not None else []}, ids


def profile_decode(engine, device: str, num_steps: int, trace_path: str | None) -> dict:
    """``num_steps`` decode steps under torch.profiler, summarised (gpu_profile)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from megaserve.bench.gpu_profile import STEP_LABEL, summarize_trace

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            with record_function(STEP_LABEL):
                engine.step()
                _sync(device)
    path = trace_path or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    try:
        summary = summarize_trace(path)
    except ValueError as e:
        summary = {"error": str(e)}
    summary["cpu_self_top"] = [
        {"name": e.key, "us_per_step": e.self_cpu_time_total / num_steps, "calls_per_step": e.count / num_steps}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]]
    if trace_path is None:
        Path(path).unlink(missing_ok=True)
    return summary


def prefill_run(engine, device: str, num: int, prompt_len: int, rng: random.Random) -> dict:
    """Seconds to prefill ``num`` fresh prompts of ``prompt_len`` tokens (1 token out each),
    after a warm-up with other prompts (compiles the prefill shapes; no prefix-cache hits)."""
    seconds = []
    with frozen_heap():  # as the server runs (decode_run); one collection for both runs
        for tag in ("warm", "timed"):
            ids = _add(engine, rng, num, prompt_len, 1, f"prefill-{tag}")
            _sync(device)
            t0 = time.perf_counter()
            done = 0
            while done < len(ids):
                done += sum(out.finished for out in engine.step())
            _sync(device)
            seconds.append(time.perf_counter() - t0)
    return {"prompts": num, "prompt_len": prompt_len, "seconds": seconds[-1],
            "tok_s": num * prompt_len / seconds[-1]}


def _resolve_model(args, options: dict, device: str) -> tuple[str, int | None]:
    """Checkpoint path for ``--model`` (random presets resolved, ``auto`` layers fitted),
    and the layer count chosen by ``auto`` (None otherwise)."""
    if not args.model.startswith("random:"):
        return args.model, None
    from megaserve.bench import random_model
    from megaserve.models.config import ModelConfig

    name, fitted = args.model, None
    if name.endswith(":auto"):
        preset = name.split(":")[1]
        cfg = ModelConfig.from_hf_dict(random_model.hf_config(preset, 1))
        if device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info()
            budget = free * options["gpu_memory_utilization"] - args.reserve_gib * 2**30
        else:
            budget = float("inf")
        fitted = min(random_model.FULL_DEPTH.get(preset, 1 << 30),
                     roofline.layers_that_fit(cfg, budget, ELT_BYTES[args.dtype]))
        if fitted <= 0:
            raise ValueError(f"{preset}: not one layer fits next to --reserve-gib {args.reserve_gib}")
        name = f"random:{preset}:{fitted}"
    return str(random_model.resolve_random_model(name, args.random_weights)), fitted


def _keeps_fp8(cfg, options: dict, device: str) -> bool:
    """Whether the engine holds its linear weights in FP8 (``--quantization fp8`` or a
    block-FP8 checkpoint, where the loader keeps them FP8: models.loader.keeps_fp8)."""
    import torch

    from megaserve.models.loader import keeps_fp8
    from megaserve.models.quantization import QuantConfig

    quant = cfg.quantization or (QuantConfig() if options.get("quantization") == "fp8" else None)
    return quant is not None and keeps_fp8(torch.device(device), quant.weight_block_size)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaserve bench decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_flags(parser)
    parser.add_argument("--batches", default=None,
                        help="decode batch sizes (default: 1,64,256 on a GPU, 1,8,32 on a CPU)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens of the decode runs")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per batch size")
    parser.add_argument("--profile-steps", type=int, default=4, help="profiled decode steps (0: no profile)")
    parser.add_argument("--prefill-len", type=int, default=None,
                        help="prompt length of the prefill run (0: none; default: 4096 on a GPU, 128 on a CPU)")
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--random-weights", default="device", choices=["device", "file"],
                        help="random:<preset> weights drawn on the device (default) or a safetensors file")
    parser.add_argument("--reserve-gib", type=float, default=12.0,
                        help="memory kept free of weights by random:<preset>:auto (KV, activations, graphs)")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="buffer size of the bandwidth copy (default: 1024 on a GPU, 256 on a CPU)")
    parser.add_argument("--matmul-n", type=int, default=None,
                        help="n of the n^3 bf16 matmul baseline (default: 8192 on a GPU, 512 on a CPU)")
    parser.add_argument("--matmul-seconds", type=float, default=1.0,
                        help="how long the held matmul rate runs (0: not measured)")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="write all results as JSON")
    parser.add_argument("--trace-dir", default=None, metavar="DIR", help="keep the Chrome traces here")
    args = parser.parse_args(argv)
    try:
        options = runtime_options(args)
        if args.dtype not in ELT_BYTES:
            raise ValueError("--dtype: give the dtype explicitly (bfloat16, float16 or float32)")
    except ValueError as e:
        print(f"megaserve bench: {e}", file=sys.stderr)
        return 2
    import torch

    device = options["device"]
    if device == "auto":
        device = options["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    _fill_size_defaults(args, device)
    try:
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        print(f"megaserve bench: --batches {args.batches!r}: expected integers such as 1,64,256",
              file=sys.stderr)
        return 2
    name = device_name(device)
    copy_bw = measure_copy_bandwidth(device, args.copy_mib << 20)
    matmul = measure_matmul_flops(device, args.matmul_n)
    held = (measure_held_matmul_flops(device, args.matmul_n, args.matmul_seconds)
            if args.matmul_seconds > 0 else None)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the baselines' buffers must not look like used memory
    try:
        options["model"], fitted = _resolve_model(args, options, device)
    except ValueError as e:
        print(f"megaserve bench: {e}", file=sys.stderr)
        return 2
    from megaserve.bench.devices import catalog_gpu
    from megaserve.planner.catalog import DEFAULT_GPUS

    spec = DEFAULT_GPUS.get(catalog_gpu(name) or "")
    options["max_num_seqs"] = max(batches)
    step_tokens = options["max_num_batched_tokens"] or default_max_num_batched_tokens(device)
    options["max_num_batched_tokens"] = max(step_tokens, max(batches))
    max_ctx = args.input_len + max(
        decode_tokens(b, args.input_len, options["max_num_batched_tokens"], args.warmup_steps,
                      args.steps, args.profile_steps) for b in batches)
    options["max_model_len"] = options.get("max_model_len") or max(max_ctx, args.prefill_len + 1)
    from megaserve import LLM

    t0 = time.perf_counter()
    llm = LLM(**options)
    load_s = time.perf_counter() - t0
    engine, cfg = llm.engine, llm.engine.model_config
    elt = ELT_BYTES[args.dtype]
    welt = 1 if _keeps_fp8(cfg, options, device) else elt  # FP8 weights: one byte each
    report = {"device": name, "command": "megaserve bench decode " + " ".join(argv), "model": args.model,
              "num_layers": cfg.num_layers, "layers_fitted_by_auto": fitted, "dtype": args.dtype,
              "quantization": options.get("quantization"), "weight_elt_bytes": welt,
              "weights_gb": roofline.weight_bytes(cfg, elt, welt) / 1e9, "engine_load_s": load_s,
              "copy_bandwidth_gbs": copy_bw / 1e9, "matmul_tflops": matmul / 1e12,
              "matmul_held_tflops": held / 1e12 if held else None,
              "datasheet": {"hbm_tbps": spec.hbm_tbps, "bf16_tflops": spec.bf16_tflops} if spec else None,
              "decode": [], "prefill": None}
    print(f"device: {name}  model: {args.model} ({cfg.num_layers} layers{', fitted to memory' if fitted else ''}, "
          f"{report['weights_gb']:.1f} GB of weights, loaded in {load_s:.1f} s)  dtype: {args.dtype}")
    print(f"baselines measured in this run: copy {copy_bw / 1e9:,.0f} GB/s (read + write), "
          f"bf16 matmul {args.matmul_n}^3 {matmul / 1e12:,.0f} TFLOP/s (best of ten)"
          + (f", {held / 1e12:,.0f} held for {args.matmul_seconds:g} s" if held else "")
          + (f"; datasheet {spec.hbm_tbps * 1e3:,.0f} GB/s, {spec.bf16_tflops:,.0f} TFLOP/s" if spec else ""))
    print(f"{'batch':>5} {'active E':>8} {'MB/step':>8} {'roof ms':>8} {'step ms':>8} {'achieved':>8} "
          f"{'tok/s':>9} {'steady ms':>9} {'steady':>7} {'graphs':>6} {'GPU busy':>8} {'gaps ms':>7}")
    rng = random.Random(0)
    for batch in batches:
        trace = str(Path(args.trace_dir) / f"decode-b{batch}.json") if args.trace_dir else None
        if trace:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        r, ids = decode_run(engine, device, batch, args.input_len, args.warmup_steps, args.steps,
                            args.profile_steps, rng)
        need = roofline.decode_bytes(cfg, batch, r["mean_context"], elt, welt)
        step_s = r["step_ms_median"] / 1e3
        steady = roofline.decode_bytes(cfg, batch, r["mean_context_steady"], elt, welt)
        r |= {"bytes": {**need.__dict__, "total": need.total}, "roofline_ms": need.total / copy_bw * 1e3,
              "achieved": need.total / copy_bw / step_s, "tok_s": batch / step_s,
              "achieved_steady": steady.total / copy_bw / (r["steady_step_ms"] / 1e3),
              "tok_s_steady": batch / (r["steady_step_ms"] / 1e3)}
        if spec:
            r["achieved_vs_datasheet"] = need.total / (spec.hbm_tbps * 1e12) / step_s
        report["decode"].append(r)
        _save(args.json_out, report)  # before the profile: a crash or timeout later keeps these
        if args.profile_steps:
            try:
                r["profile"] = profile_decode(engine, device, args.profile_steps, trace)
                # profiled kernel time over the unprofiled step: the profiler slows the host,
                # so its busy fraction understates how busy an unprofiled step keeps the GPU
                if "gpu_busy_us_per_step" in r["profile"]:
                    r["gpu_kernel_share_of_step"] = r["profile"]["gpu_busy_us_per_step"] / 1e3 / r["step_ms_median"]
            except RuntimeError as e:  # the profiler, not the engine, failed: keep the timings
                r["profile"] = {"error": f"torch.profiler failed: {e}"}
            _save(args.json_out, report)
        for rid in ids:
            engine.abort_request(rid)
        prof = r.get("profile", {})
        busy = f"{prof['gpu_busy_fraction']:.0%}" if "gpu_busy_fraction" in prof else "-"
        gaps = f"{prof['host_gaps']['total_us_per_step'] / 1e3:.2f}" if "host_gaps" in prof else "-"
        print(f"{batch:>5} {need.active_experts_per_layer:>8.1f} {need.total / 1e6:>8.0f} {r['roofline_ms']:>8.3f} "
              f"{r['step_ms_median']:>8.3f} {r['achieved']:>8.1%} {r['tok_s']:>9.1f} "
              f"{r['steady_step_ms']:>9.3f} {r['achieved_steady']:>7.1%} {'on' if r['cuda_graph_sizes'] else 'off':>6} "
              f"{busy:>8} {gaps:>7}")
    for r in report["decode"]:
        for k in r.get("profile", {}).get("top_kernels", [])[:6]:
            print(f"  b{r['batch']}: {k['us_per_step']:9.1f} us/step {k['share_of_gpu_time']:6.1%} "
                  f"x{k['calls_per_step']:.0f} {k['name'][:90]}")
    if args.prefill_len:
        p = prefill_run(engine, device, args.prefill_prompts, args.prefill_len, rng)
        flops = roofline.prefill_flops_per_token(cfg, args.prefill_len) * p["tok_s"]
        p |= {"tflops": flops / 1e12, "of_matmul_measured": flops / matmul}
        if held:
            p["of_matmul_held"] = flops / held
        if spec:
            p["of_datasheet_peak"] = flops / (spec.bf16_tflops * 1e12)
        report["prefill"] = p
        _save(args.json_out, report)
        print(f"prefill: {p['prompts']} x {p['prompt_len']} tokens in {p['seconds']:.3f} s: {p['tok_s']:,.0f} tok/s, "
              f"{p['tflops']:.0f} TFLOP/s = {p['of_matmul_measured']:.0%} of the measured matmul"
              + (f" ({p['of_matmul_held']:.0%} of its held rate)" if held else "")
              + (f", {p['of_datasheet_peak']:.0%} of the datasheet peak" if spec else ""))
    llm.shutdown()
    if args.json_out:
        _save(args.json_out, report)
        print(f"wrote {args.json_out}")
    return 0


def _save(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
