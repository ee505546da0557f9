"""The MoE down GEMM of prefill-sized calls on Hopper, in Gluon (Triton's explicit dialect):
the tiles of :func:`megaserve.kernels.triton_impl.moe._expert_gemm_tma_kernel` (no gather,
scattered rows, no SwiGLU), the same k16 chains, so the same bits (the GPU tests compare
them), in a persistent warp-specialised kernel.

Why a second kernel: the Triton kernel runs one 128 x 256 tile a program, so every tile
waits for its first loads and no load runs during its epilogue. Here one program an SM
walks tiles ``program_id + k * programs`` (``moe._tile_of``'s numbering, row tile by row
tile), in three warp groups (``gl.warp_specialize``):

* a load group streams TMA loads of each K step's rows of A ``[BLOCK_M, BLOCK_K]`` and of
  the expert's weights ``[BLOCK_N, BLOCK_K]`` into a ring of STAGES slots (mbarriers:
  ``ready`` when a slot's bytes have landed, ``empty`` when both MMA groups are done with
  it), across tile boundaries;
* two MMA groups take 64 rows of the tile each: a wgmma a K step with one in flight, then
  the epilogue, which stores whole rows (16 bytes a thread) at ``order[position]``.

Rows past an expert's end (the next expert's) are read and never stored, and rows past R
and weight rows past N read as zeros, as in the Triton kernel.
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


@triton.constexpr_function
def _experts_layout(block_e, warps):
    """``[block_e]`` with every warp holding all of it: :func:`_tile_of`'s sums stay inside
    a warp."""
    return gl.BlockedLayout([max(1, block_e // 32)], [32], [warps], [0])


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _expert_tiles(offsets_ptr, num_experts, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr):
    """(experts, lo, hi, ends, tiles) `[BLOCK_E]`: expert e's grouped positions [lo, hi),
    the row tiles through it and its own."""
    experts = gl.arange(0, BLOCK_E, layout=_experts_layout(BLOCK_E, gl.num_warps()))
    live = experts < num_experts
    lo = gl.load(offsets_ptr + experts, mask=live, other=0)
    hi = gl.load(offsets_ptr + experts + 1, mask=live, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    return experts, lo, hi, gl.associative_scan(tiles, 0, _add), tiles


@gluon.jit
def _tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_M: gl.constexpr):
    """Tile t: (expert, first position, end of the expert's positions, column tile), row
    tile by row tile as moe._tile_of numbers them without N_MAJOR."""
    tile = t // tiles_n
    expert = gl.sum((ends <= tile).to(gl.int32), axis=0)
    mine = experts == expert
    row_tile = tile - gl.sum(gl.where(mine, ends - tiles, 0), axis=0)
    start = gl.sum(gl.where(mine, lo, 0), axis=0) + row_tile * BLOCK_M
    return expert, start, gl.sum(gl.where(mine, hi, 0), axis=0), t % tiles_n


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, offsets_ptr, num_experts, N, K,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            BLOCK_E: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr):
    """The load partition: K step i of this program's tiles into slot ``i % STAGES`` once
    both MMA groups are done with the slot's previous step (``empty``)."""
    experts, lo, hi, ends, tiles = _expert_tiles(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    tiles_n = gl.cdiv(N, BLOCK_N)
    i = 0
    for t in range(gl.program_id(0), gl.sum(tiles, axis=0) * tiles_n, PROGRAMS):
        expert, start, end, col = _tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_M)
        for k0 in range(0, K, BLOCK_K):
            slot = i % STAGES
            # (a fresh barrier's phase "before 0" counts as complete: the first STAGES pass)
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot),
                            a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [start, k0], ready.index(slot),
                                            a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [expert * N + col * BLOCK_N, k0],
                                            ready.index(slot), w_bufs.index(slot))
            i += 1


@gluon.jit
def _mma(a_bufs, w_bufs, ready, empty, c_ptr, order_ptr, offsets_ptr, num_experts, N, K,
         stride_cm, HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr, STAGES: gl.constexpr,
         PROGRAMS: gl.constexpr):
    """An MMA partition (one warp group): rows ``HALF * BLOCK_M / 2 + [0, BLOCK_M / 2)`` of
    each tile, then their store."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    # Whole rows a warp, 16 bytes a thread (the accumulator's layout would store 4-byte
    # pieces of 8 rows at a time: the epilogue took ~2x as long).
    OUT: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [4, 1],
                                         [1, 0])
    ROWS: gl.constexpr = BLOCK_M // 2
    experts, lo, hi, ends, tiles = _expert_tiles(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    tiles_n = gl.cdiv(N, BLOCK_N)
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, ACC)
    i = 0
    for t in range(gl.program_id(0), gl.sum(tiles, axis=0) * tiles_n, PROGRAMS):
        expert, start, end, col = _tile_of(t, tiles_n, experts, lo, hi, ends, tiles, BLOCK_M)
        acc = zero
        for k0 in range(0, K, BLOCK_K):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot).slice(HALF * ROWS, ROWS),
                                w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if k0 > 0:  # the previous step's dot is done with its slot
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
        res = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), OUT)
        pos = start + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT))
        ok = pos < end
        dst = gl.load(order_ptr + pos, mask=ok, other=0).to(gl.int64)
        cols = col * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT))
        gl.store(c_ptr + gl.expand_dims(dst * stride_cm, 1) + gl.expand_dims(cols, 0), res,
                 mask=gl.expand_dims(ok, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def expert_gemm_scatter_kernel(a_desc, w_desc, c_ptr, order_ptr, offsets_ptr, num_experts, N,
                               K, stride_cm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
                               STAGES: gl.constexpr, PROGRAMS: gl.constexpr,
                               MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    """``c[order[p]] = a[p] @ w[e].T`` for every grouped position p of expert e (module
    docstring); this program's warps are the first MMA group."""
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_mma, (a_bufs, w_bufs, ready, empty, c_ptr, order_ptr, offsets_ptr, num_experts, N,
                K, stride_cm, 0, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, STAGES, PROGRAMS)),
        (_mma, (a_bufs, w_bufs, ready, empty, c_ptr, order_ptr, offsets_ptr, num_experts, N,
                K, stride_cm, 1, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, STAGES, PROGRAMS)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, offsets_ptr, num_experts, N,
                   K, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, STAGES, PROGRAMS)),
    ], [4, 4], [MMA_REGS, LOAD_REGS])


# Launch constants (H100): 128 x 256 tiles of K steps of 64, four slots (192 KB; the
# epilogue's layout change takes 32 KB more), 12 warps x 168 registers = 2 x 4 x 232 + 4 x 40.
BLOCK_M = 128
BLOCK_N = 256
BLOCK_K = 64
STAGES = 4
MMA_REGS = 232
LOAD_REGS = 40
MAXNREG = 168
ENV = "MEGASERVE_MOE_GLUON"  # "0": the Triton kernel everywhere (A/B runs)


def applies(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`launch` can run this down GEMM: a Hopper GPU (its wgmma), bf16 rows
    and weights that TMA can read (16-byte aligned rows), and ``$MEGASERVE_MOE_GLUON`` not
    "0"."""
    return (a.is_cuda and a.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and a.stride(1) == 1 and w.is_contiguous()
            and (a.stride(0) * 2) % 16 == 0 and (w.shape[2] * 2) % 16 == 0
            and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(a.device)[0] == 9
            and os.environ.get(ENV, "1") != "0")


def launch(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor,
           out: torch.Tensor, num_sms: int) -> None:
    """``out[order[p]] = a[p] @ w[e].T`` for each expert e's grouped positions p in
    ``[offsets[e], offsets[e + 1])``: a `[R, K]` in grouped order, w `[E, N, K]`, out `[R, N]`
    (rows past offsets[E] are not written)."""
    e, n, k = w.shape
    a_desc = TensorDescriptor.from_tensor(
        a, [BLOCK_M, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K],
                                                                   gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(
        w.view(e * n, k), [BLOCK_N, BLOCK_K],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16))
    expert_gemm_scatter_kernel[(num_sms,)](
        a_desc, w_desc, out, order, offsets, e, n, k, out.stride(0), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_E=triton.next_power_of_2(e), STAGES=STAGES,
        PROGRAMS=num_sms, MMA_REGS=MMA_REGS, LOAD_REGS=LOAD_REGS, num_warps=4,
        maxnreg=MAXNREG)
