"""The MoE expert GEMMs of prefill-sized calls on Hopper, in Gluon (Triton's explicit
dialect): the tiles of :func:`megaserve.kernels.triton_impl.moe._expert_gemm_tma_kernel`,
the same k16 chains and the same SwiGLU epilogue, so the same bits (the GPU tests compare
them), in a persistent warp-specialised kernel. Two forms:

* **down** (no gather, rows scattered to ``order[position]``): 128 x 256 tiles, A and the
  weights by TMA;
* **gate_up** (rows gathered from ``x[order[position] // rows_per_token]``, SwiGLU): 128
  rows x (128 gate + 128 up columns) tiles, column tile by column tile inside an expert
  (``moe.tile_of``'s N_MAJOR), A by cp.async, the weights by TMA.

Why a second kernel: the Triton kernel runs one tile a program, so every tile waits for its
first loads and no load runs during its epilogue. Here one program an SM walks tiles
``program_id + k * programs`` (``moe.tile_of``'s numbering), in three warp groups
(``gl.warp_specialize``):

* a load group streams each K step's rows of A ``[BLOCK_M, BLOCK_K]`` and the expert's
  weight rows into a ring of STAGES slots (mbarriers: ``ready_a`` / ``ready_w`` when a
  slot's rows / weights have landed, ``empty`` when both MMA groups are done with it),
  across tile boundaries;
* two MMA groups take 64 rows of each tile: a wgmma a K step with one in flight, then the
  epilogue, which stores whole rows (16 bytes a thread).

Rows past an expert's end (the next expert's) are read and never stored, and rows past R
and weight rows past N read as zeros, as in the Triton kernel.
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

# Rows of bf16 over warps, 16 bytes a thread: the gather of A, and the epilogue's stores
from .attention_gluon import rows_layout
from .matmul import tma_readable


@triton.constexpr_function
def _experts_layout(block_e, warps):
    """``[block_e]`` with every warp holding all of it: :func:`tile_of`'s sums stay inside
    a warp."""
    return gl.BlockedLayout([max(1, block_e // 32)], [32], [warps], [0])


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def expert_tiles(offsets_ptr, num_experts, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr):
    """(experts, lo, hi, ends, tiles) `[BLOCK_E]`: expert e's grouped positions [lo, hi),
    the row tiles through it and its own."""
    experts = gl.arange(0, BLOCK_E, layout=_experts_layout(BLOCK_E, gl.num_warps()))
    live = experts < num_experts
    lo = gl.load(offsets_ptr + experts, mask=live, other=0)
    hi = gl.load(offsets_ptr + experts + 1, mask=live, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    return experts, lo, hi, gl.associative_scan(tiles, 0, _add), tiles


@gluon.jit
def tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_M: gl.constexpr,
            N_MAJOR: gl.constexpr):
    """Tile t: (expert, first position, end of the expert's positions, column tile),
    numbered as moe.tile_of numbers them."""
    if N_MAJOR:
        expert = gl.sum((ends * tiles_n <= t).to(gl.int32), axis=0)
        mine = experts == expert
        count = gl.maximum(gl.sum(gl.where(mine, tiles, 0), axis=0), 1)
        local = t - gl.sum(gl.where(mine, ends - tiles, 0), axis=0) * tiles_n
        row_tile = local % count
        col = local // count
    else:
        tile = t // tiles_n
        expert = gl.sum((ends <= tile).to(gl.int32), axis=0)
        mine = experts == expert
        row_tile = tile - gl.sum(gl.where(mine, ends - tiles, 0), axis=0)
        col = t % tiles_n
    start = gl.sum(gl.where(mine, lo, 0), axis=0) + row_tile * BLOCK_M
    return expert, start, gl.sum(gl.where(mine, hi, 0), axis=0), col


@gluon.jit
def gathered_rows(a_ptr, order_ptr, start, end, stride_am, ROWS: gl.constexpr,
                  ROWS_PER_TOKEN: gl.constexpr, LAYOUT: gl.constexpr):
    """(row pointers, in_expert) `[ROWS, 1]` in LAYOUT's rows: grouped positions ``start +
    [0, ROWS)`` read row ``order[p] // ROWS_PER_TOKEN`` of a (row 0 past ``end``), and
    whether each is the expert's (p < end): a gathering loader's A rows."""
    pos = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    rows = gl.load(order_ptr + pos, mask=pos < end, other=0) // ROWS_PER_TOKEN
    return (a_ptr + gl.expand_dims(rows.to(gl.int64) * stride_am, 1),
            gl.expand_dims(pos < end, 1))


@gluon.jit
def _loader(a_ptr, a_desc, w_desc, a_bufs, w_bufs, ready_a, ready_w, empty, order_ptr,
            offsets_ptr, num_experts, N, K, stride_am, GATHER: gl.constexpr,
            SWIGLU: gl.constexpr, N_MAJOR: gl.constexpr, ROWS_PER_TOKEN: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            BLOCK_E: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr):
    """The load partition: K step i of this program's tiles into slot ``i % STAGES`` once
    both MMA groups are done with the slot's previous step (``empty``). The weights by TMA
    (with SWIGLU, gate rows n and up rows N + n); A by TMA, or with GATHER by cp.async from
    rows ``order[position] // ROWS_PER_TOKEN`` (K a multiple of BLOCK_K: no column mask)."""
    GATHER_L: gl.constexpr = rows_layout(BLOCK_K, gl.num_warps())
    W_BYTES: gl.constexpr = (2 if SWIGLU else 1) * w_desc.block_type.nbytes
    experts, lo, hi, ends, tiles = expert_tiles(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    tiles_n = gl.cdiv(N, BLOCK_N)
    kk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, GATHER_L))
    i = 0
    for t in range(gl.program_id(0), gl.sum(tiles, axis=0) * tiles_n, PROGRAMS):
        expert, start, end, col = tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_M,
                                          N_MAJOR)
        if GATHER:
            a_rows, row_ok = gathered_rows(a_ptr, order_ptr, start, end, stride_am, BLOCK_M,
                                           ROWS_PER_TOKEN, GATHER_L)
        w_row = expert * (2 * N if SWIGLU else N) + col * BLOCK_N
        for k0 in range(0, K, BLOCK_K):
            slot = i % STAGES
            # (a fresh barrier's phase "before 0" counts as complete: the first STAGES pass)
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            if GATHER:
                mbarrier.expect(ready_w.index(slot), W_BYTES)
                async_copy.async_copy_global_to_shared(
                    a_bufs.index(slot), a_rows + gl.expand_dims(k0 + kk, 0), mask=row_ok)
                async_copy.mbarrier_arrive(ready_a.index(slot), increment_count=False)
            else:
                mbarrier.expect(ready_w.index(slot), W_BYTES + a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [start, k0], ready_w.index(slot),
                                                a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [w_row, k0], ready_w.index(slot),
                                            w_bufs.index(slot).slice(0, BLOCK_N))
            if SWIGLU:
                tma.async_copy_global_to_shared(w_desc, [w_row + N, k0], ready_w.index(slot),
                                                w_bufs.index(slot).slice(BLOCK_N, BLOCK_N))
            i += 1


@gluon.jit
def _mma(a_bufs, w_bufs, ready_a, ready_w, empty, c_ptr, order_ptr, offsets_ptr, num_experts,
         N, K, stride_cm, HALF: gl.constexpr, GATHER: gl.constexpr, SWIGLU: gl.constexpr,
         N_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr, STAGES: gl.constexpr,
         PROGRAMS: gl.constexpr):
    """An MMA partition (one warp group): rows ``HALF * BLOCK_M / 2 + [0, BLOCK_M / 2)`` of
    each tile, then their store: SWIGLU, silu(gate) * up at their grouped positions (the
    rounding of moe._store_tile), else the product at rows ``order[position]``."""
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, W_ROWS, 16])
    # Whole rows a warp, 16 bytes a thread (the accumulator's layout would store 4-byte
    # pieces of 8 rows at a time: the epilogue took ~2x as long).
    OUT: gl.constexpr = rows_layout(BLOCK_N, 4)
    ROWS: gl.constexpr = BLOCK_M // 2
    out_ty: gl.constexpr = c_ptr.dtype.element_ty
    experts, lo, hi, ends, tiles = expert_tiles(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    tiles_n = gl.cdiv(N, BLOCK_N)
    zero = gl.zeros([ROWS, W_ROWS], gl.float32, ACC)
    i = 0
    for t in range(gl.program_id(0), gl.sum(tiles, axis=0) * tiles_n, PROGRAMS):
        expert, start, end, col = tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_M,
                                          N_MAJOR)
        if start + HALF * ROWS >= end:  # none of this half's rows is the expert's (a tail
            for k0 in range(0, K, BLOCK_K):  # tile of at most ROWS rows): only free the slots
                slot = i % STAGES
                mbarrier.wait(ready_w.index(slot), (i // STAGES) & 1)
                if GATHER:
                    mbarrier.wait(ready_a.index(slot), (i // STAGES) & 1)
                mbarrier.arrive(empty.index(slot))
                i += 1
        else:
            acc = zero
            for k0 in range(0, K, BLOCK_K):
                slot = i % STAGES
                mbarrier.wait(ready_w.index(slot), (i // STAGES) & 1)
                if GATHER:
                    mbarrier.wait(ready_a.index(slot), (i // STAGES) & 1)
                    fence_async_shared()  # the cp.async writes, before the wgmma reads them
                acc = warpgroup_mma(a_bufs.index(slot).slice(HALF * ROWS, ROWS),
                                    w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if k0 > 0:  # the previous step's dot is done with its slot
                    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                i += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
            if SWIGLU:  # columns [gate 0..BLOCK_N) | [up 0..BLOCK_N)
                gate, up = gl.split(acc.reshape([ROWS, 2, BLOCK_N]).permute((0, 2, 1)))
                g = gate.to(out_ty).to(gl.float32)
                act = (g / (1.0 + gl.exp(-g))).to(out_ty)  # as moe._store_tile
                res = gl.convert_layout(act * up.to(out_ty), OUT)
            else:
                res = gl.convert_layout(acc.to(out_ty), OUT)
            pos = start + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT))
            ok = pos < end
            if SWIGLU:
                dst = pos.to(gl.int64)
            else:
                dst = gl.load(order_ptr + pos, mask=ok, other=0).to(gl.int64)
            cols = col * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT))
            gl.store(c_ptr + gl.expand_dims(dst * stride_cm, 1) + gl.expand_dims(cols, 0), res,
                     mask=gl.expand_dims(ok, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def expert_gemm_kernel(a_ptr, a_desc, w_desc, c_ptr, order_ptr, offsets_ptr, num_experts, N,
                       K, stride_am, stride_cm, GATHER: gl.constexpr, SWIGLU: gl.constexpr,
                       N_MAJOR: gl.constexpr, ROWS_PER_TOKEN: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       BLOCK_E: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr,
                       MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    """One form of the module docstring's GEMM over all tiles; this program's warps are
    the first MMA group. N: output columns (with SWIGLU, I; the weights hold 2N rows)."""
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    a_bufs = gl.allocate_shared_memory(
        gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16))
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, W_ROWS, BLOCK_K], w_desc.layout)
    ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_w = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_a.index(s), count=4 * 32)  # every load thread's cp.async
        mbarrier.init(ready_w.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_mma, (a_bufs, w_bufs, ready_a, ready_w, empty, c_ptr, order_ptr, offsets_ptr,
                num_experts, N, K, stride_cm, 0, GATHER, SWIGLU, N_MAJOR, BLOCK_M, BLOCK_N,
                BLOCK_K, BLOCK_E, STAGES, PROGRAMS)),
        (_mma, (a_bufs, w_bufs, ready_a, ready_w, empty, c_ptr, order_ptr, offsets_ptr,
                num_experts, N, K, stride_cm, 1, GATHER, SWIGLU, N_MAJOR, BLOCK_M, BLOCK_N,
                BLOCK_K, BLOCK_E, STAGES, PROGRAMS)),
        (_loader, (a_ptr, a_desc, w_desc, a_bufs, w_bufs, ready_a, ready_w, empty, order_ptr,
                   offsets_ptr, num_experts, N, K, stride_am, GATHER, SWIGLU, N_MAJOR,
                   ROWS_PER_TOKEN, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, STAGES, PROGRAMS)),
    ], [4, 4], [MMA_REGS, LOAD_REGS])


# Launch constants (H100): 128-row tiles of K steps of 64 over 256 weight rows (down: 256
# output columns; gate_up: 128 gate + 128 up), four slots (192 KB; the epilogue's layout
# change takes ~32 KB more); 12 warps x 168 registers = 2 x 4 x 224 + 4 x 56 (the gather's
# addresses; the down GEMM needs fewer).
BLOCK_M = 128
BLOCK_K = 64
STAGES = 4
MMA_REGS = 224
LOAD_REGS = 56
MAXNREG = 168
# The gate_up form for experts of at most this many output columns. H100, alternating
# medians (lab/moe_bench.py --gluon): Qwen3-30B-A3B (I = 768) at 131,072 rows 1,474 ->
# 1,386 us and at 32,768 rows 456 -> 425 us, but Mixtral-8x7B (I = 14,336) at 8,192 and
# 32,768 rows 4,666 -> 5,614 and 17,155 -> 18,577 us (the down form: 1,540 -> 1,548 and
# 7,921 -> 6,246 us; Qwen3-30B-A3B at 131,072 rows 875 -> 758 us).
SWIGLU_MAX_N = 2048
ENV = "MEGASERVE_MOE_GLUON"  # "0": the Triton kernel everywhere (A/B runs)


def applies(a: torch.Tensor, w: torch.Tensor, *, gather: bool, swiglu: bool,
            scatter: bool) -> bool:
    """Whether :func:`launch` can run this expert GEMM: the down form (no gather, scattered
    rows) or the gate_up form (gather, SwiGLU, grouped rows) with at most SWIGLU_MAX_N
    output columns, on a Hopper GPU (its wgmma), bf16 rows and weights that TMA and 16-byte
    copies can read (K a multiple of BLOCK_K for the gather), and ``$MEGASERVE_MOE_GLUON``
    not "0"."""
    e, n_w, k = w.shape
    form = ((not gather and scatter and not swiglu)
            or (gather and swiglu and not scatter and n_w // 2 <= SWIGLU_MAX_N
                and k % BLOCK_K == 0))
    return (form and a.is_cuda and a.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and w.is_contiguous() and tma_readable(a) and tma_readable(w)
            and torch.cuda.get_device_capability(a.device)[0] == 9
            and os.environ.get(ENV, "1") != "0")


def launch(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor,
           out: torch.Tensor, num_sms: int, *, swiglu: bool, rows_per_token: int = 1) -> None:
    """The expert GEMM of :func:`applies`'s forms over each expert e's grouped positions p
    in ``[offsets[e], offsets[e + 1])``. down (``swiglu=False``): a `[R, K]` in grouped
    order, w `[E, N, K]`, ``out[order[p]] = a[p] @ w[e].T``. gate_up: a `[R /
    rows_per_token, K]` rows, w `[E, 2N, K]` (gate rows, then up rows), ``out[p] =
    silu(gate) * up`` of row ``a[order[p] // rows_per_token]``. Rows of out not named are
    not written."""
    e, n_w, k = w.shape
    n = n_w // 2 if swiglu else n_w
    block_n = 128 if swiglu else 256
    w_desc = TensorDescriptor.from_tensor(
        w.view(e * n_w, k), [block_n, BLOCK_K],
        gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.bfloat16))
    a_desc = None if swiglu else TensorDescriptor.from_tensor(
        a, [BLOCK_M, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K],
                                                                   gl.bfloat16))
    expert_gemm_kernel[(num_sms,)](
        a, a_desc, w_desc, out, order, offsets, e, n, k, a.stride(0), out.stride(0),
        GATHER=swiglu, SWIGLU=swiglu, N_MAJOR=swiglu, ROWS_PER_TOKEN=rows_per_token,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, BLOCK_E=triton.next_power_of_2(e),
        STAGES=STAGES, PROGRAMS=num_sms, MMA_REGS=MMA_REGS, LOAD_REGS=LOAD_REGS, num_warps=4,
        maxnreg=MAXNREG)
