"""Batch-invariant grouped expert GEMMs on block-FP8 weights (CUDA, Hopper): the SwiGLU
expert FFN of :func:`kernels.fp8_expert_ffn`.

Shape legend: T = tokens, R = routed rows, E = experts, D = hidden, I = expert
intermediate, G = 128-groups along K.

NOTE: a routed row's arithmetic is fp8_gemm's NOTE (one split: S = 1) with its expert's
weights, wherever the row sits:

    x [T, D] ─ gate_up GEMM (x quantized per row and group) ─▶ gate, up   fp32 chains
             ─ epilogue: h = silu(round(gate)) * round(up) in fp32 (round: x.dtype)
    h [R, I] ─ quantized per row and group ─ down GEMM ─▶ out [R, D]      row order

The rows are grouped by expert as :mod:`moe` groups them (its align pass, or with at most
``moe.INLINE_ALIGN_MAX_ROWS`` rows its inline grouping in every program; the same
integers) and the tiles numbered the same way (moe's NOTE): each program is one (expert,
BLOCK_M grouped positions, BLOCK_N columns) tile, the grid a bound from (R, E) alone.

Launch choices, none of which changes a bit (:class:`Fp8MoeLaunch`): tile shapes and
warps; whether x and h are quantized inside the GEMMs' K loops (:func:`fp8_gemm.load_group`,
decode: one launch less each) or each by one quantize launch before its GEMM (the K loops
stream e4m3 rows; no column tile repeats the quantization): the same helper on the same
values; whether SwiGLU is the gate_up GEMM's epilogue (h in fp32) or the launch that
quantizes h (:func:`fp8_gemm.silu_mul_quantize_rows` of gate and up in x.dtype): the
same roundings; whether :mod:`fp8_moe_gluon`'s kernel (Hopper; e4m3 rows in, no SwiGLU
epilogue) runs a grouped GEMM instead of this module's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import fp8_moe_gluon
from .fp8_gemm import (FP8_MAX, GROUP, check_weight, load_group, load_raw, load_scales,
                       pdl_args, promote, quantize_rows, silu_mul_quantize_rows, swiglu,
                       weight_scales)
from .matmul import num_sms
from .moe import INLINE_ALIGN_MAX_ROWS, align, max_tiles, rows_at, tile_of


@triton.jit
def _fp8_expert_kernel(
    # Pointers
    a_ptr, as_ptr, w_ptr, wsc_ptr, c_ptr, ids_ptr, order_ptr, offsets_ptr,
    # Shapes
    R, num_experts, N, K,
    # Strides
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
    # Meta-parameters
    QUANT_A: tl.constexpr, SWIGLU: tl.constexpr, ROUND: tl.constexpr,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr,
    INLINE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr, WS_SCALAR: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """One (expert, BLOCK_M positions, BLOCK_N columns) tile of ``a @ dequant(w[e]).T``.

    GATHER: position p reads row ``order[p] // ROWS_PER_TOKEN`` of a (else row p);
    SCATTER: writes row ``order[p]`` of c (else row p). SWIGLU: N is I; the tile
    accumulates gate columns n and up columns N + n and stores :func:`swiglu` of the two
    rounded to ROUND (1 bf16, 2 fp16, 0 none), fp32. Else c gets the fp32 tile cast.
    QUANT_A: a holds float rows, quantized in the K loop; else e4m3 rows, scales at as.
    """
    expert, start, end, col_tile = tile_of(tl.program_id(0), offsets_ptr, ids_ptr, R,
                                            num_experts, N, BLOCK_M, BLOCK_N, BLOCK_E,
                                            BLOCK_R, INLINE, False)
    if expert >= num_experts:
        return
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = start + tl.arange(0, BLOCK_M)  # positions in the grouped order
    row_ok = pos < end
    col_ok = cols < N
    if GATHER or SCATTER:
        rows = rows_at(pos, row_ok, order_ptr, ids_ptr, R, num_experts, BLOCK_R, INLINE)
    if GATHER:
        src = rows // ROWS_PER_TOKEN
    else:
        src = pos
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = wsc_ptr + expert.to(tl.int64) * stride_wse
    g_rows = w_base + cols.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + N * stride_wn
    num_groups = tl.cdiv(K, GROUP)
    as_rows = as_ptr + src.to(tl.int64) * stride_asm
    a_s = load_scales(as_rows, row_ok, 0, num_groups, QUANT_A)
    n0 = col_tile * BLOCK_N
    b_s = weight_scales(s_base, cols, col_ok, n0, 0, num_groups, stride_wsn, WS_SCALAR, GROUP)
    u_s = weight_scales(s_base, cols + N, col_ok, n0 + N, 0, num_groups, stride_wsn, WS_SCALAR,
                        GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANT_A:
        a_raw = load_raw(a_ptr, src, row_ok, 0, num_groups, K, stride_am, GROUP)
    else:
        a_raw = a_s
    for g in range(0, num_groups):
        # group g + 1's scales load during step g (no load latency inside a step)
        a_s_next = load_scales(as_rows, row_ok, g + 1, num_groups, QUANT_A)
        b_s_next = weight_scales(s_base, cols, col_ok, n0, g + 1, num_groups, stride_wsn,
                                 WS_SCALAR, GROUP)
        if SWIGLU:
            u_s_next = weight_scales(s_base, cols + N, col_ok, n0 + N, g + 1, num_groups,
                                     stride_wsn, WS_SCALAR, GROUP)
        else:
            u_s_next = u_s
        if QUANT_A:  # group g + 1's rows load during step g
            a_raw_next = load_raw(a_ptr, src, row_ok, g + 1, num_groups, K, stride_am, GROUP)
        else:
            a_raw_next = a_raw
        a, a_s = load_group(a_ptr, src, row_ok, g, K, stride_am, a_s, a_raw, QUANT_A,
                            FP8_MAX, GROUP)
        a_raw = a_raw_next
        kk = g * GROUP + tl.arange(0, GROUP)
        w_ok = col_ok[:, None] & (kk < K)[None, :]
        b = tl.load(g_rows + kk[None, :], mask=w_ok, other=0.0)
        acc = promote(acc, tl.dot(a, tl.trans(b)), a_s, b_s, WS_SCALAR)
        if SWIGLU:
            b_up = tl.load(u_rows + kk[None, :], mask=w_ok, other=0.0)
            acc_up = promote(acc_up, tl.dot(a, tl.trans(b_up)), a_s, u_s, WS_SCALAR)
        a_s = a_s_next
        b_s = b_s_next
        u_s = u_s_next
    dst = rows if SCATTER else pos
    out_ok = row_ok[:, None] & col_ok[None, :]
    c_at = c_ptr + dst.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    if SWIGLU:
        if ROUND == 1:
            acc = acc.to(tl.bfloat16).to(tl.float32)
            acc_up = acc_up.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            acc = acc.to(tl.float16).to(tl.float32)
            acc_up = acc_up.to(tl.float16).to(tl.float32)
        tl.store(c_at, swiglu(acc, acc_up), mask=out_ok)
    else:
        tl.store(c_at, acc.to(c_ptr.dtype.element_ty), mask=out_ok)


@dataclass(frozen=True)
class Fp8MoeLaunch:
    """The launches of one FP8 expert FFN; never changes a bit (module NOTE).

    block_m, up_n (columns of the gate_up tile), down_n, warps, stages. fused: the gate_up
    tile holds up_n gate and up_n up columns and its epilogue applies SwiGLU (h fp32);
    else it holds up_n of the 2I columns, stores them in x.dtype and
    :func:`silu_mul_quantize_rows` makes h (one launch; needs h_in_loop False: the same
    rounding of gate and up, the same fp32 SwiGLU). x_in_loop / h_in_loop: x (h) quantized
    in the gate_up (down) GEMM's K loop, else by one quantize launch before it. gluon: the
    GEMMs that take e4m3 rows and store their product (unfused, quantized before) run
    :mod:`fp8_moe_gluon`'s kernel where it applies (rows grouped by the align pass)."""

    block_m: int = 64
    up_n: int = 64
    down_n: int = 128
    num_warps: int = 4
    num_stages: int = 4
    x_in_loop: bool = True
    h_in_loop: bool = True
    fused: bool = True
    gluon: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"Fp8MoeLaunch: block_m {self.block_m} must be 64 or 128 (wgmma)")
        for v in (self.up_n, self.down_n):
            if v not in (32, 64, 128, 256):
                raise ValueError(f"Fp8MoeLaunch: column tile {v} must be 32, 64, 128 or 256")
        if not self.fused and self.h_in_loop:
            raise ValueError("Fp8MoeLaunch: fused=False quantizes h in its own launch "
                             "(h_in_loop=False)")
        if self.num_warps not in (4, 8) or self.num_stages < 1:
            raise ValueError(f"Fp8MoeLaunch: num_warps {self.num_warps} must be 4 or 8, "
                             f"num_stages {self.num_stages} >= 1")


# tuning runs: "m,up_n,down_n,warps,stages,x_in_loop,h_in_loop,fused[,gluon]" (decode sizes)
_LAUNCH_ENV = "MEGASERVE_FP8_MOE"
# H200, lab/fp8_moe_gluon_sweep.py, Qwen3-30B-A3B's expert FFN (us, Triton / Gluon): batch
# 64 (4 rows an expert) 177 / 161, 256 (16) 189 / 174, 1024 (64) 241 / 279.
GLUON_MAX_ROWS_PER_EXPERT = 32


def plan_moe(num_rows: int, num_experts: int) -> Fp8MoeLaunch:
    """The launch for ``num_rows`` routed rows over ``num_experts`` (bit-neutral).

    Up to 64 rows an expert on average (decode): x quantized by one launch, gate_up
    unfused in 64 x 128 tiles, 4 stages, h by :func:`silu_mul_quantize_rows` (every K
    loop streams e4m3 rows; one dot a step), both GEMMs by :mod:`fp8_moe_gluon` up to
    GLUON_MAX_ROWS_PER_EXPERT rows an expert on average, where it applies. H200,
    ``fp8_bench --sweep``, Qwen3-30B-A3B's experts (128, top-8), Triton kernel: 27 / 178
    / 192 / 252 us at batch 1 / 64 / 256 / 1024, against 47 / 353 / 378 / 557 with x and
    h quantized in the K loops (fused SwiGLU) and 32 / 279 / 325 / 416 for the bf16
    expert FFN. More rows: the same with 128 x 128 tiles, 8 warps, 3 stages.
    ``$MEGASERVE_FP8_MOE`` replaces the decode launch (tuning runs)."""
    if num_rows <= 64 * num_experts:
        text = os.environ.get(_LAUNCH_ENV)
        if text:
            v = [int(t) for t in text.split(",")]
            return Fp8MoeLaunch(*v[:5], *(bool(f) for f in v[5:]))
        return Fp8MoeLaunch(64, 128, 128, 4, 4, x_in_loop=False, h_in_loop=False, fused=False,
                            gluon=num_rows <= GLUON_MAX_ROWS_PER_EXPERT * num_experts)
    return Fp8MoeLaunch(128, 128, 128, 8, 3, x_in_loop=False, h_in_loop=False, fused=False)


_ROUND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}


def _grouped(a, a_s, w, w_s, out, ids, grouping, *, n: int, quant_a: bool, swiglu: bool,
             round_ty: torch.dtype, gather: bool, scatter: bool,
             rows_per_token: int, block_m: int, block_n: int, num_warps: int,
             num_stages: int, gluon: bool = False) -> None:
    r = ids.shape[0]
    num_experts, _, k = w.shape
    offsets, order = grouping if grouping is not None else (ids, ids)  # unused if inline
    if (gluon and grouping is not None and not quant_a and not swiglu
            and fp8_moe_gluon.applies(a, w, gather=gather)):
        fp8_moe_gluon.grouped(a, a_s, w, w_s, out, offsets, order, num_sms(a.device),
                              gather=gather, scatter=scatter, rows_per_token=rows_per_token,
                              pdl=pdl_args(a.device, "gluon_moe")["PDL"])
        return
    grid = (max_tiles(r, num_experts, block_m) * triton.cdiv(n, block_n),)
    _fp8_expert_kernel[grid](
        a, a_s, w, w_s, out, ids, order, offsets, r, num_experts, n, k,
        a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1),
        out.stride(0), QUANT_A=quant_a, SWIGLU=swiglu, ROUND=_ROUND[round_ty],
        GATHER=gather, SCATTER=scatter, ROWS_PER_TOKEN=rows_per_token,
        INLINE=grouping is None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_R=max(16, triton.next_power_of_2(r)) if grouping is None else 16,
        # a tile's gate (and up) columns share one scale row: one scale a group
        WS_SCALAR=block_n <= GROUP and (not swiglu or n % GROUP == 0),
        GROUP=GROUP, FP8_MAX=FP8_MAX, num_warps=num_warps, num_stages=num_stages)


def _grouping(ids: torch.Tensor, num_experts: int):
    """moe's grouping of the routed rows: None (inline, few rows) or (offsets, order)."""
    return None if ids.shape[0] <= INLINE_ALIGN_MAX_ROWS else align(ids, num_experts)


def fp8_grouped_gemm(xq: torch.Tensor, xs: torch.Tensor, expert_ids: torch.Tensor,
                     weight: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype,
                     rows_per_token: int = 1, block_m: int = 64,
                     block_n: int = 128) -> torch.Tensor:
    """Routed row r: ``dequant(xq[r // rows_per_token]) @ dequant(weight[expert_ids[r]]).T``.

    xq `[R / rows_per_token, K]` e4m3 and xs `[.., G]` float32 (:func:`quantize_rows`);
    expert_ids `[R]` int64 in [0, E] (E: routed nowhere, its output row unspecified);
    weight `[E, N, K]` e4m3, scale_inv `[E, ceil(N/128), ceil(K/128)]`. Returns `[R, N]`
    in out_dtype; each row's bits are independent of the other rows and of the tiles.
    """
    num_rows = expert_ids.shape[0]
    num_experts, n, k = weight.shape
    check_weight(weight, scale_inv, k)
    out = torch.empty(num_rows, n, dtype=out_dtype, device=xq.device)
    if num_rows == 0:
        return out
    ids = expert_ids.contiguous()
    _grouped(xq, xs, weight, scale_inv, out, ids, _grouping(ids, num_experts), n=n,
             quant_a=False, swiglu=False, round_ty=out_dtype, gather=True,
             scatter=True, rows_per_token=rows_per_token, block_m=block_m, block_n=block_n,
             num_warps=4, num_stages=3)
    return out


def fp8_expert_ffn(x: torch.Tensor, expert_ids: torch.Tensor, w_gate_up: torch.Tensor,
                   s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                   rows_per_token: int = 1, launch: Fp8MoeLaunch | None = None) -> torch.Tensor:
    """SwiGLU experts on block-FP8 weights: ``down_e(silu(gate_e x) * up_e x)`` per routed
    row r of token ``r // rows_per_token`` (module NOTE). x `[T, D]` bf16/fp16/fp32,
    expert_ids `[R]` int64 in [0, E] (E: routed nowhere, its output row unspecified),
    w_gate_up `[E, 2I, D]`, w_down `[E, D, I]` e4m3 with their 128 x 128 scales. Returns
    `[R, D]` in x.dtype. Launches: :func:`plan_moe`, or ``launch`` (tests, tuning): the
    same bits either way."""
    r = expert_ids.shape[0]
    num_experts, two_i, d = w_gate_up.shape
    inter = two_i // 2
    if rows_per_token < 1 or x.shape[0] * rows_per_token != r:
        raise ValueError(f"fp8_expert_ffn: x has {x.shape[0]} rows, expert_ids {r}; need "
                         f"x rows * rows_per_token ({rows_per_token}) == expert_ids rows")
    check_weight(w_gate_up, s_gate_up, d)
    check_weight(w_down, s_down, inter)
    out = torch.empty(r, w_down.shape[1], dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    lp = launch or plan_moe(r, num_experts)
    ids = expert_ids.contiguous()
    grouping = _grouping(ids, num_experts)
    common = dict(round_ty=x.dtype, rows_per_token=rows_per_token, block_m=lp.block_m,
                  num_warps=lp.num_warps, num_stages=lp.num_stages, gluon=lp.gluon)
    x = x if x.stride(1) == 1 else x.contiguous()
    a, a_s = (x, x) if lp.x_in_loop else quantize_rows(x)
    if lp.fused:
        h = torch.empty(r, inter, dtype=torch.float32, device=x.device)  # [R, I] grouped
        _grouped(a, a_s, w_gate_up, s_gate_up, h, ids, grouping, n=inter,
                 quant_a=lp.x_in_loop, swiglu=True, gather=True, scatter=False,
                 block_n=lp.up_n, **common)
        h, h_s = (h, h) if lp.h_in_loop else quantize_rows(h)
    else:
        gate_up = torch.empty(r, two_i, dtype=x.dtype, device=x.device)  # [R, 2I] grouped
        _grouped(a, a_s, w_gate_up, s_gate_up, gate_up, ids, grouping, n=two_i,
                 quant_a=lp.x_in_loop, swiglu=False, gather=True, scatter=False,
                 block_n=lp.up_n, **common)
        h, h_s = silu_mul_quantize_rows(gate_up)
    _grouped(h, h_s, w_down, s_down, out, ids, grouping, n=w_down.shape[1],
             quant_a=lp.h_in_loop, swiglu=False, gather=False, scatter=True,
             block_n=lp.down_n, **common)
    return out


# The jitted grouped GEMM, for ahead-of-time compiles (fp8_bench --resources).
expert_kernel = _fp8_expert_kernel
