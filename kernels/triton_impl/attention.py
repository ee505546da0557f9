"""Paged attention (prefill, chunked prefill and decode in one kernel) and the KV write.

Shape legend: T = new tokens, S = sequences, Hq / Hkv = query / KV heads, G = Hq / Hkv,
Dh = head dim, C = KV_SPLIT_SIZE keys per split.

NOTE: one program owns BLOCK_Q consecutive new tokens of one sequence and one KV head;
its BLOCK_M = BLOCK_Q * G_PAD rows are (token, query head of the group) pairs:

    row r  →  token  r // G_PAD,  query head  kv_head * G + r % G_PAD   (r % G_PAD < G)

For each split of C keys (ascending), a row computes, exactly as kernels.cpu does,
``m_s = max(scores)``, ``p = exp(scores - m_s)``, ``l_s = Σp``, ``o_s = p @ V`` and folds
``(m, l, o) ← merge((m, l, o), (m_s, l_s, o_s))``. Split 0 always holds key 0, so ``m`` is
finite after it and a split lying wholly past a row's position merges as an exact
identity (alpha = 1, beta = 0): a row's bits depend on its own position and context only,
not on the other rows of its tile nor on how many splits the tile walks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.api import KV_SPLIT_SIZE

_ROWS_PER_PROGRAM = 64  # BLOCK_M: fixed, independent of the batch


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < ROW) & (slot >= 0)  # negative slots: padding tokens, skipped
    k = tl.load(k_ptr + tok * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs, mask=mask)
    tl.store(kc_ptr + slot * ROW + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v `[T, Hkv, Dh]` into contiguous caches `[blocks, block_size, Hkv, Dh]` at
    ``slot_mapping`` `[T]` (negative slots are skipped)."""
    t = k.shape[0]
    row = k_cache.shape[2] * k_cache.shape[3]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv_cache: caches must be contiguous")
    k = k.reshape(t, row)
    v = v.reshape(t, row)
    if t:
        _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping.contiguous(),
                               k.stride(0), v.stride(0), ROW=row,
                               BLOCK=triton.next_power_of_2(row), num_warps=4)


@triton.jit
def _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence s whose tiles (numbered qsl[s] // BLOCK_Q + s onward) hold ``pid``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _split_scores(q, kc_ptr, vc_ptr, bt_ptr, split, ctx_len, kv_head, pos,
                  stride_kb, stride_ks, stride_kh, scale, BLOCK_SIZE: tl.constexpr,
                  SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(m_s, l_s, o_s) of one split for the tile's rows; see the module NOTE."""
    keys = split * SPLIT + tl.arange(0, SPLIT)
    in_ctx = keys < ctx_len
    block_ids = tl.load(bt_ptr + keys // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
    base = block_ids * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    d = tl.arange(0, BLOCK_D)
    kv_mask = in_ctx[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(kc_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, SPLIT] fp32
    visible = keys[None, :] <= pos[:, None]
    scores = tl.where(visible, scores, float("-inf"))
    m_s = tl.max(scores, axis=1)
    m_safe = tl.where(m_s == float("-inf"), 0.0, m_s)
    p = tl.exp(scores - m_safe[:, None])
    l_s = tl.sum(p, axis=1)
    o_s = tl.dot(p.to(v.dtype), v)  # [BLOCK_M, BLOCK_D] fp32
    return m_s, l_s, o_s


@triton.jit
def _paged_attention_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr,
                            num_seqs, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_kb, stride_ks, stride_kh, stride_bt,
                            GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    tile_start = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= q_len:
        return
    ctx_len = tl.load(ctx_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // G_PAD
    head = kv_head * GROUP + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < GROUP)
    pos = ctx_len - q_len + tok  # each row's position in its sequence
    d = tl.arange(0, BLOCK_D)
    q_offs = (q_begin + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + d[None, :], mask=row_ok[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0)
    bt = bt_ptr + seq.to(tl.int64) * stride_bt
    last_pos = ctx_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    num_splits = last_pos // SPLIT + 1
    m, l, o = _split_scores(q, kc_ptr, vc_ptr, bt, 0, ctx_len, kv_head, pos, stride_kb,
                            stride_ks, stride_kh, scale, BLOCK_SIZE, SPLIT, HEAD_DIM, BLOCK_D)
    for split in range(1, num_splits):
        m_s, l_s, o_s = _split_scores(q, kc_ptr, vc_ptr, bt, split, ctx_len, kv_head, pos,
                                      stride_kb, stride_ks, stride_kh, scale, BLOCK_SIZE,
                                      SPLIT, HEAD_DIM, BLOCK_D)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_s - m_new)
        o = o * alpha[:, None] + o_s * beta[:, None]
        l = l * alpha + l_s * beta
        m = m_new
    out = o / l[:, None]
    o_offs = (q_begin + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """See ``kernels.api.paged_attention``; no host synchronisation (graph-capturable).

    q `[T, Hq, Dh]`; caches `[blocks, block_size, Hkv, Dh]` (unit last stride);
    block_tables `[S, max_blocks]` int32; context_lens `[S]`; query_start_loc `[S+1]`.
    """
    t, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"paged_attention: Hq={num_q_heads} not a multiple of Hkv={num_kv_heads}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_attention: k_cache and v_cache need the same, unit-last strides")
    group = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, _ROWS_PER_PROGRAM // g_pad)
    num_seqs = context_lens.shape[0]
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    grid = (t // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
        num_seqs, float(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_SIZE=k_cache.shape[1],
        SPLIT=KV_SPLIT_SIZE, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4, num_stages=2)
    return out
