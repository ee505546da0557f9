"""Reference CUDA backend on vendor libraries: cuBLAS (``F.linear``) and SDPA.

Selected with ``MEGASERVE_KERNELS=reference`` (read once, at the first CUDA kernel call).
It measures the **cost of invariance**: same API, same model, but cuBLAS and SDPA are
NOT batch-invariant, so this backend breaks the determinism contract by design. Use it
for benchmarks only. Shape legend as in ``kernels``.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
import torch.nn.functional as F

from .cpu import composed_rotary_and_cache
from .triton_impl import counter_uniform, embed_tokens, log_softmax, sample  # noqa: F401 (API)

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None

logger = logging.getLogger(__name__)

__all__ = [
    "combine", "combine_residual", "counter_uniform", "embed_tokens", "expert_ffn", "linear",
    "log_softmax", "paged_attention", "rms_norm", "rotary_and_cache", "sample", "silu_and_mul",
    "topk_route", "write_kv_cache",
]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLAS ``x @ weight.T (+ bias)``: x `[M, K]`, weight `[N, K]` → `[M, N]`."""
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """As ``megaserve.kernels.api.rms_norm``, with torch's own reductions."""
    if residual is not None:
        x = x + residual
    h = x.float()
    y = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y, x) if residual is not None else y


def linear_rms_norm(x, weight, norm_weight, eps, residual):
    return rms_norm(linear(x, weight), norm_weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up `[T, 2I]` → `[T, I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v `[T, Hkv, Dh]` into caches `[blocks, block_size, Hkv, Dh]` at slot_mapping `[T]`."""
    h, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, h, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, h, d)[slot_mapping] = v.to(v_cache.dtype)


def rotary_and_cache(qkv, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache,
                     slot_mapping, num_q_heads) -> torch.Tensor:
    """Per-head norm, rotary and the cache write as separate torch ops (the unfused
    sequence); qkv `[T, (Hq + 2 Hkv) * Dh]` → rotated q `[T, Hq, Dh]`."""
    return composed_rotary_and_cache(rms_norm, write_kv_cache, qkv, positions, cos, sin,
                                     q_norm, k_norm, eps, k_cache, v_cache, slot_mapping,
                                     num_q_heads)


def _varlen_kwargs() -> dict:
    """Keyword arguments for this torch's ``varlen_attn``: causal and GQA are spelled
    differently across torch releases (2.10: ``is_causal``; later: ``window_size``,
    ``enable_gqa``); the scale is passed apart (absent in 2.10: 1/sqrt(Dh))."""
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal, bottom-right aligned
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                    one_token_per_seq=False):
    """One flash ``varlen_attn`` call for the whole batch (SDPA's per-sequence loop where
    torch has no varlen API). The paged K/V is gathered into one packed `[sum(L), Hkv, Dh]`
    tensor on the device; one host sync reads the total and maximum lengths (the varlen
    API takes them as Python ints).

    q `[T, Hq, Dh]`; caches `[blocks, block_size, Hkv, Dh]`; block_tables `[S, max_blocks]`;
    context_lens `[S]`; query_start_loc `[S+1]`. The n new queries of a sequence are its
    last n positions (causal with an offset). Returns `[T, Hq, Dh]` in q.dtype.
    """
    global _varlen_ok
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if varlen_attn is None or q.device.type != "cuda" or _varlen_ok is False:
        return _paged_attention_loop(*args)
    try:
        out = _paged_attention_varlen(*args)
        _varlen_ok = True
        return out
    except RuntimeError as err:  # this torch's flash build rejects the inputs
        if _varlen_ok:
            raise
        _varlen_ok = False
        logger.warning("varlen_attn unusable (%s); one SDPA call per sequence", err)
        return _paged_attention_loop(*args)


_varlen_ok: bool | None = None  # None: not tried yet


def _paged_attention_varlen(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                            scale):
    num_seqs = context_lens.shape[0]
    block_size, hkv, dh = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    lens = context_lens.long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    total_k, max_k, max_q = torch.stack([lens.sum(), lens.max(), q_lens.max()]).tolist()
    cu_k = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.cumsum(lens, 0)
    seq_of_key = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), lens,
                                         output_size=total_k)  # [sum(L)]
    pos = torch.arange(total_k, device=q.device) - cu_k[seq_of_key].long()
    slots = block_tables[seq_of_key, pos // block_size].long() * block_size + pos % block_size
    k = k_cache.view(-1, hkv, dh)[slots]  # [sum(L), Hkv, Dh]
    v = v_cache.view(-1, hkv, dh)[slots]
    kwargs = _varlen_kwargs()
    if "scale" in inspect.signature(varlen_attn).parameters:
        kwargs["scale"] = scale
    else:
        q = q * (scale * math.sqrt(dh))  # this torch always scales by 1/sqrt(Dh)
    return varlen_attn(q, k, v, query_start_loc.int(), cu_k, int(max_q), int(max_k), **kwargs)


def _paged_attention_loop(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                          scale):
    """Fallback without a varlen API: per-sequence gather of the paged K/V, then SDPA."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for s, length in enumerate(context_lens.tolist()):
        b, e = starts[s], starts[s + 1]
        if e == b:
            continue
        blocks = block_tables[s, : -(-length // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)  # [Hkv, L, Dh]
        v = v_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)
        qs = q[b:e].transpose(0, 1)  # [Hq, n, Dh]
        n = e - b
        # The n new queries are the last n positions: causal with an offset.
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[b:e] = o[0].transpose(0, 1)
    return out


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """torch.topk over fp32 softmax; `[T, E]` → (ids `[T, k]`, weights `[T, k]`)."""
    w, ids = torch.topk(torch.softmax(router_logits.float(), -1), top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w


def route(x, weight, top_k, renormalize):
    return topk_route(linear(x, weight), top_k, renormalize)


def expert_ffn(x, expert_ids, w_gate_up, w_down, *, rows_per_token: int = 1) -> torch.Tensor:
    """SwiGLU over rows sorted by expert: two grouped cuBLAS/CUTLASS calls
    (``torch._grouped_mm``) for all experts, no host sync; one ``F.linear`` pair per expert
    present where this torch or GPU has no grouped GEMM.

    x `[R / rows_per_token, D]`; expert_ids `[R]` int64 in [0, E) (row r reads x row
    r // rows_per_token); w_gate_up `[E, 2I, D]`; w_down `[E, D, I]`.
    Returns `[R, D]` in x.dtype.
    """
    global _grouped_ok
    if _grouped_ok is not False and x.is_cuda and hasattr(torch, "_grouped_mm"):
        try:
            out = _expert_ffn_grouped(x, expert_ids, w_gate_up, w_down, rows_per_token)
            _grouped_ok = True
            return out
        except RuntimeError as err:  # unsupported dtype / GPU / layout in this torch
            if _grouped_ok:
                raise
            _grouped_ok = False
            logger.warning("torch._grouped_mm unusable (%s); one cuBLAS call per expert", err)
    if rows_per_token != 1:
        x = x.repeat_interleave(rows_per_token, dim=0)  # [R, D]
    return _expert_ffn_loop(x, expert_ids, w_gate_up, w_down)


_grouped_ok: bool | None = None  # None: not tried yet


def _expert_ffn_grouped(x, expert_ids, w_gate_up, w_down, rows_per_token=1) -> torch.Tensor:
    num_experts = w_gate_up.shape[0]
    order = torch.argsort(expert_ids, stable=True)  # rows grouped by expert
    sorted_ids = expert_ids[order]
    # offs[e] = end of expert e's rows in the sorted order (int32, cumulative).
    offs = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device),
                              right=True).int()
    rows = x[order // rows_per_token]  # [R, D], grouped
    h = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offs)  # [R, 2I]
    y = torch._grouped_mm(silu_and_mul(h), w_down.transpose(1, 2), offs=offs)  # [R, D]
    out = torch.empty_like(y)
    out[order] = y
    return out


def _expert_ffn_loop(x, expert_ids, w_gate_up, w_down) -> torch.Tensor:
    out = torch.empty(x.shape[0], w_down.shape[1], dtype=x.dtype, device=x.device)
    for expert in torch.unique(expert_ids).tolist():
        rows = (expert_ids == expert).nonzero().squeeze(1)
        out[rows] = F.linear(silu_and_mul(F.linear(x[rows], w_gate_up[expert])), w_down[expert])
    return out


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`[T, k, D]` × `[T, k]` → `[T, D]` float32."""
    return (expert_out.float() * topk_weights[..., None]).sum(1)


def combine_residual(expert_out, topk_weights, residual, weight=None, eps=0.0):
    """``residual + combine(...)`` and, with ``weight``, its RMSNorm: separate torch ops."""
    h = residual + combine(expert_out, topk_weights).to(residual.dtype)
    return h if weight is None else (rms_norm(h, weight, eps), h)
