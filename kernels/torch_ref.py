"""Reference CUDA backend on vendor libraries: cuBLAS (``F.linear``) and SDPA.

Selected with ``MEGASERVE_KERNELS=reference`` (read once, at the first CUDA kernel call).
It measures the **cost of invariance**: same API, same model, but cuBLAS and SDPA are
NOT batch-invariant, so this backend breaks the determinism contract by design. Use it
for benchmarks only. Shape legend as in ``kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_impl import counter_uniform, log_softmax, sample  # noqa: F401 (API)

__all__ = [
    "combine", "counter_uniform", "expert_ffn", "linear", "log_softmax", "paged_attention",
    "rms_norm", "sample", "silu_and_mul", "topk_route", "write_kv_cache",
]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLAS ``x @ weight.T (+ bias)``: x `[M, K]`, weight `[N, K]` → `[M, N]`."""
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """As ``kernels.api.rms_norm``, with torch's own reductions."""
    if residual is not None:
        x = x + residual
    h = x.float()
    y = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y, x) if residual is not None else y


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up `[T, 2I]` → `[T, I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v `[T, Hkv, Dh]` into caches `[blocks, block_size, Hkv, Dh]` at slot_mapping `[T]`."""
    h, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, h, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, h, d)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """Per-sequence gather of the paged K/V, then SDPA (flash where it applies)."""
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


def expert_ffn(x, expert_ids, w_gate_up, w_down) -> torch.Tensor:
    """One cuBLAS SwiGLU per expert present: x `[R, D]` → `[R, D]`."""
    out = torch.empty(x.shape[0], w_down.shape[1], dtype=x.dtype, device=x.device)
    for expert in torch.unique(expert_ids).tolist():
        rows = (expert_ids == expert).nonzero().squeeze(1)
        out[rows] = F.linear(silu_and_mul(F.linear(x[rows], w_gate_up[expert])), w_down[expert])
    return out


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`[T, k, D]` × `[T, k]` → `[T, D]` float32."""
    return (expert_out.float() * topk_weights[..., None]).sum(1)
