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
    """A linear's output left as its split-K parts, for the kernel that consumes it to
    fold (no fold tail or fold launch here): ws `[S, N, M]` fp32, feature-major as swap
    mode stores them, or with ``token_major`` `[S, M, N]` as split mode does; bias `[N]` or
    None. The output is ``cast(((ws[0] + ws[1]) + ...) + bias)`` in ``dtype`` (matmul's
    NOTE); consumer kernels fold with :func:`fold_row_parts` at :attr:`strides`."""

    ws: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    token_major: bool = False

    @property
    def num_rows(self) -> int:
        return self.ws.shape[1 if self.token_major else 2]

    @property
    def num_features(self) -> int:
        return self.ws.shape[2 if self.token_major else 1]

    @property
    def strides(self) -> tuple[int, int, int]:
        """(split, feature, token) strides of ws, in elements."""
        s, a, b = self.ws.stride()
        return (s, b, a) if self.token_major else (s, a, b)


@triton.jit
def fold_row_parts(ws_ptr, bias_ptr, feats, tok, mask, stride_s, stride_f, stride_t,
                   NUM_SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Features ``feats`` of token ``tok`` of a linear's unfolded parts (:class:`Parts`,
    at its strides): the fp32 total (+ bias) before the cast, in the order of the linear's
    own fold, for a consumer kernel that folds them itself."""
    offs = feats * stride_f + tok * stride_t
    total = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, NUM_SPLITS):
        total = total + tl.load(ws_ptr + s * stride_s + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + feats, mask=mask, other=0.0).to(tl.float32)
    return total
