"""Row-wise Triton kernels: RMSNorm (+ residual), SwiGLU, combine (+ residual and the next
RMSNorm), log-softmax (+ the greedy token), the embedding lookup.

Shape legend: T = tokens, D = hidden, I = intermediate, k = experts per token, V = vocab.

Every kernel runs one row per program with a block size fixed by the row length, so a
row's reduction order (``tl.sum`` over a fixed-size block, blocks folded in ascending
order) is a function of the row length only, never of the number of rows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import pdl
from .parts import Parts, fold_row_parts

# Kernels that fold a linear's parts store the row and load it back before reducing it
# (_rms_norm_kernel's docstring); "0" reduces the folded row as it is (A/B runs).
PARTS_RELOAD = os.environ.get("MEGASERVE_PARTS_RELOAD", "1") != "0"
_MAX_ROW_BLOCK = 4096  # longer rows are reduced in chunks of this many elements


@triton.jit
def rms_rstd(h, D, eps):
    """``1 / sqrt(mean(h * h) + eps)`` of one row ``h`` (fp32, zero past ``D``): the one
    reduction of RMSNorm. Every RMSNorm kernel calls this on a row loaded whole, with the
    warps of :func:`norm_warps`, so the fused kernels reduce in the order rms_norm does."""
    var = tl.sum(h * h, axis=0) / D
    return tl.math.rsqrt(var + eps)


@triton.jit
def rms_rstd_rows(h, D, eps):
    """:func:`rms_rstd` of each row of a tile ``h`` `[R, BLOCK_D]` (fp32), as `[R, 1]`. A
    row's bits are :func:`rms_rstd`'s on that row alone when the tile lays each row out as
    a one-warp program lays it out alone (one warp's lanes, BLOCK_D / 32 contiguous columns
    a thread; the caller's job, checked bitwise by GPU tests)."""
    var = tl.sum(h * h, axis=1) / D
    return tl.math.rsqrt(var + eps)[:, None]


@triton.jit
def rms_apply(h, rstd, w, DTYPE: tl.constexpr):
    """``w * (h * rstd).to(DTYPE)`` rounded to DTYPE: the normalised value is cast before
    the weight multiply, as in HF. Elementwise, so a rotary partner loaded apart gets the
    bits its own column gets."""
    return (w * (h * rstd).to(DTYPE)).to(DTYPE)


def norm_warps(block_d: int) -> int:
    """Warps of a one-row RMSNorm program over ``block_d`` columns (part of the bits: the
    reduction's layout)."""
    return min(16, max(1, block_d // 512))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, bias_ptr, D, eps,
                     stride_x, stride_r, stride_o, stride_h, stride_ps, stride_pf, stride_pt,
                     HAS_RES: tl.constexpr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     RELOAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """PARTS > 0 (with HAS_RES): x_ptr holds the PARTS unfolded parts of a linear's
    output (:class:`parts.Parts` at strides stride_p*, bias at bias_ptr if HAS_BIAS), folded here;
    h is then stored and, with RELOAD, loaded back, so that the reduction reads a row
    loaded as the plain kernel loads its x (the layout of a reduction's operand, and with
    it the order of its adds, may follow the width of the loads it comes from)."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if PARTS > 0:
        x = fold_row_parts(x_ptr, bias_ptr, cols, row, mask, stride_ps, stride_pf, stride_pt,
                           PARTS, HAS_BIAS).to(out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x + r).to(out_ptr.dtype.element_ty)  # h = x + residual, in x.dtype
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
        if RELOAD:
            tl.debug_barrier()  # the block's stores of h are visible to its loads
            x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = rms_apply(h, rms_rstd(h, D, eps), w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor | Parts, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """See ``megaserve.kernels.api.rms_norm``. x: `[T, D]`; weight: `[D]`; residual: `[T, D]` or None.

    x may be a linear's unfolded :class:`parts.Parts` (with a residual), folded here
    to the bits the folded linear would give."""
    parts = x if isinstance(x, Parts) else None
    if parts is not None:
        if residual is None:
            raise ValueError("rms_norm: unfolded parts need a residual")
        x = parts.ws
        t, d, dtype = parts.num_rows, parts.num_features, parts.dtype
    else:
        t, d = x.shape
        dtype = x.dtype
        x = x if x.stride(1) == 1 else x.contiguous()
    block_d = triton.next_power_of_2(d)
    if block_d > 65536:
        raise ValueError(f"rms_norm: hidden size {d} too large (max 65536)")
    out = torch.empty(t, d, dtype=dtype, device=x.device)
    h = torch.empty_like(out) if residual is not None else out
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    res = residual if residual is not None else x
    bias = parts.bias if parts is not None and parts.bias is not None else out
    if t:
        _rms_norm_kernel[(t,)](x, res, weight, out, h, bias, d, float(eps),
                               x.stride(0), res.stride(0), out.stride(0), h.stride(0),
                               *(parts.strides if parts is not None else (0, 0, 0)),
                               HAS_RES=residual is not None,
                               PARTS=parts.ws.shape[0] if parts is not None else 0,
                               HAS_BIAS=parts is not None and parts.bias is not None,
                               RELOAD=parts is not None and PARTS_RELOAD,
                               BLOCK_D=block_d, num_warps=norm_warps(block_d),
                               **pdl.launch_args(x.device))
    return (out, h) if residual is not None else out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_g + I + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # silu in fp32, rounded like F.silu
    tl.store(out_ptr + row * stride_o + cols, act * up, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up `[T, 2I]` (gate first) → `silu(gate) * up` `[T, I]`, elementwise."""
    t, two_i = gate_up.shape
    i = two_i // 2
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if t and i:
        _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0),
                                                     out.stride(0), BLOCK=block, num_warps=4)
    return out


@triton.jit
def _combine_kernel(eo_ptr, w_ptr, out_ptr, D, stride_et, stride_ek, stride_wt,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    w0 = tl.load(w_ptr + row * stride_wt)
    acc = w0 * tl.load(eo_ptr + row * stride_et + cols, mask=mask, other=0.0).to(tl.float32)
    for rank in tl.static_range(1, TOP_K):  # ascending rank order, fixed
        w = tl.load(w_ptr + row * stride_wt + rank)
        o = tl.load(eo_ptr + row * stride_et + rank * stride_ek + cols, mask=mask, other=0.0)
        acc = acc + w * o.to(tl.float32)
    tl.store(out_ptr + row * D + cols, acc, mask=mask)


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """expert_out `[T, k, D]`, topk_weights `[T, k]` float32 → `[T, D]` float32 (into
    ``out``, contiguous, where given: the same bits)."""
    t, k, d = expert_out.shape
    expert_out = expert_out if expert_out.stride(2) == 1 else expert_out.contiguous()
    w = topk_weights.float().contiguous()
    if out is None:
        out = torch.empty(t, d, dtype=torch.float32, device=expert_out.device)
    block = 1024
    if t and d:
        _combine_kernel[(t, triton.cdiv(d, block))](
            expert_out, w, out, d, expert_out.stride(0), expert_out.stride(1), w.stride(0),
            TOP_K=k, BLOCK=block, num_warps=4)
    return out


@triton.jit
def mul_rounded(a, b, NO_CONTRACT: tl.constexpr):
    """``a * b`` in fp32, rounded on its own: never contracted into an FMA with the add
    that consumes it (torch rounds every op; the compiler would fuse ``x * c + y``).
    NO_CONTRACT off only where libdevice is absent (the Triton interpreter, whose numpy
    ops round each op anyway)."""
    if NO_CONTRACT:
        return libdevice.mul_rn(a, b)
    return a * b


def no_contract() -> bool:
    """Whether kernels can call libdevice's ``mul_rn`` (not under TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@triton.jit
def _combine_residual_kernel(eo_ptr, w_ptr, res_ptr, nw_ptr, out_ptr, h_ptr, D, eps,
                             stride_et, stride_ek, stride_wt, stride_r, stride_o, stride_h,
                             TOP_K: tl.constexpr, HAS_NORM: tl.constexpr,
                             NO_CONTRACT: tl.constexpr, BLOCK_D: tl.constexpr,
                             PDL: tl.constexpr):
    pdl.wait_then_release(PDL)  # first: no memory access before it
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    # combine: _combine_kernel's expression, term by term, in ascending rank order
    w0 = tl.load(w_ptr + row * stride_wt)
    o0 = tl.load(eo_ptr + row * stride_et + cols, mask=mask, other=0.0).to(tl.float32)
    if TOP_K == 1:  # a lone product would contract with the residual add below
        acc = mul_rounded(w0, o0, NO_CONTRACT)
    else:
        acc = w0 * o0
    for rank in tl.static_range(1, TOP_K):
        w = tl.load(w_ptr + row * stride_wt + rank)
        o = tl.load(eo_ptr + row * stride_et + rank * stride_ek + cols, mask=mask, other=0.0)
        acc = acc + w * o.to(tl.float32)
    dtype = h_ptr.dtype.element_ty
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    x = (r + acc.to(dtype)).to(dtype)  # h = residual + combine, in the residual's dtype
    tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    if HAS_NORM:
        h = x.to(tl.float32)
        nw = tl.load(nw_ptr + cols, mask=mask, other=0.0)
        y = rms_apply(h, rms_rstd(h, D, eps), nw, dtype)
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def combine_residual(expert_out: torch.Tensor, topk_weights: torch.Tensor,
                     residual: torch.Tensor, weight: torch.Tensor | None = None,
                     eps: float = 0.0):
    """See ``megaserve.kernels.api.combine_residual``: one row per program, the combine of
    :func:`combine`, the add of ``residual + out.to(dtype)``, the reduction of
    :func:`rms_norm` (same block and warps)."""
    t, k, d = expert_out.shape
    block_d = triton.next_power_of_2(d)
    if block_d > 65536:
        raise ValueError(f"combine_residual: hidden size {d} too large (max 65536)")
    expert_out = expert_out if expert_out.stride(2) == 1 else expert_out.contiguous()
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    w = topk_weights.float().contiguous()
    h = torch.empty(t, d, dtype=residual.dtype, device=residual.device)
    out = torch.empty_like(h) if weight is not None else h
    if t:
        _combine_residual_kernel[(t,)](
            expert_out, w, residual, weight if weight is not None else h, out, h, d,
            float(eps), expert_out.stride(0), expert_out.stride(1), w.stride(0),
            residual.stride(0), out.stride(0), h.stride(0), TOP_K=k,
            HAS_NORM=weight is not None, NO_CONTRACT=no_contract(), BLOCK_D=block_d,
            num_warps=norm_warps(block_d), **pdl.launch_args(h.device))
    return (out, h) if weight is not None else h


@triton.jit
def _softmax_parts_kernel(x_ptr, m_ptr, s_ptr, V, stride_x, NUM_CHUNKS, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    """Chunk c of row r: m = max, s = sum(exp(x - m)) over its BLOCK columns."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk: s = 0, no NaN
    tl.store(m_ptr + row * NUM_CHUNKS + chunk, m)
    tl.store(s_ptr + row * NUM_CHUNKS + chunk, tl.sum(tl.exp(x - m_safe), axis=0))


@triton.jit
def _softmax_out_kernel(x_ptr, m_ptr, s_ptr, out_ptr, gv_ptr, gi_ptr, V, stride_x, stride_o,
                        NUM_CHUNKS, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                        GREEDY: tl.constexpr, PDL: tl.constexpr):
    """Chunk c of row r: ``(x - max) - log(sum_c s_c * exp(m_c - max))``; every chunk of a
    row folds the same parts the same way, so they agree on the row's max and log-sum."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_C)
    ok = parts < NUM_CHUNKS
    ms = tl.load(m_ptr + row * NUM_CHUNKS + parts, mask=ok, other=float("-inf"))
    ss = tl.load(s_ptr + row * NUM_CHUNKS + parts, mask=ok, other=0.0)
    row_max = tl.max(ms, axis=0)
    scale = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - row_max))
    log_z = tl.log(tl.sum(ss * scale, axis=0))
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x - row_max) - log_z
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if GREEDY:  # the chunk's first maximum, for _greedy_fold_kernel
        # one reduction for the value and its index; ties: the first column
        top, best = tl.max(tl.where(mask, y, float("-inf")), axis=0, return_indices=True,
                           return_indices_tie_break_left=True)
        tl.store(gv_ptr + row * NUM_CHUNKS + tl.program_id(1), top)
        tl.store(gi_ptr + row * NUM_CHUNKS + tl.program_id(1),
                 tl.program_id(1) * BLOCK + best.to(tl.int64))


@triton.jit
def _greedy_fold_kernel(gv_ptr, gi_ptr, tok_ptr, NUM_CHUNKS, BLOCK_C: tl.constexpr,
                        PDL: tl.constexpr):
    """Row r's greedy token: the first chunk holding the row's maximum, that chunk's first
    maximum: the row's first maximum, as ``torch.argmax``."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_C)
    ok = parts < NUM_CHUNKS
    vals = tl.load(gv_ptr + row * NUM_CHUNKS + parts, mask=ok, other=float("-inf"))
    first = tl.argmax(vals, axis=0, tie_break_left=True)
    tl.store(tok_ptr + row, tl.load(gi_ptr + row * NUM_CHUNKS + first))


def log_softmax(logits: torch.Tensor, greedy_out: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """logits `[B, V]` (any float dtype, computed in fp32) → `[B, V]` float32: each row in
    chunks of ``_MAX_ROW_BLOCK`` columns, one program per (row, chunk) in two launches
    (chunk max and exp-sum, then the output), so a lone row (batch-1 decode over a 152k
    vocabulary) runs on many SMs. The chunking and every reduction's shape are functions
    of V only: row-invariant. ``greedy_out`` (`[B]` int64): each row's first maximum, from
    the output launch's chunk maxima and a third launch of one program per row."""
    b, v = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    if out is None:  # (kernels.api.log_softmax checks a given one)
        out = torch.empty(b, v, dtype=torch.float32, device=logits.device)
    if not (b and v):
        return out
    block = min(_MAX_ROW_BLOCK, triton.next_power_of_2(v))
    chunks = triton.cdiv(v, block)
    block_c = max(16, triton.next_power_of_2(chunks))
    parts = torch.empty(2, b, chunks, dtype=torch.float32, device=logits.device)
    greedy = greedy_out is not None
    if greedy and (greedy_out.shape != (b,) or greedy_out.dtype != torch.int64):
        raise ValueError(f"log_softmax: greedy_out must be [{b}] int64, got "
                         f"{tuple(greedy_out.shape)} {greedy_out.dtype}")
    if greedy:
        best_val = torch.empty(b, chunks, dtype=torch.float32, device=logits.device)
        best_idx = torch.empty(b, chunks, dtype=torch.int64, device=logits.device)
    else:
        best_val, best_idx = parts[0], parts[1]  # unused
    launch = dict(num_warps=8, **pdl.launch_args(out.device))
    _softmax_parts_kernel[(b, chunks)](logits, parts[0], parts[1], v, logits.stride(0), chunks,
                                       BLOCK=block, **launch)
    _softmax_out_kernel[(b, chunks)](logits, parts[0], parts[1], out, best_val, best_idx, v,
                                     logits.stride(0), out.stride(0), chunks, BLOCK=block,
                                     BLOCK_C=block_c, GREEDY=greedy, **launch)
    if greedy:
        _greedy_fold_kernel[(b,)](best_val, best_idx, greedy_out, chunks, BLOCK_C=block_c,
                                  num_warps=1, **pdl.launch_args(out.device))
    return out


@triton.jit
def _embed_kernel(embed_ptr, tok_ptr, src_ptr, sampled_ptr, out_ptr, D, stride_e, stride_t,
                  stride_s, stride_o, HAS_SOURCES: tl.constexpr, BLOCK_D: tl.constexpr,
                  PDL: tl.constexpr):
    """Row r: ``embed[token]``, token = ``sampled[source]`` where HAS_SOURCES and the
    row's source is >= 0, else ``tokens[r]``."""
    pdl.wait_then_release(PDL)  # first: no memory access before it
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(tok_ptr + row * stride_t).to(tl.int64)
    if HAS_SOURCES:
        src = tl.load(src_ptr + row * stride_s).to(tl.int64)
        picked = tl.load(sampled_ptr + tl.maximum(src, 0), mask=src >= 0, other=0)
        tok = tl.where(src >= 0, picked.to(tl.int64), tok)
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        mask = d0 + cols < D
        x = tl.load(embed_ptr + tok * stride_e + d0 + cols, mask=mask)
        tl.store(out_ptr + row * stride_o + d0 + cols, x, mask=mask)


def embed_tokens(embed: torch.Tensor, tokens: torch.Tensor, sources: torch.Tensor | None = None,
                 sampled: torch.Tensor | None = None) -> torch.Tensor:
    """See ``megaserve.kernels.api.embed_tokens``: one program per row, one launch."""
    t = tokens.shape[0]
    v, d = embed.shape
    if embed.stride(1) != 1:
        raise ValueError("embed_tokens: embedding rows must be contiguous")
    if (sources is None) != (sampled is None):
        raise ValueError("embed_tokens: pass both sources and sampled, or neither")
    out = torch.empty(t, d, dtype=embed.dtype, device=embed.device)
    if t and d:
        has = sources is not None
        _embed_kernel[(t,)](
            embed, tokens, sources if has else tokens, sampled if has else tokens, out, d,
            embed.stride(0), tokens.stride(0), sources.stride(0) if has else 0, out.stride(0),
            HAS_SOURCES=has, BLOCK_D=min(triton.next_power_of_2(d), 4096), num_warps=4,
            **pdl.launch_args(out.device))
    return out
