"""MoE kernels: stable top-k routing and the SwiGLU expert FFN over rows grouped by expert.

Shape legend: T = tokens, E = experts, k = top-k, R = routed rows, D = hidden,
I = expert intermediate.

NOTE: the expert FFN is three launches (four from ``ALIGN_CHUNKED_ROWS`` rows, where the
align pass is two: chunk histograms, then placement), none of which reads a size on the
host (decode steps are captured in CUDA graphs) and none with a data-dependent grid:

    expert_ids [R] ─ align ─> offsets [E+1], order [R]     rows grouped by expert, stable
    x [R/k', D] ─ gate_up GEMM, SwiGLU epilogue ─> hidden [R, I]   grouped order
    hidden ─ down GEMM, scattered store ─> out [R, D]          row order

k' = ``rows_per_token``: routed row r reads token row r // k' of x (a token's k routed
rows share one x row; no [R, D] copy of it). Calls of at most ``INLINE_ALIGN_MAX_ROWS``
rows (decode) skip the align launch: each GEMM program counts its offsets and its rows'
order from expert_ids itself (``MoeLaunch.inline_align``), the same integers.

A GEMM tile is (expert e, BLOCK_M consecutive positions of e's rows, BLOCK_N columns).
Each program numbers the tiles expert by expert from ``offsets`` (``cdiv(count_e,
BLOCK_M)`` tiles each, the last one narrower with ``GemmTiles.tail_m``; inside an expert
row tile by row tile, or with ``GemmTiles.n_major`` column tile by column tile, so that
the row tiles sharing a weight tile run together); the grid is a bound on their number
from (R, E) alone and the programs past the last tile return at once. The weights are
read through pointers or TMA descriptors (``GemmTiles.tma``; gate and up may share one
dot, ``GemmTiles.join``).

Every output element is one fp32 chain of tensor-core k16 steps in ascending K order,
whatever R, the tile shape, warps, stages, the weight path or the launch's K step
(``GemmTiles.block_k``: a dot over 128 of K is the same chain of k16 steps as two dots
over 64; a K tail is zero-padded, by masks or TMA's zero fill, and a k16 step of zeros
adds exact zeros; an output column's chain reads only its own weight row, wherever it
sits in the dot): the launch (picked from R and E by
:func:`plan_launch`) never changes a bit (the hardware fact in matmul.py's NOTE), so a
row's bits depend on its input and its expert's weights only. The SwiGLU epilogue
rounds like the unfused GEMM + ``silu_and_mul``: gate and up rounded to the output dtype,
silu in fp32 of the rounded gate, rounded, times the rounded up.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import moe_gluon, pdl, rowwise
from .matmul import linear_parts, num_sms, tma_readable
from .parts import Parts, fold_row_parts
from .rowwise import silu_and_mul


@triton.jit
def _topk_kernel(logit_ptr, ids_ptr, w_ptr, ws_ptr, bias_ptr, E, stride_l, stride_ps,
                 stride_pf, stride_pt,
                 TOP_K: tl.constexpr, RENORM: tl.constexpr, PARTS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RELOAD: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """PARTS > 0: the router's logits are the PARTS unfolded parts at ws_ptr
    (:class:`parts.Parts` at strides stride_p*, bias at bias_ptr if HAS_BIAS), folded here and
    stored to logit_ptr; with RELOAD loaded back before the softmax (rowwise
    _rms_norm_kernel's docstring: the softmax's sum then reads a row loaded as it is
    without parts)."""
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    if PARTS > 0:
        logits = fold_row_parts(ws_ptr, bias_ptr, cols, row, cols < E, stride_ps, stride_pf,
                                stride_pt, PARTS, HAS_BIAS).to(logit_ptr.dtype.element_ty)
        tl.store(logit_ptr + row * stride_l + cols, logits, mask=cols < E)
        if RELOAD:
            tl.debug_barrier()  # the block's stores are visible to its loads
            logits = tl.load(logit_ptr + row * stride_l + cols, mask=cols < E,
                             other=float("-inf"))
        else:
            logits = tl.where(cols < E, logits, float("-inf"))
    else:
        logits = tl.load(logit_ptr + row * stride_l + cols, mask=cols < E,
                         other=float("-inf"))
    x = logits.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    remaining = tl.where(cols < E, probs, -1.0)
    total = 0.0
    # The row's ids and weights stay in registers until one store of each.
    ranks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    ws = tl.zeros([BLOCK_K], tl.float32)
    for rank in tl.static_range(TOP_K):
        # one reduction for the value and its index; ties: lowest expert id
        w, best = tl.max(remaining, axis=0, return_indices=True,
                         return_indices_tie_break_left=True)
        ids = tl.where(ranks == rank, best.to(tl.int64), ids)
        ws = tl.where(ranks == rank, w, ws)
        total = total + w  # ascending rank order
        remaining = tl.where(cols == best, -2.0, remaining)
    if RENORM:
        ws = ws / total
    tl.store(ids_ptr + row * TOP_K + ranks, ids, mask=ranks < TOP_K)
    tl.store(w_ptr + row * TOP_K + ranks, ws, mask=ranks < TOP_K)


def topk_route(router_logits: torch.Tensor | Parts, top_k: int, renormalize: bool):
    """router_logits `[T, E]` → (ids `[T, k]` int64, weights `[T, k]` float32), rank order.

    router_logits may be the router's unfolded :class:`parts.Parts`, folded here to the
    bits of the folded logits."""
    parts = router_logits if isinstance(router_logits, Parts) else None
    t, e = (parts.num_rows, parts.num_features) if parts is not None else router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"topk_route: top_k={top_k} must be in 1..{e}")
    if top_k & (top_k - 1) and renormalize:
        # tl.arange needs a power of two; renormalise on the host side of the kernel.
        ids, w = topk_route(router_logits, top_k, False)
        return ids, w / _ordered_sum(w).unsqueeze(-1)
    if parts is not None:  # the kernel stores the folded logits here
        logits = torch.empty(t, e, dtype=parts.dtype, device=parts.ws.device)
    else:
        logits = (router_logits if router_logits.stride(1) == 1
                  else router_logits.contiguous())
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ws = parts.ws if parts is not None else logits
    bias = parts.bias if parts is not None and parts.bias is not None else logits
    if t:
        _topk_kernel[(t,)](logits, ids, w, ws, bias, e, logits.stride(0),
                           *(parts.strides if parts is not None else (0, 0, 0)), TOP_K=top_k,
                           RENORM=renormalize, PARTS=ws.shape[0] if parts is not None else 0,
                           HAS_BIAS=parts is not None and parts.bias is not None,
                           RELOAD=parts is not None and rowwise.PARTS_RELOAD,
                           BLOCK_E=triton.next_power_of_2(e),
                           BLOCK_K=triton.next_power_of_2(top_k), num_warps=1,
                           **_launch_args(logits.device, "topk"))
    return ids, w


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool):
    """See ``megaserve.kernels.api.route``: the top-k folds the router's parts where
    :func:`matmul.linear_parts` leaves them (decode rows)."""
    return topk_route(linear_parts(x, weight), top_k, renormalize)


def _ordered_sum(w: torch.Tensor) -> torch.Tensor:
    total = w[:, 0]
    for rank in range(1, w.shape[1]):
        total = total + w[:, rank]
    return total


@triton.jit
def _align_kernel(ids_ptr, order_ptr, offsets_ptr, R, num_experts, BLOCK_R: tl.constexpr,
                  PDL: tl.constexpr):
    """Program e: offsets[e] = #ids below e; order[offsets[e] + j] = the j-th row with id e.

    Ids equal to ``num_experts`` (routed nowhere) fall after every expert's rows and get
    no position.
    """
    pdl.wait_then_release(PDL)
    e = tl.program_id(0)
    below = tl.zeros([BLOCK_R], dtype=tl.int32)
    hits = tl.zeros([BLOCK_R], dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + rows, mask=rows < R, other=num_experts)
        below += (ids < e).to(tl.int32)
        hits += (ids == e).to(tl.int32)
    start = tl.sum(below, axis=0)
    count = tl.sum(hits, axis=0)
    tl.store(offsets_ptr + e, start)
    if e == num_experts - 1:
        tl.store(offsets_ptr + num_experts, start + count)
    seen = count * 0
    r0 = 0
    while seen < count:  # ascending rows: a stable order
        rows = r0 + tl.arange(0, BLOCK_R)
        hit = (tl.load(ids_ptr + rows, mask=rows < R, other=num_experts) == e).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - 1
        tl.store(order_ptr + start + rank, rows, mask=hit > 0)
        seen += tl.sum(hit, axis=0)
        r0 += BLOCK_R


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, R, num_experts, CHUNK: tl.constexpr,
                  BINS: tl.constexpr, PDL: tl.constexpr):
    """Program c: counts[c, e] = #ids equal to e among rows [c * CHUNK, +CHUNK) (bin
    ``num_experts`` counts the rows routed nowhere)."""
    pdl.wait_then_release(PDL)
    c = tl.program_id(0)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + rows, mask=rows < R, other=num_experts).to(tl.int32)
    tl.store(counts_ptr + c * BINS + tl.arange(0, BINS), tl.histogram(ids, BINS))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, order_ptr, offsets_ptr, R, num_experts,
                  CHUNK: tl.constexpr, BINS: tl.constexpr, CHUNK_TILE: tl.constexpr,
                  PDL: tl.constexpr):
    """Program c places rows [c * CHUNK, +CHUNK): a row with id e goes to offsets[e] + (its
    rank among the rows with id e, ascending), i.e. after the rows of id e in earlier
    chunks and the earlier rows of id e in its own chunk (a stable grouping). Program 0
    writes offsets. Ids equal to ``num_experts`` get no position."""
    pdl.wait_then_release(PDL)
    c = tl.program_id(0)
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], tl.int32)  # rows of each id, all chunks
    before = tl.zeros([BINS], tl.int32)  # ... in chunks before c
    num_chunks = tl.cdiv(R, CHUNK)
    for c0 in range(0, num_chunks, CHUNK_TILE):
        chunks = c0 + tl.arange(0, CHUNK_TILE)
        cnt = tl.load(counts_ptr + chunks[:, None] * BINS + bins[None, :],
                      mask=(chunks < num_chunks)[:, None], other=0)
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where((chunks < c)[:, None], cnt, 0), axis=0)
    total = tl.where(bins < num_experts, total, 0)
    start = tl.cumsum(total, axis=0) - total  # offsets[e] (integer sums: exact)
    if c == 0:
        tl.store(offsets_ptr + bins, start, mask=bins < num_experts)
        tl.store(offsets_ptr + num_experts, tl.sum(total, axis=0))
    mine = tl.load(counts_ptr + c * BINS + bins)
    first = tl.cumsum(mine, axis=0) - mine  # where id e starts in this chunk's sorted rows
    local = tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + c * CHUNK + local, mask=c * CHUNK + local < R,
                  other=num_experts).to(tl.int32)
    key = tl.sort(ids * CHUNK + local)  # by id, then row: unique keys
    sid = key // CHUNK
    dest = tl.gather(start + before, sid, 0) + local - tl.gather(first, sid, 0)
    tl.store(order_ptr + dest, c * CHUNK + key % CHUNK, mask=sid < num_experts)


@triton.jit
def _expert_ranges(offsets_ptr, ids_ptr, R, num_experts, BLOCK_E: tl.constexpr,
                   BLOCK_R: tl.constexpr, INLINE: tl.constexpr):
    """(experts, lo, hi) `[BLOCK_E]`: expert e's rows are grouped positions [lo[e], hi[e])
    (0, 0 past num_experts): read from the align pass's offsets, or with INLINE counted
    from the R expert ids themselves (lo[e] = #ids below e, hi[e] = #ids up to e)."""
    experts = tl.arange(0, BLOCK_E)
    live = experts < num_experts
    if INLINE:
        ids = _load_ids(ids_ptr, R, num_experts, BLOCK_R)
        lo = tl.sum((ids[None, :] < experts[:, None]).to(tl.int32), axis=1)
        hi = tl.sum((ids[None, :] <= experts[:, None]).to(tl.int32), axis=1)
        lo = tl.where(live, lo, 0)
        hi = tl.where(live, hi, 0)
    else:
        lo = tl.load(offsets_ptr + experts, mask=live, other=0)
        hi = tl.load(offsets_ptr + experts + 1, mask=live, other=0)
    return experts, lo, hi


@triton.jit
def _load_ids(ids_ptr, R, num_experts, BLOCK_R: tl.constexpr):
    """The R expert ids `[BLOCK_R]` int32; num_experts (routed nowhere) past R."""
    rows = tl.arange(0, BLOCK_R)
    return tl.load(ids_ptr + rows, mask=rows < R, other=num_experts).to(tl.int32)


@triton.jit
def _rows_at(pos, row_ok, order_ptr, ids_ptr, R, num_experts, BLOCK_R: tl.constexpr,
             INLINE: tl.constexpr):
    """``order[pos]``: the row (call order) at each grouped position (0 where not row_ok).

    INLINE: from the ids, as the align pass orders them: row r sits at its rank, the
    number of rows with a smaller id or the same id and a smaller index (stable)."""
    if INLINE:
        ids = _load_ids(ids_ptr, R, num_experts, BLOCK_R)
        r = tl.arange(0, BLOCK_R)
        before = (ids[None, :] < ids[:, None]) | (
            (ids[None, :] == ids[:, None]) & (r[None, :] < r[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)  # [BLOCK_R]; rows past R rank past
        hit = (rank[None, :] == pos[:, None]) & row_ok[:, None]  # every grouped position
        return tl.sum(tl.where(hit, r[None, :], 0), axis=1)
    else:
        return tl.load(order_ptr + pos, mask=row_ok, other=0)


@triton.jit
def _tile_of(pid, offsets_ptr, ids_ptr, R, num_experts, N, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
             INLINE: tl.constexpr, N_MAJOR: tl.constexpr):
    """Program ``pid``'s tile: (expert, first position, end of the expert's positions,
    column tile); expert >= num_experts past the last tile (module NOTE). The experts'
    position ranges come from :func:`_expert_ranges`.

    Tiles are numbered expert by expert; inside an expert, row tile by row tile (the
    column tiles of one row tile are consecutive programs: one read of its rows from L2)
    or, with N_MAJOR, column tile by column tile (the row tiles of one weight tile are
    consecutive programs: one read of the weights from device memory).
    """
    experts, lo, hi = _expert_ranges(offsets_ptr, ids_ptr, R, num_experts, BLOCK_E, BLOCK_R,
                                     INLINE)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M  # row tiles of expert e
    ends = tl.cumsum(tiles, axis=0)  # row tiles through expert e
    if N_MAJOR:
        expert = tl.sum((ends * tiles_n <= pid).to(tl.int32), axis=0)
        mine = experts == expert
        first = tl.sum(tl.where(mine, ends - tiles, 0), axis=0)
        count = tl.maximum(tl.sum(tl.where(mine, tiles, 0), axis=0), 1)
        local = pid - first * tiles_n
        row_tile = local % count
        col_tile = local // count
    else:
        tile = pid // tiles_n
        col_tile = pid % tiles_n
        expert = tl.sum((ends <= tile).to(tl.int32), axis=0)
        mine = experts == expert
        row_tile = tile - tl.sum(tl.where(mine, ends - tiles, 0), axis=0)
    start = tl.sum(tl.where(mine, lo, 0), axis=0) + row_tile * BLOCK_M
    end = tl.sum(tl.where(mine, hi, 0), axis=0)
    return expert, start, end, col_tile


@triton.jit
def _store_tile(acc, acc_up, c_ptr, dst, row_ok, cols, col_ok, stride_cm,
                SWIGLU: tl.constexpr):
    """Round the fp32 tile to c's dtype (SWIGLU: the module NOTE's epilogue) and store it
    at rows ``dst``."""
    out_ty = c_ptr.dtype.element_ty
    if SWIGLU:
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty)  # as rowwise._silu_mul_kernel
        res = act * acc_up.to(out_ty)
    else:
        res = acc.to(out_ty)
    tl.store(c_ptr + dst.to(tl.int64)[:, None] * stride_cm + cols[None, :], res,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expert_gemm_kernel(
    # Pointers
    a_ptr, w_ptr, c_ptr, ids_ptr, order_ptr, offsets_ptr,
    # Shapes
    R, num_experts, N, K,
    # Strides
    stride_am, stride_we, stride_wn, stride_cm,
    # Meta-parameters
    SWIGLU: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr, INLINE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, EARLY_IDS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (expert, BLOCK_M positions, BLOCK_N columns) tile of ``a @ w[e].T``, both
    operands through pointer loads.

    GATHER: position p reads row ``order[p] // ROWS_PER_TOKEN`` of a (else row p);
    SCATTER: writes row ``order[p]`` of c (else row p). SWIGLU: N is I, the tile
    accumulates gate columns n and up columns N + n of w and stores ``silu(gate) * up``
    (module NOTE's roundings). EARLY_IDS: the previous kernel did not write ids, order or
    offsets (the down GEMM follows the gate_up GEMM), so the program finds its tile and
    rows before its PDL wait (pdl's NOTE), and one past the last tile exits without it.
    """
    if not EARLY_IDS:
        pdl.wait_then_release(PDL)
    expert, start, end, col_tile = _tile_of(tl.program_id(0), offsets_ptr, ids_ptr, R,
                                            num_experts, N, BLOCK_M, BLOCK_N, BLOCK_E,
                                            BLOCK_R, INLINE, False)
    if expert >= num_experts:
        return
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = start + tl.arange(0, BLOCK_M)  # positions in the grouped order
    row_ok = pos < end
    col_ok = cols < N
    if GATHER or SCATTER:
        rows = _rows_at(pos, row_ok, order_ptr, ids_ptr, R, num_experts, BLOCK_R, INLINE)
    if EARLY_IDS:
        pdl.wait_then_release(PDL)  # a is the previous kernel's
    if GATHER:
        src = rows // ROWS_PER_TOKEN
    else:
        src = pos
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + src.to(tl.int64)[:, None] * stride_am
    g_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + N * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        a = tl.load(a_rows + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_ok = col_ok[:, None] & k_ok[None, :]
        b = tl.load(g_rows + (k0 + kk)[None, :], mask=w_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        if SWIGLU:
            b_up = tl.load(u_rows + (k0 + kk)[None, :], mask=w_ok, other=0.0)
            acc_up = tl.dot(a, tl.trans(b_up), acc_up)
    _store_tile(acc, acc_up, c_ptr, rows if SCATTER else pos, row_ok, cols, col_ok,
                stride_cm, SWIGLU)


@triton.jit
def _expert_gemm_tma_kernel(
    # Pointers and TMA descriptors
    a_ptr, a_desc, a_tail_desc, w_desc, c_ptr, ids_ptr, order_ptr, offsets_ptr,
    # Shapes
    R, num_experts, N, K,
    # Strides
    stride_am, stride_cm,
    # Meta-parameters
    SWIGLU: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr, INLINE: tl.constexpr, JOIN: tl.constexpr,
    N_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    """The tile of :func:`_expert_gemm_kernel` (same arguments, same bits) with the
    weights, and a unless GATHER, read by TMA.

    TAIL_M (0: none): a tile with at most TAIL_M of its expert's rows left (an expert's
    last tile) runs as a TAIL_M-row tile: the same tiles in the same order, less padding.

    w_desc: w viewed `[E * H, N, K]` (H = 2 with SWIGLU: gate then up, else 1), block
    `[1, BLOCK_N, BLOCK_K]` (with JOIN `[2, BLOCK_N, BLOCK_K]`: gate and up rows in one
    dot over 2 * BLOCK_N columns, split in the epilogue). Rows past N and K past K read
    as zeros, so no tile sees another expert's weights. a_desc / a_tail_desc (not
    GATHER): a `[R, K]`, block `[BLOCK_M, BLOCK_K]` / `[TAIL_M, BLOCK_K]`; rows past
    ``end`` (the next expert's) are read and never stored (each output row depends on its
    own a row only).
    """
    pdl.wait_then_release(PDL)
    expert, start, end, col_tile = _tile_of(tl.program_id(0), offsets_ptr, ids_ptr, R,
                                            num_experts, N, BLOCK_M, BLOCK_N, BLOCK_E,
                                            BLOCK_R, INLINE, N_MAJOR)
    if expert >= num_experts:
        return
    if TAIL_M > 0:
        if end - start <= TAIL_M:
            _tma_tile(a_ptr, a_tail_desc, w_desc, c_ptr, ids_ptr, order_ptr, R, num_experts,
                      N, K, stride_am, stride_cm, expert, start, end, col_tile, SWIGLU,
                      GATHER, SCATTER, ROWS_PER_TOKEN, INLINE, JOIN, TAIL_M, BLOCK_N,
                      BLOCK_K, BLOCK_R)
            return
    _tma_tile(a_ptr, a_desc, w_desc, c_ptr, ids_ptr, order_ptr, R, num_experts, N, K,
              stride_am, stride_cm, expert, start, end, col_tile, SWIGLU, GATHER, SCATTER,
              ROWS_PER_TOKEN, INLINE, JOIN, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)


@triton.jit
def _tma_tile(a_ptr, a_desc, w_desc, c_ptr, ids_ptr, order_ptr, R, num_experts, N, K,
              stride_am, stride_cm, expert, start, end, col_tile, SWIGLU: tl.constexpr,
              GATHER: tl.constexpr, SCATTER: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr,
              INLINE: tl.constexpr, JOIN: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (expert, BLOCK_M positions from ``start``, BLOCK_N columns) tile of
    :func:`_expert_gemm_tma_kernel`; positions from ``end`` on are not stored."""
    n0 = col_tile * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    pos = start + tl.arange(0, BLOCK_M)
    row_ok = pos < end
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    if GATHER or SCATTER:
        rows = _rows_at(pos, row_ok, order_ptr, ids_ptr, R, num_experts, BLOCK_R, INLINE)
    if GATHER:
        a_rows = a_ptr + (rows // ROWS_PER_TOKEN).to(tl.int64)[:, None] * stride_am
    H: tl.constexpr = 2 if SWIGLU else 1
    if JOIN:
        acc2 = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if GATHER:
            a = tl.load(a_rows + (k0 + kk)[None, :],
                        mask=row_ok[:, None] & (k0 + kk < K)[None, :], other=0.0)
        else:
            a = a_desc.load([start, k0])
        if JOIN:
            b = w_desc.load([expert * 2, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K)
            acc2 = tl.dot(a, b.T, acc2)
        else:
            b = w_desc.load([expert * H, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc)
            if SWIGLU:
                b_up = w_desc.load([expert * 2 + 1, n0, k0]).reshape(BLOCK_N, BLOCK_K)
                acc_up = tl.dot(a, b_up.T, acc_up)
    if JOIN:  # columns [gate 0..BLOCK_N) | [up 0..BLOCK_N)
        acc, acc_up = tl.split(acc2.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1))
    _store_tile(acc, acc_up, c_ptr, rows if SCATTER else pos, row_ok, cols, col_ok,
                stride_cm, SWIGLU)


_K_QUANTUM = 64  # the arithmetic's K step; a launch's block_k is a multiple of it


# This module's kernels launched with PDL (programmatic dependent launch: a kernel starts
# before its predecessor ends and waits in pdl.wait_then_release). Every kernel here keeps
# that wait, so adding one is a name in this set ("up", "down": the expert GEMMs of any
# call; "decode_up", "decode_down": only calls with inline grouping, at most
# INLINE_ALIGN_MAX_ROWS rows, so no large call changes). $MEGASERVE_MOE_PDL (names,
# comma-separated) replaces the set for tuning runs. What gained at batch-1 decode of the
# 48-layer Qwen3-30B-A3B shape on an H100 is in: top-k, align and both decode GEMMs (the
# down GEMM once it finds its tile and rows before its wait, _expert_gemm_kernel's
# EARLY_IDS). PDL on every expert GEMM lost in full runs (Mixtral's batch 256 fell from 69%
# to 61% of its roofline). The down GEMM launches early only after a gate_up grid of at
# most _DOWN_PDL_MAX_WAVES programs per SM (Qwen3-30B-A3B at batch 1: 192 programs): after
# a gate_up grid of several waves (Mixtral's 896 programs) down's early programs hold SM
# slots those waves need. Timings: docs/benchmarks.md in git history, "Roofline".
PDL_KERNELS = frozenset({"topk", "align", "decode_up", "decode_down"})
_DOWN_PDL_MAX_WAVES = 2
_PDL_ENV = "MEGASERVE_MOE_PDL"


def _launch_args(device: torch.device, kernel: str, inline: bool = False) -> dict:
    args = pdl.named_launch_args(device, kernel, PDL_KERNELS, _PDL_ENV)
    if inline and not args["PDL"]:
        args = pdl.named_launch_args(device, f"decode_{kernel}", PDL_KERNELS, _PDL_ENV)
    return args


@dataclass(frozen=True)
class GemmTiles:
    """Tile shape and pipeline of one expert GEMM launch. Never changes a bit (module NOTE).

    block_n counts output columns: for the gate_up GEMM, I columns (each tile reads
    2 * block_n weight rows, gate and up). block_k: K per dot of the launch's K loop, a
    power-of-two multiple of 64 (the same chain of k16 steps whatever it is). tma: the
    weights (and the down GEMM's rows) through TMA descriptors where their strides allow
    (16-byte aligned rows), else pointer loads. join (tma): gate and up in one dot over
    2 * block_n columns. n_major (tma): an expert's tiles in column-tile order (module
    NOTE). tail_m (tma; 0: none): a tile with at most tail_m of its expert's rows left
    (the expert's last tile) runs with tail_m rows (less padding; the same tiles in the
    same order, so it reads its weights from L2 after the expert's other row tiles).
    gluon (tma): on Hopper, :mod:`moe_gluon`'s persistent kernel with its own tiles where it
    applies (``moe_gluon.applies``; the same bits; block sizes, warps and stages here apply
    elsewhere).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    block_k: int = _K_QUANTUM
    tma: bool = False
    join: bool = False
    n_major: bool = False
    tail_m: int = 0
    gluon: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmTiles: {name}={v} must be a power of two >= 16")
        if self.block_k < _K_QUANTUM or self.block_k & (self.block_k - 1):
            raise ValueError(f"GemmTiles: block_k={self.block_k} must be a power of two >= "
                             f"{_K_QUANTUM}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"GemmTiles: bad num_warps={self.num_warps} / "
                             f"num_stages={self.num_stages}")
        if (self.join or self.n_major or self.gluon) and not self.tma:
            raise ValueError("GemmTiles: join, n_major and gluon need tma=True")
        if self.gluon and self.tail_m:
            raise ValueError("GemmTiles: the gluon kernel has no tail tiles (tail_m=0)")
        if self.tail_m and not (self.tma and 16 <= self.tail_m < self.block_m
                                and not self.tail_m & (self.tail_m - 1)):
            raise ValueError(f"GemmTiles: tail_m={self.tail_m} must be 0, or with tma=True a "
                             f"power of two >= 16 below block_m={self.block_m}")


@dataclass(frozen=True)
class MoeLaunch:
    """The launches of one expert FFN: ``up`` (gate_up, SwiGLU epilogue) and ``down``.

    inline_align: no align launch; each GEMM program groups the rows itself from the expert
    ids (the same offsets and order, in registers), which takes one dependent launch and
    one dependent load off a decode step's chain. Calls of more than
    ``INLINE_ALIGN_MAX_ROWS`` rows take the align launch whatever this says.
    """

    up: GemmTiles
    down: GemmTiles
    inline_align: bool = False


# Launches by mean rows per expert (rows per call / experts held), ascending (max, launch);
# more take _PREFILL. Measured on an H100 (lab/moe_bench.py --sweep, Qwen3-30B-A3B's
# expert shape, 128 experts): up to 4 rows per expert (512 rows), 16-row tiles put the most
# programs on the weights (batch 1 has one row per expert), K step 128 and 3 stages; then
# 64-row tiles, K step 128, 4 stages. Keyed per expert, not per call, so a model with few
# big experts (Mixtral: 8) leaves 16-row tiles, which re-read each expert's weights once
# per 16 rows, as soon as its experts get more rows (batch 256: 64 rows each; 16-row tiles
# there made its decode step 2.4x slower).
# Prefill (lab/moe_bench.py --sweep --grid prefill, H100, 4096 tokens: Qwen3-30B-A3B
# 32768 rows, Mixtral-8x7B 8192 rows): 128-row tiles, 8 warps, 4 stages, weights by TMA.
# gate_up: gate and up in one 128 x 256 dot, column-tile order (Mixtral's 112 column
# tiles an expert: 1.9x faster than row-tile order, which re-reads an expert's 235 MB of
# weights per row tile; Qwen's 6: the same); down: 128 x 256 tiles. Up to 512 rows per
# expert, an expert's last tile with at most 64 rows left runs as a 64-row tile (tail_m):
# at Qwen's 256 rows an expert (~Poisson) a 128-row tile wastes ~20% of the MMA rows. H100,
# Qwen3-30B-A3B 32768 rows (lab/moe_bench.py --grid tails, same call): the FFN 700-710
# us against 739 without; alone, gate_up 457 -> 445 us, down 252 -> 249. Mixtral-8x7B at
# 8192 rows (1024 an expert: < 6% padding) was 3.5% slower with them (4736 against 4575
# us), so larger calls take _PREFILL, whose GEMMs run moe_gluon's persistent kernel on
# Hopper where it applies (the same bits; timings at moe_gluon.SWIGLU_MAX_N). The 512-row
# bucket keeps its Triton tail tiles.
_PREFILL = MoeLaunch(GemmTiles(128, 128, 8, 4, tma=True, join=True, n_major=True, gluon=True),
                     GemmTiles(128, 256, 8, 4, tma=True, gluon=True))
_BY_ROWS_PER_EXPERT = (
    (4, MoeLaunch(GemmTiles(16, 32, 4, 3, 128), GemmTiles(16, 128, 4, 3, 128))),
    (64, MoeLaunch(GemmTiles(64, 64, 4, 4, 128), GemmTiles(64, 128, 4, 4, 128))),
    (512, MoeLaunch(dataclasses.replace(_PREFILL.up, tail_m=64, gluon=False),
                    dataclasses.replace(_PREFILL.down, tail_m=64, gluon=False))))
# The align pass (_align) in chunks from this many rows: one program per expert scanning
# every id twice took 21.6 / 82.3 us at 32,768 / 131,072 rows and 128 experts on an H100,
# the chunked pass 13.1 / 17.9; below ~16k rows the one-launch pass is faster (4,096 rows:
# 3.6 against 12.2 us). Rows a chunk: _ALIGN_CHUNK.
ALIGN_CHUNKED_ROWS = 16384
_ALIGN_CHUNK = 1024
# The inline grouping's bound on a call's rows (its [E, R] and [R, R] compares per program).
INLINE_ALIGN_MAX_ROWS = 64
# Tuning runs: "m,n,warps,stages,k_step[,tma[,join]];..." (up; down) replaces the first
# bucket's launch; $MEGASERVE_MOE_INLINE_ALIGN=0 keeps the align launch at every size
# (speed choices: the bits never change).
_DECODE_ENV = "MEGASERVE_MOE_DECODE_TILES"
_INLINE_ENV = "MEGASERVE_MOE_INLINE_ALIGN"


def _decode_launch() -> MoeLaunch:
    text = os.environ.get(_DECODE_ENV)
    if not text:
        return _BY_ROWS_PER_EXPERT[0][1]
    up, down = ([int(v) for v in part.split(",")] for part in text.split(";"))
    return MoeLaunch(*(GemmTiles(*v[:5], *(bool(f) for f in v[5:])) for v in (up, down)))


def plan_launch(num_rows: int, num_experts: int = 128) -> MoeLaunch:
    """The launch for a call of ``num_rows`` routed rows over ``num_experts`` experts (a
    speed choice, bit-neutral)."""
    for max_per_expert, launch in _BY_ROWS_PER_EXPERT:
        if num_rows <= max_per_expert * num_experts:
            if launch is not _BY_ROWS_PER_EXPERT[0][1]:
                return launch
            inline = (num_rows <= INLINE_ALIGN_MAX_ROWS
                      and os.environ.get(_INLINE_ENV, "1") != "0")
            return dataclasses.replace(_decode_launch(), inline_align=inline)
    return _PREFILL


def _max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Bound on sum_e cdiv(count_e, block_m) over counts summing to at most num_rows."""
    return (num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m


def _align(expert_ids: torch.Tensor, num_experts: int, *,
           chunked: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids `[R]` → (offsets `[E + 1]` int32, order `[R]` int32), see module NOTE.

    order[offsets[e]:offsets[e + 1]] are the rows with id e, ascending; the positions from
    offsets[E] on are unspecified (rows with id E). Calls of ``ALIGN_CHUNKED_ROWS`` rows or
    more (``chunked``: force either way) take two launches over chunks of
    ``_ALIGN_CHUNK`` rows (each chunk's histogram of ids, then each chunk places its rows
    from all chunks' histograms); smaller ones one program per expert, each scanning every
    id twice. The same integers either way.
    """
    r = expert_ids.shape[0]
    ids = expert_ids if expert_ids.stride(0) == 1 else expert_ids.contiguous()
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
    order = torch.empty(r, dtype=torch.int32, device=ids.device)
    if not (r >= ALIGN_CHUNKED_ROWS if chunked is None else chunked):
        block_r = max(16, min(4096, triton.next_power_of_2(r)))
        _align_kernel[(num_experts,)](ids, order, offsets, r, num_experts, BLOCK_R=block_r,
                                      num_warps=4 if block_r <= 1024 else 8,
                                      **_launch_args(ids.device, "align"))
        return offsets, order
    bins = triton.next_power_of_2(num_experts + 1)
    chunks = triton.cdiv(r, _ALIGN_CHUNK)
    counts = torch.empty(chunks, bins, dtype=torch.int32, device=ids.device)
    common = dict(CHUNK=_ALIGN_CHUNK, BINS=bins, num_warps=4,
                  **_launch_args(ids.device, "align"))
    _count_kernel[(chunks,)](ids, counts, r, num_experts, **common)
    _place_kernel[(chunks,)](ids, counts, order, offsets, r, num_experts,
                             CHUNK_TILE=max(1, min(16, 8192 // bins)), **common)
    return offsets, order


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                 grouping: tuple[torch.Tensor, torch.Tensor] | None, tiles: GemmTiles, *,
                 swiglu: bool, gather: bool, scatter: bool,
                 rows_per_token: int = 1, pdl_ok: bool = True) -> torch.Tensor:
    """a `[R / rows_per_token, K]` times each position's expert `w[e]` `[N', K]` → `[R, N]`
    (module NOTE); R = ids' length. grouping: the align pass's (offsets, order), or None:
    the programs group the rows from ``ids`` themselves (R <= INLINE_ALIGN_MAX_ROWS).

    N = N' // 2 with ``swiglu`` (silu(gate) * up), else N'. ``rows_per_token`` > 1 only
    with ``gather``. ``pdl_ok=False``: no PDL launch, whatever PDL_KERNELS says.
    """
    r = ids.shape[0]
    offsets, order = grouping if grouping is not None else (ids, ids)  # unused if inline
    num_experts, n_w, k = w.shape
    n = n_w // 2 if swiglu else n_w
    out = torch.empty(r, n, dtype=a.dtype, device=a.device)
    if (tiles.gluon and grouping is not None
            and moe_gluon.applies(a, w, gather=gather, swiglu=swiglu, scatter=scatter)):
        moe_gluon.launch(a, w, offsets, order, out, num_sms(a.device), swiglu=swiglu,
                         rows_per_token=rows_per_token)
        return out
    grid = (_max_tiles(r, num_experts, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    common = dict(
        SWIGLU=swiglu, GATHER=gather, SCATTER=scatter, ROWS_PER_TOKEN=rows_per_token,
        INLINE=grouping is None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, BLOCK_E=triton.next_power_of_2(num_experts),
        # (one build for every R when the align pass groups the rows: BLOCK_R is unused)
        BLOCK_R=max(16, triton.next_power_of_2(r)) if grouping is None else 16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **(_launch_args(a.device, "up" if swiglu else "down", inline=grouping is None)
           if pdl_ok else {"PDL": False}))
    if tiles.tma and tma_readable(w) and (gather or tma_readable(a)):
        halves = 2 if swiglu else 1
        w3 = w.view(num_experts * halves, n, k)  # [E * H, N, K]: gate, up of e at 2e, 2e+1
        join = tiles.join and swiglu
        w_desc = TensorDescriptor.from_tensor(
            w3, [2 if join else 1, tiles.block_n, tiles.block_k])
        a_desc, a_tail_desc = (None if gather or not m else TensorDescriptor.from_tensor(
            a, [m, tiles.block_k]) for m in (tiles.block_m, tiles.tail_m))
        _expert_gemm_tma_kernel[grid](
            a, a_desc, a_tail_desc, w_desc, out, ids, order, offsets, r, num_experts, n, k,
            a.stride(0), out.stride(0), JOIN=join, N_MAJOR=tiles.n_major,
            TAIL_M=tiles.tail_m, **common)
        return out
    _expert_gemm_kernel[grid](
        a, w, out, ids, order, offsets, r, num_experts, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), EARLY_IDS=not swiglu, **common)
    return out


def expert_ffn(x: torch.Tensor, expert_ids: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, *, rows_per_token: int = 1,
               launch: MoeLaunch | None = None, fused: bool = True) -> torch.Tensor:
    """x `[R / rows_per_token, D]`, expert_ids `[R]`, w_gate_up `[E, 2I, D]`, w_down
    `[E, D, I]` → `[R, D]`; routed row r reads x row ``r // rows_per_token``.

    ``launch`` forces the tiles (tests, tuning; default :func:`plan_launch`); ``fused=False``
    runs the gate_up GEMM and ``silu_and_mul`` apart (the reference the fused epilogue
    must equal bitwise). Neither changes a bit of the result.
    """
    r = expert_ids.shape[0]
    num_experts = w_gate_up.shape[0]
    if rows_per_token < 1 or x.shape[0] * rows_per_token != r:
        raise ValueError(f"expert_ffn: x has {x.shape[0]} rows, expert_ids {r}; need "
                         f"x rows * rows_per_token ({rows_per_token}) == expert_ids rows")
    if r == 0:
        return torch.empty(0, w_down.shape[1], dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    lp = launch or plan_launch(r, num_experts)
    ids = expert_ids if expert_ids.stride(0) == 1 else expert_ids.contiguous()
    inline = lp.inline_align and r <= INLINE_ALIGN_MAX_ROWS
    grouping = None if inline else _align(ids, num_experts)
    if fused:
        hidden = _expert_gemm(x, w_gate_up, ids, grouping, lp.up, swiglu=True, gather=True,
                              scatter=False, rows_per_token=rows_per_token)  # [R, I] grouped
    else:
        up = dataclasses.replace(lp.up, block_n=2 * lp.up.block_n)
        gate_up = _expert_gemm(x, w_gate_up, ids, grouping, up, swiglu=False, gather=True,
                               scatter=False, rows_per_token=rows_per_token)  # [R, 2I]
        hidden = silu_and_mul(gate_up)
    up_programs = (_max_tiles(r, num_experts, lp.up.block_m)
                   * triton.cdiv(w_gate_up.shape[1] // 2, lp.up.block_n))
    return _expert_gemm(hidden, w_down, ids, grouping, lp.down, swiglu=False, gather=False,
                        scatter=True,
                        pdl_ok=up_programs <= _DOWN_PDL_MAX_WAVES * num_sms(x.device))


# The grouping and tile numbering the FP8 expert FFN (fp8_moe) shares with these kernels.
align = _align
max_tiles = _max_tiles
rows_at = _rows_at
tile_of = _tile_of
# One grouped GEMM and the prefill launch plan, which lab/moe_bench.py times one by one.
expert_gemm = _expert_gemm
PREFILL = _PREFILL
