"""GPU: attention on one GPU, experts on the others; outputs bitwise equal to one GPU."""

from __future__ import annotations

import pytest
import torch

from megaserve import LLM, SamplingParams
from megaserve.engine.config import EngineConfig
from megaserve.runtime.layout import nccl_gpu_clash

pytestmark = pytest.mark.gpu

PROMPTS = [{"prompt_token_ids": [(11 * i + j) % 500 for j in range(4 + 13 * i)]} for i in range(6)]
PARAMS = [SamplingParams(max_tokens=12, temperature=t, seed=i, ignore_eos=True, logprobs=2)
          for i, t in enumerate([0, 0.8, 0, 1.0, 0.8, 0])]


def _signature(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def single_gpu():
    # A small KV cache: the layouts' worker processes size theirs from the GPU's free
    # memory, and this process's allocator keeps what its engine took cached.
    with LLM(dtype="bfloat16", device="cuda:0", kv_cache_memory_bytes=1 << 28) as llm:
        return _signature(llm.generate(PROMPTS, PARAMS))


# Workers go round-robin over the GPUs, attention replicas first: with 4 GPUs, (1, 3, m)
# puts attention on GPU 0 and one expert worker on each of GPUs 1-3.
LAYOUTS = [(1, 1, 1), (1, 1, 2), (1, 3, 2), (2, 2, 4), (1, 3, 4)]


@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl", "tcp"])
@pytest.mark.parametrize("replicas, experts, microbatches", LAYOUTS)
def test_disaggregated_gpus_equal_single_gpu(single_gpu, transport, replicas, experts, microbatches):
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs at least 2 GPUs")
    if (replicas, experts, microbatches) == (1, 3, 4) and gpus < 4:
        pytest.skip("the experts-on-GPUs-1-3 layout needs 4 GPUs")
    if transport == "nccl" and nccl_gpu_clash(EngineConfig(
            device="cuda", attention_replicas=replicas, expert_workers=experts)):
        # On the host data plane a replica would share a GPU with an expert worker: NCCL
        # cannot connect them (its "invalid usage", 2x H200), so the layout is refused up
        # front with a clear error. The device data plane (the default on CUDA) keeps the
        # replicas on the front-end's GPU and the expert workers on the others: it runs.
        with pytest.raises(ValueError, match="transport 'nccl': .* on one GPU"):
            LLM(dtype="bfloat16", device="cuda", attention_replicas=replicas,
                expert_workers=experts, microbatches=microbatches, transport=transport,
                data_plane="host")
    # kv_cache_memory_bytes: the one-replica layouts run their engine in this process,
    # whose allocator keeps it cached for the next layout's processes on the same GPU.
    with LLM(dtype="bfloat16", device="cuda", attention_replicas=replicas, expert_workers=experts,
             microbatches=microbatches, transport=transport,
             kv_cache_memory_bytes=1 << 28) as llm:
        got = _signature(llm.generate(PROMPTS, PARAMS))
    assert got == single_gpu
