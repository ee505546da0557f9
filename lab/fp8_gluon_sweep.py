"""Launch sweep of the Gluon block-FP8 linear (kernels/triton_impl/fp8_gemm_gluon.py) on
fp8_bench's shapes, H200: tile rows x ring slots x TMA-store epilogue, against the Triton
plan and cuBLAS row-wise FP8 in the same run; each variant checked bitwise against the
Triton plan.

    python lab/fp8_gluon_sweep.py [--sizes 256 4096] [--block-m 128 64] [--stages 4 5 6]
                                  [--store tma reg]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

import torch

from megaserve.kernels import fp8_bench as fb
from megaserve.kernels.triton_impl import fp8_gemm_gluon as fg
from megaserve.kernels.triton_impl.fp8_gemm import (fp8_linear, plan_linear, quantize_rows,
                                                    split_groups)

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--block-m", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[6])
    parser.add_argument("--store", nargs="+", default=["tma"], choices=["tma", "reg"])
    args = parser.parse_args()
    variants = list(itertools.product(args.block_m, args.stages,
                                      [s == "tma" for s in args.store]))
    print(f"{'GEMM':22} {'M':>5} {'cuBLAS':>8} {'triton':>8} "
          + " ".join(f"{f'm{b}s{s}' + ('tma' if t else 'reg'):>10}" for b, s, t in variants))
    logs = {v: [] for v in variants}
    logs["triton"] = []
    for name, (n, k) in fb.GEMM_SHAPES.items():
        fp8 = [fb.random_fp8(n, k) for _ in range(fb.copies(n * k))]
        sb = torch.rand(1, n, device="cuda")
        for m in args.sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            sa = torch.rand(m, 1, device="cuda")
            cublas = fb.graph_us([lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb,
                                                                 out_dtype=torch.bfloat16)
                                   for w, _ in fp8])
            tri_lp = dataclasses.replace(plan_linear(m, n, k), gluon=False)
            tri = fb.graph_us([lambda w=w, s=s: fp8_linear(x, w, s, launch=tri_lp) for w, s in fp8])
            logs["triton"].append(cublas / tri)
            ref = fp8_linear(x, *fp8[0], launch=tri_lp)
            sg = split_groups(n, k)
            times = []
            for block_m, stages, tma in variants:
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

                def call(w, s, out=out, block_m=block_m, stages=stages, tma=tma):
                    fg.linear(xq, xs, w, s, out, sg, block_m=block_m, stages=stages, c_tma=tma)

                call(*fp8[0])
                assert torch.equal(out, ref), f"{name} M={m} {block_m} {stages} {tma}"
                us = fb.graph_us([lambda w=w, s=s: call(w, s) for w, s in fp8])
                times.append(us)
                logs[(block_m, stages, tma)].append(cublas / us)
            print(f"{name:22} {m:5d} {cublas:8.1f} {tri:8.1f} "
                  + " ".join(f"{t:10.1f}" for t in times), flush=True)
        del fp8
    for key, ratios in logs.items():
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"geomean cuBLAS / {key}: {geo:.3f} (GEMM only; quantize not timed)")


if __name__ == "__main__":
    main()
