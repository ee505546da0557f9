"""Batch-invariant block-FP8 GEMMs on CUDA (Hopper): linears and the grouped expert GEMM.

Shape legend: M = rows (tokens), R = routed rows, K = reduction, N = output features,
E = experts, G = K / 128 groups.

NOTE: the arithmetic of one output element is fixed by (N, K) alone:

    x row m ──quantize──▶ xq[m, :] e4m3, xs[m, g] = amax(|x[m, 128g:128g+128]|) / 448
                          (per token, per group of 128: a function of the row alone)
    acc = 0
    for g = 0 .. G-1 (ascending):     d = dot(xq[m, group g], wq[n, group g])   fp32 (tensor cores)
                                      acc = acc + d * xs[m, g] * ws[n / 128, g]
    out = cast(acc)

One tile shape for every M (``BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 128``, 4 warps, no
split-K): a row's dot chain, its scales and its accumulation order never depend on how
many rows share the launch or where the row sits in its tile. The grouped expert GEMM
runs the same per-row chain over the rows of each expert, so a routed row's result is
independent of how many rows each expert received.

Weights: e4m3 `[N, K]` (`[E, N, K]`) with float32 ``scale_inv`` `[ceil(N/128), ceil(K/128)]`
(`[E, ...]`): DeepSeek-V3's and the Qwen3 FP8 checkpoints' 128 x 128 block format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # activation group = weight block = BLOCK_K = BLOCK_N
BLOCK_M = 64
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                     SWIGLU: tl.constexpr, FP8_MAX: tl.constexpr, GROUP: tl.constexpr):
    """One (row, 128-column group): amax (exact in any order), scale = amax / 448 (1 for
    an all-zero group), e4m3 values. SWIGLU: the row is ``[gate | up]`` of width 2K and the
    quantized value is ``silu(gate) * up`` computed in fp32."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(x_ptr + row * stride_xm + K + cols, mask=ok, other=0.0).to(tl.float32)
        x = x * tl.sigmoid(x) * up
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=ok)
    tl.store(s_ptr + row * stride_sm + g, scale)


def _quantize(x: torch.Tensor, swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, width = x.shape
    k = width // 2 if swiglu else width
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, triton.cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    if m:
        x = x if x.stride(-1) == 1 else x.contiguous()
        _quantize_kernel[(m, scale.shape[1])](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
                                              SWIGLU=swiglu, FP8_MAX=FP8_MAX, GROUP=GROUP, num_warps=1)
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


@dataclass(frozen=True)
class ExpertGroups:
    """Routed rows grouped by expert on the device (no host synchronisation), computed
    once per layer and shared by the gate/up and down GEMMs."""

    order: torch.Tensor  # [R] int64, routed rows sorted by expert id (stable)
    counts: torch.Tensor  # [E] int64, rows per expert (rows routed to E excluded)
    tile_start: torch.Tensor  # [E] int64, first BLOCK_M tile of each expert
    row_start: torch.Tensor  # [E] int64, first position of each expert in ``order``
    max_tiles: int  # an upper bound on the tiles (the grid)


def group_rows(expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """:class:`ExpertGroups` of expert_ids `[R]` int64 in [0, E]."""
    order = torch.sort(expert_ids, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_ids.device)
    counts = counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))[:num_experts]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    return ExpertGroups(order, counts, torch.cumsum(tiles, 0) - tiles,
                        torch.cumsum(counts, 0) - counts,
                        triton.cdiv(expert_ids.shape[0], BLOCK_M) + num_experts)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, rows_ptr, tile_start_ptr, row_start_ptr, count_ptr,
    M, N, K, NUM_EXPERTS,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
    ROWS_PER_TOKEN: tl.constexpr, GROUPED: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_M)
    if GROUPED:
        # Tile pid_t belongs to the last expert whose first tile is <= pid_t.
        experts = tl.arange(0, E_PAD)
        starts = tl.load(tile_start_ptr + experts, mask=experts < NUM_EXPERTS, other=2**30)
        e = tl.max(tl.where(starts <= pid_t, experts, -1), axis=0)
        local = pid_t - tl.load(tile_start_ptr + e)
        count = tl.load(count_ptr + e)
        if local * BLOCK_M >= count:
            return  # past the last tile: the grid is an upper bound
        in_tile = local * BLOCK_M + lanes
        row_ok = in_tile < count
        routed = tl.load(rows_ptr + tl.load(row_start_ptr + e) + in_tile, mask=row_ok, other=0)
        a_rows = routed // ROWS_PER_TOKEN
        c_rows = routed
        b_base = b_ptr + e.to(tl.int64) * stride_be
        bs_base = bs_ptr + e.to(tl.int64) * stride_bse
    else:
        a_rows = pid_t * BLOCK_M + lanes
        row_ok = a_rows < M
        c_rows = a_rows
        b_base = b_ptr
        bs_base = bs_ptr
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_base + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + a_rows.to(tl.int64) * stride_asm
    bs_ptrs = bs_base + pid_n * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - g * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[None, :] < N) & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + g, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + g)
        d = tl.dot(a, b)
        acc = acc + (d * a_s[:, None]) * b_s
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + c_rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def _check_weight(weight: torch.Tensor, scale_inv: torch.Tensor, k: int) -> None:
    n = weight.shape[-2]
    expected = (*weight.shape[:-2], triton.cdiv(n, GROUP), triton.cdiv(k, GROUP))
    if weight.dtype != FP8 or weight.shape[-1] != k or not weight.is_contiguous():
        raise ValueError(f"fp8 GEMM: weight must be contiguous float8_e4m3fn [..., N, {k}], got "
                         f"{weight.dtype} {list(weight.shape)}")
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8 GEMM: scale_inv must be float32 {list(expected)} (128 x 128 blocks), "
                         f"got {scale_inv.dtype} {list(scale_inv.shape)}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T`` with x quantized per token and 128-group: x `[M, K]`
    bf16/fp16/fp32; weight `[N, K]` e4m3; scale_inv `[ceil(N/128), ceil(K/128)]` float32.
    Returns `[M, N]` in ``out_dtype`` (default x.dtype). Batch-invariant (module NOTE)."""
    m, k = x.shape
    _check_weight(weight, scale_inv, k)
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    xq, xs = quantize_rows(x)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, GROUP))
    _fp8_gemm_kernel[grid](
        xq, xs, weight, scale_inv, out, xq, xq, xq, xq, m, n, k, 1,
        xq.stride(0), xs.stride(0), 0, weight.stride(0), 0, scale_inv.stride(0), out.stride(0),
        ROWS_PER_TOKEN=1, GROUPED=False, E_PAD=1, BLOCK_M=BLOCK_M, BLOCK_N=GROUP, BLOCK_K=GROUP,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def fp8_grouped_gemm(xq: torch.Tensor, xs: torch.Tensor, expert_ids: torch.Tensor,
                     weight: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype,
                     rows_per_token: int = 1, groups: ExpertGroups | None = None) -> torch.Tensor:
    """Routed row r: ``dequant(xq[r // rows_per_token]) @ dequant(weight[expert_ids[r]]).T``.

    xq `[R / rows_per_token, K]` e4m3 and xs `[.., G]` float32 (:func:`quantize_rows`);
    expert_ids `[R]` int64 in [0, E] (E: routed nowhere, its output row unspecified);
    weight `[E, N, K]` e4m3, scale_inv `[E, ceil(N/128), ceil(K/128)]`. Returns `[R, N]`.
    Rows are grouped by expert on the device (stable sort, no host synchronisation;
    ``groups``: :func:`group_rows` of these expert_ids, computed by the caller once);
    each row's arithmetic is the module NOTE's chain, whatever the grouping.
    """
    num_rows = expert_ids.shape[0]
    num_experts, n, k = weight.shape
    _check_weight(weight, scale_inv, k)
    out = torch.empty(num_rows, n, dtype=out_dtype, device=xq.device)
    if num_rows == 0:
        return out
    g = groups or group_rows(expert_ids, num_experts)
    grid = (g.max_tiles, triton.cdiv(n, GROUP))
    _fp8_gemm_kernel[grid](
        xq, xs, weight, scale_inv, out, g.order, g.tile_start, g.row_start, g.counts,
        num_rows, n, k, num_experts,
        xq.stride(0), xs.stride(0), weight.stride(0), weight.stride(1), scale_inv.stride(0),
        scale_inv.stride(1), out.stride(0),
        ROWS_PER_TOKEN=rows_per_token, GROUPED=True, E_PAD=triton.next_power_of_2(num_experts),
        BLOCK_M=BLOCK_M, BLOCK_N=GROUP, BLOCK_K=GROUP, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def fp8_expert_ffn(x: torch.Tensor, expert_ids: torch.Tensor, w_gate_up: torch.Tensor,
                   s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                   rows_per_token: int = 1) -> torch.Tensor:
    """SwiGLU experts on block-FP8 weights: ``down_e(silu(gate_e x) * up_e x)`` per routed
    row (arguments as ``kernels.expert_ffn``; weights e4m3 with their 128 x 128 scales).
    The intermediate ``silu(gate) * up`` is computed in fp32 from the gate/up GEMM's
    output (in x.dtype) and quantized per row and group in the same pass. Five launches:
    quantize, grouping, two GEMMs and the fused activation. Returns `[R, D]` in x.dtype."""
    groups = group_rows(expert_ids, w_gate_up.shape[0])
    xq, xs = quantize_rows(x)
    gate_up = fp8_grouped_gemm(xq, xs, expert_ids, w_gate_up, s_gate_up, x.dtype, rows_per_token,
                               groups)
    hq, hs = silu_mul_quantize_rows(gate_up)
    return fp8_grouped_gemm(hq, hs, expert_ids, w_down, s_down, x.dtype, 1, groups)
