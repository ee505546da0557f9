"""Registers, spills and shared memory of the paged-attention kernels on sm_90, no GPU needed.

Run anywhere triton is installed: ``python lab/kernel_resources.py``. Each launch below
is compiled ahead of time for an H100/H200 (``GPUTarget('cuda', 90, 32)``) with Triton's
bundled ptxas, pointers and strides marked 16-divisible as the JIT marks them at run time,
and ``cuobjdump -res-usage`` reads the cubin. ``stack`` > 0 means the kernel spills.

It found that 16-row decode tiles replicated their accumulators across warps
(mma warps along the rows; the 16-wide l-dot chose that layout for all three dots) and
that the chunk accumulator made 64-row 4-warp prefill tiles spill; the device sweep then
confirmed both.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaserve.kernels.triton_impl import attention_kernels as ak  # noqa: E402
from megaserve.kernels.triton_impl.sm90 import compile_sm90  # noqa: E402

_INT_PTRS = ("bt_ptr", "ctx_ptr", "qsl_ptr")
_WS_PTRS = ("ws_m_ptr", "ws_l_ptr", "ws_o_ptr")


def resources(fn, constexprs: dict, num_warps: int, num_stages: int,
              fp32_ws: bool = True) -> dict:
    """Compile ``fn`` for sm_90; returns {regs, stack, smem} (bytes for the last two)."""
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    args = {}
    for name in fn.arg_names:
        if name in constexprs:
            continue
        if name.endswith("_ptr"):
            args[name] = ("*i32" if name in _INT_PTRS
                          else "*fp32" if name in _WS_PTRS and fp32_ws else "*bf16")
        else:
            args[name] = "fp32" if name == "scale" else "i32"
    build = compile_sm90(fn, args, constexprs, num_warps=num_warps, num_stages=num_stages,
                         divisible=tuple(n for n in args if n.startswith("stride")))
    return dict(regs=build.regs, stack=build.stack, smem=build.smem)


def main() -> None:
    # The bench shape: Hq=32, Hkv=8 (G=4), head_dim 128, cache blocks of 16, EXP2 arithmetic.
    common = dict(GROUP=4, G_PAD=4, SPLIT=64, CHUNK=16, HEAD_DIM=128, BLOCK_D=128,
                  BLOCK_SIZE=16, NUM_Q_HEADS=32, EXP2=True, LONG_FIRST=False, L_COLS=16,
                  DECODE=False, PDL=False)
    decode = dict(common, BLOCK_Q=4, MASK_TAIL=True, PREFETCH=True)
    launches = [
        ("serial decode r16 w2 s4", ak.paged_attention_kernel, dict(decode, PARTS=False), 2, 4),
        ("serial decode r16 w4 s4", ak.paged_attention_kernel, dict(decode, PARTS=False), 4, 4),
        ("chunk decode r16 w2 s3", ak.paged_attention_kernel, dict(decode, PARTS=True), 2, 3),
        ("chunk decode r16 w4 s3", ak.paged_attention_kernel, dict(decode, PARTS=True), 4, 3),
        ("fold 16 columns w1 (chunk parts)", ak.attention_fold_kernel,
         dict(common, BLOCK_Q=1, BLOCK_D=16, UNROLL=16), 1, 3),
    ]
    for rows, warps, stages in ((64, 4, 2), (128, 8, 2), (128, 8, 3)):
        launches.append((f"serial prefill r{rows} w{warps} s{stages}",
                         ak.paged_attention_kernel,
                         dict(common, BLOCK_Q=rows // 4, MASK_TAIL=True,
                              PREFETCH=stages > 2, PARTS=False), warps, stages))
    for name, fn, constexprs, warps, stages in launches:
        serial = fn is ak.paged_attention_kernel and not constexprs.get("PARTS")
        res = resources(fn, constexprs, warps, stages, fp32_ws=not serial)
        print(f"{name:36s} regs {res['regs']:3d}  spill {res['stack']:4d} B  "
              f"smem {res['smem'] / 1024:6.1f} KiB", flush=True)


if __name__ == "__main__":
    main()
