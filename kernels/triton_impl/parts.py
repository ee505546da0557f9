"""A linear's output left as split-K parts for the kernel that consumes it to fold.

A decode step is a chain of short kernels. A split-K linear ends with a fold of its fp32
parts (an atomic counter and a second round trip through memory, or a fold launch);
where the next kernel (the norm after o_proj, the top-k after the router) folds them
itself, in the same order, the linear stops at its parts: one tail fewer, the same bits
(matmul.linear_parts, and the consumers in rowwise and moe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Parts:
    """A linear's output left as the split-K parts of a swap launch, for the kernel that
    consumes it to fold (no fold tail or fold launch here): ws `[S, N, M]` fp32
    (feature-major, as swap mode stores them); bias `[N]` or None. The output is
    ``cast(((ws[0] + ws[1]) + ...) + bias)`` in ``dtype``, transposed (matmul's NOTE);
    consumer kernels fold with :func:`fold_row_parts`."""

    ws: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def num_rows(self) -> int:
        return self.ws.shape[2]


@triton.jit
def fold_row_parts(ws_ptr, bias_ptr, feats, tok, mask, M, N, NUM_SPLITS: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
    """Features ``feats`` of token ``tok`` of a swap launch's unfolded parts (ws `[S, N,
    M]`, :class:`Parts`): the fp32 total (+ bias) before the cast, in the order of
    the swap kernel's own fold, for a consumer kernel that folds them itself."""
    offs = feats * M + tok
    total = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, NUM_SPLITS):
        total = total + tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + feats, mask=mask, other=0.0).to(tl.float32)
    return total
