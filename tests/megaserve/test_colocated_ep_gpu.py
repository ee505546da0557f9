"""GPU: co-located expert parallelism over 2 GPUs on the host data plane over tcp (worker i
on GPU i is attention replica i and expert worker i); outputs bitwise equal to one GPU."""

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


# tcp only: cuda_ipc and nccl are refused for co-located workers (runtime/layout.py,
# transport_refusal).
@pytest.mark.parametrize("attention_gpus", [None, (1, 0)])
def test_colocated_ep_over_two_gpus_equals_one_gpu(single_gpu, attention_gpus):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with LLM(dtype="bfloat16", device="cuda", data_parallel_size=2,
             enable_expert_parallel=True, transport="tcp",
             attention_gpus=attention_gpus) as llm:
        engine = llm.engine
        got = _signature(llm.generate(PROMPTS, PARAMS))
    assert got == single_gpu
    stats = engine.expert_stats  # (sent by the expert roles as they stop)
    assert sorted(stats) == [0, 1] and all(s.rows > 0 for s in stats.values())
