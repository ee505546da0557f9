"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a compressed paged cache.

Per token and layer the cache holds one row of ``kv_lora_rank + qk_rope_head_dim`` values
(`[num_blocks, block_size, 1, Dc]`): the normed KV latent ``c`` and the rotated rope key
shared by all heads. The layer's K and V caches are that one tensor.

NOTE: one form for prefill, chunked prefill and decode: the **weight-absorbed** one.
Each head's query is mapped into the latent space (``q_c = W_UK_h^T q_nope``), attention
is multi-query attention of Hq heads of width Dc over the cached rows (scores
``q_c . c + q_rope . k_rope``, values = the rows themselves), and each head's latent
output is expanded by ``W_UV_h`` before o_proj. The expanded form (K/V of every head
materialised per prefill token) reduces in a different order, so mixing the two would
make a token's bits depend on whether it was prefilled or decoded; with one form they
never do, and the attention is ``kernels.mla_attention`` (keys read from the cache after
the write, a token's keys reduced in an order fixed by its own position: on CPU the
batch-invariant paged attention with value width Dc, the rope columns dropped; on CUDA a
Triton kernel over the latent rows).

Shape legend: T = tokens, H = heads, D = hidden, Rq = q_lora_rank, Rkv = kv_lora_rank,
Dn / Dr / Dv = qk_nope / qk_rope / v head dims, Dc = Rkv + Dr, P = rotary positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaserve import kernels
from megaserve.models.config import ModelConfig, YarnScaling


@dataclass
class MLAWeights:
    """One layer's MLA projections (nn.Linear layout `[out, in]`)."""

    a_proj: torch.Tensor  # [Rq + Dc, D]: q_a_proj rows (if Rq) then kv_a_proj_with_mqa rows
    q_a_norm: torch.Tensor | None  # [Rq]; None where q_proj reads the hidden state
    q_b_proj: torch.Tensor  # [H * (Dn + Dr), Rq or D]: q_b_proj, or q_proj
    kv_a_norm: torch.Tensor  # [Rkv]
    w_uk: torch.Tensor  # [H, Rkv, Dn]: head h maps q_nope into the latent (W_UK_h^T)
    w_uv: torch.Tensor  # [H, Dv, Rkv]: head h expands its latent output
    o_proj: torch.Tensor  # [D, H * Dv]


def split_kv_b(kv_b: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj `[H * (Dn + Dv), Rkv]` → (w_uk `[H, Rkv, Dn]`, w_uv `[H, Dv, Rkv]`)."""
    mla = config.mla
    per_head = kv_b.view(config.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    w_uk = per_head[:, : mla.qk_nope_head_dim].transpose(1, 2).contiguous()
    w_uv = per_head[:, mla.qk_nope_head_dim:].contiguous()
    return w_uk, w_uv


def softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
    scale = config.mla.qk_head_dim ** -0.5
    yarn = config.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        m = _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        scale = scale * m * m
    return scale


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, base: float, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies `[dim / 2]` and cos/sin factor, computed as HF does."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    factor = yarn.attention_factor
    if factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            factor = _yarn_mscale(yarn.factor, yarn.mscale) / _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        else:
            factor = _yarn_mscale(yarn.factor)
    return inv_freq, float(factor)


def rope_tables(config: ModelConfig, max_positions: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[P, Dr]` of the rope dims (``cat(freqs, freqs)``, YaRN-scaled where the
    config says), computed in fp32 and stored in ``dtype``."""
    dim = config.mla.qk_rope_head_dim
    if config.rope_scaling is None:
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        factor = 1.0
    else:
        inv_freq, factor = _yarn_inv_freq(dim, config.rope_theta, config.rope_scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return ((emb.cos() * factor).to(device=device, dtype=dtype),
            (emb.sin() * factor).to(device=device, dtype=dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary of x `[T, n, Dr]` with cos/sin `[T, 1, Dr]` (rows of :func:`rope_tables`).

    Interleaved (DeepSeek's layout): pairs (x0, x1), (x2, x3), ... rotate together and the
    result is laid out evens-then-odds, as HF's ``apply_rotary_pos_emb_interleave``; the
    dot products of q and k do not depend on that layout."""
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _per_head_linear(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x `[T, H, K]`, weights `[H, N, K]` → `[T, H, N]`: head h is ``x[:, h] @ weights[h].T``
    (``kernels.per_head_linear``: row-invariant, one launch for every head on CUDA)."""
    return kernels.per_head_linear(x, weights)


def write_latent_cache(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store latent rows `[T, Dc]` into cache `[num_blocks, block_size, 1, Dc]` at
    ``slot_mapping`` `[T]` (negative: a padding row, nothing written). Exact copies, through
    ``kernels.write_kv_cache`` (no host synchronisation on CUDA), which writes its K and V
    rows: here the same row into the same tensor."""
    rows = latent.to(cache.dtype)[:, None, :]  # [T, 1, Dc]
    kernels.write_kv_cache(rows, rows, cache, cache, slot_mapping)


def mla_attention(
    config: ModelConfig,
    w: MLAWeights,
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """MLA up to o_proj's input: x `[T, D]` (the input norm) → `[T, H * Dv]`.

    Writes the tokens' latent rows into ``cache`` (`[num_blocks, block_size, 1, Dc]`)
    before attending (metadata as in ``kernels.paged_attention``; ``kernels.mla_attention``
    attends). A token's result
    depends only on its own row, its position and the cached rows before it.
    """
    mla, num_tokens = config.mla, x.shape[0]
    num_heads, rkv, dn, dr = config.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim
    a = kernels.linear(x, w.a_proj)  # [T, Rq + Dc]
    if w.q_a_norm is not None:
        q_in = kernels.rms_norm(a[:, : mla.q_lora_rank].contiguous(), w.q_a_norm, config.rms_norm_eps)
        kv = a[:, mla.q_lora_rank:]
    else:
        q_in, kv = x, a
    q = kernels.linear(q_in, w.q_b_proj).view(num_tokens, num_heads, dn + dr)  # [T, H, Dn + Dr]
    c = kernels.rms_norm(kv[:, :rkv].contiguous(), w.kv_a_norm, config.rms_norm_eps)  # [T, Rkv]
    cos_t, sin_t = cos[positions][:, None, :], sin[positions][:, None, :]  # [T, 1, Dr]
    k_rope = _rotate(kv[:, None, rkv:], cos_t, sin_t, mla.rope_interleave)  # [T, 1, Dr]
    write_latent_cache(torch.cat([c, k_rope[:, 0]], dim=-1), cache, slot_mapping)
    q_rope = _rotate(q[..., dn:], cos_t, sin_t, mla.rope_interleave)  # [T, H, Dr]
    q_c = _per_head_linear(q[..., :dn], w.w_uk)  # [T, H, Rkv]
    query = torch.cat([q_c, q_rope], dim=-1)  # [T, H, Dc]
    latent_out = kernels.mla_attention(query, cache, block_tables, context_lens,
                                       query_start_loc, rkv, scale)  # [T, H, Rkv]
    return _per_head_linear(latent_out, w.w_uv).reshape(num_tokens, num_heads * mla.v_head_dim)
