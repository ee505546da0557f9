"""Triton kernels of paged attention; the host side and the contract are in
:mod:`megaserve.kernels.triton_impl.attention` (see its NOTE: the arithmetic, fixed).

Launch-only switches (constexpr, never the bits):

* ``MASK_TAIL``: a tile's splits that lie wholly at or before its first row's position
  (``split * C + C - 1 <= first_pos``, so inside the context and visible to every row)
  run without the context mask on the loads and with a per-row (not per-key) select in
  place of the causal ``where``. A device run found the version without any
  select NOT bitwise equal at head_dim 128 (FMA contraction of ``* scale`` and ``- m``,
  1 bf16 ulp); with the select every check passed, so the defaults use it.
* ``PREFETCH``: the block ids of split ``s + 1`` are loaded while split ``s`` is computed
  and carried in registers, so the K/V gathers of a split depend on no load of the same
  iteration (Triton's pipeliner then double-buffers them instead of chaining
  block-table load -> gather -> compute inside one iteration).
* ``LONG_FIRST``: tiles are numbered from the last, so long causal rows start first.

One arithmetic switch, ``EXP2`` (it changes the bits of every launch alike, never between
launches): ``scale`` arrives with log2(e) folded in, a split's max is taken over
the raw dot products and scaled once per row (rounding is monotone, so this is the max of
the scaled scores), ``p = exp2(fma(dot, scale, -m))`` with an explicit FMA, and the merge
uses ``exp2`` and explicit FMAs. Nothing is left for the compiler to contract differently
in the masked and unmasked paths, so no select is needed there; one per-row select keeps
the scaled max out of the later subtractions (see ``_split_step``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl


@triton.jit
def find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
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
def _block_ids(bt, split, bt_keys, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr):
    """Cache block of each key of ``split`` `[SPLIT]` (0 past the table row's ``bt_keys``
    keys). Bounded by the row, not by the context, so the load need not wait for the
    context length: an id past the context is never used to read the cache (those keys'
    K/V loads are masked by the context in ``_load_kv``)."""
    keys = split * SPLIT + tl.arange(0, SPLIT)
    return tl.load(bt + keys // BLOCK_SIZE, mask=keys < bt_keys, other=0).to(tl.int64)


@triton.jit
def _load_kv(kc_ptr, vc_ptr, block_ids, split, ctx_len, kv_head, stride_kb, stride_ks,
             stride_kh, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """The keys of ``split`` `[SPLIT]` and their K, V rows `[SPLIT, BLOCK_D]` (zeros past
    the context when MASKED, and in padded columns)."""
    keys = split * SPLIT + tl.arange(0, SPLIT)
    base = block_ids * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        kv_mask = (keys < ctx_len)[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(kc_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            k = tl.load(kc_ptr + base[:, None] + d[None, :])
            v = tl.load(vc_ptr + base[:, None] + d[None, :])
        else:
            dm = (d < HEAD_DIM)[None, :]
            k = tl.load(kc_ptr + base[:, None] + d[None, :], mask=dm, other=0.0)
            v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=dm, other=0.0)
    return keys, k, v


@triton.jit
def _split_step(q, kc_ptr, vc_ptr, block_ids, split, ctx_len, kv_head, pos, m, l, o,
                stride_kb, stride_ks, stride_kh, scale, BLOCK_SIZE: tl.constexpr,
                SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                MASKED: tl.constexpr, EXP2: tl.constexpr, L_COLS: tl.constexpr):
    """A chunk's running state (m, l, o) for the tile's rows after one more split (the
    NOTE in attention.py): the split's max joins ``m``, ``p`` is taken against the new
    max, and ``p @ V`` accumulates inside the dot into ``o`` rescaled by ``alpha``.
    ``MASKED=False`` only for splits every row sees whole (module docstring)."""
    keys, k, v = _load_kv(kc_ptr, vc_ptr, block_ids, split, ctx_len, kv_head, stride_kb,
                          stride_ks, stride_kh, BLOCK_SIZE, SPLIT, HEAD_DIM, BLOCK_D, MASKED)
    if EXP2:
        raw = tl.dot(q, tl.trans(k))  # [BLOCK_M, SPLIT] fp32
        if MASKED:
            raw = tl.where(keys[None, :] <= pos[:, None], raw, float("-inf"))
        # max exact in any order; -inf stays -inf. The (always true) per-row select keeps
        # ``* scale`` a separate rounding: without it the compiler contracted it into a
        # later subtraction in one launch and not in another (seen in sm_90 PTX).
        m_s = tl.where(pos >= 0, tl.max(raw, axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(tl.fma(raw, scale, -m_ref[:, None])).to(v.dtype)
        alpha = tl.exp2(m - m_ref)
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
        if MASKED:
            scores = tl.where(keys[None, :] <= pos[:, None], scores, float("-inf"))
        else:
            # Keep a select between ``* scale`` and ``- m``: without one the compiler
            # fused them into an FMA for head_dim 128 and the bits changed (seen on an
            # H200). This per-row predicate is always true.
            scores = tl.where(pos[:, None] >= 0, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # max: exact in any order
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_ref[:, None]).to(v.dtype)
        alpha = tl.exp(m - m_ref)
    # Σp as a dot: its k16 chain does not depend on the layout. L_COLS equal columns (a
    # launch choice: each column is the same chain whatever the width); 16 or more, since
    # a square [16, 16] result made Triton lay a 16-row tile's dots out with the warps
    # along the rows, each warp holding the whole tile.
    l_s = tl.max(tl.dot(p, tl.full([SPLIT, L_COLS], 1.0, v.dtype)), axis=1)
    if EXP2:
        l = tl.fma(l, alpha, l_s)
    else:
        l = l * alpha + l_s
    return m_new, l, tl.dot(p, v, o * alpha[:, None])


@triton.jit
def _tile_rows(ctx_ptr, qsl_ptr, num_seqs, pid, kv_head, GROUP: tl.constexpr,
               G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, DECODE: tl.constexpr):
    """Index math of one (tile, KV head) program: its sequence and rows.

    Returns (live, seq, ctx_len, tok_glob, head, row_ok, pos, first_pos, last_pos);
    ``live`` is False for the spare programs of the grid. Integer work only. DECODE:
    every sequence has one new token (query_start_loc is 0, 1, ..., S) and tile ``pid``
    is sequence ``pid``'s, so nothing but its context length is read (the same rows).
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    if DECODE:
        seq = pid
        q_begin = pid
        q_len = 1
        tile_start = 0
        live = pid < num_seqs
        ctx_len = tl.load(ctx_ptr + seq, mask=live, other=0)
    else:
        seq = find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
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
    first_pos = ctx_len - q_len + tile_start
    last_pos = ctx_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    return live, seq, ctx_len, tok_glob, head, row_ok, pos, first_pos, last_pos


@triton.jit
def _load_q(q_ptr, tok_glob, head, row_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """The tile's queries `[BLOCK_M, BLOCK_D]` (zeros in dead rows and padded columns)."""
    d = tl.arange(0, BLOCK_D)
    q_offs = tok_glob[:, None] * stride_qt + head[:, None] * stride_qh
    return tl.load(q_ptr + q_offs + d[None, :],
                   mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _merge(m, l, o, m_s, l_s, o_s, EXP2: tl.constexpr):
    """Fold chunk state s into the running (m, l, o); the one merge every launch uses.
    Two empty states (m = m_s = -inf: a row that has seen no key of a chunk yet) merge to
    the empty state (-inf, 0, 0), not NaN; the select changes no finite case."""
    m_new = tl.maximum(m, m_s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    if EXP2:
        alpha = tl.exp2(m - m_ref)
        beta = tl.exp2(m_s - m_ref)
        o = tl.fma(o, alpha[:, None], o_s * beta[:, None])
        l = tl.fma(l, alpha, l_s * beta)
    else:
        alpha = tl.exp(m - m_ref)
        beta = tl.exp(m_s - m_ref)
        o = o * alpha[:, None] + o_s * beta[:, None]
        l = l * alpha + l_s * beta
    return m_new, l, o


@triton.jit
def _store_rows(out_ptr, o, l, tok_glob, head, row_ok, stride_ot, stride_oh, d0,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows' ``o / l`` at columns ``d0 + [0, BLOCK_D)`` (those < HEAD_DIM)."""
    d = d0 + tl.arange(0, BLOCK_D)
    out = o / l[:, None]
    o_offs = tok_glob[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def paged_attention_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr,
                            ws_m_ptr, ws_l_ptr, ws_o_ptr, num_seqs, num_tokens, scale,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_kb, stride_ks, stride_kh, stride_bt, bt_keys,
                            NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr,
                            G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                            CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, MASK_TAIL: tl.constexpr,
                            PREFETCH: tl.constexpr, LONG_FIRST: tl.constexpr,
                            EXP2: tl.constexpr, PARTS: tl.constexpr, L_COLS: tl.constexpr,
                            DECODE: tl.constexpr, PDL: tl.constexpr):
    """Serial mode: one program walks all of its tile's chunks (CHUNK splits each), runs
    each chunk's splits from the empty state, merges the chunks into the row's state and
    writes ``o / l``. ``PARTS`` (chunk mode): program axis 2 picks one chunk, whose state
    is stored unnormalised at ws_m / ws_l `[chunks, T, Hq]` and ws_o `[chunks, T, Hq, Dh]`
    for the fold kernel (rows that reach the chunk only); with DECODE, a sequence of one
    chunk gets its output here instead, and the fold skips it."""
    if not DECODE:
        pdl.wait_then_release(PDL)  # first: no memory access before it
    kv_head = tl.program_id(1)
    pid = tl.program_id(0)
    if LONG_FIRST:
        pid = tl.num_programs(0) - 1 - pid
    # DECODE: the context lengths and the block table are step inputs (pdl's NOTE), read
    # before the wait; q and the new token's K/V are the previous kernel's, read after it.
    live, seq, ctx_len, tok_glob, head, row_ok, pos, first_pos, last_pos = _tile_rows(
        ctx_ptr, qsl_ptr, num_seqs, pid, kv_head, GROUP, G_PAD, BLOCK_Q, DECODE)
    if live:
        bt = bt_ptr + seq.to(tl.int64) * stride_bt
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        n_splits = last_pos // SPLIT + 1
        full = 0  # splits below this are wholly visible to every row (MASK_TAIL)
        if MASK_TAIL:
            full = (first_pos + 1) // SPLIT
        n_chunks = tl.cdiv(n_splits, CHUNK)
        c_lo = 0
        c_hi = n_chunks
        if PARTS:
            c_lo = tl.program_id(2)
            c_hi = tl.minimum(c_hi, c_lo + 1)
        if DECODE:
            if c_hi <= c_lo:
                return  # a chunk past the context: nothing to compute or wait for
        # The block ids of the next split to run; with PREFETCH each loop leaves them one
        # split ahead, so they are right for the next loop and the next chunk as well.
        ids = _block_ids(bt, c_lo * CHUNK, bt_keys, BLOCK_SIZE, SPLIT)
        if DECODE:
            pdl.wait_then_release(PDL)
        q = _load_q(q_ptr, tok_glob, head, row_ok, stride_qt, stride_qh, HEAD_DIM, BLOCK_D)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the empty state
        l = tl.zeros([BLOCK_M], tl.float32)
        o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # (Loops inline, not in a helper: the interpreter runs range() over tensor bounds
        # only in the kernel's own body.)
        for chunk in range(c_lo, c_hi):
            s0 = chunk * CHUNK
            s1 = tl.minimum(s0 + CHUNK, n_splits)
            mid = tl.maximum(s0, tl.minimum(s1, full))
            m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_c = tl.zeros([BLOCK_M], tl.float32)
            o_c = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for split in range(s0, mid):  # full splits, unmasked
                if PREFETCH:
                    nxt = _block_ids(bt, split + 1, bt_keys, BLOCK_SIZE, SPLIT)
                else:
                    ids = _block_ids(bt, split, bt_keys, BLOCK_SIZE, SPLIT)
                m_c, l_c, o_c = _split_step(q, kc_ptr, vc_ptr, ids, split, ctx_len, kv_head,
                                            pos, m_c, l_c, o_c, stride_kb, stride_ks,
                                            stride_kh, scale, BLOCK_SIZE, SPLIT, HEAD_DIM,
                                            BLOCK_D, False, EXP2, L_COLS)
                if PREFETCH:
                    ids = nxt
            for split in range(mid, s1):  # the rest, masked
                if PREFETCH:
                    nxt = _block_ids(bt, split + 1, bt_keys, BLOCK_SIZE, SPLIT)
                else:
                    ids = _block_ids(bt, split, bt_keys, BLOCK_SIZE, SPLIT)
                m_c, l_c, o_c = _split_step(q, kc_ptr, vc_ptr, ids, split, ctx_len, kv_head,
                                            pos, m_c, l_c, o_c, stride_kb, stride_ks,
                                            stride_kh, scale, BLOCK_SIZE, SPLIT, HEAD_DIM,
                                            BLOCK_D, True, EXP2, L_COLS)
                if PREFETCH:
                    ids = nxt
            if PARTS:
                if DECODE and n_chunks == 1:
                    # The sequence's only chunk: its output, as the fold would write it
                    # (merging one chunk into the empty state is exact), and the fold
                    # skips the sequence.
                    _store_rows(out_ptr, o_c, l_c, tok_glob, head, row_ok, stride_ot,
                                stride_oh, 0, HEAD_DIM, BLOCK_D)
                else:
                    _store_parts(ws_m_ptr, ws_l_ptr, ws_o_ptr, m_c, l_c, o_c, chunk,
                                 s0 * SPLIT, num_tokens, tok_glob, head, row_ok, pos,
                                 NUM_Q_HEADS, HEAD_DIM, BLOCK_D)
            else:
                m, l, o = _merge(m, l, o, m_c, l_c, o_c, EXP2)
        if not PARTS:
            _store_rows(out_ptr, o, l, tok_glob, head, row_ok, stride_ot, stride_oh, 0,
                        HEAD_DIM, BLOCK_D)


@triton.jit
def _store_parts(ws_m_ptr, ws_l_ptr, ws_o_ptr, m_s, l_s, o_s, part, first_key, num_tokens,
                 tok_glob, head, row_ok, pos, NUM_Q_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Chunk state ``part`` (starting at key ``first_key``) of the rows that reach it, fp32,
    unnormalised."""
    d = tl.arange(0, BLOCK_D)
    row_idx = (part * num_tokens + tok_glob) * NUM_Q_HEADS + head  # [BLOCK_M] int64
    reach = row_ok & (first_key <= pos)
    tl.store(ws_m_ptr + row_idx, m_s, mask=reach)
    tl.store(ws_l_ptr + row_idx, l_s, mask=reach)
    tl.store(ws_o_ptr + row_idx[:, None] * HEAD_DIM + d[None, :], o_s,
             mask=reach[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _load_part(ws_m_ptr, ws_l_ptr, ws_o_ptr, part, num_tokens, tok_glob, head, reach, d,
               d_ok, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Part ``part`` as :func:`_store_parts` stored it; the empty state (-inf, 0, 0) in
    rows that do not ``reach`` it."""
    idx = (part * num_tokens + tok_glob) * NUM_Q_HEADS + head
    m_s = tl.load(ws_m_ptr + idx, mask=reach, other=float("-inf"))
    l_s = tl.load(ws_l_ptr + idx, mask=reach, other=0.0)
    o_s = tl.load(ws_o_ptr + idx[:, None] * HEAD_DIM + d[None, :],
                  mask=reach[:, None] & d_ok, other=0.0)
    return m_s, l_s, o_s


@triton.jit
def attention_fold_kernel(ctx_ptr, qsl_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, out_ptr,
                           num_seqs, num_tokens, stride_ot, stride_oh,
                           NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr,
                           G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr,
                           CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr, UNROLL: tl.constexpr, EXP2: tl.constexpr,
                           DECODE: tl.constexpr, PDL: tl.constexpr):
    """Chunk mode, step 2: merge the stored chunk states in order, exactly as the serial
    kernel merges them in registers (same :func:`_merge`). A chunk past a row's reach is
    the empty state (m = -inf, l = 0, o = 0), which is what the serial kernel merges there,
    so the fold tile need not match the parts tile. UNROLL chunk states are loaded per step
    (independent loads in flight), then merged one by one. Program axis 2 takes columns
    ``[pid2 * BLOCK_D, +BLOCK_D)`` of head_dim: each column's merge is elementwise, so a
    chunked fold gives the same bits. DECODE: a sequence of one chunk is skipped (the
    parts kernel wrote its output)."""
    if not DECODE:
        pdl.wait_then_release(PDL)  # first: no memory access before it
    kv_head = tl.program_id(1)
    # DECODE: the context lengths are a step input (pdl's NOTE), read before the wait
    live, seq, ctx_len, tok_glob, head, row_ok, pos, first_pos, last_pos = _tile_rows(
        ctx_ptr, qsl_ptr, num_seqs, tl.program_id(0), kv_head, GROUP, G_PAD, BLOCK_Q,
        DECODE)
    if live:
        n_chunks = tl.cdiv(last_pos // SPLIT + 1, CHUNK)
        if DECODE:
            # The parts are the previous kernel's. A program with nothing to fold waits too:
            # a grid whose programs all exit unwaited would let the next kernel start before
            # the parts kernel has finished (pdl's NOTE).
            pdl.wait_then_release(PDL)
            if n_chunks == 1:
                return  # one chunk: the parts kernel wrote the output itself
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        d0 = tl.program_id(2) * BLOCK_D
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = (d < HEAD_DIM)[None, :]
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the empty state
        l = tl.zeros([BLOCK_M], tl.float32)
        o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        row_chunks = tl.cdiv(pos // SPLIT + 1, CHUNK)
        for base in range(0, n_chunks, UNROLL):
            for j in tl.static_range(UNROLL):
                chunk = base + j
                m_s, l_s, o_s = _load_part(ws_m_ptr, ws_l_ptr, ws_o_ptr, chunk, num_tokens,
                                           tok_glob, head, row_ok & (chunk < row_chunks), d,
                                           d_ok, NUM_Q_HEADS, HEAD_DIM)
                m, l, o = _merge(m, l, o, m_s, l_s, o_s, EXP2)
        _store_rows(out_ptr, o, l, tok_glob, head, row_ok, stride_ot, stride_oh, d0,
                    HEAD_DIM, BLOCK_D)
