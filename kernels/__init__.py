"""Batch-invariant kernels: one API, compiled C++ for CPU and Triton (and Gluon) for CUDA.

Every function here promises **batch invariance**: the result for one row (token) is
bitwise the same whatever the other rows are and however many there are. Reduction orders
are fixed by the weight shapes and the row's own position, never by the number of rows.

Shape legend used throughout:
    T = tokens, S = sequences, D = hidden size, K = reduction size, N = output features,
    Hq / Hkv = query / key-value heads, Dh = head dim, E = experts, I = expert intermediate,
    k = experts per token (top-k), V = vocabulary, R = routed rows (token, expert) pairs.

The implementation is chosen from the device of the first tensor argument: CUDA tensors go
to ``megaserve.kernels.triton_impl`` (Triton, and Gluon on Hopper), everything else to
``megaserve.kernels.cpu`` (C++ compiled on first use). ``megaserve.kernels.testing`` holds
the timing and input helpers that benchmarks, ``lab/`` and tests share.
"""

from __future__ import annotations

from .api import (
    KV_SPLIT_SIZE,
    combine,
    combine_residual,
    counter_uniform,
    embed_tokens,
    expert_ffn,
    fp8_expert_ffn,
    fp8_linear,
    linear,
    linear_rms_norm,
    log_softmax,
    mla_attention,
    paged_attention,
    per_head_linear,
    rms_norm,
    rotary_and_cache,
    route,
    router_logits,
    sample,
    sigmoid_topk_route,
    silu_and_mul,
    topk_route,
    write_kv_cache,
)

__all__ = [
    "KV_SPLIT_SIZE",
    "combine",
    "combine_residual",
    "counter_uniform",
    "embed_tokens",
    "expert_ffn",
    "fp8_expert_ffn",
    "fp8_linear",
    "linear",
    "linear_rms_norm",
    "log_softmax",
    "mla_attention",
    "paged_attention",
    "per_head_linear",
    "rms_norm",
    "rotary_and_cache",
    "route",
    "router_logits",
    "sample",
    "sigmoid_topk_route",
    "silu_and_mul",
    "topk_route",
    "write_kv_cache",
]
