"""Decode linears of Qwen3-30B-A3B on a CUDA GPU: weight bandwidth per call and per step,
today's rule against candidate split lengths and decode launches, bits checked.

Shape legend: M = tokens, N = output features, K = reduction, S = splits along K.

Per layer: qkv [N=5120, K=2048], o_proj [2048, 4096], router [128, 2048]; once per step:
lm_head [151936, 2048]; bf16, no bias. One process:

1. bitwise, in parallel worker processes (which also fill Triton's cache for the timings):
   every candidate (S, launch) against fold mode under the same S, M in CHECK_MS, fresh
   outputs poisoned with NaN; the planner's launch at M = 256 likewise; fold against a
   float64 reference;
2. per call: a 1 GiB copy's bandwidth (read + write), then each shape at M in TIME_MS,
   calls cycling through distinct weight copies (>= 4x the L2) replayed from a CUDA graph
   (lab/moe_bench.py's timer), for the baseline (the committed rule of BASELINE_RULE,
   i.e. ``config_for`` / ``plan_launch`` under it) and every bit-clean candidate;
3. per step: 48 x (qkv, o_proj, router) + lm_head in one graph at each M, baseline vs
   the rule in force (``config_for`` / ``plan_launch``) vs the fastest candidate per
   shape; TB/s of weight bytes (2.46 GB at this shape) and % of the copy's.

Usage (device): ``source lab/device/setup.sh; python3 lab/linear_decode.py --out $OUT``.
``--smoke``: CPU dry run under TRITON_INTERPRET=1 (tiny shapes, fp16, wall-clock timings).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time

import sweep_support  # lab/sweep_support.py

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048),
          "lm_head": (151936, 2048)}  # name -> (N, K)
PER_STEP = {"qkv": 48, "o_proj": 48, "router": 48, "lm_head": 1}
SPLITS = {"qkv": [1, 2, 4, 8], "o_proj": [1, 2, 4, 8, 16], "router": [1, 2, 4, 8, 16, 32],
          "lm_head": [1]}
CHECK_MS = [1, 3, 8, 64]
TIME_MS = [1, 8, 64, 256]
SWAP_MS = [1, 8, 64]
CYCLE_BYTES = 256 << 20  # weight bytes cycled per timed graph (H100 L2: 50 MB)
# The rule committed before this script: the baseline in every run.
BASELINE_RULE = ('{"max_k": 2048, "min_steps": 4, "quantum": 128, "swap": [[64, {"block_k": '
                 '128, "block_m": 64, "block_n": 128, "flat": 2, "flatten": false, '
                 '"fold_last": true, "group_m": 8, "mode": "swap", "num_stages": 3, '
                 '"num_warps": 4, "persistent": 0}]], "target_programs": 64}')
SMOKE_SHAPES = {"qkv": (192, 256), "o_proj": (64, 512), "router": (32, 256),
                "lm_head": (320, 256)}


def launches(smoke: bool = False) -> dict:
    """Candidate decode launches (swap mode, M <= 64): name -> Launch. ``smoke``: at the
    config's K step (the interpreter's dot is serial over k, not k16 steps)."""
    import dataclasses

    from megaserve.kernels.triton_impl.matmul import Launch as L

    cands = {
        "f64k128s3": L("swap", 64, num_warps=4, num_stages=3, block_k=128),
        "f64k128s4": L("swap", 64, num_warps=4, num_stages=4, block_k=128),
        "f64k256s3": L("swap", 64, num_warps=4, num_stages=3, block_k=256),
        "f64k64s4": L("swap", 64, num_warps=4, num_stages=4, block_k=64),
        "f128k128s3": L("swap", 128, num_warps=4, num_stages=3, block_k=128),
        "f128k64s4": L("swap", 128, num_warps=4, num_stages=4, block_k=64),
        "f32k128s4w2": L("swap", 32, num_warps=2, num_stages=4, block_k=128),
        "f16k128s4w1": L("swap", 16, num_warps=1, num_stages=4, block_k=128),
        "f64k128s3pf": L("swap", 64, num_warps=4, num_stages=3, block_k=128, fold_last=False),
        # deeper pipelines of small weight tiles: more bytes in flight per program
        "f16k256s6w1": L("swap", 16, num_warps=1, num_stages=6, block_k=256),
        "f16k128s8w1": L("swap", 16, num_warps=1, num_stages=8, block_k=128),
        "f32k256s5w2": L("swap", 32, num_warps=2, num_stages=5, block_k=256),
        "f32k128s8w2": L("swap", 32, num_warps=2, num_stages=8, block_k=128),
        "f64k128s6": L("swap", 64, num_warps=4, num_stages=6, block_k=128),
    }
    return {nm: dataclasses.replace(lp, block_k=0) if smoke else lp for nm, lp in cands.items()}


def cfg_of(k: int, s: int):
    from megaserve.kernels.triton_impl.matmul import MatmulConfig

    return MatmulConfig(64, k // s)


def splits(name: str, k: int) -> list[int]:
    """Candidate split counts of a shape whose split length is a multiple of 64."""
    return [s for s in SPLITS[name] if k % s == 0 and (k // s) % 64 == 0]


def usable(lp, cfg, k: int) -> bool:
    if cfg.split_len % (lp.block_k or cfg.block_k):
        return False
    return lp.fold_last or k // cfg.split_len > 1


def baseline_plan(n: int, k: int, m: int, dt):
    """(config, launch) of the earlier committed rule, whatever rule is in force now."""
    from megaserve.kernels.triton_impl import matmul as mm

    before = os.environ.get(mm.SMALL_K_RULE_ENV)
    os.environ[mm.SMALL_K_RULE_ENV] = BASELINE_RULE
    try:
        cfg = mm.config_for(n, k, dt)
        return cfg, mm.plan_launch(m, n, k, cfg)
    finally:
        if before is None:
            del os.environ[mm.SMALL_K_RULE_ENV]
        else:
            os.environ[mm.SMALL_K_RULE_ENV] = before


def current_plan(n: int, k: int, m: int, dt):
    from megaserve.kernels.triton_impl import matmul as mm

    cfg = mm.config_for(n, k, dt)
    return cfg, mm.plan_launch(m, n, k, cfg)


_ORIG_EMPTY = None


def _setup(smoke: bool):
    """Once per process: interpreter patch (smoke); NaN poison for fresh float tensors."""
    global _ORIG_EMPTY
    import torch

    if _ORIG_EMPTY is not None:
        return torch
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        sweep_support.patch_interpreter()
    _ORIG_EMPTY, torch.empty = sweep_support.poisoned_empty(torch)
    return torch


def _env(smoke: bool):
    import torch

    return ("cpu", torch.float16) if smoke else ("cuda", torch.bfloat16)


def _data(torch, dev, dt, n, k, rows, copies=1):
    g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dev, dt)
    x = torch.randn(rows, k, generator=g).to(dev, dt)
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    return ws, x


def check_job(job: tuple) -> tuple:
    """(shape, S, launch name or 'tall', smoke) -> (key, problems)."""
    name, s, lname, smoke = job
    torch = _setup(smoke)
    dev, dt = _env(smoke)
    from megaserve.kernels.triton_impl.matmul import linear, plan_launch

    n, k = (SMOKE_SHAPES if smoke else SHAPES)[name]
    key = f"{name}:S{s}:{lname}"
    try:
        cfg = cfg_of(k, s)
        (w,), x = _data(torch, dev, dt, n, k, 256)
        problems = []
        if lname == "tall":
            ref = linear(x, w, mode="fold", config=cfg)
            exact = x[:64].double() @ w.double().T
            err = float((ref[:64].double() - exact).norm() / exact.norm())
            if not err < 1e-2:
                problems.append(f"fold rel err {err:.2e}")
            lp = plan_launch(256, n, k, cfg)
            if not torch.equal(linear(x, w, config=cfg, launch=lp), ref):
                problems.append(f"M=256 {lp.mode}{lp.block_m}x{lp.block_n}")
            return key, problems
        ref = linear(x[:64], w, mode="fold", config=cfg)
        lp = launches(smoke)[lname]
        for m in CHECK_MS:
            out = linear(x[:m], w, config=cfg, launch=lp)
            if not torch.equal(out, ref[:m]):
                problems.append(f"M={m}")
        return key, problems
    except Exception as e:  # noqa: BLE001 - a candidate that fails is reported, not fatal
        return key, [f"error {type(e).__name__}: {str(e)[:300]}"]


def _timer(torch, smoke: bool):
    if smoke:
        def wall_us(fn, reps: int = 1) -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e6 / reps
        return wall_us, lambda: 1e12
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe_bench import graph_time_us

    from megaserve.bench.decode import measure_copy_bandwidth

    return graph_time_us, lambda: measure_copy_bandwidth("cuda", 1 << 30)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--deadline", type=float, default=230.0,
                        help="s after start: stop timing candidates, go to the step")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--ms", default=",".join(map(str, TIME_MS)),
                        help="comma-separated M values of the timings (default: %(default)s)")
    args = parser.parse_args(argv)
    time_ms = [int(v) for v in args.ms.split(",")]
    t0 = time.time()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    torch = _setup(args.smoke)
    dev, dt = _env(args.smoke)
    from megaserve.kernels.triton_impl.matmul import linear, plan_launch

    cand_lps = launches(args.smoke)
    jobs = [(name, s, ln, args.smoke) for name, (n, k) in shapes.items() for s in splits(name, k)
            for ln in ["tall", *cand_lps]
            if ln == "tall" or usable(cand_lps[ln], cfg_of(k, s), k)]
    bad: dict = {}
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for key, problems in pool.imap_unordered(check_job, jobs):
            if problems:
                bad[key] = problems
                print(f"NOT CLEAN {key}: {problems}", flush=True)
    print(f"checks: {len(jobs)} jobs, {len(bad)} not clean, {time.time() - t0:.0f}s", flush=True)

    torch.empty = _ORIG_EMPTY  # no NaN fills inside the timed graphs
    graph_us, copy_bw = _timer(torch, args.smoke)
    bw = copy_bw()
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    print(f"device {device}; copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    data = {}
    for name, (n, k) in shapes.items():
        copies = 2 if args.smoke else max(PER_STEP[name], min(160, -(-CYCLE_BYTES // (2 * n * k))))
        data[name] = _data(torch, dev, dt, n, k, max(time_ms), copies)
    res: dict = {"device": device, "copy_Bps": bw, "bad": bad, "calls": {}, "step": {}}

    def call_us(name, m, cfg, lp, cycle=True) -> float:
        ws, x = data[name]
        ws = ws if cycle else ws[:1]
        xm = x[:m].contiguous()

        def fn():
            for w in ws:
                linear(xm, w, config=cfg, launch=lp)
        return graph_us(fn, reps=3) / len(ws)

    def report(name, m, label, us):
        n, k = shapes[name]
        tbs = 2 * n * k / (us * 1e-6) / 1e12
        res["calls"].setdefault(name, {}).setdefault(str(m), {})[label] = us
        print(f"{name:>8} M={m:>3} {label:>22}: {us:8.2f} us {tbs:5.2f} TB/s "
              f"{100e12 * tbs / bw:5.1f}% copy", flush=True)

    best: dict = {}  # (name, m) -> (us, S, launch name)
    for name, (n, k) in shapes.items():
        for m in time_ms:
            cfg, lp = baseline_plan(n, k, m, dt)
            report(name, m, "baseline", call_us(name, m, cfg, lp))
            cfg, lp = current_plan(n, k, m, dt)
            report(name, m, "in force", call_us(name, m, cfg, lp))
    for name, (n, k) in shapes.items():
        for m in time_ms:
            for s in splits(name, k):
                if time.time() - t0 > args.deadline:
                    break
                cfg = cfg_of(k, s)
                if m > 64:
                    if f"{name}:S{s}:tall" in bad:
                        continue
                    lp = plan_launch(m, n, k, cfg)
                    cands = {"tall": lp}
                else:
                    cands = {ln: lp for ln, lp in cand_lps.items()
                             if usable(lp, cfg, k) and f"{name}:S{s}:{ln}" not in bad}
                for ln, lp in cands.items():
                    try:
                        us = call_us(name, m, cfg, lp)
                    except Exception as e:  # noqa: BLE001
                        print(f"time error {name} S{s} {ln} M={m}: {str(e)[:200]}", flush=True)
                        continue
                    report(name, m, f"S{s}:{ln}", us)
                    if (name, m) not in best or us < best[(name, m)][0]:
                        best[(name, m)] = (us, s, ln)
    print("fastest bit-clean candidate per shape and M:", flush=True)
    for (name, m), (us, s, ln) in sorted(best.items()):
        print(f"  {name:>8} M={m:>3}: S{s}:{ln} {us:.2f} us", flush=True)
    res["best"] = {f"{nm}:{m}": [us, s, ln] for (nm, m), (us, s, ln) in best.items()}

    step_bytes = sum(PER_STEP[nm] * 2 * n * k for nm, (n, k) in shapes.items())
    for m in time_ms:
        plans = {"baseline": {nm: baseline_plan(n, k, m, dt) for nm, (n, k) in shapes.items()},
                 "in force": {nm: current_plan(n, k, m, dt) for nm, (n, k) in shapes.items()}}
        if all((nm, m) in best for nm in shapes):
            plans["fastest"] = {}
            for nm, (n, k) in shapes.items():
                _, s, ln = best[(nm, m)]
                cfg = cfg_of(k, s)
                plans["fastest"][nm] = (cfg, cand_lps[ln] if ln != "tall"
                                        else plan_launch(m, n, k, cfg))
        for label, plan in plans.items():
            xs = {nm: data[nm][1][:m].contiguous() for nm in shapes}

            def step(plan=plan, xs=xs):
                for layer in range(PER_STEP["qkv"]):
                    for nm in ("qkv", "o_proj", "router"):
                        ws = data[nm][0]
                        linear(xs[nm], ws[layer % len(ws)], config=plan[nm][0], launch=plan[nm][1])
                linear(xs["lm_head"], data["lm_head"][0][0], config=plan["lm_head"][0],
                       launch=plan["lm_head"][1])
            us = graph_us(step, reps=2)
            tbs = step_bytes / (us * 1e-6) / 1e12
            res["step"].setdefault(str(m), {})[label] = us
            print(f"step M={m:>3} {label:>9}: {us / 1e3:7.3f} ms {tbs:5.2f} TB/s "
                  f"{100e12 * tbs / bw:5.1f}% copy ({step_bytes / 1e9:.2f} GB)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "linear_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
