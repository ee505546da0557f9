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

Two launch modes give the same bits: **serial** (one program per tile and KV head folds
its splits in registers) and **split** (decode, where serial leaves SMs idle: programs
over (tile, KV head, group of splits) store each split's unmerged (m_s, l_s, o_s) in fp32,
then a fold kernel merges them in the same ascending order with the same ``_merge``).
"""


from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.api import KV_SPLIT_SIZE

_ROWS_PER_PROGRAM = 64  # BLOCK_M: fixed, independent of the batch
# Split mode below this many serial programs (about two per SM of an H100/H200), while
# its fp32 parts fit in this many bytes.
_SERIAL_MIN_PROGRAMS = 264
_MAX_WS_BYTES = 256 << 20
_SPLIT_MODE_PROGRAMS = 1056  # programs in a split-mode grid, about eight per SM


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
def _tile_rows(q_ptr, ctx_ptr, qsl_ptr, num_seqs, pid, kv_head, stride_qt, stride_qh,
               GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Index math of one (tile, KV head) program: its sequence, rows and query tile.

    Returns (live, seq, ctx_len, tok_glob, head, row_ok, pos, q, num_splits); ``live`` is
    False for the spare programs of the grid. Integer work only: no rounding here.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    seq = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    tile_start = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    live = tile_start < q_len
    ctx_len = tl.load(ctx_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // G_PAD
    head = kv_head * GROUP + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < GROUP) & live
    pos = ctx_len - q_len + tok  # each row's position in its sequence
    tok_glob = (q_begin + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    q_offs = tok_glob[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + d[None, :], mask=row_ok[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0)
    last_pos = ctx_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    return live, seq, ctx_len, tok_glob, head, row_ok, pos, q, last_pos


@triton.jit
def _merge(m, l, o, m_s, l_s, o_s):
    """Fold split s into the running (m, l, o); the one merge both launch modes use."""
    m_new = tl.maximum(m, m_s)
    alpha = tl.exp(m - m_new)
    beta = tl.exp(m_s - m_new)
    o = o * alpha[:, None] + o_s * beta[:, None]
    l = l * alpha + l_s * beta
    return m_new, l, o


@triton.jit
def _store_rows(out_ptr, o, l, tok_glob, head, row_ok, stride_ot, stride_oh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    out = o / l[:, None]
    o_offs = tok_glob[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _paged_attention_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr,
                            num_seqs, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_kb, stride_ks, stride_kh, stride_bt,
                            GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Serial mode: one program walks all of its tile's splits."""
    kv_head = tl.program_id(1)
    live, seq, ctx_len, tok_glob, head, row_ok, pos, q, last_pos = _tile_rows(
        q_ptr, ctx_ptr, qsl_ptr, num_seqs, tl.program_id(0), kv_head, stride_qt, stride_qh,
        GROUP, G_PAD, BLOCK_Q, HEAD_DIM, BLOCK_D)
    if live:
        bt = bt_ptr + seq.to(tl.int64) * stride_bt
        num_splits = last_pos // SPLIT + 1
        m, l, o = _split_scores(q, kc_ptr, vc_ptr, bt, 0, ctx_len, kv_head, pos, stride_kb,
                                stride_ks, stride_kh, scale, BLOCK_SIZE, SPLIT, HEAD_DIM,
                                BLOCK_D)
        for split in range(1, num_splits):
            m_s, l_s, o_s = _split_scores(q, kc_ptr, vc_ptr, bt, split, ctx_len, kv_head, pos,
                                          stride_kb, stride_ks, stride_kh, scale, BLOCK_SIZE,
                                          SPLIT, HEAD_DIM, BLOCK_D)
            m, l, o = _merge(m, l, o, m_s, l_s, o_s)
        _store_rows(out_ptr, o, l, tok_glob, head, row_ok, stride_ot, stride_oh,
                    HEAD_DIM, BLOCK_D)


@triton.jit
def _attention_parts_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, qsl_ptr, ws_m_ptr,
                            ws_l_ptr, ws_o_ptr, num_seqs, num_tokens, scale, stride_qt,
                            stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                            NUM_Q_HEADS: tl.constexpr, SPLITS_PER_PROG: tl.constexpr,
                            GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Split mode, step 1: one program per (tile, KV head, SPLITS_PER_PROG consecutive
    splits) stores each split's (m_s, l_s, o_s) of its rows, fp32, unmerged, at ws_m / ws_l
    `[splits, T, Hq]` and ws_o `[splits, T, Hq, Dh]`."""
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * SPLITS_PER_PROG
    live, seq, ctx_len, tok_glob, head, row_ok, pos, q, last_pos = _tile_rows(
        q_ptr, ctx_ptr, qsl_ptr, num_seqs, tl.program_id(0), kv_head, stride_qt, stride_qh,
        GROUP, G_PAD, BLOCK_Q, HEAD_DIM, BLOCK_D)
    if live:
        bt = bt_ptr + seq.to(tl.int64) * stride_bt
        d = tl.arange(0, BLOCK_D)
        for split in range(first, tl.minimum(first + SPLITS_PER_PROG, last_pos // SPLIT + 1)):
            m_s, l_s, o_s = _split_scores(q, kc_ptr, vc_ptr, bt, split, ctx_len, kv_head, pos,
                                          stride_kb, stride_ks, stride_kh, scale, BLOCK_SIZE,
                                          SPLIT, HEAD_DIM, BLOCK_D)
            row_idx = (split * num_tokens + tok_glob) * NUM_Q_HEADS + head  # [BLOCK_M] int64
            tl.store(ws_m_ptr + row_idx, m_s, mask=row_ok)
            tl.store(ws_l_ptr + row_idx, l_s, mask=row_ok)
            tl.store(ws_o_ptr + row_idx[:, None] * HEAD_DIM + d[None, :], o_s,
                     mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _attention_fold_kernel(q_ptr, ctx_ptr, qsl_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, out_ptr,
                           num_seqs, num_tokens, stride_qt, stride_qh, stride_ot, stride_oh,
                           NUM_Q_HEADS: tl.constexpr,
                           GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                           SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Split mode, step 2: fold the stored parts in ascending split order, exactly as the
    serial kernel folds them in registers (same :func:`_merge`)."""
    kv_head = tl.program_id(1)
    live, seq, ctx_len, tok_glob, head, row_ok, pos, q, last_pos = _tile_rows(
        q_ptr, ctx_ptr, qsl_ptr, num_seqs, tl.program_id(0), kv_head, stride_qt, stride_qh,
        GROUP, G_PAD, BLOCK_Q, HEAD_DIM, BLOCK_D)
    if live:
        d = tl.arange(0, BLOCK_D)
        o_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
        row_idx = tok_glob * NUM_Q_HEADS + head
        m = tl.load(ws_m_ptr + row_idx, mask=row_ok, other=0.0)
        l = tl.load(ws_l_ptr + row_idx, mask=row_ok, other=1.0)
        o = tl.load(ws_o_ptr + row_idx[:, None] * HEAD_DIM + d[None, :], mask=o_mask, other=0.0)
        for split in range(1, last_pos // SPLIT + 1):
            idx = (split * num_tokens + tok_glob) * NUM_Q_HEADS + head
            m_s = tl.load(ws_m_ptr + idx, mask=row_ok, other=0.0)
            l_s = tl.load(ws_l_ptr + idx, mask=row_ok, other=0.0)
            o_s = tl.load(ws_o_ptr + idx[:, None] * HEAD_DIM + d[None, :], mask=o_mask,
                          other=0.0)
            m, l, o = _merge(m, l, o, m_s, l_s, o_s)
        _store_rows(out_ptr, o, l, tok_glob, head, row_ok, stride_ot, stride_oh,
                    HEAD_DIM, BLOCK_D)


def use_split_mode(num_programs: int, max_splits: int, ws_bytes: int) -> bool:
    """Launch choice only (both modes give identical bits): split the KV walk over programs
    when the serial grid leaves most SMs idle (decode) and the fp32 parts stay small."""
    return max_splits > 1 and num_programs < _SERIAL_MIN_PROGRAMS and ws_bytes <= _MAX_WS_BYTES


def _splits_per_program(num_programs: int, max_splits: int) -> int:
    """Consecutive splits per split-mode program: a power of two that keeps about
    _SPLIT_MODE_PROGRAMS programs in the grid (launch shape only, never the bits)."""
    want = max(1, num_programs * max_splits // _SPLIT_MODE_PROGRAMS)
    return min(16, triton.next_power_of_2(want))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    mode: str | None = None,
                    splits_per_program: int | None = None) -> torch.Tensor:
    """See ``kernels.api.paged_attention``; no host synchronisation (graph-capturable).

    q `[T, Hq, Dh]`; caches `[blocks, block_size, Hkv, Dh]` (unit last stride);
    block_tables `[S, max_blocks]` int32; context_lens `[S]`; query_start_loc `[S+1]`.
    ``mode`` forces 'serial' (one program walks a tile's splits) or 'split' (one program
    per split, then an ordered fold); None picks from the shapes. Both modes give the same
    bits (same per-split arithmetic, same merge order; checked by the GPU tests).
    ``splits_per_program`` (split mode; default from the shapes) only groups the
    per-split work onto programs, so it cannot change the bits either.
    """
    t, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"paged_attention: Hq={num_q_heads} not a multiple of Hkv={num_kv_heads}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_attention: k_cache and v_cache need the same, unit-last strides")
    if mode not in (None, "serial", "split"):
        raise ValueError(f"paged_attention: mode must be 'serial' or 'split', got {mode!r}")
    group = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, _ROWS_PER_PROGRAM // g_pad)
    num_seqs = context_lens.shape[0]
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    grid = (t // block_q + num_seqs, num_kv_heads)
    # Upper bound on any sequence's splits, from shapes only (no host sync).
    max_splits = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], KV_SPLIT_SIZE)
    ws_bytes = max_splits * t * num_q_heads * (head_dim + 2) * 4
    if mode is None:
        mode = "split" if use_split_mode(grid[0] * grid[1], max_splits, ws_bytes) else "serial"
    common = dict(GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, SPLIT=KV_SPLIT_SIZE,
                  HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    if mode == "serial":
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
            num_seqs, float(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            BLOCK_SIZE=k_cache.shape[1], num_warps=4, num_stages=2, **common)
        return out
    ws_m = torch.empty(max_splits, t, num_q_heads, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_o = torch.empty(max_splits, t, num_q_heads, head_dim, dtype=torch.float32,
                       device=q.device)
    spp = splits_per_program or _splits_per_program(grid[0] * grid[1], max_splits)
    _attention_parts_kernel[grid + (triton.cdiv(max_splits, spp),)](
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, ws_m, ws_l, ws_o,
        num_seqs, t, float(scale), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, SPLITS_PER_PROG=spp, BLOCK_SIZE=k_cache.shape[1],
        num_warps=4, num_stages=2, **common)
    _attention_fold_kernel[grid](
        q, context_lens, query_start_loc, ws_m, ws_l, ws_o, out, num_seqs, t,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), NUM_Q_HEADS=num_q_heads,
        num_warps=4, **common)
    return out
