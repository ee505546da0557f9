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
# Query rows per attention step: bounds the `[rows, Hq, KV_SPLIT_SIZE, Dh]` temporaries.
ATTN_QUERY_CHUNK = 32
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


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """`[length padded to KV_SPLIT_SIZE, Hkv, Dh]` float32, zeros past ``length``."""
    ctx = cache[block_ids].reshape(-1, cache.shape[2], cache.shape[3])[:length].float()
    padded = -(-length // KV_SPLIT_SIZE) * KV_SPLIT_SIZE
    if padded != length:
        ctx = torch.cat([ctx, ctx.new_zeros(padded - length, *ctx.shape[1:])])
    return ctx


def _attend_rows(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Online-softmax attention of query rows over fixed-size key splits.

    q: `[r, Hq, Dh]` float32; q_positions: `[r]` int64; k_ctx, v_ctx: `[L', Hq, Dh]`
    float32 (L' a multiple of KV_SPLIT_SIZE). A split entirely past a row's position
    merges as an exact identity (scale 1, contribution 0), so rows are unaffected by
    how many splits the longest row in the group needs.
    """
    last_split = int(q_positions.max()) // KV_SPLIT_SIZE
    m = l = o = None
    for split in range(last_split + 1):
        start = split * KV_SPLIT_SIZE
        k = k_ctx[start : start + KV_SPLIT_SIZE].transpose(0, 1)  # [Hq, C, Dh]
        v = v_ctx[start : start + KV_SPLIT_SIZE].transpose(0, 1)  # [Hq, C, Dh]
        scores = tree_sum(q[:, :, None, :] * k[None], dim=-1) * scale  # [r, Hq, C]
        key_pos = torch.arange(start, start + KV_SPLIT_SIZE)
        visible = key_pos[None, :] <= q_positions[:, None]  # [r, C]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        m_split = scores.amax(dim=-1)  # [r, Hq]
        m_safe = torch.where(torch.isinf(m_split), torch.zeros_like(m_split), m_split)
        p = torch.exp(scores - m_safe[..., None])  # [r, Hq, C]
        l_split = tree_sum(p, dim=-1)  # [r, Hq]
        o_split = tree_sum(p[..., None] * v[None], dim=2)  # [r, Hq, Dh]
        if m is None:
            # Split 0 holds key 0, visible to every row: m is finite from here on.
            m, l, o = m_split, l_split, o_split
            continue
        m_new = torch.maximum(m, m_split)
        alpha = torch.exp(m - m_new)
        beta = torch.exp(m_split - m_new)
        o = o * alpha[..., None] + o_split * beta[..., None]
        l = l * alpha + l_split * beta
        m = m_new
    return o / l[..., None]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lengths = context_lens.tolist()
    for s, length in enumerate(lengths):
        q_begin, q_end = starts[s], starts[s + 1]
        num_new = q_end - q_begin
        if num_new == 0:
            continue
        block_ids = block_tables[s, : -(-length // block_size)].long()
        k_ctx = _gather_context(k_cache, block_ids, length)
        v_ctx = _gather_context(v_cache, block_ids, length)
        if group > 1:
            k_ctx = k_ctx.repeat_interleave(group, dim=1)
            v_ctx = v_ctx.repeat_interleave(group, dim=1)
        positions = torch.arange(length - num_new, length)
        for r in range(0, num_new, ATTN_QUERY_CHUNK):
            rows = slice(q_begin + r, min(q_begin + r + ATTN_QUERY_CHUNK, q_end))
            out[rows] = _attend_rows(
                q[rows].float(), positions[r : r + ATTN_QUERY_CHUNK], k_ctx, v_ctx, scale
            ).to(q.dtype)
    return out


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
    out = torch.empty(x.shape[0], w_down.shape[1], dtype=x.dtype)
    for expert in torch.unique(expert_ids).tolist():
        rows = (expert_ids == expert).nonzero().squeeze(1)
        hidden = silu_and_mul(linear(x[rows], w_gate_up[expert]))
        out[rows] = linear(hidden, w_down[expert])
    return out


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
