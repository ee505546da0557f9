"""Does the decode expert GEMM's weight layout cost bandwidth? A streaming-read test of the
TMA boxes fp8_moe_gluon reads, on a GPU.

fp8_moe_gluon's loader reads each expert weight `[N, K]` (e4m3, row-major, K contiguous)
in boxes of 256 rows x 128 columns: 256 segments of 128 bytes, 2 KB apart (K = 2048), the
next group's box the next 128 bytes of the same rows. Its expert FFN runs at ~86-89% of
the copy rate (docs/results/models-fp8.md). If DRAM serves those scattered segments
slower than a sequential stream, weights stored tile by tile (each box 32 KB contiguous:
`[E * N / 256 * G * 256, 128]`, same bytes per box, the same bits in shared memory) would
recover it. This script reads every box of Qwen3-30B-A3B's gate_up and down weights of
one layer, once per layout, with one persistent program an SM walking the tiles in the
kernel's order (tile t = pid, pid + SMs, ...; its K groups in order), and prints GB/s
against a torch copy in the same run. No output bits are involved: a read test only.
H200 (docs/results/models-fp8.md): tiled 3-5% faster, but this reader runs at half the
copy rate, so it does not settle the question.

    python lab/tma_box_layout.py                  # GPU
    TRITON_INTERPRET=1 python lab/tma_box_layout.py --smoke
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megaserve.kernels import fp8_bench as fb

BOX_ROWS, BOX_COLS = 256, 128


@triton.jit
def _read_kernel(desc, out_ptr, num_tiles, GROUPS: tl.constexpr, TILED: tl.constexpr,
                 PROGRAMS: tl.constexpr, N: tl.constexpr):
    """Sum of every byte of this program's tiles (kept so the loads stay)."""
    acc = tl.zeros([128], tl.int32)
    for t in range(tl.program_id(0), num_tiles, PROGRAMS):
        for g in tl.range(GROUPS, num_stages=4):
            if TILED:
                blk = desc.load([(t * GROUPS + g) * 256, 0])
            else:
                tiles_n: tl.constexpr = N // 256
                expert = t // tiles_n
                col = t % tiles_n
                blk = desc.load([expert * N + col * 256, g * 128])
            acc += tl.sum(blk.to(tl.int32), axis=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def tiled(w: torch.Tensor) -> torch.Tensor:
    """`[E, N, K]` → `[E * N/256 * K/128 * 256, 128]`: box (expert, column tile, group)
    contiguous, in that order."""
    e, n, k = w.shape
    return (w.view(e, n // 256, 256, k // 128, 128).permute(0, 1, 3, 2, 4)
            .reshape(-1, 128).contiguous())


def read_gbps(w: torch.Tensor, layout: str, sms: int) -> float:
    """GB/s of reading every box of ``w`` `[E, N, K]` in ``layout`` (fp8_bench.graph_us),
    and checks the sum."""
    e, n, k = w.shape
    groups, num_tiles = k // 128, e * n // 256
    src = tiled(w) if layout == "tiled" else w.view(e * n, k)
    desc = TensorDescriptor.from_tensor(src, [BOX_ROWS, BOX_COLS])
    out = torch.empty(sms, dtype=torch.int32, device=w.device)

    def launch():
        _read_kernel[(sms,)](desc, out, num_tiles, GROUPS=groups, TILED=layout == "tiled",
                             PROGRAMS=sms, N=n, num_warps=8)

    launch()
    if int(out.sum()) != int(w.sum(dtype=torch.int64)):
        raise RuntimeError(f"{layout}: the boxes read do not cover the weights")
    if not w.is_cuda:  # the interpreter's check (--smoke)
        return 0.0
    # four reads a replay: one alone would carry the graph replay's ~10 us (5-10% here)
    return w.numel() / (fb.graph_us([launch] * 4) * 1e-6) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="check both layouts' box walks under TRITON_INTERPRET=1 (CPU)")
    args = parser.parse_args()
    if args.smoke:
        from sweep_support import patch_interpreter

        patch_interpreter()
        w = torch.randint(0, 255, (2, 512, 256), dtype=torch.uint8)
        for layout in ("rows", "tiled"):
            read_gbps(w, layout, 3)
        print("smoke: both layouts read every byte once")
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: copy {fb.copy_bandwidth() / 1e9:,.0f} GB/s "
          "(read + write; fp8_bench.copy_bandwidth)")
    for name, (n, k) in {"gate_up": (1536, 2048), "down": (2048, 768)}.items():
        w = torch.randint(0, 255, (128, n, k), dtype=torch.uint8, device="cuda")
        for layout in ("rows", "tiled", "rows"):
            print(f"{name:8} [128, {n}, {k}] {layout:6} {read_gbps(w, layout, sms):,.0f} GB/s",
                  flush=True)


if __name__ == "__main__":
    main()
