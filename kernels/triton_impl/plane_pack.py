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
* :func:`combine_into`: ``kernels.combine``'s sum (the same kernel, so the same bits)
  written straight into a given float32 buffer, e.g. the replica's inbox on another GPU.

Nothing here reduces across rows or columns except :func:`combine_into`, whose reduction
is ``kernels.combine``'s (a token's k products in ascending rank order): every output
element is a function of its own inputs only, whatever T, P or the launch.
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
