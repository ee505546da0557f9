"""GPU: attention on one GPU, experts on the others; outputs bitwise equal to one GPU."""

from __future__ import annotations

import pytest
import torch

from megaserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [{"prompt_token_ids": [(11 * i + j) % 500 for j in range(4 + 13 * i)]} for i in range(6)]
PARAMS = [SamplingParams(max_tokens=12, temperature=t, seed=i, ignore_eos=True, logprobs=2)
          for i, t in enumerate([0, 0.8, 0, 1.0, 0.8, 0])]


def _signature(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def single_gpu():
    with LLM(dtype="bfloat16", device="cuda:0") as llm:
        return _signature(llm.generate(PROMPTS, PARAMS))


@pytest.mark.parametrize("transport", ["cuda_ipc", "tcp"])
@pytest.mark.parametrize("replicas, experts, microbatches", [(1, 1, 1), (1, 1, 2), (1, 3, 2), (2, 2, 4)])
def test_disaggregated_gpus_equal_single_gpu(single_gpu, transport, replicas, experts, microbatches):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 GPUs")
    with LLM(dtype="bfloat16", device="cuda", attention_replicas=replicas, expert_workers=experts,
             microbatches=microbatches, transport=transport) as llm:
        got = _signature(llm.generate(PROMPTS, PARAMS))
    assert got == single_gpu
