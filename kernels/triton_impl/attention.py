"""Paged attention (prefill, chunked prefill and decode) and the KV write.

Shape legend: T = new tokens, S = sequences, Hq / Hkv = query / KV heads, G = Hq / Hkv,
Dh = head dim, C = KV_SPLIT_SIZE keys per split.

NOTE: one program owns a tile of BLOCK_Q consecutive new tokens of one sequence and one
KV head; its BLOCK_M = BLOCK_Q * G_PAD rows are (token, query head of the group) pairs:

    row r  →  token  r // G_PAD,  query head  kv_head * G + r % G_PAD   (r % G_PAD < G)

For each split of C keys (ascending), a row computes, exactly as kernels.cpu does,
``m_s = max(scores)``, ``p = exp(scores - m_s)``, ``l_s = Σp``, ``o_s = p @ V`` and folds
``(m, l, o) ← merge((m, l, o), (m_s, l_s, o_s))``. Split 0 always holds key 0, so ``m`` is
finite after it and a split lying wholly past a row's position merges as an exact
identity (alpha = 1, beta = 0): a row's bits depend on its own position and context only.

Every step is layout-independent, so the tile (rows, warps, pipeline depth) is a launch
choice, free per call: ``max`` is exact in any order; the scores, ``o_s`` and ``l_s`` are
tensor-core dots (``l_s = p @ 1``, the same bf16 ``p`` that ``o_s`` uses), whose k16
steps round each output element alike whatever the instruction's tile shape; ``exp``
and ``merge`` are elementwise. (A ``tl.sum`` would reduce in an order set by the layout.)

Two launch modes give the same bits: **serial** (one program per tile and KV head folds
its splits in registers) and **split** (few programs: programs over (tile, KV head,
group of splits) store each split's unmerged (m_s, l_s, o_s) in fp32, then a fold kernel
merges them in the same ascending order with the same ``_merge``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.api import KV_SPLIT_SIZE

# Split mode below this many serial programs (about two per SM of an H100/H200), while
# its fp32 parts fit in this many bytes.
_SERIAL_MIN_PROGRAMS = 264
_MAX_WS_BYTES = 256 << 20
_SPLIT_MODE_PROGRAMS = 1056  # programs in a split-mode grid, about eight per SM


@dataclass(frozen=True)
class AttentionLaunch:
    """How one call is launched: tile and grid only, never the arithmetic (see NOTE)."""

    mode: str = "serial"  # 'serial' | 'split'
    rows: int = 64  # tile rows (BLOCK_M), a power of two >= 16 (raised to G_PAD if larger)
    num_warps: int = 4
    num_stages: int = 2
    splits_per_program: int = 0  # split mode: consecutive splits per program; 0 = auto
    fold_tokens: int = 1  # split mode: tokens per fold program
    fold_unroll: int = 8  # split mode: parts the fold loads before merging them

    def __post_init__(self) -> None:
        if self.mode not in ("serial", "split"):
            raise ValueError(f"AttentionLaunch: mode must be 'serial' or 'split', got {self.mode!r}")
        for name in ("rows", "num_warps", "fold_tokens", "fold_unroll"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"AttentionLaunch: {name}={v} must be a power of two")
        if self.rows < 16 or self.num_stages < 1 or self.splits_per_program < 0:
            raise ValueError(f"AttentionLaunch: bad rows/num_stages/splits_per_program: {self}")


# Tiles kept after the round-4 sweep (scripts/attn_sweep.py, H200): decode-like batches
# (at most two new tokens per sequence) and everything else. 128-row / 8-warp prefill
# tiles measured the same as 64 / 4 (2551 vs 2554 us), 3 stages slower.
DECODE_TILE = dict(rows=16, num_warps=2, num_stages=3, fold_unroll=16)
PREFILL_TILE = dict(rows=64, num_warps=4, num_stages=2)
# Decode-like batches also take split mode from this many splits per sequence on (S=64 x
# 4096: split 339 us vs serial 412; S=32 x 2048: serial 106 vs split 129).
_DECODE_SPLIT_MIN_SPLITS = 64


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
                  SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  L_BY_DOT: tl.constexpr):
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
    m_s = tl.max(scores, axis=1)  # exact in any order
    m_safe = tl.where(m_s == float("-inf"), 0.0, m_s)
    p = tl.exp(scores - m_safe[:, None]).to(v.dtype)
    o_s = tl.dot(p, v)  # [BLOCK_M, BLOCK_D] fp32
    if L_BY_DOT:  # Σp as a dot: its k16 chain does not depend on the layout
        l_s = tl.max(tl.dot(p, tl.full([SPLIT, 16], 1.0, v.dtype)), axis=1)
    else:
        l_s = tl.sum(p.to(tl.float32), axis=1)
    return m_s, l_s, o_s


@triton.jit
def _tile_rows(ctx_ptr, qsl_ptr, num_seqs, pid, kv_head, GROUP: tl.constexpr,
               G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Index math of one (tile, KV head) program: its sequence and rows.

    Returns (live, seq, ctx_len, tok_glob, head, row_ok, pos, last_pos); ``live`` is
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
    last_pos = ctx_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    return live, seq, ctx_len, tok_glob, head, row_ok, pos, last_pos


@triton.jit
def _load_q(q_ptr, tok_glob, head, row_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """The tile's queries `[BLOCK_M, BLOCK_D]` (zeros in dead rows and padded columns)."""
    d = tl.arange(0, BLOCK_D)
    q_offs = tok_glob[:, None] * stride_qt + head[:, None] * stride_qh
    return tl.load(q_ptr + q_offs + d[None, :],
                   mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)


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
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            L_BY_DOT: tl.constexpr):
    """Serial mode: one program walks all of its tile's splits."""
    kv_head = tl.program_id(1)
    live, seq, ctx_len, tok_glob, head, row_ok, pos, last_pos = _tile_rows(
        ctx_ptr, qsl_ptr, num_seqs, tl.program_id(0), kv_head, GROUP, G_PAD, BLOCK_Q)
    if live:
        q = _load_q(q_ptr, tok_glob, head, row_ok, stride_qt, stride_qh, HEAD_DIM, BLOCK_D)
        bt = bt_ptr + seq.to(tl.int64) * stride_bt
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        # From (-inf, 0, 0), merging split 0 is exact: alpha = 0, beta = 1.
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split in range(0, last_pos // SPLIT + 1):
            m_s, l_s, o_s = _split_scores(q, kc_ptr, vc_ptr, bt, split, ctx_len, kv_head, pos,
                                          stride_kb, stride_ks, stride_kh, scale, BLOCK_SIZE,
                                          SPLIT, HEAD_DIM, BLOCK_D, L_BY_DOT)
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
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            L_BY_DOT: tl.constexpr):
    """Split mode, step 1: one program per (tile, KV head, SPLITS_PER_PROG consecutive
    splits) stores each split's (m_s, l_s, o_s) of the rows it reaches (split <= the
    row's last split), fp32, unmerged, at ws_m / ws_l `[splits, T, Hq]` and ws_o
    `[splits, T, Hq, Dh]`."""
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * SPLITS_PER_PROG
    live, seq, ctx_len, tok_glob, head, row_ok, pos, last_pos = _tile_rows(
        ctx_ptr, qsl_ptr, num_seqs, tl.program_id(0), kv_head, GROUP, G_PAD, BLOCK_Q)
    if live:
        q = _load_q(q_ptr, tok_glob, head, row_ok, stride_qt, stride_qh, HEAD_DIM, BLOCK_D)
        bt = bt_ptr + seq.to(tl.int64) * stride_bt
        d = tl.arange(0, BLOCK_D)
        for split in range(first, tl.minimum(first + SPLITS_PER_PROG, last_pos // SPLIT + 1)):
            m_s, l_s, o_s = _split_scores(q, kc_ptr, vc_ptr, bt, split, ctx_len, kv_head, pos,
                                          stride_kb, stride_ks, stride_kh, scale, BLOCK_SIZE,
                                          SPLIT, HEAD_DIM, BLOCK_D, L_BY_DOT)
            row_idx = (split * num_tokens + tok_glob) * NUM_Q_HEADS + head  # [BLOCK_M] int64
            reach = row_ok & (split * SPLIT <= pos)
            tl.store(ws_m_ptr + row_idx, m_s, mask=reach)
            tl.store(ws_l_ptr + row_idx, l_s, mask=reach)
            tl.store(ws_o_ptr + row_idx[:, None] * HEAD_DIM + d[None, :], o_s,
                     mask=reach[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _attention_fold_kernel(ctx_ptr, qsl_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, out_ptr,
                           num_seqs, num_tokens, stride_ot, stride_oh,
                           NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr,
                           G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           UNROLL: tl.constexpr):
    """Split mode, step 2: fold the stored parts in ascending split order, exactly as the
    serial kernel folds them in registers (same :func:`_merge`). A part past a row's last
    split is the exact identity (m_s = -inf, l_s = 0, o_s = 0) that the serial kernel
    merges there, so the fold tile need not match the parts tile. UNROLL parts are
    loaded per step (independent loads in flight), then merged one by one."""
    kv_head = tl.program_id(1)
    live, seq, ctx_len, tok_glob, head, row_ok, pos, last_pos = _tile_rows(
        ctx_ptr, qsl_ptr, num_seqs, tl.program_id(0), kv_head, GROUP, G_PAD, BLOCK_Q)
    if live:
        d = tl.arange(0, BLOCK_D)
        o_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
        row_idx = tok_glob * NUM_Q_HEADS + head
        m = tl.load(ws_m_ptr + row_idx, mask=row_ok, other=0.0)
        l = tl.load(ws_l_ptr + row_idx, mask=row_ok, other=1.0)
        o = tl.load(ws_o_ptr + row_idx[:, None] * HEAD_DIM + d[None, :], mask=o_mask, other=0.0)
        row_splits = pos // SPLIT + 1
        for base in range(1, last_pos // SPLIT + 1, UNROLL):
            for j in tl.static_range(UNROLL):
                split = base + j
                reach = row_ok & (split < row_splits)
                idx = (split * num_tokens + tok_glob) * NUM_Q_HEADS + head
                m_s = tl.load(ws_m_ptr + idx, mask=reach, other=float("-inf"))
                l_s = tl.load(ws_l_ptr + idx, mask=reach, other=0.0)
                o_s = tl.load(ws_o_ptr + idx[:, None] * HEAD_DIM + d[None, :],
                              mask=reach[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
                m, l, o = _merge(m, l, o, m_s, l_s, o_s)
        _store_rows(out_ptr, o, l, tok_glob, head, row_ok, stride_ot, stride_oh,
                    HEAD_DIM, BLOCK_D)


def choose_launch(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int,
                  max_splits: int, ws_bytes: int) -> AttentionLaunch:
    """The launch for a call, from host-known shapes only (no sync): small tiles for
    decode-like batches (at most two new tokens per sequence), large ones otherwise; split
    mode when the serial grid would leave most SMs idle and the fp32 parts stay small."""
    decode_like = num_tokens <= 2 * num_seqs
    tile = DECODE_TILE if decode_like else PREFILL_TILE
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, tile["rows"] // g_pad)
    programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    few = programs < _SERIAL_MIN_PROGRAMS or (
        decode_like and max_splits >= _DECODE_SPLIT_MIN_SPLITS)
    if max_splits > 1 and few and ws_bytes <= _MAX_WS_BYTES:
        return AttentionLaunch("split", **tile)
    return AttentionLaunch("serial", **tile)


def _splits_per_program(num_programs: int, max_splits: int) -> int:
    """Consecutive splits per split-mode program: a power of two that keeps about
    _SPLIT_MODE_PROGRAMS programs in the grid (launch shape only, never the bits)."""
    want = max(1, num_programs * max_splits // _SPLIT_MODE_PROGRAMS)
    return min(16, triton.next_power_of_2(want))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    mode: str | None = None, splits_per_program: int | None = None,
                    launch: AttentionLaunch | None = None,
                    l_by_dot: bool = True) -> torch.Tensor:
    """See ``kernels.api.paged_attention``; no host synchronisation (graph-capturable).

    q `[T, Hq, Dh]`; caches `[blocks, block_size, Hkv, Dh]` (unit last stride);
    block_tables `[S, max_blocks]` int32; context_lens `[S]`; query_start_loc `[S+1]`.
    ``launch`` (default: :func:`choose_launch`) sets the tile, the mode ('serial': one
    program walks a tile's splits; 'split': programs per group of splits, then an ordered
    fold) and the grid; ``mode`` / ``splits_per_program`` override those two fields. No
    launch choice changes the bits (same per-split arithmetic, same merge order; checked
    by the GPU tests and scripts/attn_sweep.py). ``l_by_dot=False`` is the round-3
    formulation (``l_s`` by ``tl.sum``, layout-dependent), kept for the sweep only.
    """
    t, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"paged_attention: Hq={num_q_heads} not a multiple of Hkv={num_kv_heads}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_attention: k_cache and v_cache need the same, unit-last strides")
    group = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    num_seqs = context_lens.shape[0]
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    # Upper bound on any sequence's splits, from shapes only (no host sync).
    max_splits = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], KV_SPLIT_SIZE)
    ws_bytes = max_splits * t * num_q_heads * (head_dim + 2) * 4
    if launch is None:
        launch = choose_launch(t, num_seqs, num_kv_heads, group, max_splits, ws_bytes)
    if mode is not None or splits_per_program is not None:
        launch = AttentionLaunch(mode or launch.mode, launch.rows, launch.num_warps,
                                 launch.num_stages, splits_per_program or 0,
                                 launch.fold_tokens, launch.fold_unroll)
    block_q = max(1, launch.rows // g_pad)
    grid = (t // block_q + num_seqs, num_kv_heads)
    common = dict(GROUP=group, G_PAD=g_pad, SPLIT=KV_SPLIT_SIZE, HEAD_DIM=head_dim,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    kv_args = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    if launch.mode == "serial":
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
            num_seqs, float(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *kv_args, BLOCK_Q=block_q, BLOCK_SIZE=k_cache.shape[1], L_BY_DOT=l_by_dot,
            num_warps=launch.num_warps, num_stages=launch.num_stages, **common)
        return out
    ws_m = torch.empty(max_splits, t, num_q_heads, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_o = torch.empty(max_splits, t, num_q_heads, head_dim, dtype=torch.float32,
                       device=q.device)
    spp = launch.splits_per_program or _splits_per_program(grid[0] * grid[1], max_splits)
    _attention_parts_kernel[grid + (triton.cdiv(max_splits, spp),)](
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, ws_m, ws_l, ws_o,
        num_seqs, t, float(scale), q.stride(0), q.stride(1), *kv_args,
        NUM_Q_HEADS=num_q_heads, SPLITS_PER_PROG=spp, BLOCK_Q=block_q,
        BLOCK_SIZE=k_cache.shape[1], L_BY_DOT=l_by_dot, num_warps=launch.num_warps,
        num_stages=launch.num_stages, **common)
    fold_q = launch.fold_tokens
    _attention_fold_kernel[(t // fold_q + num_seqs, num_kv_heads)](
        context_lens, query_start_loc, ws_m, ws_l, ws_o, out, num_seqs, t,
        out.stride(0), out.stride(1), NUM_Q_HEADS=num_q_heads, BLOCK_Q=fold_q,
        UNROLL=launch.fold_unroll, num_warps=4, **common)
    return out
