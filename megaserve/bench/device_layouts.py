"""``megaserve bench device-layouts``: multi-GPU layouts of one host against a baseline.

Every layout serves the same cases; the baseline layout (``--baseline``, default the
co-located single-process engine on one GPU, CUDA graphs) is measured first in the same
run, and each layout's tokens/s is reported whole and per GPU::

    megaserve bench device-layouts --model random:qwen3-30b-a3b:48 --cases 64x256,64x1024 \\
        --whole 64x256 --layouts ep:2,dp:2,split:1,split:2 --json out.json

Layouts (``--layouts``, comma-separated):

* ``colocated``: one engine in this process on one GPU;
* ``ep:N``: co-located expert parallelism over N GPUs on the device plane
  (``data_parallel_size=N, enable_expert_parallel=True, transport="cuda_ipc"``: process i
  on GPU i is attention replica i and expert worker i);
* ``dp:N``: N whole engines, one per GPU (data parallelism, no exchange);
* ``attnR:E``: R attention replica processes on GPU 0, E expert processes on GPUs 1..E
  (device plane, cuda_ipc, lockstep);
* ``split:m``: one attention replica on GPU 0 + one expert process on GPU 1, m
  micro-batches (the device plane's one-process front-end).

A case ``IxB`` is ``I`` prompt tokens and ``B`` sequences **per attention replica** (a
layout with R replicas serves ``R * B``; with ``--batch-is total`` B is the layout's,
``ceil(B / R)`` per replica), ``--output-len`` tokens each. Per layout and
case:

* ``steady``: the ``R * B`` prompts are prefilled, decode runs until every sequence has a
  token plus :data:`SETTLE_STEPS` steps (graphs captured and replayed), then
  :data:`TIMED_STEPS` steps are timed: ``ms_step`` (the TPOT at that batch: the wall time
  over the tokens each sequence received in it) and ``tok_s = R * B / ms_step``, whole
  and per GPU; ``gc_passes`` / ``gc_ms``: the collector's passes of each generation in
  the front-end's process during those steps and their time (the heap is frozen as the
  server freezes it; a full pass is a pause of the step it falls in);
* for the cases in ``--whole``: the whole workload (``R * B`` fresh prompts, prefill
  included, every request to ``--output-len``) over its wall time, whole and per GPU.

One engine per layout serves every case (``max_num_seqs`` = the largest B). ``--json``
writes every row as it is measured (a run cut short keeps what finished);
``--measurements`` writes the planner's measurement file (planner/measurements.py) of the
rows it can express (co-located on one GPU, co-located EP, 1 attention + n_e experts,
DP as one of its one-GPU engines).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from dataclasses import dataclass

from megaserve.bench.layouts_report import measurements_file, merge, print_table, write_json
from megaserve.engine.gc_heap import collections_during, frozen_heap

SETTLE_STEPS = 4  # decode steps after every sequence has a token, before timing
TIMED_STEPS = 10
TRACED_STEPS = 3  # with $MEGASERVE_EXPERT_TRACE, after the timed steps


@dataclass(frozen=True)
class Case:
    """``input_len`` prompt tokens, ``batch`` sequences per attention replica."""

    input_len: int
    batch: int

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.batch < 1:
            raise ValueError(f"a case needs input_len >= 1 and batch >= 1, got {self}")

    @property
    def name(self) -> str:
        return f"{self.input_len}x{self.batch}"


def parse_cases(text: str) -> list[Case]:
    """``"64x256,2048x128"`` -> cases; ValueError naming a malformed entry."""
    cases = []
    for item in filter(None, text.split(",")):
        left, sep, right = item.partition("x")
        if not sep or not left.isdigit() or not right.isdigit():
            raise ValueError(f"case {item!r}: expected INPUT_LENxBATCH, e.g. 64x256")
        cases.append(Case(int(left), int(right)))
    if not cases:
        raise ValueError("no cases: give e.g. --cases 64x256")
    return cases


def layout_config(name: str, base: dict, device: str = "cuda"):
    """(EngineConfig, GPUs used, attention replicas) of a ``--layouts`` entry; ValueError
    for an unknown one. ``device="cpu"`` runs the same layouts over ``tcp`` (a check of the
    harness: no GPUs, the counts are the processes a GPU run would place)."""
    from megaserve.engine.config import EngineConfig

    link = "cuda_ipc" if device.startswith("cuda") else "tcp"
    kind, _, arg = name.partition(":")
    if kind == "colocated" and not arg:
        return EngineConfig(**base, device=f"{device}:0" if device == "cuda" else device), 1, 1
    if kind in ("ep", "dp") and arg.isdigit() and int(arg) >= 2:
        n = int(arg)
        if kind == "ep":
            return EngineConfig(**base, device=device, data_parallel_size=n,
                                enable_expert_parallel=True, transport=link), n, n
        return EngineConfig(**base, device=device, data_parallel_size=n, transport="tcp"), n, n
    if kind.startswith("attn") and kind[4:].isdigit() and arg.isdigit():
        r, e = int(kind[4:]), int(arg)
        gpus = dict(attention_gpus=(0,) * r, expert_gpus=tuple(range(1, 1 + e))) if link == "cuda_ipc" else {}
        return EngineConfig(**base, device=device, attention_replicas=r, expert_workers=e,
                            transport=link, **gpus), 1 + e, r
    if kind == "split" and (arg or "1").isdigit():
        return EngineConfig(**base, device=device, disaggregate=True, transport=link,
                            microbatches=int(arg or 1)), 2, 1
    raise ValueError(f"unknown layout {name!r}: use colocated, ep:N, dp:N (N >= 2), attnR:E or split:m")


def _prompts(vocab: int, count: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(count)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def steady(engine, prompts: list[list[int]], params, device: str, tag: str) -> dict:
    """Decode ms per step with every sequence of ``prompts`` decoding (module docstring);
    the requests are aborted afterwards. ``steps_to_decode``: steps until each had a token.

    A step is what each sequence gains a token in, counted from the outputs: a front-end
    whose ``step()`` returns whichever replica answered first (DP, no lockstep) makes
    several calls a step."""
    tokens: dict[str, int] = {}  # request id -> tokens delivered so far

    def step() -> list:
        outs = engine.step()
        for out in outs:
            tokens[out.request_id] = len(out.outputs[0].token_ids)
        return outs

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    started, steps = set(), 0
    while len(started) < len(prompts):
        if not engine.has_unfinished_requests():
            raise RuntimeError("every request finished before all were decoding: raise --output-len")
        started.update(out.request_id for out in step() if out.outputs[0].token_ids)
        steps += 1
    for _ in range(SETTLE_STEPS):
        step()
    _sync(device)
    before = sum(tokens.values())
    with collections_during() as passes:
        start = time.perf_counter()
        for _ in range(TIMED_STEPS):
            step()
        _sync(device)
        elapsed = time.perf_counter() - start
    decoded = (sum(tokens.values()) - before) / len(prompts)  # steps of every sequence
    if decoded <= 0:
        raise RuntimeError(f"no sequence gained a token in {TIMED_STEPS} steps")
    _traced_steps(engine, tag)
    for i in range(len(prompts)):
        engine.abort_request(f"{tag}{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return {"ms_step": elapsed / decoded * 1e3, "steps_to_decode": steps,
            "timed_steps": TIMED_STEPS, "decode_steps": decoded,
            "gc_passes": passes.count, "gc_ms": passes.seconds * 1e3}


def _traced_steps(engine, tag: str) -> None:
    """With ``$MEGASERVE_EXPERT_TRACE`` (megaserve/runtime/step_trace.py): TRACED_STEPS more
    steps in a trace window of every process, this one's timeline in ``front<tag>-0.json``."""
    from megaserve.runtime.step_trace import START_FILE, StepTrace

    front = StepTrace.from_env(f"front{tag.rstrip('.')}")
    if front is None:
        return
    start = os.path.join(front.trace_dir, START_FILE)
    open(start, "w").close()
    for _ in range(TRACED_STEPS):
        front.before_step()
        engine.step()
    os.remove(start)
    front.before_step()


def whole(engine, prompts: list[list[int]], params, device: str, tag: str) -> dict:
    """The whole workload over its wall time: generated tokens / s and steps."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    _sync(device)
    start = time.perf_counter()
    generated = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        steps += 1
    _sync(device)
    wall = time.perf_counter() - start
    return {"whole_tok_s": generated / wall, "whole_s": wall, "whole_steps": steps,
            "generated": generated}


def per_replica(case: Case, replicas: int, total: bool) -> int:
    """Sequences per attention replica of ``case`` (``total``: ``case.batch`` is the
    layout's, split evenly, rounded up)."""
    return -(-case.batch // replicas) if total else case.batch


def measure_layout(name: str, base: dict, cases: list[Case], whole_cases: set[str], output_len: int,
                   device: str, seed: int, total: bool = False) -> list[dict]:
    """One engine for layout ``name`` (``max_num_seqs``: the largest batch per replica);
    a row per case (module docstring)."""
    from megaserve import SamplingParams
    from megaserve.runtime.factory import make_engine

    _, _, replicas = layout_config(name, base, device)
    base = {**base, "max_num_seqs": max(per_replica(c, replicas, total) for c in cases)}
    config, gpus, replicas = layout_config(name, base, device)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine = make_engine(config)
    start_s = time.perf_counter() - started
    print(f"layout {name}: {type(engine).__name__} started in {start_s:.1f} s", flush=True)
    rows = []
    try:
        # The heap frozen as the server freezes it (megaserve/engine/gc_heap.py): a full
        # collection over the front-end's objects would pause a step now and then.
        with frozen_heap():
            for n, case in enumerate(cases):
                count = replicas * per_replica(case, replicas, total)
                row = {"layout": name, "engine": type(engine).__name__, "gpus": gpus,
                       "replicas": replicas, "m": config.microbatches, "input_len": case.input_len,
                       "output_len": output_len, "batch": count // replicas, "seqs": count,
                       "max_num_batched_tokens": config.max_num_batched_tokens,
                       "async_scheduling": config.async_scheduling, "start_s": start_s}
                prompts = _prompts(engine.vocab_size, count, case.input_len, seed + 2 * n)
                row.update(steady(engine, prompts, params, device, f"s{n}."))
                row["tok_s"] = count / row["ms_step"] * 1e3
                row["tok_s_gpu"] = row["tok_s"] / gpus
                if case.name in whole_cases:
                    fresh = _prompts(engine.vocab_size, count, case.input_len, seed + 2 * n + 1)
                    row.update(whole(engine, fresh, params, device, f"w{n}."))
                    row["whole_tok_s_gpu"] = row["whole_tok_s"] / gpus
                rows.append(row)
    finally:
        engine.shutdown()
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaserve bench device-layouts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3-30b-a3b:48")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the same layouts over tcp (checks the harness, not speed)")
    parser.add_argument("--cases", default="64x256", help="INPUT_LENxBATCH per attention replica, comma-separated")
    parser.add_argument("--batch-is", choices=("replica", "total"), default="replica",
                        help="total: a case's BATCH is the layout's sequences, split over its replicas")
    parser.add_argument("--whole", default=None,
                        help="cases also timed as a whole workload (default: the first; 'none': no case)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV pool per engine (default: 16 GiB on cuda, the engine's CPU "
                             "default on cpu, where each process's pool is host memory)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--baseline", default="colocated", help="the layout measured first")
    parser.add_argument("--layouts", default="ep:2")
    parser.add_argument("--async-scheduling", choices=("on", "off", "default"), default="default")
    parser.add_argument("--json", default=None, help="write every row here as it is measured")
    parser.add_argument("--measurements", default=None, help="write the planner's measurement file here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="check every layout's config, then stop")
    parser.add_argument("--stacks-after", type=float, default=None, metavar="S",
                        help="dump this process's Python stacks to stderr after S seconds (a hang's "
                             "evidence; worker processes dump theirs on SIGUSR1)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="no run: print the table of these --json files (one per layout, one call) "
                             "and write --json / --measurements from them; the first file's baseline counts")
    args = parser.parse_args(argv)
    if args.kv_cache_memory_bytes is None and args.device == "cuda":
        args.kv_cache_memory_bytes = 16 << 30
    if args.merge:
        found = [path for path in args.merge if os.path.exists(path)]
        if not found:
            print("megaserve bench device-layouts --merge: none of the files exists")
            return 1
        payload = merge([json.load(open(path)) for path in found])
        for path in sorted(set(args.merge) - set(found)):  # a run killed before its first row
            payload["failed"][os.path.basename(path)] = "no result: the run ended before its first row"
        write_json(args.json, payload)
        print_table(payload)
        if args.measurements:
            write_json(args.measurements, measurements_file(payload))
        return 0
    if args.stacks_after:
        import faulthandler
        import signal

        faulthandler.dump_traceback_later(args.stacks_after, exit=False)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # as the workers do
    cases = parse_cases(args.cases)
    whole_cases = ({cases[0].name} if args.whole is None else set() if args.whole == "none"
                   else {c.name for c in parse_cases(args.whole)})
    layouts = [args.baseline, *(n for n in args.layouts.split(",") if n and n != args.baseline)]
    if args.measurements:
        from megaserve.bench.profile_out import planner_model

        planner_model(args.model)  # ValueError now, not after the run
    import torch

    from megaserve.bench.random_model import model_path

    base = dict(model=model_path(args.model), dtype=args.dtype, max_num_seqs=max(c.batch for c in cases),
                kv_cache_memory_bytes=args.kv_cache_memory_bytes)  # per layout: measure_layout
    if args.max_num_batched_tokens:
        base["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.async_scheduling != "default":
        base["async_scheduling"] = args.async_scheduling == "on"
    for name in layouts:  # every name checked before the first engine
        config, gpus, replicas = layout_config(name, base, args.device)
        if args.dry_run:
            print(f"{name}: {gpus} GPU(s), {replicas} replica(s), m={config.microbatches}, "
                  f"transport {config.transport}, async {config.async_scheduling}, "
                  f"cases {[c.name for c in cases]}")
    if args.dry_run:
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("megaserve bench device-layouts: needs a CUDA GPU (or --device cpu)")
        return 2
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    payload = {"device": device_name, "gpus_visible": torch.cuda.device_count() if args.device == "cuda" else 0,
               "model": args.model, "dtype": args.dtype, "output_len": args.output_len,
               "cases": [c.name for c in cases], "batch_is": args.batch_is, "baseline": args.baseline,
               "tree": os.environ.get("MEGASERVE_TREE", "unknown"), "torch": torch.__version__,
               "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "rows": [], "failed": {}}
    for name in layouts:
        try:
            rows = measure_layout(name, dict(base), cases, whole_cases, args.output_len, args.device, args.seed,
                                  total=args.batch_is == "total")
        except Exception as e:  # the other layouts still run; the JSON says which failed
            payload["failed"][name] = f"{type(e).__name__}: {e}"
            print(f"layout {name!r} FAILED: {type(e).__name__}: {e}", flush=True)
            rows = []
        for row in rows:
            print("measured", row, flush=True)
        payload["rows"] += rows
        write_json(args.json, payload)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print_table(payload)
    if args.measurements:
        write_json(args.measurements, measurements_file(payload))
    return 0 if not payload["failed"] else 1

if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
