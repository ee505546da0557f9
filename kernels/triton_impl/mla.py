"""Multi-head latent attention (weight-absorbed, DeepSeek-V2/V3) over the paged latent
cache, on CUDA through Triton; batch-invariant.

Shape legend: T = query tokens, S = sequences, H = heads, R = kv_lora_rank (latent),
Dr = rope dims, Dc = R + Dr (one cached row per token), BLOCK_H = heads per program.

NOTE: one program per (query token, block of BLOCK_H heads) walks the keys 0..position of
its own token in blocks of BLOCK_N = 64, ascending, with an online softmax:

    s_j  = (q_c . c_j + q_r . kr_j) * scale          fp32 (tensor-core dots)
    m' = max(m, max_j s_j);  p_j = exp(s_j - m');  l = l * exp(m - m') + sum_j p_j
    acc = acc * exp(m - m') + sum_j p_j c_j           (values: the latent rows)
    out = acc / l

The loop's bound and order depend only on the token's position, never on the other
tokens of the batch or of its sequence, so a token's bits are the same in a decode step,
in any prefill chunk and next to any other requests. Keys are read from the cache, written
before the call. Padding tokens (position < 0) write zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 16
BLOCK_N = 64


@triton.jit
def _mla_kernel(
    q_ptr, cache_ptr, tables_ptr, seq_ptr, pos_ptr, out_ptr,
    num_heads, block_size, scale,
    stride_qt, stride_qh, stride_cs, stride_tb, stride_ot, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    lat = tl.arange(0, RANK)
    rope = tl.arange(0, ROPE)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_row + lat[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, R]
    q_r = tl.load(q_row + RANK + rope[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, Dr]
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, RANK), tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for start in range(0, pos + 1, BLOCK_N):
        j = start + keys
        ok = j <= pos
        block = tl.load(tables_ptr + seq * stride_tb + j // block_size, mask=ok, other=0)
        slot = block.to(tl.int64) * block_size + j % block_size
        row = cache_ptr + slot * stride_cs
        c = tl.load(row[:, None] + lat[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, R]
        kr = tl.load(row[:, None] + RANK + rope[None, :], mask=ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_r, tl.trans(kr), input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(c))
            s += tl.dot(q_r, tl.trans(kr))
        s = tl.where(ok[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, c.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(c.dtype), c)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / l[:, None]
    out = tl.where(pos >= 0, out, 0.0)
    o_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + lat[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def token_positions(query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                    num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence `[T]` int32, position `[T]` int32) of each packed query token: the
    tokens of sequence s are the last ones of its ``context_lens[s]``. Device ops only."""
    ends = query_start_loc[1:].to(torch.int64)
    rows = torch.arange(num_tokens, device=ends.device)
    seq = torch.searchsorted(ends, rows, right=True)
    pos = context_lens.to(torch.int64)[seq] - (ends[seq] - rows)
    return seq.to(torch.int32), pos.to(torch.int32)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start_loc: torch.Tensor, rank: int,
                  scale: float) -> torch.Tensor:
    """Absorbed MLA: q `[T, H, Dc]` (latent query then rope query), cache
    `[num_blocks, block_size, 1, Dc]` contiguous; metadata as ``kernels.paged_attention``.
    Returns the latent output `[T, H, rank]` in q.dtype (module NOTE). Raises ValueError for
    a rank or rope width that is not a power of two >= 16."""
    num_tokens, num_heads, width = q.shape
    rope = width - rank
    for name, v in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"mla_attention: {name} {v} must be a power of two >= 16")
    if not cache.is_contiguous() or cache.shape[-1] != width or cache.shape[2] != 1:
        raise ValueError(f"mla_attention: cache must be contiguous [blocks, block_size, 1, {width}]")
    out = torch.empty(num_tokens, num_heads, rank, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    seq, pos = token_positions(query_start_loc, context_lens, num_tokens)
    q = q if q.stride(-1) == 1 else q.contiguous()
    tables = block_tables.to(torch.int32)
    grid = (num_tokens, triton.cdiv(num_heads, BLOCK_H))
    _mla_kernel[grid](
        q, cache, tables, seq, pos, out, num_heads, cache.shape[1], float(scale),
        q.stride(0), q.stride(1), cache.stride(1), tables.stride(0), out.stride(0), out.stride(1),
        RANK=rank, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out


# Tiles of the per-head linear: fixed, so a row's arithmetic never depends on T.
_HEAD_BLOCK_M = 64
_HEAD_BLOCK_N = 64
_HEAD_BLOCK_K = 64


@triton.jit
def _head_linear_kernel(x_ptr, w_ptr, out_ptr, T, N, K,
                        stride_xt, stride_xh, stride_wh, stride_wn, stride_ot, stride_oh,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE: tl.constexpr):
    """Head pid2, tokens [BLOCK_M * pid0, +BLOCK_M), columns [BLOCK_N * pid1, +BLOCK_N):
    out[t, h, n] = round(sum over k of x[t, h, k] * w[h, n, k]), fp32 dots over BLOCK_K
    steps of k in ascending order."""
    h = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + h * stride_xh + rows.to(tl.int64)[:, None] * stride_xt
    w_rows = w_ptr + h * stride_wh + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        a = tl.load(x_rows + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + (k0 + kk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    o_ptrs = out_ptr + h * stride_oh + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def per_head_linear(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x `[T, H, K]` (any strides with unit last stride), weights `[H, N, K]` of x's dtype
    → `[T, H, N]` in x.dtype: head h is ``x[:, h] @ weights[h].T`` with fp32 accumulation,
    one launch for every head (MLA's absorbed W_UK and W_UV). Fixed tiles: a row's bits
    never depend on T. ValueError on mismatched shapes or dtypes."""
    t, heads, k = x.shape
    if weights.dim() != 3 or weights.shape[0] != heads or weights.shape[2] != k \
            or weights.dtype != x.dtype:
        raise ValueError(f"per_head_linear: weights must be {x.dtype} [{heads}, N, {k}], got "
                         f"{weights.dtype} {list(weights.shape)}")
    n = weights.shape[1]
    out = torch.empty(t, heads, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    grid = (triton.cdiv(t, _HEAD_BLOCK_M), triton.cdiv(n, _HEAD_BLOCK_N), heads)
    _head_linear_kernel[grid](
        x, weights, out, t, n, k, x.stride(0), x.stride(1), weights.stride(0),
        weights.stride(1), out.stride(0), out.stride(1), BLOCK_M=_HEAD_BLOCK_M,
        BLOCK_N=_HEAD_BLOCK_N, BLOCK_K=_HEAD_BLOCK_K, IEEE=x.dtype == torch.float32,
        num_warps=4, num_stages=3)
    return out
