"""MoE kernels: stable top-k routing and the SwiGLU expert FFN over rows grouped by expert.

Shape legend: T = tokens, E = experts, k = top-k, R = routed rows, D = hidden,
I = expert intermediate.

NOTE: the grouped GEMM gives every row the same fixed tile config and K loop whatever
the expert's row count: a row's bits depend on its own input and its expert's weights
only. Rows are stably sorted by expert; tiles are numbered per expert as
``offsets[e] // BLOCK_M + e`` onward (a bound, so no host synchronisation is needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rowwise import silu_and_mul


@triton.jit
def _topk_kernel(logit_ptr, ids_ptr, w_ptr, E, stride_l, TOP_K: tl.constexpr,
                 RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logit_ptr + row * stride_l + cols, mask=cols < E, other=float("-inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    remaining = tl.where(cols < E, probs, -1.0)
    total = 0.0
    for rank in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=0, tie_break_left=True)  # ties: lowest expert id
        w = tl.max(remaining, axis=0)
        tl.store(ids_ptr + row * TOP_K + rank, best.to(tl.int64))
        tl.store(w_ptr + row * TOP_K + rank, w)
        total = total + w  # ascending rank order
        remaining = tl.where(cols == best, -2.0, remaining)
    if RENORM:
        ranks = tl.arange(0, TOP_K)
        ws = tl.load(w_ptr + row * TOP_K + ranks)
        tl.store(w_ptr + row * TOP_K + ranks, ws / total)


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """router_logits `[T, E]` → (ids `[T, k]` int64, weights `[T, k]` float32), rank order."""
    t, e = router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"topk_route: top_k={top_k} must be in 1..{e}")
    if top_k & (top_k - 1) and renormalize:
        # tl.arange needs a power of two; renormalise on the host side of the kernel.
        ids, w = topk_route(router_logits, top_k, False)
        return ids, w / _ordered_sum(w).unsqueeze(-1)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        _topk_kernel[(t,)](logits, ids, w, e, logits.stride(0), TOP_K=top_k,
                           RENORM=renormalize, BLOCK_E=triton.next_power_of_2(e), num_warps=1)
    return ids, w


def _ordered_sum(w: torch.Tensor) -> torch.Tensor:
    total = w[:, 0]
    for rank in range(1, w.shape[1]):
        total = total + w[:, rank]
    return total


@triton.jit
def _grouped_gemm_kernel(a_ptr, rows_ptr, w_ptr, c_ptr, offsets_ptr, num_experts, N, K,
                         stride_am, stride_we, stride_wn, stride_cm,
                         GATHER: tl.constexpr, SCATTER: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    # Expert of this tile: the last e with offsets[e] // BLOCK_M + e <= pid.
    lo = 0
    hi = num_experts
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(offsets_ptr + mid) // BLOCK_M + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    expert = lo - 1
    start = tl.load(offsets_ptr + expert)
    count = tl.load(offsets_ptr + expert + 1) - start
    local = (pid - (start // BLOCK_M + expert)) * BLOCK_M
    if local >= count:
        return
    idx = start + local + tl.arange(0, BLOCK_M)  # positions in the sorted order
    row_ok = local + tl.arange(0, BLOCK_M) < count
    src = tl.load(rows_ptr + idx, mask=row_ok, other=0) if GATHER else idx
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + src.to(tl.int64)[:, None] * stride_am
    w_base = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        a = tl.load(a_base + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + (k0 + kk)[None, :], mask=(cols[:, None] < N) & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    dst = tl.load(rows_ptr + idx, mask=row_ok, other=0) if SCATTER else idx
    tl.store(c_ptr + dst.to(tl.int64)[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


_BM, _BN, _BK = 64, 128, 64


def _grouped_gemm(a: torch.Tensor, order: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                  gather: bool, scatter: bool) -> torch.Tensor:
    """Rows (sorted by expert) times their expert's `[N, K]` weight; see module NOTE."""
    r = order.shape[0]
    num_experts, n, k = w.shape
    out = torch.empty(r, n, dtype=a.dtype, device=a.device)
    grid = (r // _BM + num_experts, triton.cdiv(n, _BN))
    _grouped_gemm_kernel[grid](a, order, w, out, offsets, num_experts, n, k,
                               a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               GATHER=gather, SCATTER=scatter, BLOCK_M=_BM, BLOCK_N=_BN,
                               BLOCK_K=_BK, num_warps=4, num_stages=3)
    return out


def expert_ffn(x: torch.Tensor, expert_ids: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor) -> torch.Tensor:
    """x `[R, D]`, expert_ids `[R]`, w_gate_up `[E, 2I, D]`, w_down `[E, D, I]` → `[R, D]`."""
    r = x.shape[0]
    num_experts = w_gate_up.shape[0]
    if r == 0:
        return torch.empty(0, w_down.shape[1], dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    sorted_ids, order = torch.sort(expert_ids, stable=True)  # order: [R] source row per slot
    # Rows below expert e, found on the device: no host synchronisation (bincount would
    # read its size on the host), so decode steps can be captured in CUDA graphs.
    bounds = torch.arange(num_experts + 1, dtype=sorted_ids.dtype, device=x.device)
    offsets = torch.searchsorted(sorted_ids, bounds)  # [E + 1] int64
    gate_up = _grouped_gemm(x, order, w_gate_up, offsets, gather=True, scatter=False)
    hidden = silu_and_mul(gate_up)  # [R, I], sorted order
    return _grouped_gemm(hidden, order, w_down, offsets, gather=False, scatter=True)
