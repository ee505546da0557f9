"""Prefill-sized linears of Qwen3-30B-A3B (qkv, o_proj) and a 4096 x 4096 weight against
cuBLAS, for the launch ``plan_launch`` picks and a few fold launches, bitwise against the
default (a launch never changes the bits). CUDA-graph replay medians, us per call; the
ratio is cuBLAS time / ours (above 1: faster than cuBLAS).

Run on one CUDA GPU: ``PYTHONPATH=. python3 lab/prefill_linears.py [--m 1024,16384]``.
Large calls run the GPU near its power limit, so a cell timed after a long one can read a
few % slower: compare neighbouring cells of one row.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = (("qkv", 5120, 2048), ("o_proj", 2048, 4096), ("4096^2", 4096, 4096))


def main() -> None:
    import torch
    from moe_bench import graph_time_us  # lab/moe_bench.py

    from megaserve.kernels.triton_impl import matmul as mm
    from megaserve.kernels.triton_impl.matmul import Launch

    p = argparse.ArgumentParser()
    p.add_argument("--m", default="256,1024,4096,16384", help="rows per call")
    args = p.parse_args()
    variants = {"128x256s3": Launch("fold", 128, 256, 8, 3),
                "128x256s4": Launch("fold", 128, 256, 8, 4),
                "256x128s4": Launch("fold", 256, 128, 8, 4)}
    for name, n, k in SHAPES:
        for m in (int(v) for v in args.m.split(",")):
            torch.manual_seed(0)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            lp = mm.plan_launch(m, n, k, mm.config_for(n, k, x.dtype))
            ref = mm.linear(x, w)
            cublas = graph_time_us(lambda: torch.mm(x, w.T))  # noqa: B023
            ours = graph_time_us(lambda: mm.linear(x, w))  # noqa: B023
            cells = [f"{name} M={m}: cuBLAS {cublas:7.1f} us",
                     f"default ({lp.mode} {lp.block_m}x{lp.block_n}, {lp.num_stages} stages) "
                     f"{cublas / ours:.3f}"]
            for vname, launch in variants.items():
                us = graph_time_us(lambda l=launch: mm.linear(x, w, launch=l))  # noqa: B023
                same = torch.equal(mm.linear(x, w, launch=launch), ref)
                cells.append(f"{vname} {cublas / us:.3f}" + ("" if same else " BITS DIFFER"))
            print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
