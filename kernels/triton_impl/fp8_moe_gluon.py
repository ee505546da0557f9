"""The FP8 grouped expert GEMM of decode-sized calls on Hopper, in Gluon: fp8_moe's
``_fp8_expert_kernel`` without its in-loop quantize and SwiGLU epilogue (the decode plan's
launches: e4m3 rows in, x.dtype rows out), the same arithmetic (fp8_moe's NOTE), so the
same bits (the GPU tests compare them).

Why a second kernel: at decode an expert sees a handful of rows (4 to 16 at batch 64 to
256 of Qwen3-30B-A3B), so its GEMM streams the expert's weights and little else. The
Triton kernel runs one (expert, 64 rows, 128 columns) tile a program: each program waits
for its first loads, pads its few rows to wgmma's 64, and keeps its whole CTA lock-step on
each group's promotion; its expert FFN ran at ~80% of the copy rate (H200). Here
(H200, ``lab/fp8_moe_gluon_sweep.py``, Qwen3-30B-A3B's expert FFN at batch 64 / 256:
161 / 174 us against 177 / 189; ~91% of the copy rate in the batch-64 decode step):

* the weights are the wgmma's A operand ("swap AB"): a tile is 256 weight rows (two
  scale blocks: output columns) x BLOCK_T grouped positions (wgmma N: 16 or 32), so a
  position's column of the accumulator is its row of the output, and few rows cost few
  registers and little promotion;
* one persistent program an SM walks tiles ``program_id + k * programs`` (fp8_moe's
  numbering, column tile by column tile inside an expert: moe_gluon.tile_of's N_MAJOR),
  in five warp groups (``gl.warp_specialize``): a loader fills a ring of STAGES slots
  (``ready_w`` / ``ready_x``, ``empty``) across tile boundaries, the weights by TMA, the
  rows by TMA (down: h in grouped order) or by cp.async gathered from
  ``x[order[position] // rows_per_token]`` (gate_up); four MMA groups take 64 weight rows
  each, then store their columns of each row (16 bytes a thread).

Per output element, as fp8_moe (one split): d_g a fresh chain of four k32 QGMMA steps from
zero over group g's 128 products, ``part = fma(d_g, xs[row, g] * ws[block, g], part)`` for
g ascending, ``out = cast(part)``. A wgmma's column n reads only B's column n, so positions
past the expert's end (the next expert's rows, zeros past R) change no stored value, and
weight rows past N (the next expert's, zeros past the last) only rows never stored.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                              mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import pdl
from .matmul import tma_readable
from .moe_gluon import expert_tiles, gathered_rows, tile_of
from .sm90 import Sm90Build, compile_sm90

GROUP = 128  # activation group = weight block = one K step
MMA_GROUPS = 4  # MMA warp groups, 64 weight rows each
BLOCK_W = 64 * MMA_GROUPS  # weight rows a tile
_GROUP = gl.constexpr(GROUP)
_BLOCK_W = gl.constexpr(BLOCK_W)
_MMA_GROUPS = gl.constexpr(MMA_GROUPS)
RING_BYTES = 192 * 1024  # the ring's shared memory (the epilogue's layout change takes more)
MAX_STAGES = 8
MMA_REGS = 104
LOAD_REGS = 64
MAXNREG = 96  # 5 warp groups x 96 = 4 x 104 + 64 (65,536 registers an SM)
ENV = "MEGASERVE_FP8_MOE_GLUON"  # "0": the Triton kernel everywhere (A/B runs)


@triton.constexpr_function
def _gather_layout(warps):
    """``[rows, 128]`` e4m3 over ``warps`` warps, 16 bytes a thread (8 threads a row)."""
    return gl.BlockedLayout([1, 16], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def _loader(bufs, bars, tiles_args, x_ptr, x_desc, w_desc, stride_xm, GATHER: gl.constexpr,
            ROWS_PER_TOKEN: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_E: gl.constexpr,
            STAGES: gl.constexpr, PROGRAMS: gl.constexpr):
    """The load partition: group g of this program's tiles into slot ``i % STAGES`` once
    every MMA group is done with the slot's previous group (``empty``)."""
    x_bufs, w_bufs = bufs
    ready_w, ready_x, empty = bars
    order_ptr, offsets_ptr, num_experts, N, K = tiles_args
    GATHER_L: gl.constexpr = _gather_layout(gl.num_warps())
    experts, lo, hi, ends, tiles = expert_tiles(offsets_ptr, num_experts, BLOCK_T, BLOCK_E)
    tiles_n = gl.cdiv(N, _BLOCK_W)
    num_groups = gl.cdiv(K, _GROUP)
    kk = gl.arange(0, _GROUP, layout=gl.SliceLayout(0, GATHER_L))
    i = 0
    for t in range(gl.program_id(0), gl.sum(tiles, axis=0) * tiles_n, PROGRAMS):
        expert, start, end, col = tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_T,
                                          True)
        if GATHER:
            x_rows, row_ok = gathered_rows(x_ptr, order_ptr, start, end, stride_xm, BLOCK_T,
                                           ROWS_PER_TOKEN, GATHER_L)
        w_row = expert * N + col * _BLOCK_W
        for g in range(num_groups):
            slot = i % STAGES
            # (a fresh barrier's phase "before 0" counts as complete: the first STAGES pass)
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            if GATHER:
                mbarrier.expect(ready_w.index(slot), w_desc.block_type.nbytes)
                async_copy.async_copy_global_to_shared(
                    x_bufs.index(slot), x_rows + gl.expand_dims(g * _GROUP + kk, 0),
                    mask=row_ok)
                async_copy.mbarrier_arrive(ready_x.index(slot), increment_count=False)
            else:
                mbarrier.expect(ready_w.index(slot),
                                w_desc.block_type.nbytes + x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [start, g * _GROUP], ready_w.index(slot),
                                                x_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [w_row, g * _GROUP], ready_w.index(slot),
                                            w_bufs.index(slot))
            i += 1


@gluon.jit
def _mma(bufs, bars, tiles_args, scales, out, MMA_GROUP: gl.constexpr, GATHER: gl.constexpr,
         SCATTER: gl.constexpr, ROWS_PER_TOKEN: gl.constexpr, BLOCK_T: gl.constexpr,
         BLOCK_E: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr):
    """An MMA partition (one warp group): weight rows ``MMA_GROUP * 64 + [0, 64)`` of each
    tile (its output columns), then their store at every position's output row
    (``order[p]`` with SCATTER, else p)."""
    x_bufs, w_bufs = bufs
    ready_w, ready_x, empty = bars
    order_ptr, offsets_ptr, num_experts, N, K = tiles_args
    xs_ptr, stride_xsm, ws_ptr, stride_wse, stride_wsn = scales
    c_ptr, stride_cm = out
    ROWS: gl.constexpr = 64
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_T, 32])
    POS: gl.constexpr = gl.SliceLayout(0, ACC)
    # 8 consecutive columns of one output row a thread (16 bytes of bf16)
    OUT: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    out_ty: gl.constexpr = c_ptr.dtype.element_ty
    zero = gl.zeros([ROWS, BLOCK_T], gl.float32, ACC)
    experts, lo, hi, ends, tiles = expert_tiles(offsets_ptr, num_experts, BLOCK_T, BLOCK_E)
    tiles_n = gl.cdiv(N, _BLOCK_W)
    num_groups = gl.cdiv(K, _GROUP)
    i = 0
    for t in range(gl.program_id(0), gl.sum(tiles, axis=0) * tiles_n, PROGRAMS):
        expert, start, end, col = tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_T,
                                          True)
        pos = start + gl.arange(0, BLOCK_T, layout=POS)
        ok = pos < end
        if GATHER:
            src = gl.load(order_ptr + pos, mask=ok, other=0) // ROWS_PER_TOKEN
        else:
            src = pos
        xs_rows = xs_ptr + src.to(gl.int64) * stride_xsm
        row0 = col * _BLOCK_W + MMA_GROUP * ROWS  # this group's first weight row
        ws_row = ws_ptr + expert.to(gl.int64) * stride_wse + (row0 // _GROUP) * stride_wsn
        w_ok = row0 < N  # (a group past N reads no scale)
        x_s = gl.load(xs_rows, mask=ok, other=0.0)
        w_s = gl.load(ws_row, mask=w_ok, other=0.0)
        part = zero
        for g in range(num_groups):
            slot = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(ready_w.index(slot), phase)
            if GATHER:
                mbarrier.wait(ready_x.index(slot), phase)
                fence_async_shared()  # the cp.async writes, before the wgmma reads them
            d = warpgroup_mma(w_bufs.index(slot).slice(MMA_GROUP * ROWS, ROWS),
                              x_bufs.index(slot).permute((1, 0)), zero, use_acc=False,
                              is_async=True)
            # group g + 1's scales load while the chain runs (0 past the last group)
            x_s_next = gl.load(xs_rows + g + 1, mask=ok & (g + 1 < num_groups), other=0.0)
            w_s_next = gl.load(ws_row + g + 1, mask=w_ok & (g + 1 < num_groups), other=0.0)
            d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
            mbarrier.arrive(empty.index(slot))
            part = gl.fma(d, gl.expand_dims(x_s * w_s, 0), part)
            x_s = x_s_next
            w_s = w_s_next
            i += 1
        res = gl.convert_layout(part.to(out_ty), OUT)
        pos = start + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, OUT))
        ok = pos < end
        if SCATTER:
            dst = gl.load(order_ptr + pos, mask=ok, other=0).to(gl.int64)
        else:
            dst = pos.to(gl.int64)
        cols = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT))
        gl.store(c_ptr + gl.expand_dims(dst * stride_cm, 0) + gl.expand_dims(cols, 1), res,
                 mask=gl.expand_dims(ok, 0) & gl.expand_dims(cols < N, 1))


@gluon.jit
def grouped_kernel(x_ptr, x_desc, xs_ptr, w_desc, ws_ptr, c_ptr, order_ptr, offsets_ptr,
                   num_experts, N, K, stride_xm, stride_xsm, stride_wse, stride_wsn, stride_cm,
                   GATHER: gl.constexpr, SCATTER: gl.constexpr, ROWS_PER_TOKEN: gl.constexpr,
                   BLOCK_T: gl.constexpr, BLOCK_E: gl.constexpr, STAGES: gl.constexpr,
                   PROGRAMS: gl.constexpr, MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
                   PDL: gl.constexpr):
    """The module docstring's GEMM over every tile; this program's warps are the first MMA
    group. GATHER: x rows gathered by cp.async (x_desc unused), else read by TMA."""
    pdl.gluon_wait_then_release(PDL)  # first: no memory access before it
    X_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, _GROUP],
                                                                  gl.float8e4nv)
    x_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_T, _GROUP], X_LAYOUT)
    w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _BLOCK_W, _GROUP],
                                       w_desc.layout)
    ready_w = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_x = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_w.index(s), count=1)
        mbarrier.init(ready_x.index(s), count=4 * 32)  # every load thread's cp.async
        mbarrier.init(empty.index(s), count=_MMA_GROUPS)
    fence_async_shared()
    # the partitions' arguments, grouped: buffers, barriers, the tile walk's inputs, the
    # scales, the output
    bufs = (x_bufs, w_bufs)
    bars = (ready_w, ready_x, empty)
    tiles_args = (order_ptr, offsets_ptr, num_experts, N, K)
    scales = (xs_ptr, stride_xsm, ws_ptr, stride_wse, stride_wsn)
    out = (c_ptr, stride_cm)
    gl.warp_specialize([
        (_mma, (bufs, bars, tiles_args, scales, out, 0, GATHER, SCATTER, ROWS_PER_TOKEN,
                BLOCK_T, BLOCK_E, STAGES, PROGRAMS)),
        (_mma, (bufs, bars, tiles_args, scales, out, 1, GATHER, SCATTER, ROWS_PER_TOKEN,
                BLOCK_T, BLOCK_E, STAGES, PROGRAMS)),
        (_mma, (bufs, bars, tiles_args, scales, out, 2, GATHER, SCATTER, ROWS_PER_TOKEN,
                BLOCK_T, BLOCK_E, STAGES, PROGRAMS)),
        (_mma, (bufs, bars, tiles_args, scales, out, 3, GATHER, SCATTER, ROWS_PER_TOKEN,
                BLOCK_T, BLOCK_E, STAGES, PROGRAMS)),
        (_loader, (bufs, bars, tiles_args, x_ptr, x_desc, w_desc, stride_xm, GATHER,
                   ROWS_PER_TOKEN, BLOCK_T, BLOCK_E, STAGES, PROGRAMS)),
    ], [4, 4, 4, 4], [MMA_REGS, MMA_REGS, MMA_REGS, LOAD_REGS])


def token_tile(num_rows: int, num_experts: int) -> int:
    """Positions a tile (wgmma N): 16 up to 16 rows an expert on average, else 32 (an
    expert with more rows takes more tiles, whose weights come from L2: N_MAJOR
    numbering). H200, ``lab/fp8_moe_gluon_sweep.py``, Qwen3-30B-A3B's expert FFN (us, T
    = 16 / 32): batch 64 161 / 177, 256 174 / 185, 1024 334 / 279; 64 spills."""
    return 16 if num_rows <= 16 * num_experts else 32


def stages(block_t: int) -> int:
    """Ring slots: as many as RING_BYTES holds, at most MAX_STAGES."""
    return min(MAX_STAGES, RING_BYTES // ((BLOCK_W + block_t) * GROUP))


def applies(x: torch.Tensor, w: torch.Tensor, *, gather: bool) -> bool:
    """Whether :func:`grouped` can run: Hopper, e4m3 rows and weights TMA can read (with
    ``gather``, K a multiple of 128 and 16-byte aligned rows for cp.async), and
    ``$MEGASERVE_FP8_MOE_GLUON`` not "0"."""
    k = w.shape[-1]
    rows_ok = (k % GROUP == 0 and x.stride(1) == 1 and x.stride(0) % 16 == 0
               and x.data_ptr() % 16 == 0) if gather else tma_readable(x)
    return (rows_ok and x.is_cuda and x.dtype == torch.float8_e4m3fn
            and w.dtype == torch.float8_e4m3fn and w.is_contiguous() and tma_readable(w)
            and torch.cuda.get_device_capability(x.device)[0] == 9
            and os.environ.get(ENV, "1") != "0")


def grouped(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
            out: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor, num_sms: int, *,
            gather: bool, scatter: bool, rows_per_token: int = 1,
            block_t: int | None = None, ring: int | None = None, pdl: bool = False) -> None:
    """fp8_moe's grouped GEMM over each expert e's grouped positions p in ``[offsets[e],
    offsets[e + 1])``: the row of p is ``x[order[p] // rows_per_token]`` with ``gather``,
    else ``x[p]``; its product with ``dequant(w[e]).T`` goes to ``out[order[p]]`` with
    ``scatter``, else ``out[p]``. x e4m3 with group scales xs (fp8_gemm.quantize_rows),
    w `[E, N, K]` e4m3 with ws `[E, ceil(N/128), ceil(K/128)]`. block_t (default
    :func:`token_tile`), ring (slots, default :func:`stages`) and pdl (launched with PDL:
    fp8_gemm.PDL_KERNELS' "gluon_moe"): speed only, the same bits. Rows of out not named
    are not written."""
    args, constexprs = _launch(x, xs, w, ws, out, offsets, order, num_sms, gather=gather,
                               scatter=scatter, rows_per_token=rows_per_token,
                               block_t=block_t or token_tile(order.shape[0], w.shape[0]),
                               ring=ring, pdl=pdl)
    grouped_kernel[(num_sms,)](**args, **constexprs, num_warps=4, maxnreg=MAXNREG,
                               launch_pdl=pdl)


def _launch(x, xs, w, ws, out, offsets, order, num_sms: int, *, gather: bool, scatter: bool,
            rows_per_token: int, block_t: int, ring: int | None, pdl: bool) -> tuple[dict, dict]:
    """:func:`grouped_kernel`'s arguments and constexprs for :func:`grouped`'s call."""
    e, n, k = w.shape
    x_layout = gl.NVMMASharedLayout.get_default_for([block_t, GROUP], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_W, GROUP], gl.float8e4nv)
    args = dict(
        x_ptr=x, x_desc=None if gather else TensorDescriptor.from_tensor(x, [block_t, GROUP],
                                                                        x_layout),
        xs_ptr=xs, w_desc=TensorDescriptor.from_tensor(w.view(e * n, k), [BLOCK_W, GROUP],
                                                       w_layout),
        ws_ptr=ws, c_ptr=out, order_ptr=order, offsets_ptr=offsets, num_experts=e, N=n, K=k,
        stride_xm=x.stride(0), stride_xsm=xs.stride(0), stride_wse=ws.stride(0),
        stride_wsn=ws.stride(1), stride_cm=out.stride(0))
    constexprs = dict(GATHER=gather, SCATTER=scatter, ROWS_PER_TOKEN=rows_per_token,
                      BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(e),
                      STAGES=ring or stages(block_t), PROGRAMS=num_sms, MMA_REGS=MMA_REGS,
                      LOAD_REGS=LOAD_REGS, PDL=pdl)
    return args, constexprs


def sm90_build(num_experts: int, n: int, k: int, *, gather: bool, block_t: int, pdl: bool,
               rows_per_token: int = 8, out_dtype: torch.dtype = torch.bfloat16) -> Sm90Build:
    """:func:`grouped`'s kernel compiled for an H100/H200 (132 SMs) on any machine, at the
    launch it makes for experts of `[n, k]` (registers, spills, shared memory, SASS). No
    GPU: CPU tensors stand in for the operands."""
    fp8, rows = torch.float8_e4m3fn, 1024
    w = torch.empty(num_experts, n, k, dtype=fp8)
    ws = torch.empty(num_experts, triton.cdiv(n, GROUP), triton.cdiv(k, GROUP))
    x = torch.empty(rows, k, dtype=fp8)
    xs = torch.empty(rows, triton.cdiv(k, GROUP))
    ids = torch.empty(rows, dtype=torch.int32)
    args, constexprs = _launch(x, xs, w, ws, torch.empty(rows, n, dtype=out_dtype), ids, ids,
                               132, gather=gather, scatter=not gather,
                               rows_per_token=rows_per_token if gather else 1,
                               block_t=block_t, ring=None, pdl=pdl)
    return compile_sm90(grouped_kernel, args, constexprs, maxnreg=MAXNREG)
