"""CPU implementation of the kernel API (torch only), batch-invariant bitwise.

Two techniques make every result independent of the batch:

* **Fixed-shape row tiles for GEMMs.** ``torch.mm`` on CPU picks its blocking (and with it
  the reduction order) from M: measured here, row 0 of a product changed for 16 of 19
  batch sizes. Running every product as `[ROW_TILE, K] @ [K, N]` tiles (the last one
  zero-padded) gives each row the same code path whatever M is, and whatever row of the
  tile it lands in, for 1 or 2 threads (tests/kernels/test_cpu_invariance.py).
* **Tree reductions from elementwise ops.** Sums over features (RMSNorm, softmax, the
  attention dot products) use a pairwise halving tree over the length padded to a power
  of two. Elementwise ops are exact per element, so the order is fixed by the reduced
  length alone; padding with zeros leaves the value unchanged (``x + 0 == x``), which
  also makes attention independent of how many keys past a query's position exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.api import KV_SPLIT_SIZE
from kernels.filters import filter_row

ROW_TILE = 16
# Rows per expert GEMM tile (a fixed shape, like ROW_TILE): at decode an expert gets about
# 2 x batch / E rows, so one tile each; prefill runs at the larger tile's speed.
EXPERT_ROW_TILE = 32
# (Query token, key split) items per batched attention call: bounds the temporaries
# (`[items, Hq, KV_SPLIT_SIZE * Hkv]` float32 scores and probabilities).
ATTN_CHUNK_ITEMS = 1024
_M32 = 0xFFFFFFFF


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    num_rows, k = x.shape
    n = weight.shape[0]
    padded_rows = -(-num_rows // ROW_TILE) * ROW_TILE
    if padded_rows != num_rows:
        x = torch.cat([x, x.new_zeros(padded_rows - num_rows, k)])
    x = x.contiguous()
    w_t = weight.t()
    out = torch.empty(padded_rows, n, dtype=x.dtype)
    for start in range(0, padded_rows, ROW_TILE):
        torch.mm(x[start : start + ROW_TILE], w_t, out=out[start : start + ROW_TILE])
    out = out[:num_rows]
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
    variance = tree_sum(h * h, dim=-1).unsqueeze(-1) / h.shape[-1]
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
    begin = 0
    while begin < num_tokens:
        count = 1  # tokens in this chunk: as many as fit ATTN_CHUNK_ITEMS (at least one)
        while (begin + count < num_tokens
               and need[order[begin + count]] * (count + 1) <= ATTN_CHUNK_ITEMS):
            count += 1
        idx = torch.tensor(order[begin:begin + count], dtype=torch.int64)
        num_splits = need[order[begin + count - 1]]  # the chunk's largest (sorted)
        begin += count
        rows = _attend_tokens(
            q.index_select(0, idx), positions.index_select(0, idx),
            tables.index_select(0, seq.index_select(0, idx)), k_cache, v_cache, num_splits,
            scale,
        )
        out.index_copy_(0, idx, rows.to(q.dtype))
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
    counts = torch.bincount(expert_ids, minlength=num_experts).tolist()
    xs = x.index_select(0, order)  # [R, D], grouped by expert
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype)
    tile = EXPERT_ROW_TILE
    gate_up = torch.empty(tile, two_inter, dtype=x.dtype)
    down = torch.empty(tile, hidden, dtype=x.dtype)
    padded = torch.zeros(tile, x.shape[1], dtype=x.dtype)
    begin = 0
    for expert, count in enumerate(counts):
        for start in range(begin, begin + count, tile):
            n = min(tile, begin + count - start)
            rows = xs[start:start + n]
            if n < tile:
                padded[:n] = rows
                padded[n:] = 0
                rows = padded
            torch.mm(rows, w_gate_up[expert].t(), out=gate_up)
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            torch.mm(act, w_down[expert].t(), out=down)
            out[start:start + n] = down[:n]
        begin += count
    return torch.empty_like(out).index_copy_(0, order, out)


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    out = topk_weights[:, 0:1] * expert_out[:, 0].float()
    for rank in range(1, expert_out.shape[1]):
        out = out + topk_weights[:, rank : rank + 1] * expert_out[:, rank].float()
    return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    shifted = x - x.amax(dim=-1, keepdim=True)
    return shifted - torch.log(tree_sum(torch.exp(shifted), dim=-1)).unsqueeze(-1)


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
