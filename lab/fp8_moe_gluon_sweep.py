"""The decode expert FFN of Qwen3-30B-A3B (128 experts, top-8, FP8) on an H200: the Triton
plan against fp8_moe_gluon's kernel at each token tile and ring depth, the whole FFN and
each of its two grouped GEMMs, bf16 in the same run; every Gluon variant checked bitwise
against the Triton plan.

    python lab/fp8_moe_gluon_sweep.py [--batches 64 256 1024] [--block-t 16 32 64]
                                      [--ring 4 6 8]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megaserve.kernels import api as kernels
from megaserve.kernels import fp8_bench as fb
from megaserve.kernels.triton_impl import fp8_moe_gluon as fg
from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows, silu_mul_quantize_rows
from megaserve.kernels.triton_impl.fp8_moe import align, fp8_expert_ffn, plan_moe
from megaserve.kernels.triton_impl.matmul import num_sms

D, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--block-t", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--ring", type=int, nargs="+", default=[0])  # 0: fp8_moe_gluon.stages
    args = parser.parse_args()
    bandwidth = fb.copy_bandwidth()
    wgu, sgu = fb.random_fp8(2 * INTER, D, EXPERTS)
    wd, sd = fb.random_fp8(D, INTER, EXPERTS)
    bgu = (torch.randn(EXPERTS, 2 * INTER, D, device="cuda") * 0.02).bfloat16()
    bd = (torch.randn(EXPERTS, D, INTER, device="cuda") * 0.02).bfloat16()
    sms = num_sms(wgu.device)
    print(f"copy {bandwidth / 1e12:.2f} TB/s; us (CUDA-graph replays); roofline: the touched "
          "experts' fp8 bytes at the copy rate")
    for b in args.batches:
        x = torch.randn(b, D, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K]
                           for _ in range(b)]).reshape(-1)
        hit = int(torch.unique(ids).numel())
        roof = hit * 3 * INTER * D / bandwidth * 1e6
        roof_up, roof_down = roof * 2 / 3, roof / 3
        plan = plan_moe(ids.shape[0], EXPERTS)
        tri = dataclasses.replace(plan, gluon=False)
        ref = fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, TOP_K, tri)
        t16 = fb.graph_us([lambda: kernels.expert_ffn(x, ids, bgu, bd, rows_per_token=TOP_K)])
        t_tri = fb.graph_us([lambda: fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, TOP_K, tri)])
        counts = torch.bincount(ids, minlength=EXPERTS)
        print(f"\nbatch {b}: {hit} experts hit, rows an expert max {int(counts.max())}, "
              f"roofline {roof:.1f} us (gate_up {roof_up:.1f}, down {roof_down:.1f}); "
              f"bf16 {t16:.1f}, fp8 Triton {t_tri:.1f} ({100 * roof / t_tri:.0f}%), "
              f"plan's token tile {fg.token_tile(ids.shape[0], EXPERTS)}")
        xq, xs = quantize_rows(x)
        offsets, order = align(ids, EXPERTS)
        gate_up = torch.empty(ids.shape[0], 2 * INTER, dtype=torch.bfloat16, device="cuda")
        fg.grouped(xq, xs, wgu, sgu, gate_up, offsets, order, sms, gather=True, scatter=False,
                   rows_per_token=TOP_K)
        hq, hs = silu_mul_quantize_rows(gate_up)
        out = torch.empty(ids.shape[0], D, dtype=torch.bfloat16, device="cuda")
        for block_t in args.block_t:
            for ring in args.ring:
                ring = ring or None
                t_up = fb.graph_us([lambda: fg.grouped(
                    xq, xs, wgu, sgu, gate_up, offsets, order, sms, gather=True, scatter=False,
                    rows_per_token=TOP_K, block_t=block_t, ring=ring)])
                t_down = fb.graph_us([lambda: fg.grouped(
                    hq, hs, wd, sd, out, offsets, order, sms, gather=False, scatter=True,
                    block_t=block_t, ring=ring)])
                same = torch.equal(out, ref)
                print(f"  gluon T={block_t:3d} ring={ring or fg.stages(block_t)}: gate_up "
                      f"{t_up:6.1f} ({100 * roof_up / t_up:3.0f}%)  down {t_down:6.1f} "
                      f"({100 * roof_down / t_down:3.0f}%)  sum {t_up + t_down:6.1f} "
                      f"({100 * roof / (t_up + t_down):3.0f}%)  bitwise {same}")
        t_plan = fb.graph_us([lambda: fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, TOP_K, plan)])
        same = torch.equal(fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, TOP_K, plan), ref)
        print(f"  plan {plan}: {t_plan:.1f} us ({100 * roof / t_plan:.0f}%) bitwise {same}")


if __name__ == "__main__":
    main()
