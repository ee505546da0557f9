"""CPU implementation of the kernel API, batch-invariant bitwise and machine-independent.

The kernels (linear, expert FFN, attention, RMSNorm, routing, combine, log-softmax) are C++
(kernels/cpu_src/, built on first use by :mod:`megaserve.kernels.cpu_ext` and called
through ctypes, which releases the GIL). Their arithmetic order is fixed in that source:

* **GEMMs** accumulate every output element over k in ascending order with fused
  multiply-adds (the vector lanes are output columns), so a row's bits depend only on the
  row and the weights, never on M, its place in a micro-kernel, or the thread count.
  Weights are packed once into `[ceil(N / P), K, P]` panels (:func:`packed`; P is the
  build's micro-kernel width, 64 or 16; expert gate/up weights as gate/up panel pairs,
  :func:`packed_gate_up`), cached per weight tensor.
* **Row sums** (RMSNorm, log-softmax, routing softmax, attention denominators) use 16
  partial sums folded by a fixed halving tree.
* **Attention** runs one query token at a time over exactly the keys at or before its
  position (unowned cache slots are never read), so a token's result is the same in a
  decode step, in any prefill chunk and next to any other tokens.
* **exp / log** are polynomials in the source (libm's pick FMA or non-FMA code by CPU);
  no FMA contraction, no ``-ffast-math``: the only fused multiply-adds are the explicit
  ones of the dot products (GEMMs, attention), one rounding in every build (libm's
  correctly rounded ``fmaf`` in the baseline build), and the ISA flags only change the
  vector width.

The rest (KV-cache writes, SwiGLU of dense MLPs, sampling) are torch ops, exact per
element or run one row at a time; the fused API calls (rotary_and_cache, combine_residual)
are compositions of these, except float32 rotary_and_cache, compiled too (one pass per
token: q/k norm, rotary, cache writes; the composition's bits).
bfloat16 inputs are computed in float32 and rounded once at the end.
Tests: tests/kernels/test_cpu_kernels.py, tests/kernels/test_cpu_batched_kernels.py,
tests/kernels/test_cpu_ext.py.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from . import cpu_ext
from .filters import filter_row

# Rows per block of the compiled expert FFN: the rows of a block share one pass over their
# expert's weights (threads split a block by columns). Never changes a bit.
EXPERT_ROW_TILE = 96
_M32 = 0xFFFFFFFF

# Threads the compiled kernels spread each call over (set_num_lanes). A row, expert task or
# query token computes the same bits whichever thread runs it.
_lanes = 1
# Calls with fewer rows (tokens) than this run on the calling thread alone: waking a
# helper costs more than it saves on a few rows (a lone decode step's ~40 calls).
PARALLEL_MIN_ROWS = 16


def _lanes_for(num_rows: int) -> int:
    return _lanes if num_rows >= PARALLEL_MIN_ROWS else 1


def set_num_lanes(num_lanes: int) -> None:
    """Spread each compiled kernel call over ``num_lanes`` threads (this one and helpers
    in the extension's pool). Raises ``ValueError`` for ``num_lanes < 1``."""
    global _lanes
    if isinstance(num_lanes, bool) or not isinstance(num_lanes, int) or num_lanes < 1:
        raise ValueError(f"num_lanes must be a positive integer, got {num_lanes!r}")
    _lanes = num_lanes


# (id(weight), layout) -> (weak reference, version, data_ptr, packed panels)
_PACKED: dict[tuple[int, str], tuple[weakref.ref, int, int, torch.Tensor]] = {}


def _cached(weight: torch.Tensor, layout: str, pack) -> torch.Tensor:
    """``pack(weight)``, cached per weight tensor and layout; re-packed when the tensor is
    modified in place (its version or storage changes)."""
    key = (id(weight), layout)
    hit = _PACKED.get(key)
    if (hit is not None and hit[0]() is weight and hit[1] == weight._version
            and hit[2] == weight.data_ptr()):
        return hit[3]
    out = pack(weight)
    _PACKED[key] = (weakref.ref(weight, lambda _, key=key: _PACKED.pop(key, None)),
                    weight._version, weight.data_ptr(), out)
    return out


def _panels(weight: torch.Tensor) -> torch.Tensor:
    *lead, n, k = weight.shape
    width = cpu_ext.load().ms_panel_width()
    panels = -(-n // width)
    w = F.pad(weight.float(), (0, 0, 0, panels * width - n))
    return w.view(*lead, panels, width, k).transpose(-1, -2).contiguous()


def packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` `[..., N, K]` as float32 panels `[..., ceil(N / P), K, P]` (zero past N;
    P = the loaded extension's ``ms_panel_width()``: 64 in the AVX-512 build, 16 in the
    others), the layout the compiled GEMMs read. Cached per weight tensor (NOTE: the cache
    is a second copy of every weight)."""
    return _cached(weight, "panels", _panels)


def _gate_up_pairs(w_gate_up: torch.Tensor) -> torch.Tensor:
    *lead, two_inter, k = w_gate_up.shape
    gate, up = _panels(w_gate_up[..., : two_inter // 2, :]), _panels(w_gate_up[..., two_inter // 2:, :])
    pairs, width = gate.shape[-3], gate.shape[-1]
    return torch.stack([gate, up], dim=-3).reshape(*lead, 2 * pairs, k, width)


def packed_gate_up(w_gate_up: torch.Tensor) -> torch.Tensor:
    """Expert gate/up weights `[E, 2I, D]` (gate rows first) as panel pairs
    `[E, 2 * ceil(I / P), D, P]`: panel 2j holds gate rows j * P.., panel 2j + 1 the up rows
    of the same outputs (each zero past I), so a task of the compiled expert FFN reads the
    gate and up columns of its outputs together. Cached like :func:`packed`."""
    return _cached(w_gate_up, "gate_up_pairs", _gate_up_pairs)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def _as(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 kernel output in ``dtype`` (no dispatch when it already is: ~2 us a call,
    ~40 calls a decode step)."""
    return out if out.dtype == dtype else out.to(dtype)


def _output(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised buffer a compiled kernel fills completely (the tests poison it)."""
    return torch.empty(*shape, dtype=dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    num_rows, k = x.shape
    n = weight.shape[0]
    xf = _f32(x)
    bf = _f32(bias) if bias is not None else None
    out = _output(num_rows, n)
    if num_rows:
        cpu_ext.load().ms_linear(xf.data_ptr(), num_rows, k, packed(weight).data_ptr(), n,
                                 bf.data_ptr() if bf is not None else None, out.data_ptr(),
                                 _lanes_for(num_rows))
    return _as(out, x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    d = shape[-1]
    if x.dtype == torch.float32:
        # The kernel adds the residual and applies the weight (fp32 throughout).
        xf = _f32(x.reshape(-1, d))
        res = _f32(residual.reshape(-1, d)) if residual is not None else None
        num_rows = xf.shape[0]
        y = _output(num_rows, d)
        h = _output(num_rows, d) if res is not None else None
        if num_rows:
            cpu_ext.load().ms_rms_norm(
                xf.data_ptr(), res.data_ptr() if res is not None else None,
                _f32(weight).data_ptr(), num_rows, d, eps, y.data_ptr(),
                h.data_ptr() if h is not None else None, _lanes)
        y = y.view(shape)
        return (y, h.view(shape)) if h is not None else y
    # Other dtypes: the residual sum in x.dtype; the normalised value rounded to x.dtype,
    # then multiplied by the weight in that dtype (as HF does).
    if residual is not None:
        x = x + residual
    hf = _f32(x.reshape(-1, d))
    normed = _output(hf.shape[0], d)
    if hf.shape[0]:
        cpu_ext.load().ms_rms_norm(hf.data_ptr(), None, None, hf.shape[0], d, eps,
                                   normed.data_ptr(), None, _lanes)
    y = weight * normed.view(shape).to(x.dtype)
    return (y, x) if residual is not None else y


def linear_rms_norm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm(linear(x, weight), norm_weight, eps, residual)


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
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0  # slot -1: a padding row (decode graphs) that writes no K/V
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


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
    """float32 (activations, tables, norms and caches, the caches contiguous): the
    compiled pass; other dtypes: the composition it reproduces bitwise."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    tensors = [qkv, cos, sin, k_cache, v_cache] + [n for n in (q_norm, k_norm) if n is not None]
    if (any(t.dtype != torch.float32 for t in tensors) or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or (q_norm is None) != (k_norm is None)
            or head_dim % 2 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim):
        return composed_rotary_and_cache(rms_norm, write_kv_cache, qkv, positions, cos, sin,
                                         q_norm, k_norm, eps, k_cache, v_cache, slot_mapping,
                                         num_q_heads)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    norms = [n.contiguous() if n is not None else None for n in (q_norm, k_norm)]
    q = _output(num_tokens, num_q_heads, head_dim)
    if num_tokens and cpu_ext.load().ms_rotary_and_cache(
            qkv.data_ptr(), pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            *(n.data_ptr() if n is not None else None for n in norms), eps,
            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), num_tokens, num_q_heads,
            num_kv_heads, head_dim, q.data_ptr(), _lanes_for(num_tokens)) != 0:
        raise IndexError(f"rotary_and_cache: a position outside the {cos.shape[0]} rows of "
                         "the cos/sin tables")
    return q


def composed_rotary_and_cache(norm, write, qkv, positions, cos, sin, q_norm, k_norm, eps,
                              k_cache, v_cache, slot_mapping, num_q_heads) -> torch.Tensor:
    """``rotary_and_cache`` (arguments as in the API) composed of a backend's ``norm``
    (its rms_norm), ``write`` (its write_kv_cache) and torch's elementwise ops, each
    rounding once: the unfused sequence the fused kernels reproduce bitwise."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if head_dim % 2 or qkv.shape[1] != q_size + 2 * kv_size:
        raise ValueError(f"rotary_and_cache: qkv {tuple(qkv.shape)} does not hold "
                         f"{num_q_heads} + 2 x {num_kv_heads} heads of an even dim {head_dim}")
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if q_norm is not None:
        q = norm(q.reshape(-1, head_dim), q_norm, eps)  # [T*Hq, Dh]
        k = norm(k.reshape(-1, head_dim), k_norm, eps)
        qk = torch.cat([q.view(num_tokens, -1), k.view(num_tokens, -1)], dim=-1)
    else:
        qk = qkv[:, : q_size + kv_size]
    x = qk.reshape(num_tokens, num_q_heads + num_kv_heads, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    qk = x * cos[positions][:, None, :] + rotated * sin[positions][:, None, :]
    q, k = qk.split([num_q_heads, num_kv_heads], dim=1)
    write(k, v.reshape(num_tokens, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    one_token_per_seq: bool = False,  # a hint the per-token loop has no use for
) -> torch.Tensor:
    """One query token at a time over the keys at or before its position (module docstring):
    a token's bits depend only on its query and those keys. float32 or bfloat16 caches."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0:
        return torch.empty_like(q)
    if k_cache.dtype == torch.float32:
        fn = cpu_ext.load().ms_paged_attention_f32
    elif k_cache.dtype == torch.bfloat16:
        fn = cpu_ext.load().ms_paged_attention_bf16
    else:
        raise ValueError(f"CPU attention supports float32 and bfloat16 caches, got {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("CPU attention needs contiguous KV caches")
    qf = _f32(q)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    if int(starts[-1]) != num_tokens:
        raise ValueError(f"query_start_loc ends at {int(starts[-1])}, q has {num_tokens} tokens")
    out = _output(num_tokens, num_q_heads, head_dim)
    fn(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
       lens.data_ptr(), starts.data_ptr(), lens.shape[0], num_tokens, num_q_heads, num_kv_heads,
       head_dim, block_size, scale, out.data_ptr(), _lanes_for(num_tokens))
    return _as(out, q.dtype)


def topk_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _f32(router_logits)
    num_tokens, num_experts = logits.shape
    ids = _output(num_tokens, top_k, dtype=torch.int64)
    weights = _output(num_tokens, top_k)
    if num_tokens:
        cpu_ext.load().ms_topk_route(logits.data_ptr(), num_tokens, num_experts, top_k,
                                     int(renormalize), ids.data_ptr(), weights.data_ptr(), _lanes)
    return ids, weights


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool):
    return topk_route(linear(x, weight), top_k, renormalize)


def expert_ffn(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    rows_per_token: int = 1,
) -> torch.Tensor:
    """Rows grouped by expert (stable), in blocks of up to EXPERT_ROW_TILE rows that read
    their expert's weights once; each row's GEMMs accumulate in a fixed order, so its bits
    never depend on the other rows. The
    extension reads one x row per routed row: with ``rows_per_token`` > 1 the float32 copy
    of x (made anyway) is expanded to `[R, D]` here."""
    num_experts, two_inter, hidden = w_gate_up.shape
    num_rows = expert_ids.shape[0]
    if rows_per_token < 1 or x.shape[0] * rows_per_token != num_rows:
        raise ValueError(f"expert_ffn: x has {x.shape[0]} rows, expert_ids {num_rows}; need "
                         f"x rows * rows_per_token ({rows_per_token}) == expert_ids rows")
    xf = _f32(x)
    if rows_per_token != 1:
        # [R, D]; contiguous: at one token the reshape is a view with row stride 0.
        xf = xf[:, None].expand(-1, rows_per_token, hidden).reshape(num_rows, hidden)
        xf = xf.contiguous()
    ids = expert_ids.to(torch.int64).contiguous()
    out = _output(num_rows, hidden)
    if num_rows and cpu_ext.load().ms_expert_ffn(
            xf.data_ptr(), ids.data_ptr(), num_rows, hidden, two_inter // 2, num_experts,
            packed_gate_up(w_gate_up).data_ptr(), packed(w_down).data_ptr(), out.data_ptr(),
            EXPERT_ROW_TILE, _lanes_for(num_rows)) != 0:
        raise ValueError(f"expert ids must lie in [0, {num_experts}] ({num_experts}: routed "
                         "nowhere)")
    return _as(out, x.dtype)


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    x = _f32(expert_out)
    w = _f32(topk_weights)
    num_tokens, top_k, hidden = x.shape
    out = _output(num_tokens, hidden)
    if num_tokens:
        cpu_ext.load().ms_combine(x.data_ptr(), w.data_ptr(), num_tokens, top_k, hidden,
                                  out.data_ptr(), _lanes)
    return out


def combine_residual(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out = _as(combine(expert_out, topk_weights), residual.dtype)
    if weight is None:
        return residual + out
    return rms_norm(out, weight, eps, residual=residual)  # out + residual: the same add


def log_softmax(logits: torch.Tensor, greedy_out: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    x = _f32(logits)
    if out is None:  # (kernels.api.log_softmax checks a given one)
        out = _output(*x.shape)
    if x.numel():
        cpu_ext.load().ms_log_softmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), _lanes)
    if greedy_out is not None:
        greedy_out.copy_(out.argmax(dim=-1))
    return out


def embed_tokens(embed: torch.Tensor, tokens: torch.Tensor, sources: torch.Tensor | None = None,
                 sampled: torch.Tensor | None = None) -> torch.Tensor:
    if (sources is None) != (sampled is None):
        raise ValueError("embed_tokens: pass both sources and sampled, or neither")
    ids = tokens.long()
    if sources is not None:
        src = sources.long()
        ids = torch.where(src >= 0, sampled[src.clamp(min=0)], ids)
    return embed[ids]


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
