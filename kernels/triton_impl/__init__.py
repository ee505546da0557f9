"""Triton implementation of the kernel API for CUDA tensors (see ``megaserve.kernels.api``).

One module per kernel family: ``matmul`` (linear), ``rowwise`` (RMSNorm, SwiGLU,
combine, combine + residual + RMSNorm, log-softmax, embedding lookup), ``attention`` (KV
write, q/k norm + rotary + KV write, paged attention), ``moe`` (routing, expert FFN),
``sampling`` (counter RNG, sampler). Beside them, Hopper kernels in Gluon that give the
bits of the Triton kernel they stand in for: ``attention_gluon`` (serial prefill
attention), ``moe_gluon`` (the expert GEMMs of prefill-sized calls). Importing defines
kernels only; nothing is compiled or launched until a function is called.
"""

from __future__ import annotations

from .attention import paged_attention, rotary_and_cache, write_kv_cache
from .matmul import linear, linear_rms_norm
from .moe import expert_ffn, route, topk_route
from .rowwise import (
    combine,
    combine_residual,
    embed_tokens,
    log_softmax,
    rms_norm,
    silu_and_mul,
)
from .sampling import counter_uniform, sample

__all__ = [
    "combine",
    "combine_residual",
    "counter_uniform",
    "embed_tokens",
    "expert_ffn",
    "linear",
    "linear_rms_norm",
    "log_softmax",
    "paged_attention",
    "rms_norm",
    "rotary_and_cache",
    "route",
    "sample",
    "silu_and_mul",
    "topk_route",
    "write_kv_cache",
]
