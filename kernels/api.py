"""The kernel API: contracts and device dispatch (see the shape legend in ``kernels``).

Each function checks nothing expensive; callers (the model) pass well-formed tensors.
A backend module implements every name below with the same signature.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from .fp8 import BlockFp8, dequantize

# Keys per attention split. Fixed, so a query's reduction order depends only on its own
# position: a decode token and the same token inside a (chunked) prefill agree bitwise.
KV_SPLIT_SIZE = 64

# Modules of this package (relative: kernels never names the package it is installed in).
_BACKENDS = {"cpu": ".cpu", "cuda": ".triton_impl"}
_loaded: dict[str, ModuleType] = {}


def _backend(t: torch.Tensor) -> ModuleType:
    """The implementation module for ``t``'s device type; raises ``RuntimeError`` if none."""
    kind = t.device.type
    module = _loaded.get(kind)
    if module is not None:
        return module
    name = _BACKENDS.get(kind)
    if kind == "cuda" and os.environ.get("MEGASERVE_KERNELS") == "reference":
        name = ".torch_ref"  # cuBLAS/SDPA baseline: NOT batch-invariant
    if name is None:
        raise RuntimeError(
            f"no kernel backend for device type {kind!r}; supported: {sorted(_BACKENDS)}"
        )
    try:
        module = importlib.import_module(name, __package__)
    except ImportError as e:
        raise RuntimeError(f"kernel backend {name} for {kind!r} is unavailable: {e}") from e
    _loaded[kind] = module
    return module


def set_cpu_threads(num_threads: int) -> None:
    """Threads the CPU kernels of this process compute with.

    torch's intra-op threads are pinned to 1 and the CPU backend spreads the fixed-shape
    tiles of each call over ``num_threads`` threads of its own (kernels.cpu.set_num_lanes):
    each tile is one single-threaded torch call whichever thread runs it, so the thread
    count never changes a result, and no OpenMP team spins on a busy machine.
    Raises ``ValueError`` for ``num_threads < 1``.
    """
    from . import cpu

    cpu.set_num_lanes(num_threads)
    torch.set_num_threads(1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with fp32 accumulation, row-invariant.

    x: `[M, K]` float; weight: `[N, K]` same dtype (nn.Linear layout), or a
    :class:`kernels.fp8.BlockFp8` (:func:`fp8_linear`, then the bias added in x.dtype);
    bias: `[N]` or None. Returns `[M, N]` in x.dtype.
    """
    if isinstance(weight, BlockFp8):
        out = fp8_linear(x, weight.weight, weight.scale_inv)
        return out if bias is None else out + bias
    return _backend(x).linear(x, weight, bias)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim in fp32, optionally fused with a residual add.

    x: `[T, D]`; weight: `[D]`. Without ``residual``: returns ``norm(x) * weight`` in
    x.dtype. With ``residual`` `[T, D]`: ``h = x + residual`` (in x.dtype) and returns
    ``(norm(h) * weight, h)``. As in HF, the normalised value is cast to x.dtype before
    the weight multiply.
    """
    return _backend(x).rms_norm(x, weight, eps, residual)


def linear_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection, the residual add and the next RMSNorm: ``rms_norm(linear(x, weight),
    norm_weight, eps, residual)``, bitwise. x: `[T, K]`, weight: `[D, K]`, residual:
    `[T, D]`; returns ``(norm(h) * norm_weight, h)``. A backend may leave the linear's
    split-K parts for the norm's kernel to fold (Triton: matmul.linear_parts). A
    :class:`kernels.fp8.BlockFp8` weight: :func:`fp8_linear`, then :func:`rms_norm` (CUDA:
    the norm folds the FP8 linear's parts, fp8_gemm.fp8_linear_parts).
    """
    if isinstance(weight, BlockFp8):
        if x.is_cuda:
            from .triton_impl.fp8_gemm import fp8_linear_parts
            from .triton_impl.rowwise import rms_norm as gpu_rms_norm

            return gpu_rms_norm(fp8_linear_parts(x, weight.weight, weight.scale_inv),
                                norm_weight, eps, residual)
        return rms_norm(fp8_linear(x, weight.weight, weight.scale_inv), norm_weight, eps, residual)
    return _backend(x).linear_rms_norm(x, weight, norm_weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: gate_up `[T, 2I]` (gate first, then up) → `silu(gate) * up` `[T, I]`."""
    return _backend(gate_up).silu_and_mul(gate_up)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values into the paged cache (in place) before attention reads them.

    k, v: `[T, Hkv, Dh]`; k_cache, v_cache: `[num_blocks, block_size, Hkv, Dh]`;
    slot_mapping: `[T]` int32 or int64, ``block_id * block_size + offset`` per token.
    """
    _backend(k).write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def rotary_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
) -> torch.Tensor:
    """The step between the QKV projection and attention: per-head q/k RMSNorm, rotary,
    and the K/V cache write, as one pass.

    qkv: `[T, (Hq + 2 Hkv) * Dh]`, q heads then k heads then v heads (the QKV linear's
    output); positions: `[T]` int32 or int64; cos, sin: `[max_positions, Dh]` in qkv.dtype (HF
    rotate-half tables); q_norm, k_norm: `[Dh]` (Qwen3) or both None; k_cache, v_cache:
    `[num_blocks, block_size, Hkv, Dh]`, contiguous; slot_mapping: `[T]` as in
    :func:`write_kv_cache` (negative: a padding token, nothing written).
    Bitwise the composition it replaces: ``rms_norm`` of each head (if q_norm), then
    ``x * cos + rotate_half(x) * sin`` with each product and the sum rounded to qkv.dtype,
    then :func:`write_kv_cache` of the rotated k and of v. Returns the rotated q
    `[T, Hq, Dh]` in qkv.dtype. Raises ``ValueError`` for an odd Dh or a qkv width that
    is not ``(Hq + 2 Hkv) * Dh``.
    """
    return _backend(qkv).rotary_and_cache(
        qkv, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping,
        num_q_heads,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    one_token_per_seq: bool = False,
) -> torch.Tensor:
    """Causal attention of new query tokens over the paged KV cache (GQA aware).

    q: `[T, Hq, Dh]`, the new tokens of S sequences packed back to back; sequence s owns
    rows ``query_start_loc[s]:query_start_loc[s+1]`` and they are the **last** tokens of
    its context of ``context_lens[s]`` tokens (their K/V already written to the cache).
    k_cache, v_cache: `[num_blocks, block_size, Hkv, Dh]`; block_tables: `[S, max_blocks]`
    int32; context_lens: `[S]` int32; query_start_loc: `[S + 1]` int32.
    Keys are reduced in splits of ``KV_SPLIT_SIZE`` merged in a fixed ascending order
    (the Triton kernels fold the splits of each chunk first, then the chunks: see
    kernels.triton_impl.attention), so the same kernel serves prefill, chunked prefill
    and decode with identical results. one_token_per_seq: a promise that query_start_loc
    is 0, 1, ..., S (a decode batch), which lets a backend skip reading it; never changes
    the result.
    Returns `[T, Hq, Dh]` in q.dtype.
    """
    return _backend(q).paged_attention(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
        one_token_per_seq=one_token_per_seq,
    )


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    rank: int,
    scale: float,
) -> torch.Tensor:
    """Weight-absorbed multi-head latent attention over the paged latent cache.

    q: `[T, H, Dc]` (the latent query ``W_UK^T q_nope`` of width ``rank``, then the rotated
    rope query); cache: `[num_blocks, block_size, 1, Dc]`, each token's latent row then its
    rope key, written before the call; metadata as in :func:`paged_attention`. Scores
    ``q . row * scale``; values are the rows' first ``rank`` columns. Returns `[T, H, rank]`
    in q.dtype. CUDA: kernels.triton_impl.mla (one program per token and head block,
    keys in fixed blocks up to the token's position); elsewhere :func:`paged_attention`
    with the cache as keys and values (its value width is Dc; the rope columns are
    dropped). A token's bits never depend on the other tokens.
    """
    if q.is_cuda:
        from .triton_impl.mla import mla_attention as run

        return run(q, cache, block_tables, context_lens, query_start_loc, rank, scale)
    out = _backend(q).paged_attention(q, cache, cache, block_tables, context_lens,
                                      query_start_loc, scale)
    return out[..., :rank]


def topk_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing with a stable top-k.

    router_logits: `[T, E]`. Softmax in fp32 over E, then the k largest probabilities;
    ties go to the lower expert id. With ``renormalize`` the k weights are divided by
    their sum. Returns ``(topk_ids `[T, k]` int64, topk_weights `[T, k]` float32)``,
    ordered by descending weight (rank order), the order combine sums in.
    """
    return _backend(router_logits).topk_route(router_logits, top_k, renormalize)


def route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router and the routing: ``topk_route(linear(x, weight), top_k, renormalize)``,
    bitwise. x: `[T, D]`, weight: `[E, D]`. A backend may leave the router's split-K parts
    for the top-k's kernel to fold (Triton: matmul.linear_parts).
    """
    return _backend(x).route(x, weight, top_k, renormalize)


def sigmoid_topk_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (sigmoid scores, bias-corrected group-limited top-k, scaled
    weights); contract in :func:`kernels.grouped_topk.sigmoid_topk_route`. Per-row torch
    ops on every device: batch-invariant, ties to the lower id."""
    from .grouped_topk import sigmoid_topk_route as route_rows

    return route_rows(router_logits, correction_bias, top_k, num_groups, topk_groups,
                      renormalize, scaling)


def per_head_linear(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x `[T, H, K]`, weights `[H, N, K]` → `[T, H, N]` in x.dtype: head h is
    ``linear(x[:, h], weights[h])`` (MLA's absorbed W_UK and W_UV), row-invariant. CUDA: one
    Triton launch for every head (:func:`triton_impl.mla.per_head_linear`); CPU: one
    :func:`linear` per head."""
    if x.is_cuda:
        from .triton_impl.mla import per_head_linear as run

        return run(x, weights)
    return torch.stack([linear(x[:, h], weights[h]) for h in range(weights.shape[0])], dim=1)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 router logits ``x.float() @ weight.T`` (DeepSeek-V3's gate): x `[T, D]`,
    weight `[E, D]` float32; returns `[T, E]` float32, each row a function of its own x
    row. CUDA: a Triton FMA-chain kernel (:mod:`triton_impl.mla_router`); CPU:
    :func:`linear` in float32."""
    if x.is_cuda:
        from .triton_impl.mla_router import router_logits as gpu_router

        return gpu_router(x, weight)
    return linear(x.float(), weight)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """:func:`linear` for a block-FP8 weight (e4m3 `[N, K]`, float32 scale_inv per 128 x 128
    block; :mod:`kernels.fp8`): x `[M, K]`, returns `[M, N]` in x.dtype. CUDA: activations
    quantized per token and 128-group, fp32 accumulation, row-invariant (Triton); CPU: the
    weight dequantized to x.dtype, then :func:`linear`."""
    if x.is_cuda:
        from .triton_impl.fp8_gemm import fp8_linear as gpu_linear

        return gpu_linear(x, weight, scale_inv)
    return linear(x, dequantize(weight, scale_inv, x.dtype))


def fp8_expert_ffn(x: torch.Tensor, expert_ids: torch.Tensor, w_gate_up: torch.Tensor,
                   s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                   *, rows_per_token: int = 1) -> torch.Tensor:
    """:func:`expert_ffn` on block-FP8 expert weights (w_gate_up `[E, 2I, D]`, w_down
    `[E, D, I]` e4m3 with their scales; :mod:`kernels.fp8`). Returns `[R, D]` in x.dtype;
    each routed row's result is independent of the other rows. CPU: the weights
    dequantized to x.dtype, then :func:`expert_ffn`."""
    if x.is_cuda:
        from .triton_impl.fp8_moe import fp8_expert_ffn as gpu_ffn

        return gpu_ffn(x, expert_ids, w_gate_up, s_gate_up, w_down, s_down, rows_per_token)
    return expert_ffn(x, expert_ids, dequantize(w_gate_up, s_gate_up, x.dtype),
                      dequantize(w_down, s_down, x.dtype), rows_per_token=rows_per_token)


def expert_ffn(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    rows_per_token: int = 1,
) -> torch.Tensor:
    """SwiGLU expert MLP over rows grouped by expert; each row's result is independent of
    how many rows each expert received.

    x: `[R / rows_per_token, D]`; expert_ids: `[R]` int64 indices into the local expert
    stack, or ``E`` for a row routed nowhere (it is never computed; its output row is
    unspecified); routed row r reads x row ``r // rows_per_token`` (a token's top-k rows
    share its x row: no expanded copy); w_gate_up: `[E, 2I, D]` (gate rows then up rows);
    w_down: `[E, D, I]`. Returns `[R, D]` in x.dtype: ``down_e(silu(gate_e x) * up_e x)``
    for each routed row, the same bits as the call with x's rows repeated.
    :class:`kernels.fp8.BlockFp8` weights (both): :func:`fp8_expert_ffn`.
    """
    if isinstance(w_gate_up, BlockFp8):
        return fp8_expert_ffn(x, expert_ids, w_gate_up.weight, w_gate_up.scale_inv, w_down.weight,
                              w_down.scale_inv, rows_per_token=rows_per_token)
    return _backend(x).expert_ffn(x, expert_ids, w_gate_up, w_down,
                                  rows_per_token=rows_per_token)


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of a token's k expert outputs in fp32, in ascending rank order.

    expert_out: `[T, k, D]` any float dtype; topk_weights: `[T, k]` float32.
    Returns `[T, D]` float32: ``((w0*o0 + w1*o1) + w2*o2) + ...``.
    """
    return _backend(expert_out).combine(expert_out, topk_weights)


def combine_residual(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's end and the next layer's input norm, as one pass.

    expert_out: `[T, k, D]`, topk_weights: `[T, k]` float32 as in :func:`combine`;
    residual: `[T, D]`; weight: `[D]` or None. ``h = residual + combine(expert_out,
    topk_weights).to(residual.dtype)``, rounded to that dtype. Without ``weight`` returns
    ``h``; with it returns ``(rms_norm(h, weight, eps), h)``. Bitwise the composition of
    :func:`combine`, the add and :func:`rms_norm`.
    """
    return _backend(expert_out).combine_residual(expert_out, topk_weights, residual, weight, eps)


def log_softmax(logits: torch.Tensor, greedy_out: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Row-invariant log-softmax in fp32. logits: `[B, V]`, any float dtype, computed in
    fp32 → `[B, V]` float32. A row's bits are a function of the row and its dtype (a
    backend's reduction layout may follow the width of the loads): callers pass the LM
    head's output as it is, on every path.

    greedy_out: `[B]` int64 or None; receives each row's greedy token, the first maximum
    of its log-probs (what ``torch.argmax`` of the output gives, and :func:`sample` at
    temperature 0), without another pass over the output.

    out: `[B, V]` float32 with contiguous rows (e.g. rows of a buffer reused across calls),
    which receives the result and is returned; None: a new tensor. Raises ``ValueError``
    for another shape, dtype, device or layout.
    """
    if out is not None and (tuple(out.shape) != tuple(logits.shape) or out.dtype != torch.float32
                            or out.device != logits.device or not out.is_contiguous()):
        raise ValueError(f"log_softmax: out must be a contiguous float32 tensor of shape "
                         f"{list(logits.shape)} on {logits.device}, got {list(out.shape)} "
                         f"{out.dtype} on {out.device}")
    return _backend(logits).log_softmax(logits, greedy_out, out)


def embed_tokens(
    embed: torch.Tensor,
    tokens: torch.Tensor,
    sources: torch.Tensor | None = None,
    sampled: torch.Tensor | None = None,
) -> torch.Tensor:
    """The embedding rows of a batch's input tokens: embed `[V, D]`, tokens `[T]` int32
    or int64 (any stride) → `[T, D]` in embed.dtype.

    sources `[T]` int32 and sampled `[N]` int64, both or neither: a row whose source is
    >= 0 takes token ``sampled[source]`` instead of its own (async scheduling: a decode
    row's input is the previous step's sample, not yet read by the host). Exact copies.
    """
    return _backend(embed).embed_tokens(embed, tokens, sources, sampled)


def counter_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): a pure function of (seed, position, vocab index).

    seeds, positions: `[B]` int64. Returns `[B, vocab_size]` float64. Backends may differ
    from each other; within one backend the value never depends on the batch.
    """
    return _backend(seeds).counter_uniform(seeds, positions, vocab_size)


def sample(
    logprobs: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Sample one token per row, batch-invariantly.

    logprobs: `[B, V]` float32 (from :func:`log_softmax`); temperatures, top_ps, min_ps:
    `[B]` float32 (temperature 0 = greedy: argmax, lowest id on ties); top_ks: `[B]` int64
    (0 = off); seeds, positions: `[B]` int64. Filtering (top-k, then top-p, then min-p)
    uses the tempered distribution; the draw is the Gumbel-max trick with
    :func:`counter_uniform` noise, so a row's token depends only on its own inputs.
    temperatures, top_ks, top_ps and min_ps may be host tensors while the rest is on the
    device (the CUDA backend reads those four on the host).
    Returns `[B]` int64 token ids.
    """
    return _backend(logprobs).sample(
        logprobs, temperatures, top_ks, top_ps, min_ps, seeds, positions
    )
