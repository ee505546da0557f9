"""The float32 router GEMM of the DeepSeek-V3 (MLA) family on CUDA, batch-invariant.

Shape legend: T = tokens, D = hidden, E = routed experts.

NOTE: logits[t, e] = sum over k of x[t, k] * w[e, k] in float32, one fused multiply-add
chain per element in ascending k, starting from 0. ``tl.dot`` on float32 operands with
``input_precision="ieee"`` lowers to exactly that chain (CUDA-core FMAs, no tensor
cores), so the tile shapes and M never change an element's bits. DeepSeek-V3 scores its
experts from float32 logits (HF's gate casts both operands to float32); the matmul
kernels of :mod:`matmul` take 16-bit operands only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _router_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M tokens, BLOCK_N experts) tile of the module NOTE's logits."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        a = tl.load(x_rows + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(w_rows + (k0 + kk)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[T, D]` (bf16, fp16 or fp32), weight `[E, D]` float32 → `[T, E]` float32 logits
    (module NOTE): each row's bits depend on that row of x alone. ValueError on a weight
    that is not float32 `[E, D]`."""
    t, d = x.shape
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"router_logits: weight must be float32 [E, {d}], got {weight.dtype} "
                         f"{list(weight.shape)}")
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    _router_kernel[(triton.cdiv(t, BLOCK_M), triton.cdiv(e, BLOCK_N))](
        x, weight, out, t, e, d, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out
