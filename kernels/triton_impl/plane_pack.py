"""The device data plane's exchange kernels: each replaces a chain of small operations of
one tick by one launch (``megaserve.runtime.device_plane``: pack, the expert side's
preparation, the pre-reduced combine).

Shape legend: T = tokens of a micro-batch, D = hidden, k = experts per token, P = replicas
of a tick, c = rows a tick uses, S = slot rows (c <= S), n = local experts.

* :func:`pack_rows`: the one-worker dispatch. x's rows, the top-k ids (as int32), the
  routing weights (optional) and the count T go into an inbox slot, which may be another
  GPU's memory (an IPC mapping): one grid instead of four copies and a fill.
* :func:`local_ids`: the expert side's routed-row ids. Row (p, t, r) of a tick is the local
  index of expert ``ids[p, t, r]`` where t < ``counts[p]``, else the sentinel n (never
  computed): a mask, a lookup and a cast in one program.
* :func:`route_rows`: the dispatch to one of several workers. The rows of the tokens
  with at least one rank that worker owns go to its slot in token order (a prefix count of
  such tokens), their ids with -1 where another worker owns the rank, and the count: one
  grid instead of a cumsum, two index copies and half a dozen elementwise launches.
* :func:`copy_routed`: the expert side's return of a tick's `[c, k, D]` outputs: only the
  (row, rank) entries the worker computed (local id not the sentinel), which are the ones
  the replica reads; the others are not written (half the bytes with two workers).
* :func:`gather_routed`: the replica's side of that return: each (token, rank)'s row from
  its owner's slot, `[T, k, D]` in rank order, in one launch (was a gather of the
  positions, index arithmetic and an indexed copy).
* :func:`combine_into`: ``kernels.combine``'s sum (the same kernel, so the same bits)
  written straight into a given float32 buffer, e.g. the replica's inbox on another GPU.

Nothing here reduces across rows or columns except :func:`combine_into`, whose reduction
is ``kernels.combine``'s (a token's k products in ascending rank order), and route_rows'
prefix count, an exact integer sum: every output element is a function of its own inputs
only, whatever T, P or the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rowwise

_PACK_BLOCK_D = 1024  # columns a program copies per iteration
_IDS_BLOCK = 1024  # routed rows local_ids handles per iteration


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, w_ptr, rows_ptr, slot_ids_ptr, slot_w_ptr, count_ptr,
                 T, D, stride_x, stride_ids, stride_w, stride_rows, stride_sids, stride_sw,
                 TOP_K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # one token a program
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = cols < D
        row = tl.load(x_ptr + t * stride_x + cols, mask=mask)
        tl.store(rows_ptr + t * stride_rows + cols, row, mask=mask)
    ranks = tl.arange(0, KP)
    rmask = ranks < TOP_K
    ids = tl.load(ids_ptr + t * stride_ids + ranks, mask=rmask)
    tl.store(slot_ids_ptr + t * stride_sids + ranks, ids.to(tl.int32), mask=rmask)
    if HAS_W:
        w = tl.load(w_ptr + t * stride_w + ranks, mask=rmask)
        tl.store(slot_w_ptr + t * stride_sw + ranks, w, mask=rmask)
    if t == 0:  # (T may arrive as a constexpr 1: no tensor methods on it)
        tl.store(count_ptr + tl.arange(0, 1), tl.zeros((1,), tl.int32) + T)


def pack_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
              rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None,
              count: torch.Tensor) -> None:
    """Write every token of a micro-batch into a one-worker inbox slot.

    x: `[T, D]`; topk_ids: `[T, k]` int64 (or int32); topk_weights: `[T, k]` float32 or
    None; rows: `[S, D]` x.dtype with S >= T; ids: `[S, k]` int32; weights: `[S, k]`
    float32 (ignored when topk_weights is None); count: `[1]` int32. Rows t < T of rows,
    ids (and weights) become token t's, count becomes T; nothing else is written. Every
    tensor may live in another GPU's memory mapped here (the stores go over the link).
    Raises ``ValueError`` for shapes or dtypes that do not fit.
    """
    t, d = x.shape
    k = topk_ids.shape[1]
    if (topk_ids.shape[0] != t or rows.shape[0] < t or rows.shape[1] != d
            or ids.shape[0] < t or ids.shape[1] != k or count.numel() != 1):
        raise ValueError(f"pack_rows: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} do "
                         f"not fit rows {tuple(rows.shape)}, ids {tuple(ids.shape)}, count "
                         f"{tuple(count.shape)}")
    if rows.dtype != x.dtype or ids.dtype != torch.int32 or count.dtype != torch.int32:
        raise ValueError(f"pack_rows: rows must be {x.dtype}, ids and count int32; got "
                         f"{rows.dtype}, {ids.dtype}, {count.dtype}")
    has_w = topk_weights is not None
    if has_w and (weights is None or weights.dtype != torch.float32
                  or topk_weights.shape != topk_ids.shape or weights.shape[0] < t
                  or weights.shape[1] != k):
        raise ValueError("pack_rows: topk_weights `[T, k]` needs a float32 weights `[S, k]`")
    for name, tensor in (("x", x), ("rows", rows), ("topk_ids", topk_ids), ("ids", ids)):
        if tensor.stride(1) != 1:
            raise ValueError(f"pack_rows: {name} must have unit column stride")
    if has_w and (topk_weights.stride(1) != 1 or weights.stride(1) != 1):
        raise ValueError("pack_rows: weights must have unit column stride")
    if t == 0:
        count.fill_(0)
        return
    w_src = topk_weights if has_w else topk_ids  # unused when not HAS_W
    w_dst = weights if has_w else ids
    _pack_kernel[(t,)](
        x, topk_ids, w_src, rows, ids, w_dst, count, t, d, x.stride(0), topk_ids.stride(0),
        w_src.stride(0), rows.stride(0), ids.stride(0), w_dst.stride(0),
        TOP_K=k, KP=triton.next_power_of_2(k), HAS_W=has_w,
        BLOCK_D=min(_PACK_BLOCK_D, triton.next_power_of_2(d)), num_warps=4)


@triton.jit
def _route_kernel(x_ptr, ids_ptr, owner_ptr, rows_ptr, slot_ids_ptr, count_ptr, pos_ptr,
                  T, D, WORKER, stride_x, stride_ids, stride_rows, stride_sids,
                  TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    first = pid * BLOCK_T  # this program's tokens: [first, first + BLOCK_T)
    ranks = tl.arange(0, KP)
    rmask = ranks < TOP_K
    # the tokens before this block that WORKER needs: its rows' first slot row
    base = tl.sum(tl.zeros((BLOCK_T,), tl.int32), axis=0)
    for start in range(0, first, BLOCK_T):
        toks = start + tl.arange(0, BLOCK_T)
        m = (toks < T)[:, None] & rmask[None, :]
        ids = tl.load(ids_ptr + toks[:, None].to(tl.int64) * stride_ids + ranks[None, :],
                      mask=m, other=0)
        own = tl.load(owner_ptr + ids, mask=m, other=-1)
        base += tl.sum(tl.max((own == WORKER).to(tl.int32), axis=1), axis=0)
    toks = first + tl.arange(0, BLOCK_T)
    ok = toks < T
    m = ok[:, None] & rmask[None, :]
    ids = tl.load(ids_ptr + toks[:, None].to(tl.int64) * stride_ids + ranks[None, :], mask=m,
                  other=0)
    own = tl.load(owner_ptr + ids, mask=m, other=-1)
    mine = m & (own == WORKER)
    need = tl.max(mine.to(tl.int32), axis=1)  # [BLOCK_T]
    pos = base + tl.cumsum(need, axis=0) - 1  # the torch path's need.cumsum(0) - 1
    tl.store(pos_ptr + toks, pos.to(tl.int64), mask=ok)
    has = ok & (need > 0)
    dest = pos.to(tl.int64)
    tl.store(slot_ids_ptr + dest[:, None] * stride_sids + ranks[None, :],
             tl.where(mine, ids, -1).to(tl.int32), mask=has[:, None] & rmask[None, :])
    src = toks.to(tl.int64)
    for dstart in range(0, D, BLOCK_D):
        cols = dstart + tl.arange(0, BLOCK_D)
        cm = has[:, None] & (cols < D)[None, :]
        row = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=cm)
        tl.store(rows_ptr + dest[:, None] * stride_rows + cols[None, :], row, mask=cm)
    if pid == tl.num_programs(0) - 1:
        total = base + tl.sum(need, axis=0)
        tl.store(count_ptr + tl.arange(0, 1), tl.zeros((1,), tl.int32) + total)


_ROUTE_BLOCK_T = 16  # tokens a program routes
_ROUTE_BLOCK_D = 512


def route_rows(x: torch.Tensor, topk_ids: torch.Tensor, owner: torch.Tensor, worker: int,
               rows: torch.Tensor, ids: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Write the tokens that expert worker ``worker`` serves into its inbox slot.

    x: `[T, D]`; topk_ids: `[T, k]` int64; owner: `[N]` int64, the worker of each global
    expert; rows: `[S, D]` x.dtype; ids: `[S, k]` int32; count: `[1]` int32. With need(t)
    = some rank of token t is owned by ``worker`` and pos = need's inclusive prefix sum - 1
    (`[T]` int64, returned): for every needed t, rows[pos[t]] = x[t] and ids[pos[t]] = its
    ids, -1 where another worker owns the rank; count = the needed tokens. Nothing else is
    written (the torch path's dump row neither). rows, ids and count may be another GPU's
    memory mapped here. Raises ``ValueError`` for shapes or dtypes that do not fit.
    """
    t, d = x.shape
    k = topk_ids.shape[1]
    if (topk_ids.shape[0] != t or rows.shape[0] < t or rows.shape[1] != d
            or ids.shape[0] < t or ids.shape[1] != k or count.numel() != 1
            or owner.dim() != 1):
        raise ValueError(f"route_rows: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"owner {tuple(owner.shape)} do not fit rows {tuple(rows.shape)}, "
                         f"ids {tuple(ids.shape)}, count {tuple(count.shape)}")
    if (rows.dtype != x.dtype or ids.dtype != torch.int32 or count.dtype != torch.int32
            or topk_ids.dtype != torch.int64 or owner.dtype != torch.int64):
        raise ValueError(f"route_rows: rows must be {x.dtype}, ids and count int32, topk_ids "
                         f"and owner int64; got {rows.dtype}, {ids.dtype}, {count.dtype}, "
                         f"{topk_ids.dtype}, {owner.dtype}")
    for name, tensor in (("x", x), ("rows", rows), ("topk_ids", topk_ids), ("ids", ids)):
        if tensor.stride(1) != 1:
            raise ValueError(f"route_rows: {name} must have unit column stride")
    pos = torch.empty(t, dtype=torch.int64, device=x.device)
    if t == 0:
        count.fill_(0)
        return pos
    _route_kernel[(triton.cdiv(t, _ROUTE_BLOCK_T),)](
        x, topk_ids, owner.contiguous(), rows, ids, count, pos, t, d, worker, x.stride(0),
        topk_ids.stride(0), rows.stride(0), ids.stride(0), TOP_K=k,
        KP=triton.next_power_of_2(k), BLOCK_T=_ROUTE_BLOCK_T,
        BLOCK_D=min(_ROUTE_BLOCK_D, triton.next_power_of_2(d)), num_warps=4)
    return pos


@triton.jit
def _copy_routed_kernel(src_ptr, local_ptr, dst_ptr, N, D, SENTINEL, stride_src,
                        stride_dst, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    entries = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (row, rank) entries
    ok = entries < N
    local = tl.load(local_ptr + entries, mask=ok, other=SENTINEL)
    live = (ok & (local != SENTINEL))[:, None]
    flat = entries.to(tl.int64)[:, None]
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        cm = live & (cols < D)[None, :]
        v = tl.load(src_ptr + flat * stride_src + cols[None, :], mask=cm)
        tl.store(dst_ptr + flat * stride_dst + cols[None, :], v, mask=cm)


_COPY_BLOCK_N = 4  # (row, rank) entries a program copies


def copy_routed(src: torch.Tensor, local: torch.Tensor, sentinel: int,
                dst: torch.Tensor) -> None:
    """``dst[t, r] = src[t, r]`` for the entries whose local expert ``local[t * k + r]`` is
    not ``sentinel`` (the ones the expert worker computed); the others are not written.

    src, dst: `[c, k, D]` of one dtype, each row-major over its (row, rank) entries with
    unit last stride (dst may be another GPU's memory mapped here); local: `[c * k]` int64.
    Raises ``ValueError`` for shapes or dtypes that do not fit.
    """
    c, k, d = src.shape
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_routed: dst {dst.dtype} {tuple(dst.shape)} must match src "
                         f"{src.dtype} {tuple(src.shape)}")
    if local.shape != (c * k,) or local.dtype != torch.int64:
        raise ValueError(f"copy_routed: local must be int64 `[{c * k}]`")
    for name, tensor in (("src", src), ("dst", dst)):
        if tensor.stride(2) != 1 or tensor.stride(0) != k * tensor.stride(1):
            raise ValueError(f"copy_routed: {name} must be row-major over (row, rank) "
                             "with unit last stride")
    if c * k == 0:
        return
    _copy_routed_kernel[(triton.cdiv(c * k, _COPY_BLOCK_N),)](
        src, local.contiguous(), dst, c * k, d, sentinel, src.stride(1), dst.stride(1),
        BLOCK_N=_COPY_BLOCK_N, BLOCK_D=min(1024, triton.next_power_of_2(d)), num_warps=4)


@triton.jit
def _gather_routed_kernel(out_ptr, owners_ptr, pos_ptr, dst_ptr, N, D, TOP_K, stride_pe,
                          stride_we, stride_wr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    entries = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (token, rank), row-major
    ok = entries < N
    token = entries // TOP_K
    rank = entries % TOP_K
    owner = tl.load(owners_ptr + entries, mask=ok, other=0).to(tl.int64)
    row = tl.load(pos_ptr + owner * stride_pe + token, mask=ok, other=0).to(tl.int64)
    src = owner * stride_we + row * stride_wr + rank.to(tl.int64) * D  # out[owner, row, rank]
    flat = entries.to(tl.int64)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        cm = ok[:, None] & (cols < D)[None, :]
        v = tl.load(out_ptr + src[:, None] + cols[None, :], mask=cm)
        tl.store(dst_ptr + flat[:, None] * D + cols[None, :], v, mask=cm)


def gather_routed(out: torch.Tensor, owners: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """``result[t, r] = out[owners[t, r], positions[owners[t, r], t], r]``: each (token,
    rank)'s expert row from the slot of the worker that computed it.

    out: `[E, C, k, D]` (one micro-batch of the replica's inbox; (row, rank, column)
    contiguous within a worker); owners: `[T, k]` int64; positions: `[E, T]` int64, each
    token's row in each worker's slot. Returns a new `[T, k, D]` tensor of out's dtype.
    Raises ``ValueError`` for shapes or dtypes that do not fit.
    """
    e, c, k, d = out.shape
    t = owners.shape[0]
    if owners.shape != (t, k) or positions.dim() != 2 or positions.shape[0] != e \
            or positions.shape[1] < t:
        raise ValueError(f"gather_routed: out {tuple(out.shape)}, owners {tuple(owners.shape)}"
                         f" and positions {tuple(positions.shape)} do not fit")
    if owners.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError("gather_routed: owners and positions must be int64")
    if out.stride(3) != 1 or out.stride(2) != d or out.stride(1) != k * d \
            or positions.stride(1) != 1:
        raise ValueError("gather_routed: out must be contiguous within a worker's slot and "
                         "positions have unit column stride")
    result = torch.empty(t, k, d, dtype=out.dtype, device=out.device)
    if t * k == 0:
        return result
    _gather_routed_kernel[(triton.cdiv(t * k, _COPY_BLOCK_N),)](
        out, owners.contiguous(), positions, result, t * k, d, k, positions.stride(0),
        out.stride(0), out.stride(1), BLOCK_N=_COPY_BLOCK_N,
        BLOCK_D=min(1024, triton.next_power_of_2(d)), num_warps=4)
    return result


@triton.jit
def _local_ids_kernel(ids_ptr, counts_ptr, replica_ptr, lookup_ptr, out_ptr, flag_ptr, P, C,
                      stride_ir, stride_it, stride_cr, stride_fr, SENTINEL,
                      TOP_K: tl.constexpr, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    # one program: a tick's routed rows are few (c * k per replica), and the only program
    # that waits may clear the flags it waited on
    if WAIT:
        for j in range(0, P):
            flag = flag_ptr + tl.load(replica_ptr + j).to(tl.int64) * stride_fr
            # acquire, system scope: the rows a peer GPU wrote before raising the flag
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen < 1:  # SET, or ABORT (stream_flags' toggle)
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            tl.atomic_xchg(flag, 0, sem="relaxed", scope="sys")  # CLEAR
    n = P * C * TOP_K
    for start in range(0, n, BLOCK):
        flat = start + tl.arange(0, BLOCK)  # (p, t, r) in row-major order
        ok = flat < n
        rank = flat % TOP_K
        t = (flat // TOP_K) % C
        p = flat // (TOP_K * C)
        replica = tl.load(replica_ptr + p, mask=ok, other=0).to(tl.int64)
        count = tl.load(counts_ptr + replica * stride_cr, mask=ok, other=0)
        valid = ok & (t < count)
        expert = tl.load(ids_ptr + replica * stride_ir + t * stride_it + rank, mask=valid,
                         other=-1).to(tl.int64)
        # -1 (routed elsewhere, or a row past the count) reads the sentinel entry
        local = tl.load(lookup_ptr + tl.where(expert < 0, SENTINEL, expert), mask=ok,
                        other=0)
        tl.store(out_ptr + flat, local, mask=ok)


def local_ids(ids: torch.Tensor, counts: torch.Tensor, replicas: torch.Tensor,
              lookup: torch.Tensor, rows: int,
              flags: torch.Tensor | None = None) -> torch.Tensor:
    """The local expert index of each routed row of a tick, masked by the counts.

    ids: `[R, S, k]` int32 (one micro-batch's slots of every replica; -1: routed to
    another worker); counts: `[R]` int32; replicas: `[P]` int64, the replicas of the tick;
    lookup: `[E + 1]` int64, global expert id → local index, its last entry the sentinel n;
    rows: c <= S. Returns `[P * c * k]` int64, row (p, t, r) = ``lookup[ids[replicas[p], t,
    r]]`` where t < counts[replicas[p]] and that id is >= 0, else ``lookup[E]``.

    flags: `[R]` int32 or None. Where given, the kernel first waits until each replica's
    flag of the tick holds SET or more (``megaserve.comm.stream_flags``' toggle, whose
    producer is another GPU or process), then clears it, instead of a stream wait and a
    stream write before the launch. HAZARD: as with a stream wait, the flag must come
    (the producer's side bounds that wait, ``Releaser``); the program spins on one SM.
    Raises ``ValueError`` for shapes or dtypes that do not fit.
    """
    r, s, k = ids.shape
    if ids.dtype != torch.int32 or counts.dtype != torch.int32 or lookup.dtype != torch.int64:
        raise ValueError(f"local_ids: ids and counts must be int32, lookup int64; got "
                         f"{ids.dtype}, {counts.dtype}, {lookup.dtype}")
    if ids.stride(2) != 1 or counts.shape != (r,) or not 0 <= rows <= s:
        raise ValueError(f"local_ids: ids {tuple(ids.shape)} (unit last stride), counts "
                         f"{tuple(counts.shape)}, rows {rows}")
    if replicas.dim() != 1 or replicas.dtype != torch.int64:
        raise ValueError("local_ids: replicas must be a 1-D int64 tensor")
    if flags is not None and (flags.dtype != torch.int32 or flags.shape != (r,)):
        raise ValueError(f"local_ids: flags must be int32 `[{r}]`")
    lookup = lookup.contiguous()
    out = torch.empty(replicas.shape[0] * rows * k, dtype=torch.int64, device=ids.device)
    if out.numel() or flags is not None:
        _local_ids_kernel[(1,)](
            ids, counts, replicas, lookup, out, counts if flags is None else flags,
            replicas.shape[0], rows, ids.stride(0), ids.stride(1), counts.stride(0),
            0 if flags is None else flags.stride(0), lookup.shape[0] - 1, TOP_K=k,
            BLOCK=_IDS_BLOCK, WAIT=flags is not None, num_warps=4)
    return out


def combine_into(expert_out: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor) -> None:
    """``out = kernels.combine(expert_out, topk_weights)`` with no intermediate (the same
    kernel and launch, so the same bits), after checking that ``out`` fits.

    expert_out: `[T, k, D]` (unit last stride); topk_weights: `[T, k]` float32; out:
    `[T, D]` float32, contiguous (may be another GPU's memory mapped here).
    Raises ``ValueError`` for shapes or dtypes that do not fit.
    """
    t, k, d = expert_out.shape
    if out.shape != (t, d) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"combine_into: out must be a contiguous float32 `[{t}, {d}]`, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if topk_weights.shape != (t, k) or topk_weights.dtype != torch.float32:
        raise ValueError(f"combine_into: topk_weights must be float32 `[{t}, {k}]`")
    if expert_out.stride(2) != 1:
        raise ValueError("combine_into: expert_out must have unit last stride")
    rowwise.combine(expert_out, topk_weights, out=out)
