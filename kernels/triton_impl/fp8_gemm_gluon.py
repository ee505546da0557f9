"""The block-FP8 linear of prefill-sized calls on Hopper, in Gluon: the arithmetic of
:mod:`fp8_gemm`'s NOTE, the same bits (the GPU tests compare them).

Why a second kernel: the Triton kernel's K loop is lock-step (a ``bar.sync`` a step for its
pipelined loads, and each group's wgmma chain waited for as soon as it is issued:
``warp_group_dot_wait {pendings = 0}`` in its TTGIR), so the tensor cores idle while the
whole CTA promotes a group's dot into its partial sum. Here the two MMA warp groups of a
tile share nothing but the ring's mbarriers, so one group's promotion runs on the CUDA
cores while the other's chain multiplies. (Keeping group g + 1's chain in flight while
promoting group g in the same warp group does not work: ptxas serialises every wgmma
when non-wgmma instructions read accumulator registers inside a pipeline stage, C7514.)

Per output element, as fp8_gemm: d_g a fresh chain of four k32 QGMMA steps from zero,
part = fma(d_g, xs_g * ws_g, part) for the split's groups in ascending order, the splits
folded into total in ascending order.

One persistent program an SM walks (BLOCK_M x 128) tiles ``program_id + k * programs``
in GROUP_M-row bands (L2 reuse of the weight columns); three warp groups
(``gl.warp_specialize``): a loader streams each group's A rows ``[BLOCK_M, 128]`` and
weight rows ``[128, 128]`` by TMA into a ring of STAGES slots (``ready`` when both
landed, ``empty`` when both MMA groups are done with it); two MMA groups take 64 rows of
each tile (BLOCK_M 128) or 64 columns (BLOCK_M 64: :func:`tile_rows`), a split's groups
in an inner loop, and send their rows out through shared
memory by a TMA store that runs during the next tile (H200, ``lab/fp8_gluon_sweep.py``:
geomean cuBLAS time / ours 0.72 storing from registers, 0.82-0.84 by TMA). Rows past M
and weight rows past N read as zeros (TMA), as the Triton kernel's masked loads read them;
the TMA store clips rows and columns past the output's.
"""


from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import pdl
from .sm90 import Sm90Build, compile_sm90

GROUP = 128  # activation group = weight block = one K step
BLOCK_N = 128
_GROUP = gl.constexpr(GROUP)  # as the kernels read it
STAGES = 6  # 6 x 32 KB and the 32 KB TMA-store buffer (H200 sweep: 4, 5, 6 within 2%)
GROUP_M = 8
MMA_REGS = 224
LOAD_REGS = 56
MAXNREG = 168
ENV = "MEGASERVE_FP8_GLUON"  # "0": the Triton kernel everywhere (A/B runs)


@gluon.jit
def _tile(t, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """Tile t's (row tile, column tile): GROUP_M row tiles walk the columns together."""
    width = GROUP_M * tiles_n
    first_m = (t // width) * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (t % width) % size_m, (t % width) // size_m


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
            PROGRAMS: gl.constexpr):
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_groups = gl.cdiv(K, _GROUP)
    i = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, PROGRAMS):
        pm, pn = _tile(t, tiles_m, tiles_n, GROUP_M)
        for g in range(num_groups):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot),
                            a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pm * BLOCK_M, g * _GROUP], ready.index(slot),
                                            a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [pn * BLOCK_N, g * _GROUP], ready.index(slot),
                                            w_bufs.index(slot))
            i += 1


@gluon.jit
def _mma(a_bufs, w_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c_smem, M, N, K,
         stride_asm, stride_bsn, stride_cm, SPLIT_GROUPS: gl.constexpr, HALF: gl.constexpr,
         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
         GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr, C_TMA: gl.constexpr):
    """An MMA partition (one warp group): of each tile, rows ``HALF * 64 + [0, 64)``
    (BLOCK_M 128) or columns ``HALF * 64 + [0, 64)`` (BLOCK_M 64). C_TMA: its part of the
    tile goes out through c_smem by a TMA store (waited for before the next tile's store),
    else by stores from registers."""
    ROWS: gl.constexpr = 64
    COLS: gl.constexpr = BLOCK_N if BLOCK_M == 128 else BLOCK_N // 2
    ROW0: gl.constexpr = HALF * ROWS if BLOCK_M == 128 else 0
    COL0: gl.constexpr = 0 if BLOCK_M == 128 else HALF * COLS
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, COLS, 32])
    ROW: gl.constexpr = gl.SliceLayout(1, ACC)
    COL: gl.constexpr = gl.SliceLayout(0, ACC)
    zero = gl.zeros([ROWS, COLS], gl.float32, ACC)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_groups = gl.cdiv(K, _GROUP)
    split = num_groups if SPLIT_GROUPS == 0 else SPLIT_GROUPS  # the host passes 0: one split
    i = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, PROGRAMS):
        pm, pn = _tile(t, tiles_m, tiles_n, GROUP_M)
        rows = pm * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=ROW)
        row_ok = rows < M
        as_rows = as_ptr + rows.to(gl.int64) * stride_asm
        bs_row = bs_ptr + ((pn * BLOCK_N) // _GROUP) * stride_bsn
        total = zero
        a_s = gl.load(as_rows, mask=row_ok, other=0.0)
        b_s = gl.load(bs_row)
        for g_lo in range(0, num_groups, split):
            part = zero
            for g in range(g_lo, gl.minimum(g_lo + split, num_groups)):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                d = warpgroup_mma(a_bufs.index(slot).slice(ROW0, ROWS),
                                  w_bufs.index(slot).slice(COL0, COLS).permute((1, 0)), zero,
                                  use_acc=False, is_async=True)
                # group g + 1's scales load while the chain runs (0 past the last group)
                a_s_next = gl.load(as_rows + g + 1, mask=row_ok & (g + 1 < num_groups),
                                   other=0.0)
                b_s_next = gl.load(bs_row + g + 1, mask=g + 1 < num_groups, other=0.0)
                d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
                mbarrier.arrive(empty.index(slot))
                part = gl.fma(d, gl.expand_dims(a_s * b_s, 1), part)
                a_s = a_s_next
                b_s = b_s_next
                i += 1
            total = total + part
        if C_TMA:
            tma.store_wait(pendings=0)  # the previous tile's rows have left c_smem
            c_smem.store(total.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [pm * BLOCK_M + ROW0, pn * BLOCK_N + COL0],
                                            c_smem)
        else:
            cols = pn * BLOCK_N + COL0 + gl.arange(0, COLS, layout=COL)
            at = (c_ptr + gl.expand_dims(rows.to(gl.int64) * stride_cm, 1)
                  + gl.expand_dims(cols, 0))
            gl.store(at, total.to(c_ptr.dtype.element_ty),
                     mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0))
    if C_TMA:
        tma.store_wait(pendings=0)


@gluon.jit
def linear_kernel(a_desc, w_desc, as_ptr, bs_ptr, c_ptr, c_desc, M, N, K, stride_asm,
                  stride_bsn, stride_cm, SPLIT_GROUPS: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                  PROGRAMS: gl.constexpr, C_TMA: gl.constexpr, MMA_REGS: gl.constexpr,
                  LOAD_REGS: gl.constexpr, PDL: gl.constexpr):
    """The module docstring's GEMM over every tile; this program's warps are the first MMA
    group. SPLIT_GROUPS: groups per K split (0: one split). C_TMA: c_desc (64-row boxes of
    c) takes the tiles' rows, else c_ptr."""
    pdl.gluon_wait_then_release(PDL)  # first: no memory access before it
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, _GROUP], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, _GROUP], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    if C_TMA:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape,
                                           c_desc.layout)
        c0 = c_smem.index(0)
        c1 = c_smem.index(1)
    else:
        c0 = a_bufs.index(0)  # unused
        c1 = c0
    fence_async_shared()
    gl.warp_specialize([
        (_mma, (a_bufs, w_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c0, M, N, K,
                stride_asm, stride_bsn, stride_cm, SPLIT_GROUPS, 0, BLOCK_M, BLOCK_N, STAGES,
                GROUP_M, PROGRAMS, C_TMA)),
        (_mma, (a_bufs, w_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c1, M, N, K,
                stride_asm, stride_bsn, stride_cm, SPLIT_GROUPS, 1, BLOCK_M, BLOCK_N, STAGES,
                GROUP_M, PROGRAMS, C_TMA)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N,
                   STAGES, GROUP_M, PROGRAMS)),
    ], [4, 4], [MMA_REGS, LOAD_REGS])


def tile_rows(m: int, n: int, sms: int) -> int:
    """Rows a tile: 128 (each MMA group 64 rows x 128 columns) where such tiles number at
    least half the SMs, else 64 (each MMA group 64 x 64). H200, ``lab/fp8_gluon_sweep.py``
    (us): Qwen3-30B-A3B qkv at M = 256 (80 tiles of 128 rows) 11.1 against 14.0; at M = 128
    (40) 10.8 against 8.8; DeepSeek-V3 o_proj at M = 128 (56) 61.3 against 48.5."""
    return 128 if 2 * triton.cdiv(m, 128) * triton.cdiv(n, BLOCK_N) >= sms else 64


def applies(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` can run: Hopper, e4m3 rows and weights TMA can read (K a
    multiple of 16, contiguous), and ``$MEGASERVE_FP8_GLUON`` not "0"."""
    k = a.shape[1]
    return (a.is_cuda and a.dtype == torch.float8_e4m3fn and k % 16 == 0
            and a.stride(1) == 1 and a.stride(0) == k and weight.is_contiguous()
            and a.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(a.device)[0] == 9
            and os.environ.get(ENV, "1") != "0")


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def linear(a: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
           out: torch.Tensor, split_groups: int, *, block_m: int | None = None,
           stages: int = STAGES, c_tma: bool | None = None, pdl: bool = False) -> None:
    """``out = a @ dequant(weight).T`` by fp8_gemm's arithmetic: a `[M, K]` e4m3 with group
    scales a_s `[M, G]` (:func:`fp8_gemm.quantize_rows`), weight `[N, K]` e4m3 with
    scale_inv `[ceil(N/128), G]`, split_groups the weight's K split (fp8_gemm.split_groups).
    block_m (default :func:`tile_rows`), stages, c_tma: the tile's rows, the ring's slots and
    whether out is written by TMA (default: where TMA can write it); pdl: launched with PDL
    (fp8_gemm.PDL_KERNELS' "gluon_linear"); speed only, the same bits."""
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    if c_tma is None:
        c_tma = (out.dtype in _GL_DTYPES and out.stride(1) == 1
                 and out.stride(0) * out.element_size() % 16 == 0 and out.data_ptr() % 16 == 0)
    args, constexprs = _launch(a, a_s, weight, scale_inv, out, split_groups, programs,
                               block_m or tile_rows(a.shape[0], weight.shape[0], programs),
                               stages, c_tma, pdl)
    linear_kernel[(programs,)](**args, **constexprs, num_warps=4, maxnreg=MAXNREG,
                               launch_pdl=pdl)


def _launch(a, a_s, weight, scale_inv, out, split_groups: int, programs: int, block_m: int,
            stages: int, c_tma: bool, pdl: bool) -> tuple[dict, dict]:
    """:func:`linear_kernel`'s arguments and constexprs for :func:`linear`'s call."""
    m, k = a.shape
    n = weight.shape[0]
    a_desc = TensorDescriptor.from_tensor(
        a, [block_m, GROUP], gl.NVMMASharedLayout.get_default_for([block_m, GROUP], gl.float8e4nv))
    w_desc = TensorDescriptor.from_tensor(
        weight, [BLOCK_N, GROUP],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, GROUP], gl.float8e4nv))
    c_desc = None
    if c_tma:
        box = [64, BLOCK_N if block_m == 128 else BLOCK_N // 2]  # one MMA group's part
        c_desc = TensorDescriptor.from_tensor(
            out, box, gl.NVMMASharedLayout.get_default_for(box, _GL_DTYPES[out.dtype]))
    one_split = split_groups >= triton.cdiv(k, GROUP)
    args = dict(a_desc=a_desc, w_desc=w_desc, as_ptr=a_s, bs_ptr=scale_inv, c_ptr=out,
                c_desc=c_desc, M=m, N=n, K=k, stride_asm=a_s.stride(0),
                stride_bsn=scale_inv.stride(0), stride_cm=out.stride(0))
    constexprs = dict(SPLIT_GROUPS=0 if one_split else split_groups, BLOCK_M=block_m,
                      BLOCK_N=BLOCK_N, STAGES=stages, GROUP_M=GROUP_M, PROGRAMS=programs,
                      C_TMA=c_tma, MMA_REGS=MMA_REGS, LOAD_REGS=LOAD_REGS, PDL=pdl)
    return args, constexprs


def sm90_build(m: int, n: int, k: int, split_groups: int, *, block_m: int,
               pdl: bool) -> Sm90Build:
    """:func:`linear`'s kernel compiled for an H100/H200 (132 SMs) on any machine, at the
    launch it makes for `[m, k] x [n, k]^T` with bf16 output stored by TMA (registers,
    spills, shared memory, SASS). No GPU: CPU tensors stand in for the operands."""
    fp8 = torch.float8_e4m3fn
    g = triton.cdiv(k, GROUP)
    args, constexprs = _launch(torch.empty(m, k, dtype=fp8), torch.empty(m, g),
                               torch.empty(n, k, dtype=fp8),
                               torch.empty(triton.cdiv(n, GROUP), g),
                               torch.empty(m, n, dtype=torch.bfloat16), split_groups, 132,
                               block_m, STAGES, True, pdl)
    return compile_sm90(linear_kernel, args, constexprs, maxnreg=MAXNREG)
