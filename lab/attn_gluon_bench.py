"""Hopper's Gluon prefill attention (kernels/triton_impl/attention_gluon.py) against the
Triton serial kernel: bitwise check and time per call (median of CUDA-graph replays).

Run on one Hopper GPU: ``PYTHONPATH=. python3 lab/attn_gluon_bench.py``. Qwen3-30B-A3B's
attention (Hq 32, Hkv 4, head_dim 128, bf16, cache blocks of 16); K/V past each context and
the spare cache blocks are NaN, so a kernel that reads them shows NaN.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HQ, HKV, DH, BS = 32, 4, 128, 16
# (sequences, context, new tokens per sequence)
CASES = [(1, 4096, 4096), (4, 4096, 4096), (1, 8192, 4096), (1, 8192, 1024), (3, 1000, 1000),
         (2, 3001, 701), (5, 77, 77)]


def main() -> None:
    import torch

    from megaserve.kernels.testing import time_ms
    from megaserve.kernels.triton_impl import attention

    triton_serial = attention.AttentionLaunch(
        "serial", **dict(attention.PREFILL_SERIAL_TILE, gluon=False))
    for seqs, ctx, new in CASES:
        blocks = -(-ctx // BS)
        kc = torch.randn(seqs * blocks + 2, BS, HKV, DH, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = (torch.randperm(seqs * blocks, device="cuda").int() + 2).view(seqs, blocks)
        if ctx % BS:
            kc[table[:, -1].long(), ctx % BS:] = float("nan")
            vc[table[:, -1].long(), ctx % BS:] = float("nan")
        kc[:2] = float("nan")
        vc[:2] = float("nan")
        q = torch.randn(seqs * new, HQ, DH, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((seqs,), ctx, device="cuda", dtype=torch.int32)
        qsl = torch.arange(0, seqs * new + 1, new, device="cuda", dtype=torch.int32)

        def run(launch):
            return attention.paged_attention(q, kc, vc, table, lens, qsl, DH**-0.5,
                                             launch=launch)

        gluon = dataclasses.replace(triton_serial, gluon=True)
        want, got = run(triton_serial), run(gluon)
        flops = 4 * seqs * new * (ctx - new + (new + 1) / 2) * HQ * DH
        times = {name: time_ms(lambda l=launch: run(l)) * 1e3  # noqa: B023
                 for name, launch in (("triton", triton_serial), ("gluon", gluon))}
        print(f"S={seqs} ctx={ctx} new={new}: bitwise={torch.equal(got, want)} "
              f"nan={bool(got.isnan().any())} | "
              + " | ".join(f"{k} {v:7.1f} us {flops / v / 1e6:4.0f} TFLOP/s"
                           for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
