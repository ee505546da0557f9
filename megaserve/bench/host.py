"""``megaserve bench host``: host (Python) time per decode step, per sequence, by phase.

On a GPU the decode forward is one CUDA graph replay; what the host does around it
(scheduling, filling the graph's static input rows, sampling bookkeeping, appending tokens,
detokenising, building outputs) is time the GPU may idle. This benchmark times those
phases of ``LLMEngine.step()`` for pure decode steps at batch sizes ``--batches``:

* B requests of ``--input-len`` token prompts (``ignore_eos``, long ``max_tokens``) are
  prefilled, ``--warmup-steps`` decode steps run, then ``--steps`` decode steps are timed;
* phases are timed with ``perf_counter`` around stable entry points, once per step (no
  per-sequence wrappers): ``schedule`` (``Scheduler.schedule``), ``fill`` (the decode
  graph's static rows, ``DecodeGraphs._fill``), ``device`` (the padded forward and the
  sampling of the tokens, synchronised on CUDA: not host time), ``runner other`` (the
  rest of the model runner's calls: ``ModelRunner.launch_decode`` and ``sample_decode``,
  or ``execute`` on a tree that predates them), ``outputs`` (the rest of ``step()``:
  appending tokens, stop checks, detokenisation, ``RequestOutput``s);
* ``host`` = step − device, reported in µs per sequence (median over steps).

``--output-kind`` sets the requests' ``SamplingParams.output_kind`` (cumulative: an
output per request per step, the default; delta: streaming; final_only: ``LLM.generate``),
where the tree has it (a tree that predates output kinds always builds cumulative
outputs). ``--async-scheduling`` turns the engine's overlap on where the tree has it (on
CPU nothing runs concurrently; the host work is what it measures).

On CPU the decode graph runs uncaptured (``DecodeGraphs(capture=False)``, the function a
graph captures), so the host path is the one a GPU step takes. ``--profile`` prints the
top functions of one more timed stretch under cProfile. ``--baseline-tree DIR`` runs each
repeat in a fresh process with ``DIR``'s megaserve and this checkout's in turn, printing
the ratio of every round (``git archive <commit> megaserve kernels | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

PHASES = ("schedule", "fill", "device", "runner other", "outputs", "host", "step")


class _PhaseTimer:
    """Wraps bound methods of one engine with perf_counter accumulators (per step)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.totals: dict[str, float] = {}

    def wrap(self, obj, name: str, phase: str, sync: bool = False) -> None:
        inner = getattr(obj, name)
        cuda = sync and self.device.startswith("cuda")

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            if cuda:
                import torch

                torch.cuda.synchronize()
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - t0
            return out

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


def _engine(args):
    from megaserve.engine.config import EngineConfig
    from megaserve.engine.engine import LLMEngine

    from megaserve.bench.random_model import model_path

    model = model_path(args.model)
    max_len = args.input_len + args.warmup_steps + 2 * args.steps + 8
    options = {}
    if args.async_scheduling and "async_scheduling" in EngineConfig.__dataclass_fields__:
        options["async_scheduling"] = True
    config = EngineConfig(model=model, dtype=args.dtype, device=args.device,
                          max_num_seqs=max(args.batches), max_model_len=max_len,
                          max_num_batched_tokens=max(4096, max(args.batches)),
                          num_kv_blocks=args.num_kv_blocks, **options)
    engine = LLMEngine(config)
    runner = engine.runner
    if args.device == "cpu" and runner.decode_graphs is None:
        from megaserve.engine.cuda_graphs import DecodeGraphs

        runner.decode_graphs = DecodeGraphs(
            runner.attention, runner.experts.experts, runner.kv_caches, runner.block_size,
            max(args.batches), int(runner.attention.cos.shape[0]), capture=False)
    return engine


def _instrument(engine, device: str) -> _PhaseTimer:
    from megaserve import kernels

    timer = _PhaseTimer(device)
    runner = engine.runner
    if runner.decode_graphs is None:  # CUDA: built on the first decode step
        runner.capture_decode_graphs()
    graphs = runner.decode_graphs
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(graphs, "_fill", "fill")
    if graphs.capture:
        # Replays go through run(); time the whole of it minus _fill as device time.
        timer.wrap(graphs, "run", "graph run", sync=True)
    else:
        timer.wrap(graphs, "_forward", "device", sync=True)
    timer.restore = lambda: None
    if hasattr(runner, "launch_decode"):
        timer.wrap(runner, "launch_decode", "execute")
        timer.wrap(runner, "sample_decode", "execute")
        timer.wrap(graphs, "_sample_tokens", "sample kernel", sync=True)
    else:  # a tree that predates them
        timer.wrap(runner, "execute", "execute")
        sample = kernels.sample
        timer.wrap(kernels, "sample", "sample kernel", sync=True)
        timer.restore = lambda: setattr(kernels, "sample", sample)
    return timer


def _phases(raw: dict[str, float], step: float) -> dict[str, float]:
    device = raw.get("device", 0.0) + raw.get("sample kernel", 0.0)
    if "graph run" in raw:
        device += raw["graph run"] - raw.get("fill", 0.0)
    schedule, execute, fill = raw.get("schedule", 0.0), raw.get("execute", 0.0), raw.get("fill", 0.0)
    return {"schedule": schedule, "fill": fill, "device": device,
            "runner other": execute - device - fill, "outputs": step - schedule - execute,
            "host": step - device, "step": step}


def measure_batch(engine, timer: _PhaseTimer, batch: int, args, profile: bool) -> dict:
    """Median µs per sequence of each phase over ``args.steps`` pure decode steps."""
    from megaserve.sampling_params import SamplingParams

    rng = random.Random(args.seed + batch)
    kind = {}
    if "output_kind" in SamplingParams.__dataclass_fields__:
        from megaserve.sampling_params import RequestOutputKind

        kind["output_kind"] = RequestOutputKind[args.output_kind.upper()]
    params = SamplingParams(max_tokens=args.warmup_steps + 2 * args.steps + 4,
                            temperature=args.temperature, ignore_eos=True, **kind)
    # Requests advancing in a step: each gets an output, except FINAL_ONLY (none while
    # running).
    expected = 0 if kind and args.output_kind == "final_only" else batch
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(engine.vocab_size) for _ in range(args.input_len)]
        engine.add_request(rid, prompt, params)
    while engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()
    timer.take()
    per_step = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outs = engine.step()
        step = time.perf_counter() - t0
        if len(outs) != expected:
            raise ValueError(f"batch {batch}: a step gave {len(outs)} outputs, not {expected}")
        per_step.append(_phases(timer.take(), step))
    report = {p: 1e6 * statistics.median(s[p] for s in per_step) / batch for p in PHASES}
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        report["profile"] = text.getvalue()
    for rid in ids:
        engine.abort_request(rid)
    return report


def _measure(args) -> dict[int, dict]:
    engine = _engine(args)
    timer = _instrument(engine, args.device)
    try:
        measure_batch(engine, timer, min(args.batches), args, False)  # warm-up
        return {b: measure_batch(engine, timer, b, args, args.profile) for b in args.batches}
    finally:
        timer.restore()


def _in_fresh_process(tree: Path, argv: list[str]) -> dict[int, dict]:
    # Imported here: a worker runs this file on a tree that may predate it.
    from megaserve.bench import baseline_tree

    return {int(b): r for b, r in baseline_tree.run(tree, __file__, "host", argv).items()}


def _print(name: str, results: dict[int, dict], base: dict[int, dict] | None = None) -> None:
    for b, r in results.items():
        row = " ".join(f"{r[p]:>12.2f}" for p in PHASES)
        ratio = f"  x{r['host'] / base[b]['host']:.2f}" if base else ""
        print(f"{name:>8} {b:>6} {row}{ratio}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaserve bench host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-moe",
                        help="builtin:NAME, a checkpoint directory, or random:<preset>:<layers>")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="64,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--output-kind", default="cumulative",
                        choices=["cumulative", "delta", "final_only"])
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--baseline-tree", default=None,
                        help="a source tree measured in turn with this one, fresh processes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.worker:  # one run of a --baseline-tree comparison (megaserve.bench.baseline_tree)
        print(json.dumps({b: {p: r[p] for p in PHASES} for b, r in _measure(args).items()}))
        return 0
    device = (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
              if args.device == "cpu" else args.device)
    print(f"device: {device}  model: {args.model}  dtype: {args.dtype}  "
          f"{args.steps} decode steps per batch, µs per sequence (median step)")
    print(f"{'run':>8} {'batch':>6} " + " ".join(f"{p:>12}" for p in PHASES))
    try:
        if args.baseline_tree:
            from megaserve.bench import baseline_tree

            worker_argv = baseline_tree.passthrough(argv)
            for r in range(args.repeat):
                base = _in_fresh_process(Path(args.baseline_tree), worker_argv)
                _print(f"base {r}", base)
                _print(f"this {r}", _in_fresh_process(baseline_tree.CHECKOUT, worker_argv), base)
            return 0
        for r in range(args.repeat):
            results = _measure(args)
            _print(str(r), results)
            for b, res in results.items():
                if "profile" in res:
                    print(f"\ncProfile, batch {b}, {args.steps} steps:\n{res['profile']}")
    except ValueError as e:
        print(f"megaserve bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
