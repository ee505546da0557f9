"""Top-k / top-p / min-p filtering of one row of log-probabilities, on any device.

Shared by the CPU and the CUDA sampling paths. Only single-row torch ops are used: a
stable sort is exact and the cumulative sum sees one row, so nothing here depends on
the batch (the batch-invariance contract of ``megaserve.kernels.api.sample``).
"""

from __future__ import annotations

import math

import torch


def filter_row(lp: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens of one row that top-k, then top-p, then min-p exclude.

    lp: `[V]` float log-probabilities (any device). top_k <= 0, top_p >= 1 and min_p <= 0
    disable the respective filter. Returns a new `[V]` tensor of lp's dtype and device.
    """
    sorted_lp, order = torch.sort(lp, descending=True, stable=True)
    keep_sorted = torch.ones_like(sorted_lp, dtype=torch.bool)
    if top_k > 0:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        probs = torch.exp(sorted_lp).masked_fill(~keep_sorted, 0.0)
        probs = probs / probs.sum()
        mass_before = torch.cumsum(probs, dim=0) - probs
        keep_sorted &= mass_before < top_p
    if min_p > 0.0:
        keep_sorted &= sorted_lp >= sorted_lp[0] + math.log(min_p)
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return lp.masked_fill(~keep, float("-inf"))
