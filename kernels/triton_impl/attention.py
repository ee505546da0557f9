"""Paged attention (prefill, chunked prefill and decode), the KV write, and the fused
per-head q/k RMSNorm + rotary + KV write that feeds it.

Shape legend: T = new tokens, S = sequences, Hq / Hkv = query / KV heads, G = Hq / Hkv,
Dh = head dim, C = KV_SPLIT_SIZE keys per split.

NOTE: one program owns a tile of BLOCK_Q consecutive new tokens of one sequence and one
KV head; its BLOCK_M = BLOCK_Q * G_PAD rows are (token, query head of the group) pairs:

    row r  →  token  r // G_PAD,  query head  kv_head * G + r % G_PAD   (r % G_PAD < G)

Keys are reduced in two fixed levels. A chunk is CHUNK_SPLITS splits of C keys. A row
runs the splits of a chunk in ascending order from the empty state (-inf, 0, 0) with one
accumulator, FlashAttention's way, in log2 units (the EXP2 form: exp2, log2(e) folded
into the scale, explicit FMAs; see attention_kernels and :func:`exp2_default`):

    m' = max(m, max(scores_s))      alpha = exp2(m - m')      p = bf16(exp2(scores_s - m'))
    l' = l * alpha + p @ 1          o' = p @ V accumulated by the dot into o * alpha

The chunk states are then merged, ascending, with ``(m, l, o) ← merge((m, l, o),
(m_c, l_c, o_c))``, and the row's output is ``o / l``. A split or chunk lying wholly past
a row's position leaves its state unchanged, exactly: a row's bits depend on its own
position and context only. (kernels.cpu folds its splits in one level; each backend's
bits are its own.) One accumulator carried across a chunk's splits, rather than a fresh
state a split merged afterwards, saves a second accumulator's registers and the stores of
every split's state (the prefill timings of both forms: docs/benchmarks.md in git history).

Every step is layout-independent, so the tile (rows, warps, pipeline depth) is a launch
choice, free per call: ``max`` is exact in any order; the scores, ``p @ V`` and ``p @ 1``
are tensor-core dots (the same bf16 ``p`` in both), whose k16 steps round each output
element alike whatever the instruction's tile shape, starting from the accumulator they
are given; ``exp2`` and ``merge`` are elementwise. (A ``tl.sum`` would reduce in an order
set by the layout.)

Two launch modes give the same bits: **serial** (one program per tile and KV head walks
its chunks in registers) and **chunk** (one program per (tile, KV head, chunk) stores the
chunk's state in fp32, then a fold kernel merges the chunks). The chunks are what makes
a long context parallel for few sequences.

The kernels are in :mod:`megaserve.kernels.triton_impl.attention_kernels`; its docstring describes
the loop switches (masks only on diagonal splits, block ids one split ahead, long rows
first), launch choices like the tile. On Hopper, serial prefill runs the same arithmetic
in Gluon (:mod:`megaserve.kernels.triton_impl.attention_gluon`: warp-specialised, its dots
in flight across the softmax; :func:`gluon_applies`), whose bits the GPU tests compare
with the Triton kernel's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..api import KV_SPLIT_SIZE
from . import attention_gluon, pdl
from .rowwise import mul_rounded, no_contract, norm_warps, rms_apply, rms_rstd_rows
from .attention_kernels import attention_fold_kernel, paged_attention_kernel

# Chunk mode below this many serial programs (about two per SM of an H100/H200), while
# its fp32 chunk states fit in this many bytes.
_SERIAL_MIN_PROGRAMS = 264
_MAX_WS_BYTES = 256 << 20
# Splits per chunk, the first level of the reduction (NOTE): part of the arithmetic, so
# one value for every launch (tests lower it to reach chunk boundaries at small sizes).
# Fewer splits a chunk give a long decode more chunks, so more programs (one a chunk and KV
# head) and SMs; more splits give prefill fewer merges. 8 balances the two
# (lab/attn_chunk_bench.py; docs/benchmarks.md in git history, "Roofline").
CHUNK_SPLITS = 8
_LOG2E = 1.4426950408889634
# Tests set this: the output and the chunk workspaces start as NaN, so an element no
# program wrote, or a part read before it was written, shows up instead of a previous
# call's leftovers.
POISON_BUFFERS = False


@dataclass(frozen=True)
class AttentionLaunch:
    """How one call is launched: tile and grid only, never the arithmetic (see NOTE)."""

    mode: str = "serial"  # 'serial' | 'chunk' (module NOTE)
    rows: int = 64  # tile rows (BLOCK_M), a power of two >= 16 (raised to G_PAD if larger)
    num_warps: int = 4
    num_stages: int = 2
    fold_tokens: int = 1  # chunk mode: tokens per fold program
    fold_unroll: int = 8  # chunk mode: chunk states the fold loads before merging them
    # Loop switches (attention_kernels docstring; none changes the bits):
    mask_tail: bool = False  # masks only on splits that cross a row's position
    prefetch: bool = False  # block ids of the next split loaded one iteration ahead
    long_first: bool = False  # tiles numbered from the last (long causal rows first)
    fold_block_d: int = 0  # chunk mode: head_dim columns per fold program; 0 = all
    fold_warps: int = 4  # chunk mode: warps per fold program
    l_cols: int = 32  # columns of the ``p @ 1`` dot (equal columns; 16 or more)
    # Serial prefill on Hopper runs attention_gluon's kernel where it applies
    # (:func:`gluon_applies`; the same bits); False keeps the Triton kernel and this tile.
    gluon: bool = True
    # Registers a thread of the main kernel may use (0: the compiler's choice). Fewer fit
    # more programs on an SM (the serial decode tile takes 255 with 2 warps: 4 programs
    # an SM, so batch 256's 1,024 programs of Qwen3-30B-A3B run in two waves) at the cost
    # of spills; register allocation only, the same bits.
    maxnreg: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("serial", "chunk"):
            raise ValueError(f"AttentionLaunch: mode must be 'serial' or 'chunk', got "
                             f"{self.mode!r}")
        fbd = self.fold_block_d
        if fbd and (fbd < 16 or fbd & (fbd - 1)):
            raise ValueError(f"AttentionLaunch: fold_block_d={self.fold_block_d} must be 0 "
                             "or a power of two >= 16")
        for name in ("rows", "num_warps", "fold_tokens", "fold_unroll", "fold_warps", "l_cols"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"AttentionLaunch: {name}={v} must be a power of two")
        if self.rows < 16 or self.num_stages < 1 or self.l_cols < 16:
            raise ValueError(f"AttentionLaunch: bad rows/num_stages/l_cols: {self}")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"AttentionLaunch: maxnreg={self.maxnreg} must be 0 or in 24..255")


# Tiles, chosen by timing every candidate with its bitwise checks (lab/attn_sweep.py,
# lab/attn_chunk_bench.py; the numbers are in docs/benchmarks.md in git history). None
# changes a bit (module NOTE).
# * Decode: serial 16-row tiles, both loop switches (mask_tail, prefetch), of 2 warps and
#   2 stages wherever the serial grid fills the GPU (several programs an SM: H200,
#   lab/attn_decode_stages.py, Qwen3-30B-A3B's heads, us at batch 64 / 256 / 1024: at ~80
#   tokens of context 11 / 23 / 73 against 15 / 34 / 108 for 4 warps and 4 stages, at
#   ~1000 tokens 49 / 138 / 514 against 49 / 152 / 540); else chunk mode (4 warps, 3
#   stages), whose fold covers 16 head_dim columns a one-warp program when the fold grid
#   is small.
# * Prefill: 128-row tiles of 8 warps (4-warp 64-row tiles spill the chunk accumulator),
#   masks only on the splits that cross a row's position, the ``p @ 1`` dot 16 columns
#   wide, the longest causal rows first (without long_first deeper pipelines lost: the
#   long tiles finished last). Serial tiles of head_dim <= 128 run 3 stages with block
#   ids one split ahead, the one loop whose K/V loads stay in flight across splits;
#   wider heads keep 2 (4 stages of 64 x 256 K/V tiles do not fit in shared memory).
# * Split mode (per-split states) is gone with the one-accumulator arithmetic: few
#   sequences get chunk mode.
_PREFILL_BASE_TILE = dict(rows=128, num_warps=8, num_stages=2, mask_tail=True)
DECODE_TILE = dict(rows=16, num_warps=4, num_stages=3, fold_unroll=16, mask_tail=True,
                   prefetch=True)
DECODE_SERIAL_TILE = dict(DECODE_TILE, num_warps=2, num_stages=2)
PREFILL_TILE = dict(_PREFILL_BASE_TILE, l_cols=16, long_first=True)
PREFILL_SERIAL_TILE = dict(PREFILL_TILE, num_stages=3, prefetch=True)
_DEEP_PREFILL_MAX_D = 128  # widest (padded) head_dim that gets PREFILL_SERIAL_TILE
_FOLD_CHUNK_BELOW = 264  # fold programs under which the fold splits head_dim by 16


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


@dataclass(frozen=True)
class RotaryLaunch:
    """How a rotary_and_cache call is launched: grid and warps only, never the bits (a row
    is laid out as a one-warp program over it alone lays it out; see the kernels).

    Tiles of ``rows`` consecutive (token, head) rows (:func:`_rotary_cache_kernel`), or with
    ``tokens``, tiles of that many tokens and all their heads (:func:`_rotary_tokens_kernel`:
    a token's cos/sin rows, position and slot are loaded once for its heads)."""

    rows: int = 1  # (token, head) rows per tile; 1 with tokens
    warps: int = 1  # warps per program; rows / warps rows a warp
    tiles: int = 1  # tiles per program, one after another
    tokens: int = 0  # if > 0: tokens per tile, each with all its heads

    def __post_init__(self) -> None:
        for name in ("rows", "warps", "tiles"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"RotaryLaunch: {name}={v} must be a power of two")
        if self.tokens < 0 or self.tokens & (self.tokens - 1):
            raise ValueError(f"RotaryLaunch: tokens={self.tokens} must be 0 or a power of two")
        if self.tokens and self.rows != 1:
            raise ValueError(f"RotaryLaunch: rows={self.rows} with tokens={self.tokens}: "
                             "a token tile holds all heads, leave rows at 1")
        if not self.tokens and self.rows % self.warps:
            raise ValueError(f"RotaryLaunch: rows={self.rows} not a multiple of "
                             f"warps={self.warps}")

    @property
    def one_row(self) -> bool:
        """One (token, head) row a tile: the launch for every row, where the others need
        rows that :func:`_tileable` accepts."""
        return self.rows == 1 and not self.tokens


# Launches by (token, head) rows (lab/rotary_bench.py on an H100, Qwen3-30B-A3B's 32 + 2
# x 4 heads of 128, PDL on; one row a program was 1.35 / 1.55 / 3.87 / 8.75 / 26.7 / 102 us
# at 1 / 8 / 64 / 256 / 1000 / 4096 tokens): one row a program below 1024 rows; 8 warps
# of one row each to 8192 (64 tokens: 2.20 us); then a token a program, its 40 heads over
# 4 warps: 4096 tokens in 38.5 us against 51.8 for tiles of 16 rows over 4 warps, each row
# of which loads its token's cos/sin rows again (same call, PDL off; the 4096 tokens move
# ~84 MB, ~28 us at 3 TB/s; docs/benchmarks.md in git history, "Roofline").
ROTARY_ONE_ROW = RotaryLaunch()
ROTARY_DECODE = RotaryLaunch(rows=8, warps=8)
ROTARY_PREFILL = RotaryLaunch(warps=4, tokens=1)
_ROTARY_TILED_ROWS = 1024
_ROTARY_PREFILL_ROWS = 8192
# The one-row launch without PDL above this many programs: a grid of many one-warp
# programs ran ~2x slower with PDL on an H100 (4096 tokens x 40 heads: 198 vs 102 us;
# 256 tokens: 13.2 vs 8.7 us).
_ROTARY_PDL_ONE_ROW_PROGRAMS = 4096


@triton.jit
def _partner(ptrs, lo, lo_mask, hi_mask, HALF: tl.constexpr):
    """rotate_half's partner of each column j of the rows at ``ptrs``: j + HALF in the first
    half (``lo``), j - HALF after; two contiguous loads, laid out like the rows."""
    return tl.where(lo, tl.load(ptrs + HALF, mask=lo_mask, other=0.0),
                    tl.load(ptrs - HALF, mask=hi_mask, other=0.0))


@triton.jit
def _weight_and_partner(ptrs, mask, lo, hi, HALF: tl.constexpr):
    """A per-head norm weight row at ``ptrs`` (columns past ``mask`` zero) and its rotate_half
    partner columns (:func:`_partner`)."""
    return tl.load(ptrs, mask=mask, other=0.0), _partner(ptrs, lo, lo, hi, HALF)


@triton.jit
def _rotate(x, xp, c, s, lo, NO_CONTRACT: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` elementwise, each product and the sum rounded to
    x's dtype; xp: each column's rotate_half partner (:func:`_partner`)."""
    dtype = x.dtype
    rot = tl.where(lo, -xp, xp)
    a = mul_rounded(x.to(tl.float32), c.to(tl.float32), NO_CONTRACT).to(dtype)
    b = mul_rounded(rot.to(tl.float32), s.to(tl.float32), NO_CONTRACT).to(dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dtype)


@triton.jit
def _rotary_cache_kernel(
        # Pointers
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
        # Shapes and strides
        num_rows, Dh, eps, stride_qkv, stride_cos, stride_sin, stride_qt,
        # Meta-parameters
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
        HAS_NORM: tl.constexpr, NO_CONTRACT: tl.constexpr, BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr):
    """Rows ``r = token * (Hq + 2 Hkv) + head`` (q heads, then k heads, then v heads); a
    program owns TILES tiles of ROWS consecutive rows.

    NOTE: the per-head RMSNorm's sum of squares is part of the bits, and its order is the
    layout's: a row must be reduced as :func:`rms_norm`'s one-warp program reduces a head
    (BLOCK_D / 32 contiguous columns a thread, then across the warp's lanes). Triton lays
    each row of this tile out so when the row fits one warp in accesses of at most 16
    bytes (the wrapper's :func:`_tileable`: aligned tensors, ``BLOCK_D * size <= 512``)
    and the accesses are capped at BLOCK_D / 32 columns (``max_contiguous`` below; without
    it Triton widens them when a warp holds several rows, and splits each row over fewer
    lanes). Narrow rows (BLOCK_D < 64) get no cap and one row a program: a cap of one
    column reorders Triton's layout.
    """
    NUM_HEADS: tl.constexpr = NUM_Q_HEADS + 2 * NUM_KV_HEADS
    dtype = qkv_ptr.dtype.element_ty
    if BLOCK_D >= 64:
        cols = tl.max_contiguous(tl.arange(0, BLOCK_D), BLOCK_D // 32)
    else:
        cols = tl.arange(0, BLOCK_D)
    mask = cols < Dh
    lo = cols < HALF
    hi = mask & (cols >= HALF)
    if HAS_NORM:  # the per-head RMSNorm weights, each column's rotary partner alike
        qw, qwp = _weight_and_partner(qw_ptr + cols, mask, lo, hi, HALF)
        kw, kwp = _weight_and_partner(kw_ptr + cols, mask, lo, hi, HALF)
    for tile in tl.static_range(TILES):
        rows = (tl.program_id(0) * TILES + tile) * ROWS + tl.arange(0, ROWS)  # [R]
        live = rows < num_rows
        tok = (rows // NUM_HEADS).to(tl.int64)
        head = rows % NUM_HEADS
        is_q = head < NUM_Q_HEADS
        is_v = head >= NUM_Q_HEADS + NUM_KV_HEADS
        rope = live & ~is_v  # q and k rows: normed and rotated
        # Weights, tables and the step's positions and slots (pdl's NOTE: not written by
        # the previous kernel) are read before the wait; qkv after it.
        slot = tl.load(slot_ptr + tok, mask=live, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + tok, mask=rope, other=0)
        c = tl.load(cos_ptr + (pos * stride_cos)[:, None] + cols[None, :],
                    mask=rope[:, None] & mask[None, :], other=0.0)
        s = tl.load(sin_ptr + (pos * stride_sin)[:, None] + cols[None, :],
                    mask=rope[:, None] & mask[None, :], other=0.0)
        if tile == 0:
            pdl.wait_then_release(PDL)
        src = (qkv_ptr + tok * stride_qkv + head * Dh)[:, None] + cols[None, :]  # [R, BLOCK_D]
        x = tl.load(src, mask=live[:, None] & mask[None, :], other=0.0)
        raw = x  # a v row is copied as loaded
        xp = _partner(src, lo[None, :], rope[:, None] & lo[None, :], rope[:, None] & hi[None, :],
                      HALF)
        if HAS_NORM:  # the per-head RMSNorm of rms_norm, its partner column alike
            w = tl.where(is_q[:, None], qw[None, :], kw[None, :])
            wp = tl.where(is_q[:, None], qwp[None, :], kwp[None, :])
            h = x.to(tl.float32)
            rstd = rms_rstd_rows(h, Dh, eps)
            x = rms_apply(h, rstd, w, dtype)
            xp = rms_apply(xp.to(tl.float32), rstd, wp, dtype)
        y = _rotate(x, xp, c, s, lo[None, :], NO_CONTRACT)
        q_dst = (q_ptr + tok * stride_qt + head * Dh)[:, None] + cols[None, :]
        tl.store(q_dst, y, mask=(live & is_q)[:, None] & mask[None, :])
        # negative slots: padding tokens, nothing written
        cache = (slot * (NUM_KV_HEADS * Dh) + (head - NUM_Q_HEADS) * Dh)[:, None] + cols[None, :]
        kv_row = live & (slot >= 0)
        tl.store(kc_ptr + cache, y.to(kc_ptr.dtype.element_ty),
                 mask=(kv_row & rope & ~is_q)[:, None] & mask[None, :])
        tl.store(vc_ptr + cache - NUM_KV_HEADS * Dh, raw.to(vc_ptr.dtype.element_ty),
                 mask=(kv_row & is_v)[:, None] & mask[None, :])


@triton.jit
def _norm_heads(x, xp, w, wp, Dh, eps):
    """The per-head RMSNorm of a tile ``x`` `[heads, tokens, BLOCK_D]` and of its partner
    columns ``xp`` alike: each (head, token) row reduced by :func:`rms_rstd_rows` on the
    tile seen as `[heads * tokens, BLOCK_D]` (a view: the rows keep their layout)."""
    HEADS: tl.constexpr = x.shape[0]
    TOKENS: tl.constexpr = x.shape[1]
    BLOCK_D: tl.constexpr = x.shape[2]
    h = x.to(tl.float32)
    rstd = rms_rstd_rows(tl.reshape(h, [HEADS * TOKENS, BLOCK_D]), Dh, eps)  # [H * T, 1]
    rstd = tl.reshape(rstd, [HEADS, TOKENS, 1])
    return rms_apply(h, rstd, w, x.dtype), rms_apply(xp.to(tl.float32), rstd, wp, x.dtype)


@triton.jit
def _rotary_tokens_kernel(
        # Pointers
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
        # Shapes and strides
        num_tokens, Dh, eps, stride_qkv, stride_cos, stride_sin, stride_qt,
        # Meta-parameters
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
        KV_PAD: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
        NO_CONTRACT: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
        TILES: tl.constexpr, PDL: tl.constexpr):
    """:func:`_rotary_cache_kernel`'s arithmetic over tiles of TOKENS consecutive tokens
    and all their heads, TILES tiles a program: q heads as `[Q_PAD, TOKENS, BLOCK_D]`, k
    and v heads as `[KV_PAD, TOKENS, BLOCK_D]` (heads past Hq / Hkv masked), each token's
    cos/sin rows `[1, TOKENS, BLOCK_D]`, position and slot loaded once and broadcast over
    its heads. Every load of a tile comes before its first store (no compiler hoists a load
    above a store that may alias it), so a tile's reads are all in flight at once.

    NOTE: each (head, token) row is laid out as in :func:`_rotary_cache_kernel`'s NOTE
    (one warp's lanes, BLOCK_D / 32 contiguous columns a thread) on the same conditions,
    plus one: every tile holds at least a row a warp (``Q_PAD * TOKENS`` and ``KV_PAD *
    TOKENS >= num_warps``; the wrapper pads the heads so). Triton narrows the accesses of
    a tile with fewer elements than BLOCK_D / 32 a thread, and splits its rows over warps.
    """
    cols = tl.max_contiguous(tl.arange(0, BLOCK_D), BLOCK_D // 32)[None, None, :]
    mask = cols < Dh  # [1, 1, BLOCK_D]
    lo = cols < HALF
    hi = mask & (cols >= HALF)
    q_heads = tl.arange(0, Q_PAD)[:, None, None]  # [Q_PAD, 1, 1]
    kv_heads = tl.arange(0, KV_PAD)[:, None, None]  # [KV_PAD, 1, 1]
    if HAS_NORM:  # the per-head RMSNorm weights, each column's rotary partner alike
        qw, qwp = _weight_and_partner(qw_ptr + cols, mask, lo, hi, HALF)
        kw, kwp = _weight_and_partner(kw_ptr + cols, mask, lo, hi, HALF)
    for tile in tl.static_range(TILES):
        first = (tl.program_id(0) * TILES + tile) * TOKENS
        tok = first + tl.arange(0, TOKENS)[None, :, None]  # [1, T, 1]
        live = tok < num_tokens
        tok = tok.to(tl.int64)
        # Weights, tables and the step's positions and slots (pdl's NOTE: not written by
        # the previous kernel) are read before the wait; qkv after it.
        slot = tl.load(slot_ptr + tok, mask=live, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + tok, mask=live, other=0)
        c = tl.load(cos_ptr + pos * stride_cos + cols, mask=live & mask, other=0.0)  # [1, T, D]
        s = tl.load(sin_ptr + pos * stride_sin + cols, mask=live & mask, other=0.0)
        if tile == 0:
            pdl.wait_then_release(PDL)
        row = qkv_ptr + tok * stride_qkv + cols  # [1, T, BLOCK_D]: the token's first head
        q_live = live & (q_heads < NUM_Q_HEADS)  # [Q_PAD, T, 1]
        kv_live = live & (kv_heads < NUM_KV_HEADS)  # [KV_PAD, T, 1]
        q_src = row + q_heads * Dh  # [Q_PAD, T, BLOCK_D]
        k_src = row + (NUM_Q_HEADS + kv_heads) * Dh  # [KV_PAD, T, BLOCK_D]
        xq = tl.load(q_src, mask=q_live & mask, other=0.0)
        xqp = _partner(q_src, lo, q_live & lo, q_live & hi, HALF)
        xk = tl.load(k_src, mask=kv_live & mask, other=0.0)
        xkp = _partner(k_src, lo, kv_live & lo, kv_live & hi, HALF)
        v = tl.load(k_src + NUM_KV_HEADS * Dh, mask=kv_live & mask, other=0.0)
        if HAS_NORM:
            xq, xqp = _norm_heads(xq, xqp, qw, qwp, Dh, eps)
            xk, xkp = _norm_heads(xk, xkp, kw, kwp, Dh, eps)
        q_dst = q_ptr + tok * stride_qt + q_heads * Dh + cols
        tl.store(q_dst, _rotate(xq, xqp, c, s, lo, NO_CONTRACT), mask=q_live & mask)
        # negative slots: padding tokens, nothing written
        cache = (slot * NUM_KV_HEADS + kv_heads) * Dh + cols  # [KV_PAD, T, BLOCK_D]
        kv_row = kv_live & (slot >= 0) & mask
        k = _rotate(xk, xkp, c, s, lo, NO_CONTRACT)
        tl.store(kc_ptr + cache, k.to(kc_ptr.dtype.element_ty), mask=kv_row)
        tl.store(vc_ptr + cache, v.to(vc_ptr.dtype.element_ty), mask=kv_row)


def rotary_launch(num_rows: int, tileable: bool) -> RotaryLaunch:
    """The launch of a rotary_and_cache call over ``num_rows`` (token, head) rows, from
    host-known shapes only: one row a program for few rows or where not ``tileable``
    (:func:`_tileable`), else :data:`ROTARY_DECODE` or, from ``_ROTARY_PREFILL_ROWS``,
    :data:`ROTARY_PREFILL`."""
    if not tileable or num_rows < _ROTARY_TILED_ROWS:
        return ROTARY_ONE_ROW
    return ROTARY_PREFILL if num_rows >= _ROTARY_PREFILL_ROWS else ROTARY_DECODE


def _tileable(block_d: int, tensors: tuple[torch.Tensor, ...], ints: tuple[int, ...]) -> bool:
    """Whether a launch of several rows a program lays each row out as one row a program
    does (:func:`_rotary_cache_kernel`'s NOTE): rows of 64 columns or more that fit one
    warp's lanes in accesses of at most 16 bytes, which Triton can use (it sizes accesses
    from what it knows when it compiles: 16-byte aligned tensors, integers divisible by
    16)."""
    return (64 <= block_d and block_d * tensors[0].element_size() <= 32 * 16
            and all(t.data_ptr() % 16 == 0 for t in tensors) and all(i % 16 == 0 for i in ints))


def rotary_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     num_q_heads: int, *, launch: RotaryLaunch | None = None) -> torch.Tensor:
    """See ``megaserve.kernels.api.rotary_and_cache``: programs over tiles of (token, head)
    rows or of tokens with all their heads, each row laid out as :func:`rms_norm`'s one-warp
    program lays out a head; no host synchronisation. ``launch`` (default
    :func:`rotary_launch`) never changes the bits; one that could (other than one row a
    tile where :func:`_tileable` is false) raises ``ValueError``."""
    t = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim % 2 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"rotary_and_cache: qkv {tuple(qkv.shape)} does not hold "
                         f"{num_q_heads} + 2 x {num_kv_heads} heads of an even dim {head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rotary_and_cache: caches must be contiguous")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rotary_and_cache: pass both q_norm and k_norm, or neither")
    block_d = triton.next_power_of_2(head_dim)
    if norm_warps(block_d) != 1:  # the kernel's NOTE: rms_norm reduces a head in one warp
        raise ValueError(f"rotary_and_cache: head dim {head_dim} > 512 is not supported")
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    q = torch.empty(t, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    num_rows = t * (num_q_heads + 2 * num_kv_heads)
    tileable = _tileable(block_d, (qkv, q, cos, sin, k_cache, v_cache),
                         (head_dim, qkv.stride(0), cos.stride(0), sin.stride(0)))
    launch = launch or rotary_launch(num_rows, tileable)
    if not (launch.one_row or tileable):
        raise ValueError(f"rotary_and_cache: {launch} could reorder a row's norm here "
                         f"(head dim {head_dim}, {qkv.dtype}, alignment): use ROTARY_ONE_ROW")
    if not t:
        return q
    norm_w = (q_norm, k_norm) if q_norm is not None else (qkv, qkv)
    args = (qkv, positions, cos, sin, *norm_w, q, k_cache, v_cache, slot_mapping)
    # the kernels' shapes and strides after their row / token count
    dims = (head_dim, float(eps), qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0))
    meta = dict(NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
                HAS_NORM=q_norm is not None, NO_CONTRACT=no_contract(), BLOCK_D=block_d,
                TILES=launch.tiles, num_warps=launch.warps)
    if launch.tokens:
        min_heads = max(1, launch.warps // launch.tokens)  # the kernel's NOTE: a row a warp
        _rotary_tokens_kernel[(triton.cdiv(t, launch.tokens * launch.tiles),)](
            *args, t, *dims, **meta, TOKENS=launch.tokens,
            Q_PAD=max(triton.next_power_of_2(num_q_heads), min_heads),
            KV_PAD=max(triton.next_power_of_2(num_kv_heads), min_heads),
            **pdl.launch_args(q.device))
        return q
    programs = triton.cdiv(num_rows, launch.rows * launch.tiles)
    with_pdl = not launch.one_row or programs <= _ROTARY_PDL_ONE_ROW_PROGRAMS
    _rotary_cache_kernel[(programs,)](
        *args, num_rows, *dims, **meta, ROWS=launch.rows,
        **(pdl.launch_args(q.device) if with_pdl else {"PDL": False}))
    return q


_DECODE_TILE_ENV = "MEGASERVE_ATTN_DECODE_TILE"


def decode_tile(text: str, source: str = "decode tile") -> dict:
    """:data:`DECODE_SERIAL_TILE` with its warps, stages and register cap replaced by
    ``text``, "WARPS,STAGES" or "WARPS,STAGES,MAXNREG" (none changes a bit); ``source``
    names where ``text`` came from in the error."""
    v = [int(t) for t in text.split(",")]
    if len(v) not in (2, 3):
        raise ValueError(f"{source} {text!r}: expected WARPS,STAGES[,MAXNREG]")
    return dict(DECODE_SERIAL_TILE, num_warps=v[0], num_stages=v[1],
                maxnreg=v[2] if len(v) == 3 else 0)


def decode_serial_tile() -> dict:
    """:data:`DECODE_SERIAL_TILE`, or :func:`decode_tile` of ``$MEGASERVE_ATTN_DECODE_TILE``
    (tuning runs, lab/device/ab_decode.sh)."""
    text = os.environ.get(_DECODE_TILE_ENV)
    return decode_tile(text, f"${_DECODE_TILE_ENV}") if text else DECODE_SERIAL_TILE


def choose_launch(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int,
                  max_splits: int, ws_bytes: int, head_dim: int = 128) -> AttentionLaunch:
    """The launch for a call, from host-known shapes only (no sync): small tiles for
    decode-like batches (at most two new tokens per sequence), large ones otherwise; chunk
    mode when the serial grid would leave most SMs idle (decode: fewer than two programs
    an SM; prefill: fewer than one) and a sequence can span several chunks, while the
    fp32 chunk states (``ws_bytes``) stay small; else serial (a long context read by few
    serial programs leaves SMs idle, which chunks fill; docs/benchmarks.md in git history).
    Serial prefill with ``head_dim`` <= 128 gets the deeper :data:`PREFILL_SERIAL_TILE`."""
    decode_like = num_tokens <= 2 * num_seqs
    tile = DECODE_TILE if decode_like else PREFILL_TILE
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, tile["rows"] // g_pad)  # (every decode tile has the same rows)
    programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    few = _SERIAL_MIN_PROGRAMS if decode_like else _SERIAL_MIN_PROGRAMS // 2
    if max_splits > CHUNK_SPLITS and programs < few and ws_bytes <= _MAX_WS_BYTES:
        fold_programs = (num_tokens + num_seqs) * num_kv_heads
        fold = (dict(fold_block_d=16, fold_warps=1)
                if decode_like and fold_programs < _FOLD_CHUNK_BELOW else {})
        return AttentionLaunch("chunk", **dict(tile, **fold))
    if decode_like:
        return AttentionLaunch("serial", **decode_serial_tile())
    deep = triton.next_power_of_2(head_dim) <= _DEEP_PREFILL_MAX_D
    return AttentionLaunch("serial", **(PREFILL_SERIAL_TILE if deep else tile))


def gluon_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  g_pad: int) -> bool:
    """Whether a serial prefill call can run attention_gluon's kernel: a Hopper GPU (its
    wgmma), bf16, head_dim 128, a query group that tiles the kernel's 64-row warp groups,
    caches its TMA loads can read (attention_gluon.tma_boxes), and ``$MEGASERVE_ATTN_GLUON``
    not "0" (A/B runs)."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            and q.shape[2] == 128 and g_pad <= attention_gluon.BLOCK_M // 2
            and attention_gluon.tma_boxes(k_cache, v_cache, KV_SPLIT_SIZE)
            and torch.cuda.get_device_capability(q.device)[0] == 9
            and os.environ.get("MEGASERVE_ATTN_GLUON", "1") != "0")


def exp2_default() -> bool:
    """The arithmetic :func:`paged_attention` uses when ``exp2`` is not given: the EXP2
    form (~1.3x faster on prefill than ``exp`` on an H200), or the ``exp`` form with
    ``MEGASERVE_ATTN_EXP2=0``."""
    return os.environ.get("MEGASERVE_ATTN_EXP2", "1") != "0"


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fp32 chunk-mode scratch: uninitialised, or NaN under ``POISON_BUFFERS``."""
    if POISON_BUFFERS:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    mode: str | None = None, launch: AttentionLaunch | None = None,
                    exp2: bool | None = None, parts_only: bool = False,
                    one_token_per_seq: bool = False) -> torch.Tensor:
    """See ``megaserve.kernels.api.paged_attention``; no host synchronisation (graph-capturable).

    q `[T, Hq, Dh]`; caches `[blocks, block_size, Hkv, Dh]` (unit last stride);
    block_tables `[S, max_blocks]` int32; context_lens `[S]`; query_start_loc `[S+1]`.
    ``launch`` (default: :func:`choose_launch`) sets the tile, the mode ('serial': one
    program walks a tile's chunks; 'chunk': a program per chunk, then an ordered fold) and
    the grid; ``mode`` overrides the launch's. No launch choice changes the bits (same
    arithmetic, same merge order; checked by the GPU tests and lab/attn_sweep.py).
    ``exp2`` picks the arithmetic (None: :func:`exp2_default`): True is the EXP2 form
    (attention_kernels docstring), False the ``exp`` one (other bits); ``parts_only``
    (chunk mode) skips the fold, so the sweep can time the two kernels apart (the output
    is then unwritten). ``one_token_per_seq``: the caller's promise that query_start_loc
    is 0, 1, ..., S (decode); the kernels then take tile s as sequence s and read no
    query_start_loc (two dependent loads fewer on a decode step's chain; the same bits;
    ``$MEGASERVE_ATTN_DECODE=0`` ignores it).
    """
    exp2 = exp2_default() if exp2 is None else exp2
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
    out = torch.full_like(q, float("nan")) if POISON_BUFFERS else torch.empty_like(q)
    if t == 0:
        return out
    # Upper bound on any sequence's splits, from shapes only (no host sync).
    max_splits = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], KV_SPLIT_SIZE)
    max_chunks = triton.cdiv(max_splits, CHUNK_SPLITS)
    ws_bytes = max_chunks * t * num_q_heads * (head_dim + 2) * 4
    if launch is None:
        launch = choose_launch(t, num_seqs, num_kv_heads, group, max_splits, ws_bytes,
                               head_dim)
    if mode is not None:
        launch = dataclasses.replace(launch, mode=mode)
    block_q = max(1, launch.rows // g_pad)
    decode = one_token_per_seq and os.environ.get("MEGASERVE_ATTN_DECODE", "1") != "0"
    if decode and t != num_seqs:
        raise ValueError(f"paged_attention: one_token_per_seq with {t} tokens and "
                         f"{num_seqs} sequences")
    grid = (num_seqs if decode else t // block_q + num_seqs, num_kv_heads)
    block_d = max(16, triton.next_power_of_2(head_dim))
    common = dict(GROUP=group, G_PAD=g_pad, SPLIT=KV_SPLIT_SIZE, HEAD_DIM=head_dim,
                  CHUNK=CHUNK_SPLITS, BLOCK_D=block_d, EXP2=exp2, DECODE=decode)
    # EXP2 (attention_kernels docstring): scores in log2 units, log2(e) folded into scale.
    scale = float(scale) * _LOG2E if exp2 else float(scale)
    seq_args = (context_lens, query_start_loc)
    if launch.mode == "serial":
        ws_m = ws_l = ws_o = out  # no parts (the kernel's PARTS is off)
    else:
        ws_m = _workspace((max_chunks, t, num_q_heads), q.device)
        ws_l = _workspace((max_chunks, t, num_q_heads), q.device)
        ws_o = _workspace((max_chunks, t, num_q_heads, head_dim), q.device)
    if (launch.mode == "serial" and launch.gluon and not decode and exp2
            and gluon_applies(q, k_cache, v_cache, g_pad)):
        attention_gluon.launch(q, k_cache, v_cache, block_tables, context_lens,
                               query_start_loc, out, scale, KV_SPLIT_SIZE, CHUNK_SPLITS,
                               launch.l_cols)
        return out
    paged_attention_kernel[grid + ((max_chunks if launch.mode == "chunk" else 1),)](
        q, k_cache, v_cache, block_tables, *seq_args, out, ws_m, ws_l, ws_o,
        num_seqs, t, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        block_tables.shape[1] * k_cache.shape[1], NUM_Q_HEADS=num_q_heads, BLOCK_Q=block_q,
        BLOCK_SIZE=k_cache.shape[1], MASK_TAIL=launch.mask_tail, PREFETCH=launch.prefetch,
        LONG_FIRST=launch.long_first, PARTS=launch.mode == "chunk", L_COLS=launch.l_cols,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **common,
        **pdl.launch_args(q.device), **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}))
    if launch.mode == "chunk" and not parts_only:
        fold_q = launch.fold_tokens
        fold_d = min(launch.fold_block_d or block_d, block_d)
        common["BLOCK_D"] = fold_d
        fold_tiles = num_seqs if decode else t // fold_q + num_seqs
        attention_fold_kernel[(fold_tiles, num_kv_heads, block_d // fold_d)](
            *seq_args, ws_m, ws_l, ws_o, out, num_seqs, t, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, BLOCK_Q=fold_q,
            UNROLL=min(launch.fold_unroll, triton.next_power_of_2(max_chunks)),
            num_warps=launch.fold_warps, **common, **pdl.launch_args(q.device))
    return out
