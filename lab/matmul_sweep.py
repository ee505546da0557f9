"""Sweep of batch-invariant matmul launches on a CUDA GPU: bitwise checks, then timings.

For each (K, N) of `megaserve bench kernels`' matmul table and each candidate launch
(kernels.triton_impl.matmul.Launch):
1. bitwise: rows of ``linear(x[:M], launch=variant)`` equal those of the default fold
   mode on the whole batch, for M in CHECK_MS (outputs poisoned with NaN first);
2. timing: CUDA-graph replay medians of each variant and of ``torch.mm`` (cuBLAS) at the
   benchmark's M values, same run.

Usage (device): ``PYTHONPATH=. python3 lab/matmul_sweep.py --part small --json out.json``.
Prints one line per cell: cuBLAS us, then ratio (cuBLAS / ours) per variant, best first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import sweep_support  # lab/sweep_support.py

CHECK_MS = [1, 2, 3, 5, 8, 16, 17, 31, 32, 33, 64, 65, 100, 127, 128, 129, 256, 512, 1000, 2048]


def variants(part: str) -> dict[str, tuple[object, int, int]]:
    """name -> (Launch, smallest M, largest M) of the candidates of one sweep part."""
    from megaserve.kernels.triton_impl.matmul import Launch as L

    small = {
        "swap128": (L("swap", 128, num_warps=4, num_stages=4), 1, 64),
        "swap128k": (L("swap", 128, num_warps=4, num_stages=4, fold_last=False), 1, 64),
        "swap64": (L("swap", 64, num_warps=4, num_stages=4), 1, 64),
        "swap64s3": (L("swap", 64, num_warps=4, num_stages=3), 1, 64),
    }
    mid = {
        "split": (L("split"), 65, 1000),
        "split_k": (L("split", fold_last=False), 65, 1000),
        "split64x128k": (L("split", 64, 128, 4, 4, fold_last=False), 65, 1000),
        "split128x64k": (L("split", 128, 64, 4, 4, fold_last=False), 65, 1000),
        "fold64x128": (L("fold", 64, 128, 4, 4), 65, 2048),
        "fold128x64": (L("fold", 128, 64, 4, 4), 65, 2048),
    }
    large = {
        "fold": (L("fold"), 65, 8192),
        "fold_s3": (L("fold", num_stages=3), 129, 8192),
        "fold_s5": (L("fold", num_stages=5), 129, 8192),
        "fold_g16": (L("fold", group_m=16), 129, 8192),
        "persist": (L("fold", persistent=132), 129, 8192),
        "persist_fl": (L("fold", persistent=132, flatten=True), 129, 8192),
        "persist_fl_s3": (L("fold", num_stages=3, persistent=132, flatten=True), 129, 8192),
        "fold128x256": (L("fold", 128, 256, 8, 3), 129, 8192),
        "swap64s3k": (L("swap", 64, num_warps=4, num_stages=3, fold_last=False), 1, 64),
        "swap64s2": (L("swap", 64, num_warps=4, num_stages=2), 1, 64),
        "swap128s3k": (L("swap", 128, num_warps=4, num_stages=3, fold_last=False), 1, 64),
    }
    return {"small": {**small, **mid}, "large": large, "all": {**small, **mid, **large}}[part]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=["small", "large", "all"], default="all")
    parser.add_argument("--m", type=int, nargs="*", default=[1, 8, 32, 128, 512, 2048, 8192])
    parser.add_argument("--rep", type=float, default=40.0, help="ms per timing")
    parser.add_argument("--deadline", type=float, default=270.0, help="stop timing after s")
    parser.add_argument("--json", default="", help="write all results here")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU dry run under TRITON_INTERPRET=1: tiny shapes, no timing")
    args = parser.parse_args(argv)
    if args.smoke:
        sweep_support.patch_interpreter()
    import torch
    import triton.testing

    from megaserve.kernels.bench import SHAPES_KN
    from megaserve.kernels.triton_impl.matmul import linear

    dev, dt, shapes, check_ms = "cuda", torch.bfloat16, SHAPES_KN, CHECK_MS
    if args.smoke:  # the interpreter mis-reads bf16 through TMA descriptors: fp16
        dev, dt, shapes, check_ms = "cpu", torch.float16, [(640, 200)], [1, 3, 17, 64, 129]

    t0 = time.time()
    cands = variants(args.part)
    results: dict = {"device": dev if args.smoke else torch.cuda.get_device_name(), "checks": {}, "times": []}
    orig, poisoned = sweep_support.poisoned_empty(torch)
    bad = set()
    # 1. bitwise checks against the default fold mode
    for k, n in shapes:
        torch.manual_seed(k * 7 + n)
        w = torch.randn(n, k, device=dev, dtype=dt) / math.sqrt(k)
        b = torch.randn(n, device=dev, dtype=dt)
        x_all = torch.randn(max(check_ms), k, device=dev, dtype=dt)
        torch.empty = poisoned
        try:
            ref = linear(x_all, w, b, mode="fold")
            for name, (lp, lo, hi) in cands.items():
                mism = []
                try:
                    for m in check_ms:
                        if m <= min(hi, max(check_ms)):
                            out = linear(x_all[:m], w, b, launch=lp)
                            if not torch.equal(out, ref[:m]):
                                mism.append(m)
                except Exception as e:  # a variant that does not compile is reported
                    mism.append(f"error {type(e).__name__}: {str(e)[:200]}")
                results["checks"][f"{k}x{n}:{name}"] = mism
                if mism:
                    bad.add(name)
                    print(f"MISMATCH {k}x{n} {name}: {mism}", flush=True)
        finally:
            torch.empty = orig
    print(f"checks done in {time.time() - t0:.0f}s; {len(bad)} variants failed: {sorted(bad)}",
          flush=True)

    if args.smoke:
        return 1 if bad else 0

    # 2. timings (graph replays), cuBLAS in the same loop
    def tm(fn) -> float:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3

    for k, n in SHAPES_KN:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        for m in args.m:
            if time.time() - t0 > args.deadline:
                print("deadline reached; stopping", flush=True)
                break
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w_t = w.t()
            cell = {"K": k, "N": n, "M": m, "cublas": tm(lambda: torch.mm(x, w_t)),
                    "default": tm(lambda: linear(x, w))}
            for name, (lp, lo, hi) in cands.items():
                if lo <= m <= hi and name not in bad:
                    try:
                        cell[name] = tm(lambda lp=lp: linear(x, w, launch=lp))
                    except Exception as e:
                        print(f"time error {k}x{n} M={m} {name}: {str(e)[:200]}", flush=True)
            results["times"].append(cell)
            ratios = sorted(((cell["cublas"] / v, key) for key, v in cell.items()
                             if key not in ("K", "N", "M", "cublas")), reverse=True)
            print(f"{k:>5} {n:>5} {m:>4} cublas {cell['cublas']:7.1f} | "
                  + " ".join(f"{key}={r:.2f}" for r, key in ratios), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
