"""Serial-mode paged attention for prefill on Hopper, in Gluon (Triton's explicit dialect):
the arithmetic of :mod:`megaserve.kernels.triton_impl.attention` (its NOTE, the EXP2 form),
step for step, with the tensor-core dots kept in flight across the softmax.

Why a second kernel: Triton 3.6 waits for every Hopper dot right after issuing it unless
the dot's result is the next iteration's accumulator, so in the Triton kernel no softmax
overlaps an MMA (ncu: tensor pipe 36% busy on a 4,096-token prompt;
docs/benchmarks.md in git history).

One program owns a (tile of BLOCK_Q tokens, KV head), as the Triton serial kernel, in
three warp groups (``gl.warp_specialize``):

* a load group fetches each split's K and V rows through the block table into a ring of
  STAGES shared-memory slots (mbarriers: ``ready`` when a slot's copies have landed,
  ``free`` when both compute groups are done with it): by TMA where all the split's keys
  lie inside the context, else by a masked cp.async gather (zeros past the context);
* two compute groups take 64 rows of the tile each, Q in registers (the A operand of
  the score dots). Iteration j of a compute group, with p(j), alpha(j) and l(j) (a column
  of p(j) @ 1) from the iteration before:

      o <- o * alpha(j);  issue S(j+1) = Q K(j+1)^T, then p(j) @ V(j)   (async wgmma)
      wait for S(j+1);  softmax of S(j+1) -> p(j+1), alpha(j+1)   (p(j) @ V(j) runs)
      issue p(j+1) @ 1;  wait for both;  l <- fma(l, alpha(j), l(j));  free the slot of j

Nothing is in flight at a loop edge, and the register operands of the dots stay live
until their wait: otherwise ptxas serialises every wgmma of the kernel. The p(j+1) @ 1
dot issued before the wait keeps the softmax ahead of it: ptxas sinks code whose results
are used only after a ``wgmma.wait_group`` below that wait (here: the whole softmax), which
leaves no dot running during it.

The dots are the same k16 chains as ``tl.dot``'s, the elementwise steps are the same
operations in the same order, and chunks of CHUNK splits are merged with the same merge,
so the output is bitwise the Triton kernel's (the GPU tests compare them). It is a launch
choice: the Triton kernel stays the reference and runs everything this one does not cover
(decode, chunk mode, other head sizes and dtypes, other GPUs; attention.gluon_applies).
"""

from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                              mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .attention_kernels import find_seq  # scalar index math: the Triton kernel's own
from .matmul import tma_readable


@triton.constexpr_function
def rows_layout(head_dim, warps):
    """Rows of ``head_dim`` bf16 over ``warps`` warps, 16 bytes a thread: the layout of
    the Q and K/V gathers."""
    return gl.BlockedLayout(size_per_thread=[1, 8],
                            threads_per_warp=[32 * 8 // head_dim, head_dim // 8],
                            warps_per_cta=[warps, 1], order=[1, 0])


@gluon.jit
def _box_rows(bt, split, SPLIT: gl.constexpr, BLOCK_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr):
    """The cache rows where a split's TMA boxes start (BOX_ROWS keys each, inside a block)."""
    rows = ()
    for j in gl.static_range(SPLIT // BOX_ROWS):
        key = split * SPLIT + j * BOX_ROWS
        rows = rows + (gl.load(bt + key // BLOCK_SIZE) * BLOCK_SIZE + key % BLOCK_SIZE,)
    return rows


@gluon.jit
def _producer(k_bufs, v_bufs, ready, free, kc_ptr, vc_ptr, k_desc, v_desc, bt, ctx_len,
              bt_keys, kv_head, stride_kb, stride_ks, stride_kh, n_splits,
              STAGES: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr,
              HEAD_DIM: gl.constexpr, WARPS: gl.constexpr):
    """The load partition: the K and V rows of splits 0..n_splits (the consumers compute
    one split's scores ahead) into slot ``split % STAGES``, once both consumers are done
    with the slot's previous split (``free``). A split whose keys all lie inside the
    context comes by TMA, a box of BOX_ROWS keys x HEAD_DIM at a time (the descriptors view
    a cache as `[blocks * BLOCK_SIZE, kv heads * HEAD_DIM]`); the others by a cp.async
    gather, zeros past the context.

    ``ready`` completes a phase after WARPS * 32 arrivals and the split's bytes: a cp.async
    split's come from every load thread once its copies have landed; a TMA split's from one
    thread, ``expect`` (one arrival; the byte count raised first, so the phase waits for
    the copies' bytes) and an arrival of the other WARPS * 32 - 1."""
    LOAD: gl.constexpr = rows_layout(HEAD_DIM, WARPS)
    BOX_ROWS: gl.constexpr = k_desc.block_type.shape[0]
    SPLIT_BYTES: gl.constexpr = 2 * (SPLIT // BOX_ROWS) * k_desc.block_type.nbytes  # K and V
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    col = kv_head * HEAD_DIM
    for split in range(0, n_splits + 1):
        slot = split % STAGES
        if split < ctx_len // SPLIT:
            rows = _box_rows(bt, split, SPLIT, BLOCK_SIZE, BOX_ROWS)  # (before the wait)
            # (a fresh barrier's phase "before 0" counts as complete: the first STAGES pass)
            mbarrier.wait(free.index(slot), ((split // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), SPLIT_BYTES)
            mbarrier.arrive(ready.index(slot), count=WARPS * 32 - 1)
            for j in gl.static_range(SPLIT // BOX_ROWS):
                tma.async_copy_global_to_shared(
                    k_desc, [rows[j], col], ready.index(slot),
                    k_bufs.index(slot).slice(j * BOX_ROWS, BOX_ROWS))
                tma.async_copy_global_to_shared(
                    v_desc, [rows[j], col], ready.index(slot),
                    v_bufs.index(slot).slice(j * BOX_ROWS, BOX_ROWS))
        else:
            keys = split * SPLIT + gl.arange(0, SPLIT, layout=gl.SliceLayout(1, LOAD))
            ids = gl.load(bt + keys // BLOCK_SIZE, mask=keys < bt_keys, other=0).to(gl.int64)
            base = ids * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            offs = gl.expand_dims(base, 1) + gl.expand_dims(d, 0)
            live = gl.expand_dims(keys < ctx_len, 1) & gl.expand_dims(d < HEAD_DIM, 0)
            mbarrier.wait(free.index(slot), ((split // STAGES) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(k_bufs.index(slot), kc_ptr + offs, mask=live)
            async_copy.async_copy_global_to_shared(v_bufs.index(slot), vc_ptr + offs, mask=live)
            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)


@gluon.jit
def _merge(m, l, o, m_s, l_s, o_s, O_ROWS: gl.constexpr):
    """attention_kernels._merge (EXP2): fold chunk state s into the running state."""
    m_new = gl.maximum(m, m_s)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_ref)
    beta = gl.exp2(m_s - m_ref)
    o = gl.fma(o, gl.expand_dims(gl.convert_layout(alpha, O_ROWS), 1),
               o_s * gl.expand_dims(gl.convert_layout(beta, O_ROWS), 1))
    l = gl.fma(l, alpha, l_s * beta)
    return m_new, l, o


@gluon.jit
def _halves_max(x, PAIRED: gl.constexpr):
    """Elementwise max of the two halves of ``x``'s columns: [R, C] -> [R, C / 2]. PAIRED:
    halves of each adjacent pair (c, c + 1), else the first and the second half."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    if PAIRED:
        a, b = gl.split(gl.reshape(x, [R, C // 2, 2]))
    else:
        a, b = gl.split(gl.permute(gl.reshape(x, [R, 2, C // 2]), [0, 2, 1]))
    return gl.maximum(a, b)


@gluon.jit
def _row_max(x):
    """``gl.max(x, axis=1)`` of a 64-column wgmma accumulator, as a tree: a thread holds
    columns c + 8j + {0, 1} (j < 8) of its rows, which ``gl.max`` folds in one dependent
    chain of 15 maxima; here the thread's 16 fold in four levels, then its 4 lanes. The
    same value (a maximum does not depend on the order; maxNum: NaN only if all are NaN)."""
    x = _halves_max(x, False)  # c and c + 32 (the same thread's)
    x = _halves_max(x, False)  # + 16
    x = _halves_max(x, False)  # + 8
    x = _halves_max(x, True)  # c and c + 1
    return gl.max(x, axis=1)  # the row's 4 lanes


@gluon.jit
def _first(a, b):
    """A reduction that keeps its first operand: every column of ``p @ 1`` holds the same
    bits (each is computed from the same operands), so each thread keeps one of its own
    (``gl.max`` over them, the Triton kernel's form, gives the same value through shuffles)."""
    return a


@gluon.jit
def _softmax(raw, m, pos, first_key, masked, scale, SPLIT: gl.constexpr, S_L: gl.constexpr):
    """One split's scores against the running max ``m`` (attention_kernels._split_step, EXP2):
    (p in bf16, alpha, the new max). ``masked``: the split crosses the tile's positions."""
    if masked:
        keys = first_key + gl.arange(0, SPLIT, layout=gl.SliceLayout(0, S_L))
        raw = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1), raw, float("-inf"))
    m_s = gl.where(pos >= 0, gl.convert_layout(_row_max(raw), gl.SliceLayout(1, S_L)) * scale,
                   float("-inf"))
    m_new = gl.maximum(m, m_s)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(gl.fma(raw, scale, -gl.expand_dims(m_ref, 1))).to(gl.bfloat16)
    return p, gl.exp2(m - m_ref), m_new


@gluon.jit
def _row_sum(p, ones, l_zero, L_L: gl.constexpr, S_ROWS: gl.constexpr):
    """One column of ``p @ 1`` (every column is the row's sum; :func:`_first`): l of one
    split."""
    l_dot = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(0, L_L, 2)), ones,
                          l_zero, use_acc=False, is_async=True)
    l_dot = warpgroup_mma_wait(num_outstanding=0, deps=(l_dot,))
    return gl.convert_layout(gl.reduce(l_dot, 1, _first), S_ROWS)


@gluon.jit
def _scores(q_reg, k_bufs, ready, split, s_zero, STAGES: gl.constexpr):
    """Issue split's ``Q K^T`` once its K has landed (async: the caller waits)."""
    slot = split % STAGES
    mbarrier.wait(ready.index(slot), (split // STAGES) & 1)
    fence_async_shared()
    return warpgroup_mma(q_reg, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _consumer(q_half, k_bufs, v_bufs, ones, ready, free, out_ptr, row0, ctx_len, q_len,
              tile_start, q_begin, kv_head, n_splits, whole, scale, stride_ot, stride_oh,
              GROUP: gl.constexpr, G_PAD: gl.constexpr, SPLIT: gl.constexpr,
              CHUNK: gl.constexpr, HEAD_DIM: gl.constexpr, L_COLS: gl.constexpr,
              STAGES: gl.constexpr, ROWS: gl.constexpr):
    """A compute partition (one warp group): rows ``row0 + [0, ROWS)`` of the tile, all its
    splits and chunks (module docstring), then their output. Nothing is in flight across a
    loop edge (ptxas serialises every wgmma of a kernel whose in-flight accumulator is
    copied at a loop edge)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, SPLIT, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HEAD_DIM, 16])
    L_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, L_COLS, 16])
    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_L)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_L)
    # Each row's position (dead rows too, as the Triton kernel's; they are not stored).
    rows = row0 + gl.arange(0, ROWS, layout=S_ROWS)
    pos = ctx_len - q_len + tile_start + rows // G_PAD
    s_zero = gl.zeros([ROWS, SPLIT], gl.float32, S_L)
    l_zero = gl.zeros([ROWS, L_COLS], gl.float32, L_L)
    empty_m = gl.full([ROWS], float("-inf"), gl.float32, S_ROWS)
    q_reg = q_half.load(gl.DotOperandLayout(0, S_L, 2))

    # Split 0's softmax and row sum (a chunk starts from the empty state).
    s0, q_reg = warpgroup_mma_wait(
        num_outstanding=0, deps=(_scores(q_reg, k_bufs, ready, 0, s_zero, STAGES), q_reg))
    p_cur, alpha_cur, m_run = _softmax(s0, empty_m, pos, 0, 0 >= whole, scale, SPLIT, S_L)
    l_cur = _row_sum(p_cur, ones, l_zero, L_L, S_ROWS)
    m = empty_m  # the row's state
    l = gl.zeros([ROWS], gl.float32, S_ROWS)
    o = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_L)
    m_chunk = empty_m
    for chunk in range(0, gl.cdiv(n_splits, CHUNK)):
        c0 = chunk * CHUNK
        c1 = gl.minimum(c0 + CHUNK, n_splits)
        l_c = gl.zeros([ROWS], gl.float32, S_ROWS)  # the chunk's sum and accumulator
        o_c = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_L)
        for split in range(c0, c1):
            # During split + 1's softmax (against the next chunk's empty state where split
            # + 1 starts it), split's p @ V runs.
            o_c = o_c * gl.expand_dims(gl.convert_layout(alpha_cur, O_ROWS), 1)
            s_nxt = _scores(q_reg, k_bufs, ready, split + 1, s_zero, STAGES)
            p_o = gl.convert_layout(p_cur, gl.DotOperandLayout(0, O_L, 2))
            o_c = warpgroup_mma(p_o, v_bufs.index(split % STAGES), o_c, is_async=True)
            s_nxt, q_reg = warpgroup_mma_wait(num_outstanding=1, deps=(s_nxt, q_reg))
            m_chunk = m_run
            m_in = gl.where(split + 1 == c1, empty_m, m_run)
            p_nxt, alpha_nxt, m_run = _softmax(s_nxt, m_in, pos, (split + 1) * SPLIT,
                                               split + 1 >= whole, scale, SPLIT, S_L)
            l_dot = warpgroup_mma(gl.convert_layout(p_nxt, gl.DotOperandLayout(0, L_L, 2)),
                                  ones, l_zero, use_acc=False, is_async=True)
            # (p(j) stays live until its dot is done: ptxas would serialise every wgmma if
            # the softmax could take its registers)
            o_c, l_dot, p_o = warpgroup_mma_wait(num_outstanding=0, deps=(o_c, l_dot, p_o))
            mbarrier.arrive(free.index(split % STAGES))  # split's K/V are done with
            l_c = gl.fma(l_c, alpha_cur, l_cur)
            l_cur = gl.convert_layout(gl.reduce(l_dot, 1, _first), S_ROWS)
            p_cur = p_nxt
            alpha_cur = alpha_nxt
        m, l, o = _merge(m, l, o, m_chunk, l_c, o_c, O_ROWS)

    out = o / gl.expand_dims(gl.convert_layout(l, O_ROWS), 1)
    rows_o = row0 + gl.arange(0, ROWS, layout=O_ROWS)
    tok_o = tile_start + rows_o // G_PAD
    ok_o = (tok_o < q_len) & (rows_o % G_PAD < GROUP)
    o_offs = ((q_begin + tok_o).to(gl.int64) * stride_ot
              + (kv_head * GROUP + rows_o % G_PAD) * stride_oh)
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    gl.store(out_ptr + gl.expand_dims(o_offs, 1) + gl.expand_dims(d_o, 0),
             out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(ok_o, 1))


@gluon.jit
def prefill_attention_kernel(q_ptr, kc_ptr, vc_ptr, k_desc, v_desc, bt_ptr, ctx_ptr, qsl_ptr,
                             out_ptr, num_seqs, scale, stride_qt, stride_qh, stride_ot,
                             stride_oh, stride_kb, stride_ks, stride_kh, stride_bt, bt_keys,
                             GROUP: gl.constexpr, G_PAD: gl.constexpr, BLOCK_Q: gl.constexpr,
                             BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr,
                             CHUNK: gl.constexpr, HEAD_DIM: gl.constexpr,
                             L_COLS: gl.constexpr, STAGES: gl.constexpr,
                             LOAD_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One (tile of BLOCK_Q tokens, KV head) program, serial mode (module docstring); tiles
    numbered from the last (long causal rows first), as the Triton launch's LONG_FIRST.
    Partitions: this program's warps (a warp group) and a second warp group compute the
    two halves of the tile's rows; LOAD_WARPS more fetch K/V (``k_desc`` / ``v_desc``: TMA
    descriptors of the caches as `[blocks * BLOCK_SIZE, kv heads * HEAD_DIM]`, a box a
    cache block's part of a split)."""
    BLOCK_M: gl.constexpr = BLOCK_Q * G_PAD
    HALF: gl.constexpr = BLOCK_M // 2
    LOAD: gl.constexpr = rows_layout(HEAD_DIM, num_warps)
    kv_head = gl.program_id(1)
    pid = gl.num_programs(0) - 1 - gl.program_id(0)
    seq = find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_begin = gl.load(qsl_ptr + seq)
    q_len = gl.load(qsl_ptr + seq + 1) - q_begin
    tile_start = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start < q_len:
        ctx_len = gl.load(ctx_ptr + seq)
        bt = bt_ptr + seq.to(gl.int64) * stride_bt
        first_pos = ctx_len - q_len + tile_start
        last_pos = ctx_len - q_len + gl.minimum(tile_start + BLOCK_Q, q_len) - 1
        n_splits = last_pos // SPLIT + 1
        whole = (first_pos + 1) // SPLIT  # splits below this: every row sees them whole

        # The tile's queries -> shared memory, as two halves (the A operands of the score
        # dots of the two compute partitions).
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM],
                                                                     gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF, HEAD_DIM], q_layout)
        d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
        for h in gl.static_range(2):
            rows_ld = h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, LOAD))
            tok_ld = tile_start + rows_ld // G_PAD
            ok_ld = (tok_ld < q_len) & (rows_ld % G_PAD < GROUP)
            q_offs = ((q_begin + tok_ld).to(gl.int64) * stride_qt
                      + (kv_head * GROUP + rows_ld % G_PAD) * stride_qh)
            q_smem.index(h).store(gl.load(q_ptr + gl.expand_dims(q_offs, 1)
                                          + gl.expand_dims(d_ld, 0),
                                          mask=gl.expand_dims(ok_ld, 1), other=0.0))
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SPLIT, HEAD_DIM],
                                                                      gl.bfloat16)
        k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, SPLIT, HEAD_DIM], kv_layout)
        v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, SPLIT, HEAD_DIM], kv_layout)
        ones = gl.allocate_shared_memory(
            gl.bfloat16, [SPLIT, L_COLS],
            gl.NVMMASharedLayout.get_default_for([SPLIT, L_COLS], gl.bfloat16),
            gl.full([SPLIT, L_COLS], 1.0, gl.bfloat16, LOAD))
        # ready[i]: slot i's copies landed (LOAD_WARPS * 32 arrivals: _producer);
        # free[i]: both compute partitions are done with slot i's split.
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=LOAD_WARPS * 32)
            mbarrier.init(free.index(i), count=2)
        fence_async_shared()
        gl.thread_barrier()

        gl.warp_specialize([
            (_consumer, (q_smem.index(0), k_bufs, v_bufs, ones, ready, free, out_ptr, 0,
                         ctx_len, q_len, tile_start, q_begin, kv_head, n_splits, whole, scale,
                         stride_ot, stride_oh, GROUP, G_PAD, SPLIT, CHUNK, HEAD_DIM, L_COLS,
                         STAGES, HALF)),
            (_consumer, (q_smem.index(1), k_bufs, v_bufs, ones, ready, free, out_ptr, HALF,
                         ctx_len, q_len, tile_start, q_begin, kv_head, n_splits, whole, scale,
                         stride_ot, stride_oh, GROUP, G_PAD, SPLIT, CHUNK, HEAD_DIM, L_COLS,
                         STAGES, HALF)),
            (_producer, (k_bufs, v_bufs, ready, free, kc_ptr, vc_ptr, k_desc, v_desc, bt,
                         ctx_len, bt_keys, kv_head, stride_kb, stride_ks, stride_kh, n_splits,
                         STAGES, BLOCK_SIZE, SPLIT, HEAD_DIM, LOAD_WARPS)),
        ], [4, LOAD_WARPS], [CONSUMER_REGS, LOAD_REGS])


# Launch constants: 16 tokens x 8 heads a tile, two compute warp groups of 64 rows and one
# load warp group; four K/V slots (in iteration j: split j, its p @ V in flight; j + 1, its
# scores in flight; j + 2 and j + 3, loading; 3 or 5 slots ran slower). Registers: 12 warps x
# 168 = 2 x 4 x 240 + 4 x 24 (setmaxnreg): with most splits by TMA the load group needs few
# (its cp.async splits spill), and the compute groups' spills drop from 72 to 24 stores
# (0.5-2% faster than 232 + 40 on an H100; docs/benchmarks.md in git history, "Roofline").
BLOCK_M = 128
STAGES = 4
LOAD_WARPS = 4
CONSUMER_REGS = 240
LOAD_REGS = 24
MAXNREG = 168
# (A box of 128 columns spans two 128-byte swizzle widths: Triton 3.6 issues it as two
# 64-column copies, the second into the slot's second column half, the layout the wgmma
# reads; the GPU test compares the bits with the Triton kernel's.)


def box_rows(block_size: int, split: int) -> int:
    """Keys a TMA box: the most that divide both a split and a cache block."""
    return math.gcd(block_size, split)


def tma_boxes(k_cache, v_cache, split: int) -> bool:
    """Whether the load partition can fetch ``split``-key splits of these caches by TMA:
    both contiguous and TMA-readable, and boxes of ``box_rows`` keys (inside one cache
    block) whole 8-row swizzle atoms of the slots."""
    return (box_rows(k_cache.shape[1], split) % 8 == 0
            and all(c.is_contiguous() and tma_readable(c) for c in (k_cache, v_cache)))


def launch(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, scale_log2,
           split: int, chunk: int, l_cols: int) -> None:
    """Run :func:`prefill_attention_kernel` over all of ``q``'s tokens into ``out`` (shapes as
    attention.paged_attention's, caches as :func:`tma_boxes` takes them); ``scale_log2``:
    the scale with log2(e) folded in."""
    t, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    box = [box_rows(k_cache.shape[1], split), head_dim]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    k_desc, v_desc = (TensorDescriptor.from_tensor(c.view(-1, num_kv_heads * head_dim), box,
                                                   layout) for c in (k_cache, v_cache))
    group = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = BLOCK_M // g_pad
    num_seqs = context_lens.shape[0]
    grid = (t // block_q + num_seqs, num_kv_heads)
    prefill_attention_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, block_tables, context_lens, query_start_loc, out,
        num_seqs, scale_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        block_tables.shape[1] * k_cache.shape[1], GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q,
        BLOCK_SIZE=k_cache.shape[1], SPLIT=split, CHUNK=chunk, HEAD_DIM=head_dim,
        L_COLS=l_cols, STAGES=STAGES, LOAD_WARPS=LOAD_WARPS, CONSUMER_REGS=CONSUMER_REGS,
        LOAD_REGS=LOAD_REGS, num_warps=4, maxnreg=MAXNREG)
