"""``megaserve bench throughput --profile-out FILE``: measurements for the planner.

Writes a measurement file (format: planner/measurements.py) that ``megaserve plan
calibrate FILE`` fits: for every batch size B of ``--profile-batches``, B requests decode
together on one co-located engine, stepped directly (``megaserve bench decode``'s
:func:`~megaserve.bench.decode.decode_run`):

* the B prompts are prefilled, then warm-up steps (CUDA graphs captured and replayed)
  bring the context to where the timed window is centred on the run's mean context
  ``input_len + output_len / 2`` (what the planner models);
* ``timed_steps`` decode steps are timed one by one (wall clock, synchronised):
  ``step_ms`` is their median, ``step_ms_min`` / ``step_ms_max`` the spread, with
  ``mean_context`` and ``steps_not_full_batch`` (steps where a request was missing), and
  ``async_scheduling: false`` (a synchronised step overlaps nothing);
* the whole workload (``--num-prompts`` x ``--input-len`` / ``--output-len``) through
  ``generate`` on the same engine, prefill included, with prompts the warm-up did not
  use (:func:`measure_whole`: no prefix-cache hits, as the planner models it), with the
  engine's ``async_scheduling``;
* with two or more visible GPUs, ``link`` entries: a GPU-to-GPU copy of 64 KiB .. 64 MiB
  (median of CUDA-event timings), for the planner's intra-node transport line
  ``seconds = alpha + bytes / (link_eff * link_gbps)``.

The per-step host overhead, per-layer overheads and bandwidth efficiency are then fitted
by the planner; run two layer counts or more (e.g. ``random:qwen3-30b-a3b:8`` and ``:24``)
so the per-step and per-layer overheads can be told apart.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import time
from pathlib import Path

from megaserve.bench.devices import catalog_gpu  # noqa: F401 (part of this module's API)

logger = logging.getLogger(__name__)


def planner_model(model: str) -> tuple[str, int]:
    """(planner built-in name, layers) of ``random:<preset>:<layers>``; ValueError otherwise."""
    from megaserve.planner.model_spec import BUILTIN_CONFIGS

    parts = model.split(":")
    if len(parts) != 3 or parts[0] != "random" or parts[1] not in BUILTIN_CONFIGS:
        raise ValueError(f"--profile-out needs --model random:<preset>:<layers> with a preset the planner knows "
                         f"({', '.join(sorted(BUILTIN_CONFIGS))}), got {model!r}")
    return parts[1], int(parts[2])


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


TIMED_STEPS = 32  # decode steps timed one by one per batch size (median reported)


def measure(options: dict, batches: list[int], input_len: int, output_len: int, seed: int,
            timed_steps: int = TIMED_STEPS, num_prompts: int = 0) -> list[dict]:
    """Decode step time per batch size on one engine (its max_num_seqs = max(batches)),
    then, if ``num_prompts``, one whole ``generate`` of that many prompts (:func:`measure_whole`).

    Returns one run per batch (fields in the module docstring), and the whole run last.
    Raises ValueError when ``output_len < 2`` or ``timed_steps < 1``.
    """
    from megaserve import LLM
    from megaserve.bench.decode import decode_run

    if output_len < 2 or timed_steps < 1:
        raise ValueError("--profile-out needs --output-len >= 2 and at least one timed step")
    device = str(options.get("device", "cpu"))
    # decode_run's timed window has mean context input_len + 1 + warmup + (steps - 1) / 2:
    # centre it on the planner's input_len + output_len / 2, with >= 2 warm-up steps
    # (the first replays of a freshly captured CUDA graph are not steady).
    warmup = max(2, round(output_len / 2 - 1 - (timed_steps - 1) / 2))
    opts = {**options, "max_num_seqs": max(batches)}
    if opts.get("max_num_batched_tokens"):  # one decode step of the largest batch fits one step's budget
        opts["max_num_batched_tokens"] = max(opts["max_num_batched_tokens"], max(batches))
    rng = random.Random(seed)
    runs = []
    with LLM(**opts) as llm:
        engine = llm.engine
        for batch in batches:
            r, ids = decode_run(engine, device, batch, input_len, warmup, timed_steps, 0, rng)
            for rid in ids:
                engine.abort_request(rid)
            step_s = r["step_ms_median"] / 1e3
            runs.append({"batch": batch, "input_len": input_len, "output_len": output_len,
                         "step_ms": round(r["step_ms_median"], 4), "tok_s": round(batch / step_s, 1),
                         "step_ms_min": round(r["step_ms_min"], 4), "step_ms_max": round(r["step_ms_max"], 4),
                         "timed_steps": timed_steps, "warmup_steps": warmup,
                         "mean_context": r["mean_context"], "steps_not_full_batch": r["steps_not_full_batch"],
                         # each step is timed with a synchronisation: host and GPU in series
                         "async_scheduling": False})
            logger.info("profile: batch %d: %.3f ms per decode step (min %.3f, max %.3f)", batch,
                        r["step_ms_median"], r["step_ms_min"], r["step_ms_max"])
        if num_prompts:
            runs.append(measure_whole(llm, device, num_prompts, input_len, output_len, rng))
    return runs


def measure_whole(llm, device: str, num_prompts: int, input_len: int, output_len: int,
                  rng: random.Random) -> dict:
    """Generated tokens/s of one ``llm.generate`` of ``num_prompts`` fresh prompts, prefill included.

    NOTE: the warm-up pass uses *other* prompts of the same shape. Timing a repeat of the
    warm-up's prompts (as the benchmark's own row does) hits the prefix cache: most of the
    prefill is skipped, and the short remainders are prefill shapes the warm-up never ran,
    compiled inside the timed window on a cold kernel cache. The planner models full
    prefill in ``max_num_batched_tokens`` chunks, so this run has no prefix-cache hits.
    """
    import torch

    from megaserve import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.vocab_size
    seconds = 0.0
    for _ in ("warm-up", "timed"):
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]} for _ in range(num_prompts)]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    cfg = llm.engine.config
    logger.info("profile: %d prompts: %.1f generated tok/s incl. prefill", num_prompts, generated / seconds)
    return {"num_prompts": num_prompts, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "input_len": input_len,
            "output_len": output_len, "tok_s": round(generated / seconds, 1), "includes_prefill": True,
            "prefix_cache_hits": False, "async_scheduling": bool(getattr(llm.engine, "async_scheduling", False))}


LINK_SIZES = (64 << 10, 1 << 20, 8 << 20, 64 << 20)


def measure_link(sizes=LINK_SIZES, iters: int = 20) -> list[dict]:
    """``link`` entries from cuda:0 -> cuda:1 copies (empty with fewer than two GPUs)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return []
    out = []
    for size in sizes:
        src = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        dst.copy_(src)  # warm-up: peer mapping
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out.append({"kind": "link", "bytes": size, "seconds": sorted(times)[len(times) // 2]})
    return out


def collect(path: str, args, options: dict, device: str, batches: list[int]) -> list[dict]:
    """Measure (decode steps per batch, the whole workload, GPU-to-GPU copies) and write
    the file; returns the runs written."""
    runs = measure(options, batches, args.input_len, args.output_len, args.seed, num_prompts=args.num_prompts)
    cuda = str(options.get("device", "cpu")).startswith("cuda")
    write(path, args, device, runs, measure_link() if cuda else [])
    return runs


def write(path: str, args, device: str, runs: list[dict], link: list[dict]) -> None:
    """The measurement file: decode runs, the whole-run tokens/s, link entries."""
    model, layers = planner_model(args.model)
    gpu = catalog_gpu(device)
    data = {
        "format": "megaserve-measurements/1",
        "gpu": args.profile_gpu or gpu or device,
        "device": device,
        "source": {"command": "megaserve bench throughput " + " ".join(args.argv), "commit": _commit(),
                   "date": time.strftime("%Y-%m-%d", time.gmtime())},
        "model": model, "num_layers": layers, "dtype": args.dtype,
        "runs": runs,
    }
    if link:
        data["measurements"] = link
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
