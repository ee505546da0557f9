"""``megaserve bench device-plane``: the device data plane against the co-located engine.

The same workload for every layout, the co-located single-process engine on one GPU (CUDA
graphs) measured first in the same run as the baseline; ``cuda_ipc`` expert workers run
on the other GPUs when there are several (``device_engine.expert_device``), else on the
same one::

    megaserve bench device-plane --model random:qwen3-30b-a3b:16 --num-prompts 256 \\
        --input-len 64 --output-len 256 --microbatches 1,2 --transports inproc,cuda_ipc

Per layout: generated tokens/s and the ratio to co-located, host CPU time per step (this
process), decode steps run as graphs, and for in-process workers (``profile``) the
attention GPU's wait per combine, the expert GPU's wait per dispatch (CUDA events inside
the graphs, steady state at the full batch) and (token, expert) rows per expert GEMM.
``--layouts cuda_ipc:1:2`` runs 2 attention replicas (transport:m:R); ``ep:2``,
``dp:2``, ``attn2:1`` run every role as a process (megaserve.bench.device_layouts). ``--flag-rtt`` and
``--tick-latency`` add a stream flag's round trip and one tick's dispatch+combine
(p50/p99) between streams of this process and between two processes.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from dataclasses import dataclass, field


def _workload(vocab: int, num_prompts: int, input_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]}
            for _ in range(num_prompts)]


def _timed(engine, prompts, params) -> tuple[float, float, int, int]:
    """(wall s, CPU s, generated tokens, steps) of one pass of the workload."""
    import torch

    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p["prompt_token_ids"], params)
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    generated = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu, generated, steps


def _steady(engine, prompts, params, batch: int, trace_path: str | None) -> dict:
    """Steady decode at ``batch`` sequences: wall ms per step, GPU kernel ms per step
    (torch.profiler, when ``trace_path``), and for the device plane with ``profile`` the
    waits per tick (CUDA events inside the graphs) and rows per expert GEMM."""
    import torch

    from megaserve.runtime.device_plane import wait_times_ms

    for i, p in enumerate(prompts[:batch]):
        engine.add_request(f"w{i}", p["prompt_token_ids"], params)
    for _ in range(6):
        engine.step()
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 10
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    out = {"ms_step": (time.perf_counter() - start) / steps * 1e3}
    if trace_path is not None:
        from torch.profiler import ProfilerActivity, profile

        start_mark = os.path.join(os.path.dirname(trace_path), "start")
        open(start_mark, "w").close()  # expert processes trace their next steps too
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        out["gpu_ms_step"] = gpu_us / 3 / 1e3
        with open(trace_path, "w") as f:
            f.write(events.table(sort_by="self_device_time_total", row_limit=40))
        prof.export_chrome_trace(trace_path[:-len(".txt")] + ".json")
        os.remove(start_mark)
    experts = getattr(engine, "experts", None)
    if experts is not None and getattr(engine, "profile", False):
        b = max(experts.waits_by_batch, default=None)
        if b is not None:
            out["attn_wait_us"] = statistics.median(wait_times_ms(experts.waits_by_batch[b])) * 1e3
        waits = []
        for server in engine.servers:
            c = max(server.waits_by_rows, default=None)
            if c is not None:
                waits += wait_times_ms(server.waits_by_rows[c])
        if waits:
            out["expert_wait_us"] = statistics.median(waits) * 1e3
        out["rows_per_gemm"] = statistics.mean(s.rows_per_gemm() for s in engine.servers)
    for i in range(batch):
        engine.abort_request(f"w{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return out


ROUND_TRIPS = 100  # per captured graph (thousands of stream memory operations in one
                  # graph stalled its launch on an H100: keep graphs of hundreds)


def _ping_graph(flags, stream, rounds: int, timed: bool, peer=None):
    """A graph of ``rounds`` round trips: SET flags[0] (``peer[0]`` when given: the other
    process's memory), wait for flags[1] (and clear it); with ``timed``, events around each
    round trip."""
    import torch

    from megaserve.comm import stream_flags as sf
    from megaserve.runtime.device_plane import timing_event

    events = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        for _ in range(rounds):
            if timed:
                pair = (timing_event(), timing_event())
                pair[0].record()
            sf.write((flags if peer is None else peer)[0:1], sf.SET)
            sf.wait_and_clear(flags[1:2])
            if timed:
                pair[1].record()
                events.append(pair)
        graph.capture_end()
    return graph, events


def _pong_graph(flags, stream, peer=None):
    """A graph of round trips' other half: wait for flags[0] (and clear it), SET flags[1]
    (``peer[1]`` when given: the other process's memory)."""
    import torch

    from megaserve.comm import stream_flags as sf

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        for _ in range(ROUND_TRIPS):
            sf.wait_and_clear(flags[0:1])
            sf.write((flags if peer is None else peer)[1:2], sf.SET)
        graph.capture_end()
    return graph


def _pong_process(handle: bytes, go, done) -> None:
    """The other process: answers every SET of its own flags[0] by a SET of the parent's
    flags[1]. Like the data plane, each side waits on its own memory and writes the
    peer's (a wait on IPC-mapped memory failed with 'invalid argument' on an H100)."""
    import torch

    from megaserve.comm.cuda_ipc import open_tensor, share_tensor

    stream = torch.cuda.Stream()
    mine = torch.zeros(4 << 20, dtype=torch.int32, device="cuda")  # own segment (IPC)
    graph = _pong_graph(mine, stream, peer=open_tensor(handle))
    torch.cuda.synchronize()
    done.put(share_tensor(mine))
    while go.get() == "go":
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        done.put("done")


def flag_round_trips(repeats: int = 20) -> dict[str, list[float]]:
    """Round-trip times (us) of a stream flag between two streams of one process and
    between two processes on this GPU (CUDA IPC), each side a replayed CUDA graph."""
    import multiprocessing

    import torch

    from megaserve.bench.plane_tick import bounded_sync
    from megaserve.comm.cuda_ipc import open_tensor, share_tensor

    results: dict[str, list[float]] = {}
    # Same process: two streams.
    flags = torch.zeros(4 << 20, dtype=torch.int32, device="cuda")  # own segment (IPC)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    ping, events = _ping_graph(flags, a, ROUND_TRIPS, timed=True)
    pong = _pong_graph(flags, b)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        with torch.cuda.stream(b):
            pong.replay()
        with torch.cuda.stream(a):
            ping.replay()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) * 1e3 for s, e in events]
    results["in-process (2 streams)"] = times
    # Two processes.
    ctx = multiprocessing.get_context("spawn")
    go, done = ctx.Queue(), ctx.Queue()
    flags.zero_()
    torch.cuda.synchronize()
    peer = ctx.Process(target=_pong_process, args=(share_tensor(flags), go, done), daemon=True)
    peer.start()
    try:
        ping, events = _ping_graph(flags, a, ROUND_TRIPS, timed=True,
                                   peer=open_tensor(done.get(timeout=120)))
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            go.put("go")
            with torch.cuda.stream(a):
                ping.replay()
            bounded_sync(a, [flags[1:2]], peer.is_alive)
            done.get(timeout=60)
            times += [s.elapsed_time(e) * 1e3 for s, e in events]
        results["2 processes (cuda_ipc)"] = times
    finally:
        go.put("stop")
        peer.join(10)
        if peer.is_alive():
            peer.kill()
    return results


@dataclass(frozen=True)
class _Layout:
    """One row of the table: transport None is the co-located engine."""

    name: str
    transport: str | None
    m: int
    replicas: int
    async_scheduling: bool
    env: dict = field(default_factory=dict)  # set while the layout runs (A/B of a switch)


def _parse_layout(spec: str, async_default: bool) -> _Layout:
    """``transport:m[:R][+async][@KEY=VALUE...]`` (transport ``colocated``: the co-located
    engine again, e.g. with async scheduling); raises ``ValueError`` for anything else."""
    if spec.partition(":")[0] in ("ep", "dp") or spec.startswith("attn"):
        # Every role a process (megaserve.bench.device_layouts.layout_config).
        return _Layout(f"{spec} (processes)", f"layout:{spec}", 1, 1, async_default)
    spec, *env_items = spec.split("@")
    asynchronous = spec.endswith("+async")
    spec = spec.removesuffix("+async")
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"layout {spec!r}: expected transport:m[:R][+async][@KEY=VALUE]")
    env = dict(item.split("=", 1) for item in env_items if "=" in item)
    if len(env) != len(env_items):
        raise ValueError(f"layout {spec!r}: environment items must be KEY=VALUE")
    transport, m, r = parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
    name = "co-located" if transport == "colocated" else f"split {transport}"
    name += (f" R={r}" if r > 1 else "") + (" async" if asynchronous else "")
    name += "".join(f" {k.removeprefix('MEGASERVE_')}={v}" for k, v in env.items())
    return _Layout(name, None if transport == "colocated" else transport, m, r,
                   asynchronous or async_default, env)


def _measure(layout: _Layout, base: dict, params, args) -> dict:
    """One layout's row: the workload timed after a warm-up pass, then steady decode."""
    import torch

    from megaserve.engine.config import EngineConfig
    from megaserve.engine.engine import LLMEngine
    from megaserve.runtime.device_engine import DevicePlaneEngine

    name, transport, m, replicas = layout.name, layout.transport, layout.m, layout.replicas
    base["async_scheduling"] = layout.async_scheduling
    if transport is None:
        engine = LLMEngine(EngineConfig(**base))
    elif transport.startswith("layout:"):
        from megaserve.bench.device_layouts import layout_config
        from megaserve.runtime.factory import make_engine

        config, *_ = layout_config(transport.removeprefix("layout:"),
                                  {k: v for k, v in base.items() if k != "device"})
        engine = make_engine(config)
    else:
        config = EngineConfig(**base, disaggregate=True, transport=transport, microbatches=m,
                              expert_workers=args.expert_workers, attention_replicas=replicas)
        engine = DevicePlaneEngine(config, profile=args.profile and transport == "inproc")
    try:
        warm = _workload(engine.vocab_size, args.num_prompts, args.input_len, args.seed + 1)
        _timed(engine, warm, params)  # warm-up: compilation, graph capture, allocator
        # Fresh prompts for the timed pass: the warm-up's would hit the prefix cache and
        # leave prefill shapes that were never compiled inside the timed window.
        prompts = _workload(engine.vocab_size, args.num_prompts, args.input_len, args.seed)
        wall, cpu, generated, steps = _timed(engine, prompts, params)
        row = {"layout": name, "m": m, "tok_s": generated / wall,
               "cpu_ms_step": cpu / steps * 1e3, "steps": steps, "graph_steps": None,
               "rows_per_gemm": None, "attn_wait_us": None, "expert_wait_us": None,
               "ms_step": None, "gpu_ms_step": None}
        if getattr(engine, "experts", None) is not None:
            row["graph_steps"] = engine.experts.stats.graph_steps
        trace = (f"{args.trace_dir}/{name.replace(' ', '_')}_m{m}.txt"
                 if args.trace_dir else None)
        row.update(_steady(engine, prompts, params, args.max_num_seqs, trace))
    finally:
        engine.shutdown()
    if args.trace_dir:  # expert processes' timelines (step_trace.TRACE_ENV)
        import glob

        for path in glob.glob(f"{args.trace_dir}/expert*.json"):
            os.replace(path, f"{trace[:-len('.txt')]}_{os.path.basename(path)}")
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaserve bench device-plane", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3-30b-a3b:16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=16 << 30)
    parser.add_argument("--microbatches", default="1,2")
    parser.add_argument("--layouts", default=None,
                        help="transport:m[:R][+async][@KEY=VALUE] instead of transports x "
                             "microbatches, e.g. inproc:2,cuda_ipc:1,cuda_ipc:1:2 (R attention "
                             "replicas), colocated:1+async, cuda_ipc:1@MEGASERVE_X=1 (an "
                             "environment variable set while that layout runs)")
    parser.add_argument("--expert-workers", type=int, default=1)
    parser.add_argument("--transports", default="inproc,cuda_ipc")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="every layout overlaps the host with the device (vLLM's "
                             "--async-scheduling; the device plane's decode steps too)")
    parser.add_argument("--trace-dir", default=None,
                        help="write a torch.profiler kernel table of 3 steady steps per layout here")
    parser.add_argument("--profile", action="store_true",
                        help="in-process workers record wait times inside their graphs")
    parser.add_argument("--flag-rtt", action="store_true",
                        help="also time a stream flag's round trip (p50/p99)")
    parser.add_argument("--tick-latency", action="store_true",
                        help="also time one tick's dispatch+combine (256 tokens x hidden "
                             "2048 x top-8, echoing expert workers; p50/p99)")
    args = parser.parse_args(argv)
    import torch

    from megaserve import SamplingParams

    if not torch.cuda.is_available():
        print("megaserve bench device-plane: needs a CUDA GPU")
        return 2
    from megaserve.bench.random_model import model_path

    model = model_path(args.model)
    base = dict(model=model, dtype=args.dtype, device="cuda",
                max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                async_scheduling=args.async_scheduling)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    layouts = [_Layout("co-located", None, 1, 1, args.async_scheduling)]
    specs = (args.layouts.split(",") if args.layouts else
             [f"{t}:{m}" for t in args.transports.split(",") for m in args.microbatches.split(",")])
    layouts += [_parse_layout(spec, args.async_scheduling) for spec in specs]
    rtt = flag_round_trips() if args.flag_rtt else {}
    for name, times in rtt.items():
        q = statistics.quantiles(times, n=100)
        print(f"flag round trip, {name}: p50 {q[49]:.1f} us, p99 {q[98]:.1f} us "
              f"({len(times)} round trips, graphs of {ROUND_TRIPS})", flush=True)
    ticks = {}
    if args.tick_latency:
        from megaserve.bench.plane_tick import TICKS, tick_latency

        for workers in (1, 2):
            for processes in (False, True):
                name = f"E={workers}, {'2 processes (cuda_ipc)' if processes else 'in-process'}"
                ticks[name] = tick_latency(workers, processes)["plane"]
                q = statistics.quantiles(ticks[name], n=100)
                print(f"tick dispatch+combine, {name}: p50 {q[49]:.1f} us, p99 {q[98]:.1f} us",
                      flush=True)
    rows = []
    for layout in layouts:
        saved_env = {key: os.environ.get(key) for key in layout.env}
        os.environ.update(layout.env)  # expert processes start with it
        try:
            rows.append(_measure(layout, dict(base), params, args))
            print("measured", rows[-1], flush=True)
        except Exception as e:  # the other layouts still run; the table says which failed
            print(f"layout {layout.name!r} m={layout.m} FAILED: {type(e).__name__}: {e}",
                  flush=True)
        finally:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    if not rows or rows[0]["layout"] != "co-located":
        print("megaserve bench device-plane: the co-located baseline did not run")
        return 1
    base_tok = rows[0]["tok_s"]
    print(f"device: {torch.cuda.get_device_name()}  model: {args.model} {args.dtype}  "
          f"{args.num_prompts} x ({args.input_len} in + {args.output_len} out), greedy")
    print(f"{'layout':<36} {'m':>2} {'tok/s':>9} {'vs co-loc':>9} {'cpu ms/step':>11} "
          f"{'steady ms/step':>14} {'gpu ms/step':>11} "
          f"{'rows/GEMM':>9} {'attn wait us':>12} {'exp wait us':>11}")
    for r in rows:
        def fmt(v, f="{:.1f}"):
            return f.format(v) if v is not None else "-"
        print(f"{r['layout']:<36} {r['m']:>2} {r['tok_s']:>9.0f} {r['tok_s'] / base_tok:>8.2f}x "
              f"{r['cpu_ms_step']:>11.2f} {fmt(r['ms_step'], '{:.2f}'):>14} "
              f"{fmt(r['gpu_ms_step'], '{:.2f}'):>11} {fmt(r['rows_per_gemm']):>9} "
              f"{fmt(r['attn_wait_us']):>12} {fmt(r['expert_wait_us']):>11}")
    for name, times in rtt.items():
        q = statistics.quantiles(times, n=100)
        print(f"flag round trip, {name}: p50 {q[49]:.1f} us, p99 {q[98]:.1f} us "
              f"({len(times)} round trips, graphs of {ROUND_TRIPS})")
    for name, times in ticks.items():
        q = statistics.quantiles(times, n=100)
        print(f"tick dispatch+combine (256 x 2048 x top-8, bf16), {name}: p50 {q[49]:.1f} us, "
              f"p99 {q[98]:.1f} us ({len(times)} ticks, graphs of {TICKS})")
    return 0
