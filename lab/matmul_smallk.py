"""Sweep: split rules for small-K matmul families (K <= 2048), decided in one run.

For each candidate :class:`SmallKRule` (split length from (N, K) only) and each decode
launch (swap mode: 64/128 weight rows, K step 64/128, stages, who folds):

1. bitwise, in parallel worker processes (which also fill Triton's disk cache for the
   timings, the GPU tests and ``megaserve bench kernels`` that follow in the same call):
   every launch vs fold mode under the same rule, M in CHECK_MS (swap up to 64), with and
   without bias, outputs poisoned with NaN; M > 64 through the planner's launch;
2. timings (main process alone on the GPU): CUDA-graph replay medians of each launch and
   of ``torch.mm`` at M in {1, 8, 32, 64} and the planner's launch at M in {128, 512};
3. decision: per rule, the best bitwise-clean launch of each M bucket (geomean over the
   shapes); the rule with the best geomean over shapes x M wins if it beats today's
   generic rule by 2% and lifts the worst M <= 64 cell of (2048, 7168). Its JSON goes to
   ``--rule-out`` ("none" if nothing wins), for ``MEGASERVE_MATMUL_SMALL_K``.

Usage (device): ``PYTHONPATH=. python3 lab/matmul_smallk.py --out $OUT``.
``--smoke``: CPU dry run under TRITON_INTERPRET=1 (tiny shapes, fake timings).
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

CHECK_MS = [1, 2, 3, 5, 8, 16, 17, 31, 32, 33, 64, 65, 128, 129, 512, 2048]
TIME_MS = [1, 8, 32, 64]
TALL_MS = [128, 512]
BUCKETS = [(16, [1, 8]), (32, [32]), (64, [64])]  # (max_m, timed M values)
SHAPES = [(2048, 7168), (2048, 4096), (1024, 7168)]  # (K, N)
RULES = {"generic": None, "p64": 64, "p132": 132, "p264": 264}
# Non-small-K cells of the GPU test and of `bench kernels`: compiled by the workers too.
BENCH_MS = [1, 8, 32, 128, 512, 2048, 8192]
TEST_MS = [1, 2, 3, 7, 16, 63, 64, 65, 100, 128, 129, 200, 511, 1000, 2047, 4096]


def launches() -> dict:
    from megaserve.kernels.triton_impl.matmul import Launch as L

    return {
        "s64": L("swap", 64, num_warps=4, num_stages=3),
        "s64s4": L("swap", 64, num_warps=4, num_stages=4),
        "s64s6": L("swap", 64, num_warps=4, num_stages=6),
        "s64k128": L("swap", 64, num_warps=4, num_stages=3, block_k=128),
        "s128": L("swap", 128, num_warps=4, num_stages=4),
        "s128k128": L("swap", 128, num_warps=4, num_stages=3, block_k=128),
        "s64s4pf": L("swap", 64, num_warps=4, num_stages=4, fold_last=False),
        "s128pf": L("swap", 128, num_warps=4, num_stages=4, fold_last=False),
    }


def rule_of(name: str):
    from megaserve.kernels.triton_impl.matmul import SmallKRule

    p = RULES[name]
    return None if p is None else SmallKRule(2048, p)


def config(name: str, n: int, k: int, dt):
    from megaserve.kernels.triton_impl.matmul import config_for

    rule = rule_of(name)
    return config_for(n, k, dt) if rule is None else rule.config(n, k)


def usable(lname: str, cfg, k: int) -> bool:
    """A launch applies to a config if its K step divides the split length; the parallel
    fold variants only where there is more than one split."""
    lp = launches()[lname]
    if cfg.split_len % (lp.block_k or cfg.block_k):
        return False
    return lp.fold_last or -(-k // cfg.split_len) > 1


_ORIG_EMPTY = None


def _setup(smoke: bool):
    """Once per process: the generic rule by default, the interpreter patch (smoke), NaN
    poison for fresh tensors (unwritten outputs show)."""
    global _ORIG_EMPTY
    import torch

    if _ORIG_EMPTY is not None:
        return torch
    os.environ["MEGASERVE_MATMUL_SMALL_K"] = "none"  # the generic rule unless a config says
    if smoke:
        sweep_support.patch_interpreter()
    _ORIG_EMPTY, torch.empty = sweep_support.poisoned_empty(torch)
    return torch


def _env(smoke: bool):
    import torch

    if smoke:
        return torch, "cpu", torch.float16
    return torch, "cuda", torch.bfloat16


def _data(torch, dev, dt, k, n, rows):
    g = torch.Generator(device="cpu").manual_seed(k * 7 + n)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dev, dt)
    b = torch.randn(n, generator=g).to(dev, dt)
    x = torch.randn(rows, k, generator=g).to(dev, dt)
    return w, b, x


def check_job(job: tuple) -> tuple:
    """(rule, k, n, launch name or 'tall', smoke) -> (key, mismatches, note)."""
    rname, k, n, lname, smoke, check_ms = job
    torch = _setup(smoke)
    torch, dev, dt = _env(smoke)
    from megaserve.kernels.triton_impl.matmul import linear, plan_launch

    key = f"{rname}:{k}x{n}:{lname}"
    try:
        cfg = config(rname, n, k, dt)
        w, b, x = _data(torch, dev, dt, k, n, max(check_ms))
        mism, note = [], ""
        for bias in (b, None):
            ref = linear(x, w, bias, mode="fold", config=cfg)
            for m in check_ms:
                if bias is None and m not in TIME_MS + TALL_MS:
                    continue
                if lname == "tall":
                    if m <= 64:
                        continue
                    lp = plan_launch(m, n, k, cfg)
                    if bias is not None:
                        note += f"M={m}:{lp.mode}{lp.block_m}x{lp.block_n} "
                else:
                    if m > 64:
                        continue
                    lp = launches()[lname]
                out = linear(x[:m], w, bias, config=cfg, launch=lp)
                if not torch.equal(out, ref[:m]):
                    mism.append(m if bias is not None else f"{m}nobias")
        return key, mism, note
    except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
        return key, [f"error {type(e).__name__}: {str(e)[:300]}"], ""


def warm_job(job: tuple) -> tuple:
    """Compile (and run once) the cells of the GPU test / bench for a K > 2048 shape."""
    k, n, ms, with_bias, smoke = job
    torch = _setup(smoke)
    torch, dev, dt = _env(smoke)
    from megaserve.kernels.triton_impl.matmul import Launch, linear

    try:
        w, b, x = _data(torch, dev, dt, k, n, max(ms))
        for m in ms:
            linear(x[:m], w, b if with_bias else None)
        if with_bias:  # the test's launch list at its M values
            lps = [Launch("fold"), Launch("fold", 128, 256, 8, 4), Launch("fold", 64, 128, 4, 4),
                   Launch("split", 128, 64, 4, 4, fold_last=False),
                   Launch("swap", 128, num_warps=4, num_stages=4),
                                          Launch("swap", 128, num_warps=4, num_stages=4,
                                                 fold_last=False),
                                          Launch("swap", 64, num_warps=4, num_stages=3)]
            for m in (5, 33, 64, 100, 300):
                linear(x[:m], w, b, mode="fold")
                for lp in lps:
                    if lp.mode != "swap" or m <= 64:
                        linear(x[:m], w, b, launch=lp)
        return f"warm {k}x{n} bias={with_bias}", ""
    except Exception as e:  # noqa: BLE001
        return f"warm {k}x{n} bias={with_bias}", f"{type(e).__name__}: {str(e)[:300]}"


def _geo(xs: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else 0.0


def decide(times: dict, bad: set, shapes: list, smoke_ok: bool = False) -> dict:
    """times[(rule, k, n, m, launch)] = us, plus (None, k, n, m, 'cublas'). Returns
    {rule: {score, min7168, buckets}} and the winner's name under 'winner'."""
    out: dict = {}
    for rname in RULES:
        buckets, ratios, ok = [], {}, True
        for max_m, bms in BUCKETS:
            if rname == "generic":
                cand = ["default"]
            else:
                cand = sorted({lk[4] for lk in times if lk[0] == rname and lk[3] in bms
                               and lk[4] not in ("default", "cublas")})
            best, best_s = None, 0.0
            for lname in cand:
                rs = []
                for k, n in shapes:
                    if lname != "default" and f"{rname}:{k}x{n}:{lname}" in bad:
                        rs = []
                        break
                    for m in bms:
                        t = times.get((rname, k, n, m, lname))
                        c = times.get((None, k, n, m, "cublas"))
                        if t is None or c is None:
                            rs = []
                            break
                        rs.append(c / t)
                    if not rs:
                        break
                if rs and _geo(rs) > best_s:
                    best, best_s = lname, _geo(rs)
            if best is None:
                ok = False
                break
            buckets.append((max_m, best))
            for k, n in shapes:
                for m in bms:
                    ratios[(k, n, m)] = times[(None, k, n, m, "cublas")] / times[
                        (rname, k, n, m, best)]
        if ok:
            for k, n in shapes:
                if f"{rname}:{k}x{n}:tall" in bad:
                    ok = False
                for m in TALL_MS:
                    t = times.get((rname, k, n, m, "default"))
                    c = times.get((None, k, n, m, "cublas"))
                    if t is None or c is None:
                        ok = False
                    else:
                        ratios[(k, n, m)] = c / t
        if not ok:
            out[rname] = {"ok": False}
            continue
        k0, n0 = shapes[0]
        out[rname] = {"ok": True, "score": _geo(list(ratios.values())),
                      "min_first": min(ratios[(k0, n0, m)] for m in TIME_MS),
                      "buckets": buckets,
                      "ratios": {f"{k}x{n}:M{m}": round(r, 3) for (k, n, m), r in ratios.items()}}
    base = out.get("generic", {})
    winner = None
    if base.get("ok"):
        for rname, r in out.items():
            if rname == "generic" or not r.get("ok"):
                continue
            if (r["score"] > 1.02 * base["score"] and r["min_first"] > base["min_first"]
                    and (winner is None or r["score"] > out[winner]["score"])):
                winner = rname
    out["winner"] = winner
    return out


def rule_json(rname: str | None, buckets: list) -> str:
    if rname is None:
        return "none"
    from megaserve.kernels.triton_impl.matmul import SmallKRule

    base = rule_of(rname)
    return SmallKRule(base.max_k, base.target_programs, base.min_steps, base.quantum,
                      tuple((m, launches()[ln]) for m, ln in buckets)).to_json()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".", help="folder for smallk.json and rule.json")
    parser.add_argument("--workers", type=int, default=18)
    parser.add_argument("--rep", type=float, default=10.0, help="ms per timing")
    parser.add_argument("--deadline", type=float, default=150.0, help="stop timing after s")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.time()
    shapes, check_ms = SHAPES, CHECK_MS
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        shapes, check_ms = [(256, 200), (128, 96)], [1, 3, 8, 17, 64, 65, 128]
    torch = _setup(args.smoke)
    torch, dev, dt = _env(args.smoke)
    from megaserve.kernels.triton_impl.matmul import linear, plan_launch

    jobs = [(r, k, n, ln, args.smoke, check_ms) for r in RULES for k, n in shapes
            for ln in ["tall", *launches()]
            if ln == "tall" or usable(ln, config(r, n, k, dt), k)]
    warm = [] if args.smoke else (
        [(k, n, BENCH_MS, False, False) for k, n in
         [(4096, 14336), (14336, 4096), (7168, 2048), (4096, 4096)]]
        + [(k, n, TEST_MS, True, False) for k, n in [(4096, 14336), (7168, 2048)]])
    bad, checks, notes = set(), {}, {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        warm_res = pool.map_async(warm_job, warm, chunksize=1)
        for key, mism, note in pool.imap_unordered(check_job, jobs):
            checks[key], notes[key] = mism, note
            if mism:
                bad.add(key)
                print(f"MISMATCH {key}: {mism}", flush=True)
        for name, err in warm_res.get():
            if err:
                print(f"{name}: {err}", flush=True)
    print(f"checks: {len(jobs)} jobs, {len(bad)} with mismatches, {time.time() - t0:.0f}s",
          flush=True)
    for key in sorted(k for k in notes if k.endswith(":tall")):
        print(f"  {key}: {notes[key]}", flush=True)

    times: dict = {}
    if args.smoke:
        import random

        rnd = random.Random(0)
        for k, n in shapes:
            for m in TIME_MS + TALL_MS:
                times[(None, k, n, m, "cublas")] = 8.0
                for r in RULES:
                    for ln in ["default", *launches()]:
                        times[(r, k, n, m, ln)] = rnd.uniform(7, 11)
    else:
        import triton.testing

        def tm(fn) -> float:
            fn()
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(fn, rep=args.rep,
                                                     return_mode="median") * 1e3

        torch.empty = _ORIG_EMPTY  # no NaN fills inside the timed graphs
        for k, n in shapes:
            w, _, xs = _data(torch, dev, dt, k, n, max(TALL_MS))
            for m in TIME_MS + TALL_MS:
                if time.time() - t0 > args.deadline:
                    print("deadline reached; deciding on what was timed", flush=True)
                    break
                x = xs[:m].contiguous()
                w_t = w.t()
                times[(None, k, n, m, "cublas")] = c = tm(lambda: torch.mm(x, w_t))
                line = []
                for r in RULES:
                    cfg = config(r, n, k, dt)
                    if m > 64 or r == "generic":
                        lp = plan_launch(m, n, k, cfg)
                        times[(r, k, n, m, "default")] = t = tm(
                            lambda cfg=cfg, lp=lp: linear(x, w, config=cfg, launch=lp))
                        line.append(f"{r}={c / t:.2f}")
                        continue
                    line.append(f"{r}:")
                    for ln, lp in launches().items():
                        if f"{r}:{k}x{n}:{ln}" in bad or not usable(ln, cfg, k):
                            continue
                        try:
                            times[(r, k, n, m, ln)] = tm(
                                lambda lp=lp, cfg=cfg: linear(x, w, config=cfg, launch=lp))
                        except Exception as e:  # noqa: BLE001
                            print(f"time error {r} {k}x{n} M={m} {ln}: {str(e)[:200]}")
                    best = max(((c / v, key[4]) for key, v in times.items()
                                if key[:4] == (r, k, n, m)), default=(0.0, "-"))
                    line[-1] += f"{best[1]}={best[0]:.2f}"
                print(f"{k:>5} {n:>5} M={m:>4} cublas {c:6.1f}us | " + " ".join(line),
                      flush=True)
    res = decide(times, bad, shapes)
    win = res["winner"]
    text = rule_json(win, res[win]["buckets"] if win else [])
    for r in RULES:
        s = res[r]
        if s.get("ok"):
            print(f"rule {r:>8}: geomean {s['score']:.3f}  min at M<=64 on {shapes[0]} "
                  f"{s['min_first']:.2f}  launches {s['buckets']}", flush=True)
        else:
            print(f"rule {r:>8}: incomplete or not bitwise clean", flush=True)
    print(f"winner: {win}\nRULE {text}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rule.json"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "smallk.json"), "w") as f:
        json.dump({"device": "cpu" if args.smoke else torch.cuda.get_device_name(),
                   "checks": checks, "notes": notes, "decision": res,
                   "times": [[*map(str, key), v] for key, v in times.items()]}, f, indent=1)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
