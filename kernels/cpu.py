"""CPU implementation of the kernel API (torch only), batch-invariant bitwise.

Three techniques make every result independent of the batch:

* **Fixed-shape GEMM tiles.** ``torch.mm`` on CPU picks its blocking (and with it the
  reduction order) from M: measured here, row 0 of a product changed for 16 of 19 batch
  sizes. Every product runs as one ``torch.mm`` per `[ROW_TILE, K] @ [K, N]` tile (the last
  one zero-padded), so each row takes the same code path whatever M is and whatever row of
  the tile it lands in. Row sums (RMSNorm, log-softmax) are such products with a ones
  column. Batched ``torch.bmm`` is used only where every call has at least two items of one
  fixed shape (attention): a single item runs as a plain GEMM, another code path.
* **Attention items.** Each (query token, key split of KV_SPLIT_SIZE keys) is one fixed-shape
  ``bmm`` item; keys past a token's position get probability exactly 0 and sums over keys
  and splits are zero-padded trees, so a token's bits depend only on its query and the keys
  it sees (see :func:`paged_attention`).
* **Tree reductions from elementwise ops** where a sum is short (softmax over experts, key
  splits): a pairwise halving tree over the length padded to a power of two. Elementwise ops
  are exact per element, and padding with zeros leaves the value unchanged (``x + 0 == x``).

Tiles are independent, so :func:`set_num_lanes` spreads them over threads without changing
a bit. Tests: tests/kernels/test_cpu_kernels.py, tests/kernels/test_cpu_batched_kernels.py.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F

from megaserve.kernels.api import KV_SPLIT_SIZE
from megaserve.kernels.filters import filter_row

ROW_TILE = 16
# Rows per expert GEMM tile (a fixed shape, like ROW_TILE). Measured on the issue-14
# workload (CPU time per token, same run): 16 at least as fast as 32 or 64, and a lone
# request pads fewer rows.
EXPERT_ROW_TILE = 16
# (Query token, key split) items per batched attention call: bounds the temporaries
# (`[items, Hq, KV_SPLIT_SIZE * Hkv]` float32 scores and probabilities).
ATTN_CHUNK_ITEMS = 1024
_M32 = 0xFFFFFFFF

# Threads the tiles of one kernel call are spread over (set_num_lanes). Every tile is one
# single-threaded torch call whichever thread runs it, so this never changes a result.
_lanes = 1
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (owning pid, pool): not inherited by fork


def set_num_lanes(num_lanes: int) -> None:
    """Spread the GEMM tiles, expert tiles and attention chunks of each call over
    ``num_lanes`` threads (this one and ``num_lanes - 1`` helpers). Call with torch's
    intra-op threads at 1: each lane runs single-threaded torch ops. Raises ``ValueError``
    for ``num_lanes < 1``."""
    global _lanes
    if isinstance(num_lanes, bool) or not isinstance(num_lanes, int) or num_lanes < 1:
        raise ValueError(f"num_lanes must be a positive integer, got {num_lanes!r}")
    _lanes = num_lanes


def _single_threaded() -> None:
    torch.set_num_threads(1)  # a new thread starts with the process default


def _run_lanes(tasks: list[Callable[[], None]]) -> None:
    """Run ``tasks`` (at most ``_lanes``): the first on this thread, the others on helper
    threads; returns when all are done and re-raises the first error."""
    global _pool
    if len(tasks) == 1:
        tasks[0]()
        return
    if _pool is None or _pool[0] != os.getpid() or _pool[1]._max_workers < len(tasks) - 1:
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=max(1, _lanes - 1),
                                                 thread_name_prefix="kernels-cpu",
                                                 initializer=_single_threaded))
    futures = [_pool[1].submit(task) for task in tasks[1:]]
    tasks[0]()
    for future in futures:
        future.result()


def _split(count: int, parts: int) -> list[range]:
    """``range(count)`` cut into at most ``parts`` contiguous, nearly equal ranges."""
    parts = max(1, min(parts, count))
    bounds = [count * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by pairwise halving; the order depends only on ``x.shape[dim]``."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return x.sum(dim)
    width = 1 << (n - 1).bit_length()
    if width != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x.squeeze(dim)


def tiled_matmul(x: torch.Tensor, w_t: torch.Tensor, tile: int) -> torch.Tensor:
    """``x @ w_t`` as one ``torch.mm`` per `[tile, K]` row tile (the last one zero-padded),
    so each row's bits depend only on the row, ``w_t`` and ``tile``.

    x: `[M, K]`; w_t: `[K, N]` (the same weight view always: strides pick the code path).
    Returns `[M, N]` in x.dtype.

    NOTE: one ``torch.mm`` per tile, not one ``torch.bmm`` over the tiles: measured here,
    a batched product took another code path than a single one for N = 1 (its rows'
    bits differed), so the tile count would have changed the result.
    """
    num_rows, k = x.shape
    num_tiles = -(-num_rows // tile)
    if num_tiles * tile != num_rows or not x.is_contiguous():
        padded = x.new_zeros(num_tiles * tile, k)
        padded[:num_rows] = x
        x = padded
    out = x.new_empty(num_tiles * tile, w_t.shape[1])

    def run(tiles: range) -> None:
        for start in range(tiles.start * tile, tiles.stop * tile, tile):
            torch.mm(x[start:start + tile], w_t, out=out[start:start + tile])

    _run_lanes([lambda r=r: run(r) for r in _split(num_tiles, _lanes)])
    return out[:num_rows]


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of each row of ``x`` `[M, K]` float32 → `[M]`, as a fixed-shape tiled GEMM with
    a ones vector: the order is fixed by K and ROW_TILE, never by M."""
    return tiled_matmul(x, _ones(x.shape[1], x.dtype), ROW_TILE).squeeze(1)


_ONES: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _ones(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A cached `[n, 1]` ones column."""
    key = (n, dtype)
    if key not in _ONES:
        _ONES[key] = torch.ones(n, 1, dtype=dtype)
    return _ONES[key]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = tiled_matmul(x, weight.t(), ROW_TILE)
    if bias is not None:
        out = out + bias
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    h = x.float()
    variance = row_sum((h * h).reshape(-1, h.shape[-1])).view(*h.shape[:-1], 1) / h.shape[-1]
    y = weight * (h * torch.rsqrt(variance + eps)).to(x.dtype)
    return (y, x) if residual is not None else y


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Batched over every query token with fixed-shape GEMM items (module docstring).

    NOTE: the unit of work is one **(query token, key split)** item: the token's `[Hq, Dh]`
    query heads against the `[KV_SPLIT_SIZE * Hkv, Dh]` keys of one split, one item of a
    ``torch.bmm`` whose shape never changes, so its bits do not depend on how many items
    run together. All KV heads are multiplied at once and the GQA-matching blocks kept
    (``diagonal``); the value product multiplies a block-diagonal probability matrix, whose
    zero blocks add exact zeros. Keys past a token's position get probability exactly 0, a
    split past it adds exact zeros, and sums over keys and splits are zero-padded trees,
    so a token's result depends only on its own query and the keys it can see: not on
    the other tokens, the chunking below, or the splits other tokens need.
    """
    num_tokens = q.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    starts = query_start_loc.tolist()
    lengths = context_lens.tolist()
    seq_of: list[int] = []
    pos_of: list[int] = []
    for s, length in enumerate(lengths):
        num_new = starts[s + 1] - starts[s]
        seq_of += [s] * num_new
        pos_of += range(length - num_new, length)
    seq = torch.tensor(seq_of, dtype=torch.int64)  # [T]
    positions = torch.tensor(pos_of, dtype=torch.int64)  # [T]
    # Splits each token needs; tokens sorted by need, chunked to bound the temporaries.
    need = [p // KV_SPLIT_SIZE + 1 for p in pos_of]
    order = sorted(range(num_tokens), key=need.__getitem__)
    tables = block_tables.long()
    chunks: list[tuple[list[int], int]] = []  # (token indices, splits)
    begin = 0
    while begin < num_tokens:
        count = 1  # tokens in this chunk: as many as fit ATTN_CHUNK_ITEMS (at least one)
        while (begin + count < num_tokens
               and need[order[begin + count]] * (count + 1) <= ATTN_CHUNK_ITEMS):
            count += 1
        if _lanes > 1 and begin == 0 and count == num_tokens:
            count = -(-num_tokens // _lanes)  # one chunk per lane
        chunks.append((order[begin:begin + count], need[order[begin + count - 1]]))
        begin += count

    def run(part: range) -> None:
        for tokens, num_splits in (chunks[i] for i in part):
            idx = torch.tensor(tokens, dtype=torch.int64)
            rows = _attend_tokens(
                q.index_select(0, idx), positions.index_select(0, idx),
                tables.index_select(0, seq.index_select(0, idx)), k_cache, v_cache,
                num_splits, scale,
            )
            out.index_copy_(0, idx, rows.to(q.dtype))

    _run_lanes([lambda r=r: run(r) for r in _split(len(chunks), _lanes)])
    return out


def _attend_tokens(
    q: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_splits: int,
    scale: float,
) -> torch.Tensor:
    """Attention of N query tokens over their first ``num_splits`` key splits.

    q: `[N, Hq, Dh]`; positions: `[N]` int64; tables: `[N, max_blocks]` int64 (each
    token's sequence's block table); caches: `[num_blocks, block_size, Hkv, Dh]`.
    Returns `[N, Hq, Dh]` float32.
    """
    num_tok, num_q_heads, head_dim = q.shape
    if num_tok * num_splits == 1:
        # A one-item torch.bmm runs as a plain GEMM, another code path than the batched
        # one: run the token twice so every item takes the batched path.
        return _attend_tokens(q.expand(2, -1, -1), positions.expand(2), tables.expand(2, -1),
                              k_cache, v_cache, num_splits, scale)[:1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    split, width = KV_SPLIT_SIZE, num_splits * KV_SPLIT_SIZE  # C, L
    items = num_tok * num_splits
    key_pos = torch.arange(width)
    block = (key_pos // block_size).clamp(max=tables.shape[1] - 1)
    slots = tables[:, block] * block_size + key_pos % block_size  # [N, L]
    hidden = key_pos[None, :] > positions[:, None]  # [N, L]: past the token's position
    slots = slots.masked_fill(hidden, 0).view(-1)
    row = num_kv_heads * head_dim
    k = k_cache.view(-1, row).index_select(0, slots).float()  # [N*L, Hkv*Dh]
    v = v_cache.view(-1, row).index_select(0, slots).float()
    # Hidden keys get probability 0; zero their values so 0 * v is 0 even for stale slots.
    v.index_fill_(0, hidden.view(-1).nonzero().squeeze(1), 0)
    a = q.float()[:, None].expand(-1, num_splits, -1, -1).reshape(items, num_q_heads, head_dim)
    b = k.view(items, split * num_kv_heads, head_dim).transpose(1, 2)  # [I, Dh, C*Hkv]
    scores = torch.bmm(a, b).view(num_tok, num_splits, num_kv_heads, group, split, num_kv_heads)
    scores = scores.diagonal(dim1=2, dim2=5)  # [N, n, G, C, Hkv]: query head h vs kv head h
    scores = scores.permute(0, 4, 2, 1, 3) * scale  # [N, Hkv, G, n, C]
    scores = scores.masked_fill(hidden.view(num_tok, 1, 1, num_splits, split), float("-inf"))
    m = scores.amax(dim=(3, 4), keepdim=True)  # key 0 is visible to every token: finite
    p = torch.exp(scores - m)  # exactly 0 where hidden
    denom = tree_sum(tree_sum(p, dim=-1), dim=-1)  # [N, Hkv, G]
    blocks = p.new_zeros(num_tok, num_splits, num_kv_heads, group, split, num_kv_heads)
    blocks.diagonal(dim1=2, dim2=5).copy_(p.permute(0, 3, 2, 4, 1))
    o = torch.bmm(blocks.view(items, num_q_heads, split * num_kv_heads),
                  v.view(items, split * num_kv_heads, head_dim))  # [I, Hq, Dh]
    o = tree_sum(o.view(num_tok, num_splits, num_q_heads, head_dim), dim=1)  # [N, Hq, Dh]
    return o / denom.reshape(num_tok, num_q_heads, 1)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / tree_sum(e, dim=-1).unsqueeze(-1)


def topk_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = _softmax(router_logits)  # [T, E]
    # A stable descending sort keeps equal probabilities in ascending expert-id order.
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / tree_sum(weights, dim=-1).unsqueeze(-1)
    return ids, weights.contiguous()


def expert_ffn(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Rows sorted by expert, then each expert's rows in `[EXPERT_ROW_TILE, D]` tiles
    (the last one zero-padded): every product has one fixed shape per weight."""
    num_experts, two_inter, _ = w_gate_up.shape
    inter, hidden = two_inter // 2, w_down.shape[1]
    order = torch.argsort(expert_ids, stable=True)
    # Ids == num_experts (rows routed nowhere) sort last and get no tile: never computed.
    counts = torch.bincount(expert_ids, minlength=num_experts).tolist()[:num_experts]
    xs = x.index_select(0, order)  # [R, D], grouped by expert
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype)
    tile = EXPERT_ROW_TILE
    tiles: list[tuple[int, int, int]] = []  # (expert, first sorted row, rows)
    begin = 0
    for expert, count in enumerate(counts):
        tiles += [(expert, start, min(tile, begin + count - start))
                  for start in range(begin, begin + count, tile)]
        begin += count

    gate_up_t = {e: w_gate_up[e].t() for e, c in enumerate(counts) if c}  # [D, 2I] views
    down_t = {e: w_down[e].t() for e, c in enumerate(counts) if c}  # [I, D] views

    def run(part: range) -> None:
        gate_up = torch.empty(tile, two_inter, dtype=x.dtype)
        act = torch.empty(tile, inter, dtype=x.dtype)
        down = torch.empty(tile, hidden, dtype=x.dtype)
        padded = torch.zeros(tile, x.shape[1], dtype=x.dtype)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        for expert, start, n in (tiles[i] for i in part):
            rows = xs[start:start + n]
            if n < tile:
                padded[:n] = rows
                padded[n:] = 0
                rows = padded
            torch.mm(rows, gate_up_t[expert], out=gate_up)
            torch.mul(F.silu(gate, inplace=True), up, out=act)
            if n == tile:  # straight into the output rows
                torch.mm(act, down_t[expert], out=out[start:start + tile])
            else:
                torch.mm(act, down_t[expert], out=down)
                out[start:start + n] = down[:n]

    _run_lanes([lambda r=r: run(r) for r in _split(len(tiles), _lanes)])
    return torch.empty_like(out).index_copy_(0, order, out)


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    out = topk_weights[:, 0:1] * expert_out[:, 0].float()
    for rank in range(1, expert_out.shape[1]):
        out = out + topk_weights[:, rank : rank + 1] * expert_out[:, rank].float()
    return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    shifted = x - x.amax(dim=-1, keepdim=True)
    return shifted - torch.log(row_sum(torch.exp(shifted))).unsqueeze(-1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding uint32 values."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def counter_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    seeds = seeds.long()
    h = _mix32((seeds & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    h = _mix32(h ^ (positions.long() & _M32))  # [B]
    vocab = torch.arange(vocab_size, dtype=torch.int64)
    bits = _mix32(_mix32((h[:, None] ^ vocab[None, :]) + 0x7F4A7C15 & _M32))  # [B, V]
    return (bits.double() + 0.5) / 4294967296.0


def sample(
    logprobs: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    tokens = logprobs.argmax(dim=-1)
    # Rows are processed one at a time so that no op sees the batch (sort, cumsum).
    for row in (temperatures > 0).nonzero().squeeze(1).tolist():
        tempered = log_softmax(logprobs[row : row + 1] / temperatures[row])[0]
        filtered = filter_row(
            tempered, int(top_ks[row]), float(top_ps[row]), float(min_ps[row])
        ).double()
        u = counter_uniform(seeds[row : row + 1], positions[row : row + 1], logprobs.shape[1])[0]
        gumbel = -torch.log(-torch.log(u))
        tokens[row] = torch.argmax(filtered + gumbel)
    return tokens
