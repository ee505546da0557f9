"""Sigmoid routing with group-limited top-k (DeepSeek-V3's ``noaux_tc``), batch-invariant.

Every operation is per row (elementwise, per-row stable sorts, sums of a fixed number of
terms written out in order), so a token's experts and weights are a function of its own
router logits only, on any device, and ties go to the lower expert (or group) id.

Shape legend: T = tokens, E = experts, G = groups, k = experts per token.
"""

from __future__ import annotations

import torch


def _sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` `[..., n]` summed over the last dim left to right: ``((x0 + x1) + x2) + ...``."""
    total = x[..., 0]
    for i in range(1, x.shape[-1]):
        total = total + x[..., i]
    return total


# CPU: torch's elementwise loops run a transcendental through a vectorised path for
# whole pairs of vectors and a scalar path for the tail, and the two differ in the last
# bit (sigmoid: 77 of 2,000 values here), so a value would depend on where its row sits
# in the batch. Rows padded to this many columns put every value on the vector path;
# calls stay under torch's parallel grain (32,768 elements) so no thread split makes a tail.
_CPU_ROW_PAD = 32
_CPU_GRAIN = 32768


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """float32 sigmoid of x `[T, E]` whose bits do not depend on T or the row's place."""
    if x.is_cuda:
        return x.sigmoid()
    num_rows, width = x.shape
    padded = -(-width // _CPU_ROW_PAD) * _CPU_ROW_PAD
    xp = torch.nn.functional.pad(x, (0, padded - width))
    rows = max(1, _CPU_GRAIN // padded)
    out = torch.cat([xp[i:i + rows].sigmoid() for i in range(0, num_rows, rows)]) if num_rows else xp
    return out[:, :width]


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row (values, indices), descending; ties: lower index first."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def sigmoid_topk_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: ``scores = sigmoid(logits)`` in fp32; the choice ranks
    ``scores + correction_bias``: groups of E/G experts are ranked by the sum of their two
    best choices, the ``topk_groups`` best groups kept, then the ``top_k`` best experts of
    those; a chosen expert's weight is its ``scores`` value (without the bias), divided by
    the k weights' sum (+1e-20) with ``renormalize``, times ``scaling``.

    router_logits: `[T, E]` any float dtype; correction_bias: `[E]` or None.
    Returns ``(topk_ids `[T, k]` int64, topk_weights `[T, k]` float32)`` in descending
    choice order (the order combine sums in). Raises ``ValueError`` where G does not divide
    E or the kept groups hold fewer than k experts.
    """
    num_tokens, num_experts = router_logits.shape
    if num_groups <= 0 or num_experts % num_groups or not 0 < topk_groups <= num_groups:
        raise ValueError(f"sigmoid_topk_route: {num_groups} groups / {topk_groups} kept do not "
                         f"fit {num_experts} experts")
    per_group = num_experts // num_groups
    if top_k > topk_groups * per_group:
        raise ValueError(f"sigmoid_topk_route: top_k {top_k} exceeds the {topk_groups * per_group} "
                         "experts of the kept groups")
    scores = sigmoid_rows(router_logits.float())  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        best2, _ = _top(choice.view(num_tokens, num_groups, per_group), 2)  # [T, G, 2]
        group_scores = best2[..., 0] + best2[..., 1]  # [T, G]
        _, groups = _top(group_scores, topk_groups)  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep[:, :, None].expand(num_tokens, num_groups, per_group).reshape(num_tokens, -1)
        choice = choice.masked_fill(~keep, float("-inf"))
    _, ids = _top(choice, top_k)  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        weights = weights / (_sum_in_order(weights) + 1e-20)[:, None]
    if scaling != 1.0:
        weights = weights * scaling
    return ids, weights
