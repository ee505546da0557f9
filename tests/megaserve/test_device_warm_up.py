"""The device-plane processes' start-up warm-up compiles every linear launch a prefill step
can take (a kernel first compiled inside a step by two co-located processes at once can
deadlock them: megaserve/runtime/device_workers.py, HAZARD)."""

from __future__ import annotations

import pytest
import torch

from megaserve.kernels.triton_impl import matmul
from megaserve.bench.random_model import PRESETS
from megaserve.runtime.device_workers import WARM_UP_TALL_FROM, warm_up_prompt_lengths


def _linear_shapes(preset: str) -> list[tuple[int, int]]:
    """(n, k) of the attention side's linears of a preset: qkv, o, router, LM head."""
    d = PRESETS[preset]
    h, q, kv = d["hidden_size"], d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
    return [(q + 2 * kv, h), (h, q), (d["num_experts"], h), (d["vocab_size"], h)]


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
@pytest.mark.parametrize("longest", [16384, 3000])
def test_warm_up_lengths_reach_every_tall_launch_of_a_prefill_step(preset: str, longest: int) -> None:
    lengths = warm_up_prompt_lengths(longest)
    assert lengths[0] == WARM_UP_TALL_FROM and lengths[-1] == longest and lengths == sorted(set(lengths))
    assert any(n % 16 for n in lengths) and any(n % 16 == 0 for n in lengths if n > WARM_UP_TALL_FROM)
    for n, k in _linear_shapes(preset):
        cfg = matmul.config_for(n, k, torch.bfloat16)
        warmed = {matmul.plan_launch(m, n, k, cfg) for m in lengths}
        for m in range(WARM_UP_TALL_FROM + 1, longest + 1, 7):
            assert matmul.plan_launch(m, n, k, cfg) in warmed, (preset, n, k, m)


def test_no_tall_warm_up_below_the_tall_launches() -> None:
    assert warm_up_prompt_lengths(63) == [] and warm_up_prompt_lengths(64) == [64]
    assert warm_up_prompt_lengths(100) == [64, 65, 100]
