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

One persistent program an SM walks (BLOCK_M x BLOCK_N) tiles ``program_id + k * programs``
in GROUP_M-row bands (L2 reuse of the weight columns); three warp groups
(``gl.warp_specialize``): a loader streams each group's A rows ``[BLOCK_M, 128]`` and
weight rows ``[BLOCK_N, 128]`` by TMA into a ring of STAGES slots (``ready`` when both
landed, ``empty`` when both MMA groups are done with it); two MMA groups take 64 rows of
each tile. Rows past M and weight rows past N read as zeros (TMA), as the Triton kernel's
masked loads read them.
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

GROUP = 128  # activation group = weight block = one K step
BLOCK_M = 128
BLOCK_N = 128
_GROUP = gl.constexpr(GROUP)  # the two as the kernels read them
_BLOCK_M = gl.constexpr(BLOCK_M)
STAGES = 4
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
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr):
    tiles_m = gl.cdiv(M, _BLOCK_M)
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
            tma.async_copy_global_to_shared(a_desc, [pm * _BLOCK_M, g * _GROUP], ready.index(slot),
                                            a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [pn * BLOCK_N, g * _GROUP], ready.index(slot),
                                            w_bufs.index(slot))
            i += 1


@gluon.jit
def _mma(a_bufs, w_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, M, N, K, stride_asm, stride_bsn,
         stride_cm, SPLIT_GROUPS: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
         STAGES: gl.constexpr, GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr):
    """An MMA partition (one warp group): rows ``HALF * 64 + [0, 64)`` of each tile."""
    ROWS: gl.constexpr = _BLOCK_M // 2
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    ROW: gl.constexpr = gl.SliceLayout(1, ACC)
    COL: gl.constexpr = gl.SliceLayout(0, ACC)
    ONE_SPLIT: gl.constexpr = SPLIT_GROUPS == 0  # the host passes 0 for "one split"
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, ACC)
    tiles_m = gl.cdiv(M, _BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_groups = gl.cdiv(K, _GROUP)
    i = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, PROGRAMS):
        pm, pn = _tile(t, tiles_m, tiles_n, GROUP_M)
        rows = pm * _BLOCK_M + HALF * ROWS + gl.arange(0, ROWS, layout=ROW)
        row_ok = rows < M
        as_rows = as_ptr + rows.to(gl.int64) * stride_asm
        bs_row = bs_ptr + ((pn * BLOCK_N) // _GROUP) * stride_bsn
        part = zero
        total = zero
        a_s = gl.load(as_rows, mask=row_ok, other=0.0)
        b_s = gl.load(bs_row)
        for g in range(num_groups):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            d = warpgroup_mma(a_bufs.index(slot).slice(HALF * ROWS, ROWS),
                              w_bufs.index(slot).permute((1, 0)), zero, use_acc=False,
                              is_async=True)
            # group g + 1's scales load while the chain runs (0 past the last group)
            a_s_next = gl.load(as_rows + g + 1, mask=row_ok & (g + 1 < num_groups), other=0.0)
            b_s_next = gl.load(bs_row + g + 1, mask=g + 1 < num_groups, other=0.0)
            d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
            mbarrier.arrive(empty.index(slot))
            part = gl.fma(d, gl.expand_dims(a_s * b_s, 1), part)
            if not ONE_SPLIT:
                if (g + 1) % SPLIT_GROUPS == 0:  # group g ends a split
                    total = total + part
                    part = zero
            a_s = a_s_next
            b_s = b_s_next
            i += 1
        if ONE_SPLIT:
            total = total + part
        elif num_groups % SPLIT_GROUPS != 0:  # the last split is short
            total = total + part
        cols = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=COL)
        at = c_ptr + gl.expand_dims(rows.to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
        gl.store(at, total.to(c_ptr.dtype.element_ty),
                 mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def linear_kernel(a_desc, w_desc, as_ptr, bs_ptr, c_ptr, M, N, K, stride_asm, stride_bsn,
                  stride_cm, SPLIT_GROUPS: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr,
                  MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    """The module docstring's GEMM over every tile; this program's warps are the first MMA
    group. SPLIT_GROUPS: groups per K split (0: one split)."""
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _BLOCK_M, _GROUP], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, _GROUP], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_mma, (a_bufs, w_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, M, N, K, stride_asm,
                stride_bsn, stride_cm, SPLIT_GROUPS, 0, BLOCK_N, STAGES, GROUP_M, PROGRAMS)),
        (_mma, (a_bufs, w_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, M, N, K, stride_asm,
                stride_bsn, stride_cm, SPLIT_GROUPS, 1, BLOCK_N, STAGES, GROUP_M, PROGRAMS)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, BLOCK_N, STAGES,
                   GROUP_M, PROGRAMS)),
    ], [4, 4], [MMA_REGS, LOAD_REGS])


def applies(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` can run: Hopper, e4m3 rows and weights TMA can read (K a
    multiple of 16, contiguous), and ``$MEGASERVE_FP8_GLUON`` not "0"."""
    k = a.shape[1]
    return (a.is_cuda and a.dtype == torch.float8_e4m3fn and k % 16 == 0
            and a.stride(1) == 1 and a.stride(0) == k and weight.is_contiguous()
            and a.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(a.device)[0] == 9
            and os.environ.get(ENV, "1") != "0")


def linear(a: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
           out: torch.Tensor, split_groups: int) -> None:
    """``out = a @ dequant(weight).T`` by fp8_gemm's arithmetic: a `[M, K]` e4m3 with group
    scales a_s `[M, G]` (:func:`fp8_gemm.quantize_rows`), weight `[N, K]` e4m3 with
    scale_inv `[ceil(N/128), G]`, split_groups the weight's K split (fp8_gemm.split_groups)."""
    m, k = a.shape
    n = weight.shape[0]
    bn = BLOCK_N
    a_desc = TensorDescriptor.from_tensor(
        a, [BLOCK_M, GROUP], gl.NVMMASharedLayout.get_default_for([BLOCK_M, GROUP], gl.float8e4nv))
    w_desc = TensorDescriptor.from_tensor(
        weight, [bn, GROUP], gl.NVMMASharedLayout.get_default_for([bn, GROUP], gl.float8e4nv))
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    one_split = split_groups >= triton.cdiv(k, GROUP)
    linear_kernel[(programs,)](
        a_desc, w_desc, a_s, scale_inv, out, m, n, k, a_s.stride(0), scale_inv.stride(0),
        out.stride(0), SPLIT_GROUPS=0 if one_split else split_groups, BLOCK_N=bn, STAGES=STAGES,
        GROUP_M=GROUP_M, PROGRAMS=programs, MMA_REGS=MMA_REGS, LOAD_REGS=LOAD_REGS,
        num_warps=4, maxnreg=MAXNREG)
