"""Triton kernels of the batch-invariant linear (see ``matmul.py``'s NOTE for the contract).

Every kernel here computes, per output element, the same chain of k16 tensor-core steps
inside each split of ``SPLIT_LEN`` along K and the same ascending fold of the fp32 split
parts: ``total = ((part_0 + part_1) + part_2) + ...``, then ``+ bias``, then the cast.
They differ only in tile shapes, operand roles and where the parts live.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl


@triton.jit
def _split_part(a_desc, b_desc, off_m, off_n, k_lo, k_hi,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 `[BLOCK_M, BLOCK_N]` = A[off_m:, k_lo:k_hi] @ B[off_n:, k_lo:k_hi].T."""
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_lo, k_hi, BLOCK_K):
        a = a_desc.load([off_m, kk])
        b = b_desc.load([off_n, kk])
        part = tl.dot(a, b.T, part)
    return part


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order of output tiles; only placement, never arithmetic."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _store_out(total, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        total = total + bias[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
             total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def linear_fold_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm,
                       SPLIT_LEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLAT: tl.constexpr,
                       PDL: tl.constexpr):
    """Fold mode: one program per output tile walks all of K."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    off_m, off_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if FLAT == 0:
        # One pipelined loop per split (the pipeline drains at every split boundary).
        total = _split_part(a_desc, b_desc, off_m, off_n, 0, SPLIT_LEN,
                            BLOCK_M, BLOCK_N, BLOCK_K)
        for k_lo in range(SPLIT_LEN, K, SPLIT_LEN):
            part = _split_part(a_desc, b_desc, off_m, off_n, k_lo, k_lo + SPLIT_LEN,
                               BLOCK_M, BLOCK_N, BLOCK_K)
            total = total + part
    else:
        # One flat pipelined loop; the part restarts at each split and is folded at its
        # end. Same arithmetic as above: total = part_0, then total + part_s.
        STEPS: tl.constexpr = SPLIT_LEN // BLOCK_K
        num_steps = tl.cdiv(K, BLOCK_K)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, num_steps):
            a = a_desc.load([off_m, step * BLOCK_K])
            b = b_desc.load([off_n, step * BLOCK_K])
            if FLAT == 1:
                part = tl.dot(a, b.T, tl.where(step % STEPS == 0, 0.0, part))
            else:
                part = tl.dot(a, b.T, part)
            if (step % STEPS == STEPS - 1) | (step == num_steps - 1):
                total = tl.where(step < STEPS, part, total + part)
                if FLAT == 2:
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    _store_out(total, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def linear_persist_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm,
                          SPLIT_LEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, num_progs,
                          FLATTEN: tl.constexpr, PDL: tl.constexpr):
    """Fold mode (flat loop, as FLAT == 2 above) on a persistent grid: program p takes
    tiles p, p + num_progs, ... (the next tile's loads can overlap this one's epilogue)."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    STEPS: tl.constexpr = SPLIT_LEN // BLOCK_K
    num_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, num_progs, flatten=FLATTEN):
        off_m, off_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, num_steps):
            a = a_desc.load([off_m, step * BLOCK_K])
            b = b_desc.load([off_n, step * BLOCK_K])
            part = tl.dot(a, b.T, part)
            if (step % STEPS == STEPS - 1) | (step == num_steps - 1):
                total = tl.where(step < STEPS, part, total + part)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        _store_out(total, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, HAS_BIAS,
                   BLOCK_M, BLOCK_N)


@triton.jit
def linear_split_kernel(a_desc, b_desc, c_ptr, bias_ptr, ws_ptr, count_ptr, M, N, K, stride_cm,
                        NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
                        HAS_BIAS: tl.constexpr, FOLD_LAST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """Split mode: one program per (tile, split) stores its fp32 part in ws `[S, M, N]`.
    FOLD_LAST: the last program of a tile (atomic counter) folds the parts; otherwise
    :func:`fold_parts_kernel` does, in a second launch."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    tile = tl.program_id(0)
    split = tl.program_id(1)
    off_m, off_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = split * SPLIT_LEN
    part = _split_part(a_desc, b_desc, off_m, off_n, k_lo, k_lo + SPLIT_LEN,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    tl.store(ws_ptr + split * M * N + offs, part, mask=mask)
    if FOLD_LAST:
        # Every thread's stores precede the counter bump (barrier, then a gpu-scope release).
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, NUM_SPLITS):
                total = total + tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0,
                                        cache_modifier=".cg")
            _store_out(total, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, HAS_BIAS,
                       BLOCK_M, BLOCK_N)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


@triton.jit
def linear_swap_kernel(w_desc, x_desc, c_ptr, bias_ptr, ws_ptr, count_ptr, M, N, K, stride_cm,
                       NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                       FOLD_LAST: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Split mode with the operands swapped, for M <= BLOCK_T (decode): the weight tile
    `[BLOCK_F, BLOCK_K]` is the MMA's A operand and the few token rows its B operand, so
    no MMA rows are wasted on padding. Parts go to ws `[S, N, M]` (feature-major, so the
    MMA layout's neighbouring token columns are neighbouring addresses)."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    tile = tl.program_id(0)
    split = tl.program_id(1)
    off_n = tile * BLOCK_F
    k_lo = split * SPLIT_LEN
    part = tl.zeros((BLOCK_F, BLOCK_T), dtype=tl.float32)
    for kk in range(k_lo, tl.minimum(k_lo + SPLIT_LEN, K), BLOCK_K):
        w = w_desc.load([off_n, kk])
        x = x_desc.load([0, kk])
        part = tl.dot(w, x.T, part)  # [BLOCK_F, BLOCK_T] fp32
    feats = off_n + tl.arange(0, BLOCK_F)
    toks = tl.arange(0, BLOCK_T)
    mask = (feats[:, None] < N) & (toks[None, :] < M)
    if NUM_SPLITS == 1:
        # The fold of one part is that part: store it directly (ws is unused).
        _store_swapped(part, c_ptr, bias_ptr, feats, toks, mask, N, stride_cm, HAS_BIAS)
    else:
        offs = feats[:, None] * M + toks[None, :]
        tl.store(ws_ptr + split * M * N + offs, part, mask=mask)
        if FOLD_LAST:
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == NUM_SPLITS - 1:
                # Unrolled, so every part's load can be in flight before the ascending adds.
                total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, NUM_SPLITS):
                    total = total + tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0,
                                            cache_modifier=".cg")
                _store_swapped(total, c_ptr, bias_ptr, feats, toks, mask, N, stride_cm,
                               HAS_BIAS)
                tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


@triton.jit
def _store_swapped(total, c_ptr, bias_ptr, feats, toks, mask, N, stride_cm,
                   HAS_BIAS: tl.constexpr):
    """total `[BLOCK_F, BLOCK_T]` fp32 (+ bias per feature) cast into c `[M, N]`."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + feats, mask=feats < N, other=0.0).to(tl.float32)
        total = total + bias[:, None]
    tl.store(c_ptr + toks[None, :] * stride_cm + feats[:, None],
             total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fold_parts_kernel(ws_ptr, c_ptr, bias_ptr, numel, inner, stride_outer, stride_inner,
                      NUM_SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BIAS_INNER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Fold of stored parts, fully parallel: ws `[S, outer, inner]` fp32, element
    e = (i, j) goes to ``c[i * stride_outer + j * stride_inner]``; the bias index is j
    (``BIAS_INNER``) or i. Same ascending adds as the in-kernel folds."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, NUM_SPLITS):
        total = total + tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    i = offs // inner
    j = offs % inner
    if HAS_BIAS:
        if BIAS_INNER:
            total = total + tl.load(bias_ptr + j, mask=mask, other=0.0).to(tl.float32)
        else:
            total = total + tl.load(bias_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + i * stride_outer + j * stride_inner, total.to(c_ptr.dtype.element_ty),
             mask=mask)
