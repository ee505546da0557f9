"""The decode linears of Qwen3-30B-A3B on a CUDA GPU under the committed small-K rule:
every M <= 64 launch of the rule gives fold mode's bits, and each row's bits are the
same at every M (float64 reference for the values)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048)])
def test_decode_linear_rule_bits(n: int, k: int) -> None:
    from megaserve.kernels.triton_impl import linear
    from megaserve.kernels.triton_impl.matmul import config_for, small_k_rule

    torch.manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=BF16) / k**0.5
    x = torch.randn(256, k, device="cuda", dtype=BF16)
    cfg = config_for(n, k, BF16)
    full = linear(x, w)  # M = 256: the planner's tall launch
    ref = x[:64].double() @ w.double().T
    assert float((full[:64].double() - ref).norm() / ref.norm()) < 1e-2
    assert torch.equal(full, linear(x, w, mode="fold"))
    rule = small_k_rule()
    assert rule is not None and k <= rule.max_k
    for m in (1, 3, 8, 17, 64):
        assert torch.equal(linear(x[:m], w), full[:m]), f"M={m}: planned launch"
        for _, lp in rule.swap:
            if cfg.split_len % (lp.block_k or cfg.block_k) == 0:
                assert torch.equal(linear(x[:m], w, launch=lp), full[:m]), f"M={m}: {lp}"
