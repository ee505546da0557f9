"""Batch-invariant block-FP8 linear on CUDA (Hopper), and the activation quantization that
every FP8 GEMM here shares (the grouped expert GEMM is in :mod:`fp8_moe`).

Shape legend: M = rows (tokens), K = reduction, N = output features, G = cdiv(K, 128)
groups, S = K splits.

NOTE: the arithmetic of one output element is fixed by (N, K) alone:

    x row m ──quantize──▶ xq[m, :] e4m3, xs[m, g] = amax(|x[m, 128g:128g+128]|) / 448
                          (per token, per group of 128: a function of the row alone)
    split s covers groups [s * SG, (s + 1) * SG)        SG = split_groups(N, K)
    part_s = 0;  for g in split s (ascending):
                     d = dot(xq[m, group g], wq[n, group g])   fresh fp32 tensor-core chain
                     part_s = fma(d, xs[m, g] * ws[n // 128, g], part_s)
                                        (:func:`promote`: one rounding of the scales'
                                        product, one of the fused multiply-add)
    total = 0;   for s = 0 .. S-1 (ascending): total = total + part_s
    out = cast(total)

What may depend on M (a launch, :class:`LinearLaunch`) never changes a bit: the row and
column tile (64 or 128 rows, 64 or 128 columns: the same per-element chain of wgmma k32
steps, whatever the instruction's N and the row's place in the tile), whether the
activation is quantized inside the GEMM's K loop or by :func:`quantize_rows` before it
(one jitted helper, :func:`quantize_tile`, the same fp32 operations either way), and
whether a program folds the splits in registers or stores part_s to a workspace that
:func:`_fold_kernel` (or the kernel that consumes the output: :func:`fp8_linear_parts`)
folds in the same order (decode: S programs per tile instead of one), and whether
:mod:`fp8_gemm_gluon`'s kernel (Hopper, prefill-sized calls) runs it instead of this
module's. tests/kernels/test_fp8_gpu.py checks every launch bitwise against the others.

Weights: e4m3 `[N, K]` with float32 ``scale_inv`` `[ceil(N/128), ceil(K/128)]`:
DeepSeek-V3's and the Qwen3 FP8 checkpoints' 128 x 128 block format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .matmul import PARTS_ENV, num_sms
from .parts import Parts

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # activation group = weight block = the K step of every FP8 GEMM
_TARGET_PROGRAMS = 132  # one per SM of an H100/H200: the decode split rule's budget
_MIN_SPLIT_GROUPS = 4
DECODE_MAX_M = 64  # rows up to which $MEGASERVE_FP8_LINEAR replaces the planned launch

# The FP8 kernels launched with PDL (pdl's NOTE; each waits first whatever this says):
# "quantize" (quantize_rows and silu_mul_quantize_rows), "linear" (this module's GEMM and
# its fold), "gluon_linear" (fp8_gemm_gluon), "gluon_moe" (fp8_moe_gluon; persistent, one
# program an SM). fp8_moe's Triton expert GEMM never (many programs a wave: moe's note on
# PDL_KERNELS). $MEGASERVE_FP8_PDL (names, comma-separated) replaces the set. The Gluon
# expert GEMM launched early cost 0.2-0.3 ms a decode step at batch 64 / 256 (H200,
# Qwen3-30B-A3B fp8: its persistent programs start behind the kernel before it) and is
# left out; the others were within the noise and stay on (docs/results/models-fp8.md).
PDL_KERNELS = frozenset({"quantize", "linear", "gluon_linear"})
_PDL_ENV = "MEGASERVE_FP8_PDL"


def pdl_args(device: torch.device, kernel: str) -> dict:
    """The launch arguments of FP8 kernel ``kernel`` (a name in :data:`PDL_KERNELS`)."""
    return pdl.named_launch_args(device, kernel, PDL_KERNELS, _PDL_ENV)


@triton.jit
def quantize_tile(x, FP8_MAX: tl.constexpr):
    """x fp32 `[ROWS, 128]` (one group per row; masked columns 0) → (q fp32 `[ROWS, 128]`
    with e4m3-representable range, scale `[ROWS]`): scale = amax / 448 (1 for an all-zero
    group), q = clamp(x / scale). The caller casts q to e4m3 (round to nearest even).
    Every FP8 GEMM and :func:`quantize_rows` quantize through this one helper."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    q = tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX)
    return q, scale


@triton.jit
def swiglu(gate, up):
    """``silu(gate) * up`` in fp32 (gate and up already rounded to the GEMM's dtype)."""
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                     SWIGLU: tl.constexpr, FP8_MAX: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """Rows [BLOCK_R * pid0, +BLOCK_R), group pid1 of x (SWIGLU: x is ``[gate | up]`` of
    width 2K and the quantized value is :func:`swiglu` of them)."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    at = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    x = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    if SWIGLU:
        x = swiglu(x, tl.load(at + K, mask=ok, other=0.0).to(tl.float32))
    q, scale = quantize_tile(x, FP8_MAX)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :],
             q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g, scale, mask=rows < M)


def _quantize(x: torch.Tensor, swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, width = x.shape
    k = width // 2 if swiglu else width
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, triton.cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    if m:
        x = x if x.stride(-1) == 1 else x.contiguous()
        block_r = 16
        _quantize_kernel[(triton.cdiv(m, block_r), scale.shape[1])](
            x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), SWIGLU=swiglu,
            FP8_MAX=FP8_MAX, GROUP=GROUP, BLOCK_R=block_r, num_warps=4,
            **pdl_args(x.device, "quantize"))
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group e4m3 quantization, one launch: x `[M, K]` → (xq `[M, K]` e4m3,
    xs `[M, G]` float32 = amax of each 128-column group / 448; 1 for an all-zero group).
    Every value is a function of its own row and group."""
    return _quantize(x, swiglu=False)


def silu_mul_quantize_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``silu(gate) * up`` (fp32) for gate_up `[R, 2I]` (gate
    columns first), fused: the expert intermediate never goes through memory unquantized."""
    return _quantize(gate_up, swiglu=True)


@triton.jit
def load_raw(a_ptr, rows, row_ok, g, g_end, K, stride_am, GROUP: tl.constexpr):
    """Group g of the float A rows ``rows`` as stored (`[ROWS, 128]`; zeros where masked
    or g >= g_end). The K loops that quantize A load group g + 1 during step g: its
    latency overlaps the step instead of stalling it."""
    kk = g * GROUP + tl.arange(0, GROUP)
    ok = row_ok[:, None] & (kk < K)[None, :] & (g < g_end)
    return tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + kk[None, :], mask=ok,
                   other=0.0)


@triton.jit
def load_group(a_ptr, rows, row_ok, g, K, stride_am, a_s, a_raw, QUANT_A: tl.constexpr,
               FP8_MAX: tl.constexpr, GROUP: tl.constexpr):
    """Group g of the A rows ``rows`` as an FP8 GEMM operand: (e4m3 `[ROWS, 128]`, scale
    `[ROWS]`). QUANT_A: ``a_raw`` holds the group's float values (:func:`load_raw`, one
    step ahead), quantized here (:func:`quantize_tile`); else a holds e4m3 rows, loaded
    here (the compiler pipelines the load), whose scales ``a_s`` the caller loaded
    (:func:`load_scales`, one group ahead). The same bits either way."""
    if QUANT_A:
        q, scale = quantize_tile(a_raw.to(tl.float32), FP8_MAX)
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale
    else:
        kk = g * GROUP + tl.arange(0, GROUP)
        ok = row_ok[:, None] & (kk < K)[None, :]
        at = a_ptr + rows.to(tl.int64)[:, None] * stride_am + kk[None, :]
        return tl.load(at, mask=ok, other=0.0), a_s


@triton.jit
def load_scales(ptrs, ok, g, g_end, SKIP: tl.constexpr):
    """float32 ``ptrs[g]`` where ok and g < g_end, else 0 (SKIP: zeros, nothing loaded).
    The K loops load group g + 1's scales during step g."""
    if SKIP:
        return tl.zeros(ptrs.shape, dtype=tl.float32)
    else:
        return tl.load(ptrs + g, mask=ok & (g < g_end), other=0.0)


@triton.jit
def weight_scales(scale_ptr, cols, col_ok, first_col, g, g_end, stride_sn,
                  SCALAR: tl.constexpr, GROUP: tl.constexpr):
    """The weight scales of group g for columns ``cols`` (0 past g_end): SCALAR (the
    tile's columns lie in one 128-row block, ``first_col``'s) one value, else one per
    column. The same value per column either way."""
    if SCALAR:
        return tl.load(scale_ptr + (first_col // GROUP) * stride_sn + g, mask=g < g_end,
                       other=0.0)
    else:
        return tl.load(scale_ptr + (cols // GROUP) * stride_sn + g, mask=col_ok & (g < g_end),
                       other=0.0)


@triton.jit
def promote(acc, d, a_s, b_s, SCALAR: tl.constexpr):
    """``fma(d, a_s * b_s, acc)``: a group's dot d `[ROWS, COLS]` scaled by its row scales
    a_s `[ROWS]` and weight scales b_s (:func:`weight_scales`) into acc. One fused
    multiply-add an element (the scales' product a row or column pair, rounded once), not
    a multiply and a multiply-add: the promotion is the K loop's CUDA-core work."""
    if SCALAR:
        scale = a_s[:, None] * b_s
    else:
        scale = a_s[:, None] * b_s[None, :]
    return tl.fma(d, tl.broadcast_to(scale, d.shape), acc)


@triton.jit
def _split_part(a_ptr, as_ptr, bs_ptr, b_rows, rows, row_ok, cols, col_ok, g_lo, g_hi, K,
                stride_am, stride_asm, stride_bsn, QUANT_A: tl.constexpr,
                WS_SCALAR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP: tl.constexpr, FP8_MAX: tl.constexpr):
    """part = 0; part = part + (dot_g * xs_g) * ws_g for g in [g_lo, g_hi) ascending."""
    as_rows = as_ptr + rows.to(tl.int64) * stride_asm
    a_s = load_scales(as_rows, row_ok, g_lo, g_hi, QUANT_A)
    first_col = tl.program_id(1) * BLOCK_N
    b_s = weight_scales(bs_ptr, cols, col_ok, first_col, g_lo, g_hi, stride_bsn, WS_SCALAR, GROUP)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANT_A:
        a_raw = load_raw(a_ptr, rows, row_ok, g_lo, g_hi, K, stride_am, GROUP)
    else:
        a_raw = a_s
    for g in range(g_lo, g_hi):
        a_s_next = load_scales(as_rows, row_ok, g + 1, g_hi, QUANT_A)
        b_s_next = weight_scales(bs_ptr, cols, col_ok, first_col, g + 1, g_hi, stride_bsn,
                                 WS_SCALAR, GROUP)
        if QUANT_A:
            a_raw_next = load_raw(a_ptr, rows, row_ok, g + 1, g_hi, K, stride_am, GROUP)
        else:
            a_raw_next = a_raw
        a, a_s = load_group(a_ptr, rows, row_ok, g, K, stride_am, a_s, a_raw, QUANT_A,
                            FP8_MAX, GROUP)
        a_raw = a_raw_next
        kk = g * GROUP + tl.arange(0, GROUP)
        b = tl.load(b_rows + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0.0)
        part = promote(part, tl.dot(a, tl.trans(b)), a_s, b_s, WS_SCALAR)
        a_s = a_s_next
        b_s = b_s_next
    return part


@triton.jit
def _fp8_linear_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr,
    M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    SPLIT_GROUPS: tl.constexpr, SPLITS: tl.constexpr, PARTS: tl.constexpr,
    QUANT_A: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):
    """One (BLOCK_M rows, BLOCK_N columns) tile; PARTS: split pid2 only, its part stored
    to ws `[S, M, N]` fp32; else every split, folded here (module NOTE)."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    num_groups = tl.cdiv(K, GROUP)
    if PARTS:
        s_lo = tl.program_id(2)
        s_hi = s_lo + 1
    else:
        s_lo = 0
        s_hi = tl.cdiv(num_groups, SPLIT_GROUPS)
    b_rows = b_ptr + cols.to(tl.int64)[:, None] * stride_bn
    WS_SCALAR: tl.constexpr = BLOCK_N <= GROUP  # a tile's columns share one scale row
    ONE_SPLIT: tl.constexpr = SPLITS == 1
    if PARTS or ONE_SPLIT:  # one split per program: no second accumulator
        g_lo = s_lo * SPLIT_GROUPS
        g_hi = tl.minimum(g_lo + SPLIT_GROUPS, num_groups) if PARTS else num_groups
        part = _split_part(a_ptr, as_ptr, bs_ptr, b_rows, rows, row_ok, cols, col_ok, g_lo, g_hi,
                           K, stride_am, stride_asm, stride_bsn, QUANT_A, WS_SCALAR, BLOCK_M,
                           BLOCK_N, GROUP, FP8_MAX)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + part
        if PARTS:  # 0 + part: a consumer that folds from ws[0] gets _fold_kernel's bits
            at = ws_ptr + (s_lo * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
            tl.store(at, total, mask=row_ok[:, None] & col_ok[None, :])
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(s_lo, s_hi):
            g_lo = s * SPLIT_GROUPS
            total = total + _split_part(a_ptr, as_ptr, bs_ptr, b_rows, rows, row_ok, cols,
                                        col_ok, g_lo, tl.minimum(g_lo + SPLIT_GROUPS, num_groups),
                                        K, stride_am, stride_asm, stride_bsn, QUANT_A, WS_SCALAR,
                                        BLOCK_M, BLOCK_N, GROUP, FP8_MAX)
    if not PARTS:
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
                 total.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fold_kernel(ws_ptr, c_ptr, M, N, stride_cm, NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    """c = cast(((0 + ws[0]) + ws[1]) + ...): the module NOTE's fold of the parts."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        total = total + tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
    row = offs // N
    tl.store(c_ptr + row.to(tl.int64) * stride_cm + offs % N, total.to(c_ptr.dtype.element_ty),
             mask=ok)


def split_groups(n: int, k: int) -> int:
    """Groups of 128 per K split for `[n, k]` weights (a function of (N, K) alone): as
    many splits as keep the decode launch's (64-column tile, split) programs within one
    per SM, each at least ``_MIN_SPLIT_GROUPS`` groups."""
    groups = triton.cdiv(k, GROUP)
    per_tile = _TARGET_PROGRAMS // triton.cdiv(n, 64)
    splits = max(1, min(per_tile, groups // _MIN_SPLIT_GROUPS))
    return triton.cdiv(groups, splits)


@dataclass(frozen=True)
class LinearLaunch:
    """How one FP8 linear runs; never changes a bit (module NOTE). parts: one program per
    (tile, split) with a fold launch after (else a program folds its tile's splits);
    quant_a: quantize the activation inside the K loop (else one :func:`quantize_rows`
    launch before); gluon: :mod:`fp8_gemm_gluon`'s kernel after :func:`quantize_rows`
    where it applies (Hopper, TMA-readable operands; else this launch's other fields)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    parts: bool = False
    quant_a: bool = False
    gluon: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128) or self.block_n not in (32, 64, 128, 256):
            raise ValueError(f"LinearLaunch: block_m {self.block_m} must be 64 or 128 and "
                             f"block_n {self.block_n} one of 32, 64, 128, 256 (wgmma tiles)")
        if self.num_warps not in (4, 8) or self.num_stages < 1:
            raise ValueError(f"LinearLaunch: num_warps {self.num_warps} must be 4 or 8, "
                             f"num_stages {self.num_stages} >= 1")


_LAUNCH_ENV = "MEGASERVE_FP8_LINEAR"  # tuning runs: "m,n,warps,stages,parts,quant_a" (decode)


def plan_linear(m: int, n: int, k: int, sms: int = _TARGET_PROGRAMS) -> LinearLaunch:
    """The launch for an `[m, k] x [n, k]^T` product on a GPU of ``sms`` SMs (a speed
    choice, bit-neutral).

    Below 1024 rows: one :func:`quantize_rows` launch, 64 x 64 tiles, 4 stages, one
    program per (tile, split) and a fold launch where the weight has more than one split
    (the most programs on the weights; H200, ``fp8_bench --sweep``: at M = 1 and 64 this
    ran the Qwen3-30B-A3B qkv / o_proj and DeepSeek-V3 o_proj in 9.6 / 9.3 / 53 us against
    17.0 / 12.2 / 119 quantizing in the K loop); from 1024 rows: 128 x 128 tiles, 8 warps,
    splits folded in registers. :mod:`fp8_gemm_gluon` where it applies, from 1024 rows and
    above DECODE_MAX_M rows where its tiles (:func:`fp8_gemm_gluon.tile_rows`, as its
    launch counts them) number a quarter of the SMs or more (H200,
    ``lab/fp8_gluon_sweep.py``, us against the Triton plan: Qwen3-30B-A3B o_proj at M =
    256, 64 tiles of 64 rows, 14.0 against 18.7; at M = 128, 32 tiles, 14.0 against
    11.6). ``$MEGASERVE_FP8_LINEAR`` replaces the launch up to ``DECODE_MAX_M`` rows
    (tuning runs)."""
    if m <= DECODE_MAX_M:
        text = os.environ.get(_LAUNCH_ENV)
        if text:
            v = [int(t) for t in text.split(",")]
            return LinearLaunch(*v[:4], *(bool(f) for f in v[4:]))
    from .fp8_gemm_gluon import BLOCK_N, tile_rows

    tiles = triton.cdiv(m, tile_rows(m, n, sms)) * triton.cdiv(n, BLOCK_N)
    gluon = m > DECODE_MAX_M and (m >= 1024 or 4 * tiles >= sms)
    if m < 1024:
        return LinearLaunch(64, 64, 4, 4, parts=split_groups(n, k) < triton.cdiv(k, GROUP),
                            gluon=gluon)
    return LinearLaunch(128, 128, 8, 3, gluon=gluon)


def check_weight(weight: torch.Tensor, scale_inv: torch.Tensor, k: int) -> None:
    """ValueError unless weight is contiguous e4m3 `[..., N, k]` with float32 128 x 128
    block scales."""
    n = weight.shape[-2]
    expected = (*weight.shape[:-2], triton.cdiv(n, GROUP), triton.cdiv(k, GROUP))
    if weight.dtype != FP8 or weight.shape[-1] != k or not weight.is_contiguous():
        raise ValueError(f"fp8 GEMM: weight must be contiguous float8_e4m3fn [..., N, {k}], got "
                         f"{weight.dtype} {list(weight.shape)}")
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8 GEMM: scale_inv must be float32 {list(expected)} (128 x 128 blocks), "
                         f"got {scale_inv.dtype} {list(scale_inv.shape)}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               out_dtype: torch.dtype | None = None,
               launch: LinearLaunch | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T`` with x quantized per token and 128-group: x `[M, K]`
    bf16/fp16/fp32; weight `[N, K]` e4m3; scale_inv `[ceil(N/128), ceil(K/128)]` float32.
    Returns `[M, N]` in ``out_dtype`` (default x.dtype). Batch-invariant (module NOTE);
    ``launch`` forces a launch (tests, tuning; default :func:`plan_linear`), the same bits.
    """
    return _fp8_linear(x, weight, scale_inv, out_dtype, launch, fold=True)


def fp8_linear_parts(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     launch: LinearLaunch | None = None) -> torch.Tensor | Parts:
    """:func:`fp8_linear`, or where its launch stores split parts (the Triton launch's:
    decode rows, :func:`plan_linear`) those parts unfolded, token-major
    (:class:`parts.Parts`, ws `[S, M, N]`, each ``0 + part``), for the consumer kernel to
    fold: the module NOTE's fold from ws[0] gives the same bits (no stored part is -0, so
    ``0 + ws[0]`` is ws[0]). One fold launch fewer; matmul's ``$MEGASERVE_LINEAR_PARTS``
    "0" folds here instead (A/B runs). H200, Qwen3-30B-A3B fp8 decode, steady step: 9.76
    ms at batch 64 either way. A Gluon parts mode (a work item a (tile, split) where the
    folded launch's tiles leave SMs idle; 8 MB of fp32 parts a layer written and read
    back at batch 256) cost 0.1 ms at batch 256 (12.06 against 11.96 ms; not profiled)
    and was taken out (docs/results/models-fp8.md)."""
    return _fp8_linear(x, weight, scale_inv, None, launch,
                       fold=os.environ.get(PARTS_ENV, "1") == "0")


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                out_dtype: torch.dtype | None, launch: LinearLaunch | None,
                fold: bool) -> torch.Tensor | Parts:
    m, k = x.shape
    check_weight(weight, scale_inv, k)
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    lp = launch or plan_linear(m, n, k, num_sms(x.device))
    sg = split_groups(n, k)
    splits = triton.cdiv(triton.cdiv(k, GROUP), sg)
    if lp.quant_a:
        a = x if x.stride(1) == 1 else x.contiguous()
        a_s = a
    else:
        a, a_s = quantize_rows(x)
        if lp.gluon:
            from . import fp8_gemm_gluon
            if fp8_gemm_gluon.applies(a, weight):
                fp8_gemm_gluon.linear(a, a_s, weight, scale_inv, out, sg,
                                      pdl=pdl_args(x.device, "gluon_linear")["PDL"])
                return out
    parts = lp.parts and splits > 1
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if parts else out
    grid = (triton.cdiv(m, lp.block_m), triton.cdiv(n, lp.block_n), splits if parts else 1)
    _fp8_linear_kernel[grid](
        a, a_s, weight, scale_inv, out, ws, m, n, k,
        a.stride(0), a_s.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        SPLIT_GROUPS=sg, SPLITS=splits, PARTS=parts, QUANT_A=lp.quant_a, BLOCK_M=lp.block_m,
        BLOCK_N=lp.block_n, GROUP=GROUP, FP8_MAX=FP8_MAX, num_warps=lp.num_warps,
        num_stages=lp.num_stages, **pdl_args(x.device, "linear"))
    if parts and not fold:
        return Parts(ws, None, out.dtype, token_major=True)
    if parts:
        block = 1024
        _fold_kernel[(triton.cdiv(m * n, block),)](ws, out, m, n, out.stride(0),
                                                   NUM_SPLITS=splits, BLOCK=block, num_warps=4,
                                                   **pdl_args(x.device, "linear"))
    return out


# The jitted linear, for ahead-of-time compiles (fp8_bench --resources).
linear_kernel = _fp8_linear_kernel
