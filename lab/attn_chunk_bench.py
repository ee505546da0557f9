"""Paged attention's default launch at decode and prefill shapes, at a chosen chunk size
(CHUNK_SPLITS is part of the arithmetic, so it is picked by timing).

Run on one GPU: ``PYTHONPATH=. python3 lab/attn_chunk_bench.py [--chunk-splits N]``.
Qwen3-30B-A3B's attention (Hq 32, Hkv 4, head_dim 128, bf16, cache blocks of 16); each
line is the median of CUDA-graph replays. Decode rows read one token per sequence; the
short-context decode cases get a block table 4,097 keys wide, as the engine's is with
``max_model_len`` 4,097, so the launch choice sees what it sees there. Prefill chunks
shorter than 1,024 tokens are also timed in both modes (the chunk-mode threshold of
:func:`choose_launch`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HQ, HKV, DH = 32, 4, 128
# (kind, sequences, context, new tokens per sequence)
CASES = [("decode", 1, 4096, 1), ("decode", 1, 16384, 1), ("decode", 2, 8192, 1),
         ("decode", 8, 8192, 1), ("decode", 32, 2048, 1), ("decode", 64, 4096, 1),
         ("decode", 1, 100, 1), ("decode", 64, 100, 1), ("prefill", 1, 4096, 4096),
         ("prefill", 1, 8192, 4096), ("prefill", 1, 8192, 512), ("prefill", 4, 1024, 1024),
         ("prefill", 1, 8192, 64), ("prefill", 1, 8192, 256)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunk-splits", type=int, default=0,
                        help="splits a chunk (0: the module's CHUNK_SPLITS)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    import torch

    from megaserve.kernels.testing import paged_inputs, time_ms
    from megaserve.kernels.triton_impl import attention

    if args.chunk_splits:
        attention.CHUNK_SPLITS = args.chunk_splits
    tag = args.tag or f"C{attention.CHUNK_SPLITS}"
    for kind, seqs, ctx, new in CASES:
        q, kc, vc, table, lens, qsl, _, _ = paged_inputs(seqs, ctx, new, HQ, HKV, DH,
                                                          torch.bfloat16)
        if kind == "decode" and ctx < 1000:
            table = torch.cat([table, table.new_zeros(seqs, 257 - table.shape[1])], 1)
        modes = [None, "serial", "chunk"] if kind == "prefill" and new < 1024 else [None]
        for mode in modes:
            us = time_ms(lambda: attention.paged_attention(  # noqa: B023
                q, kc, vc, table, lens, qsl, DH**-0.5, mode=mode,
                one_token_per_seq=new == 1)) * 1e3
            print(f"{tag:6s} {kind} S={seqs} ctx={ctx} new={new} {mode or 'default'}: "
                  f"{us:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
