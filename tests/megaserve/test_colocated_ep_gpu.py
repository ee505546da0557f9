"""GPU: co-located expert parallelism over 2 GPUs (worker i on GPU i is attention replica i
and expert worker i), on the device data plane over cuda_ipc (megaserve.runtime.
device_workers: CUDA graphs, lockstep, the worker's own expert role through local
tensors) and on the host data plane over tcp; outputs bitwise equal to one GPU; steady
decode of every role never synchronises with the host."""

from __future__ import annotations

import pytest
import torch

from megaserve import LLM, SamplingParams
from tests.megaserve.layout_workload import run_with_steady_steps_under

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


@pytest.mark.parametrize("attention_gpus", [None, (1, 0)])
def test_colocated_ep_on_the_device_plane_equals_one_gpu(single_gpu, attention_gpus):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with LLM(dtype="bfloat16", device="cuda", data_parallel_size=2,
             enable_expert_parallel=True, transport="cuda_ipc", max_num_seqs=8,
             kv_cache_memory_bytes=1 << 28, attention_gpus=attention_gpus) as llm:
        engine = llm.engine
        assert engine.device_roles
        got = _signature(llm.generate(PROMPTS, PARAMS))
    assert got == single_gpu
    stats = engine.expert_stats  # DeviceRoleStats, sent by each process as it stops
    assert sorted(stats) == [0, 1]
    assert all(s.replica_graph_steps > 0 and s.expert_graph_steps > 0
               for s in stats.values()), stats
    assert all(s.step_reports % 2 == 0 for s in stats.values())  # one per expert worker


def test_colocated_ep_steady_decode_never_synchronises(single_gpu):
    """Co-located EP over 2 GPUs on the device plane, async scheduling: once the decode
    graphs run, ten steps of every process (its replica's step and its expert role's
    launches, which share the process's sync-debug mode) run under
    ``set_sync_debug_mode("error")``; a synchronisation would fail the worker and force a
    restart, so none may happen, and the tokens stay bitwise one GPU's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from megaserve.engine.config import EngineConfig
    from megaserve.runtime.factory import make_engine

    engine = make_engine(EngineConfig(dtype="bfloat16", device="cuda", data_parallel_size=2,
                                      enable_expert_parallel=True, transport="cuda_ipc",
                                      max_num_seqs=8, kv_cache_memory_bytes=1 << 28,
                                      async_scheduling=True))
    greedy = [i for i, p in enumerate(PARAMS) if p.temperature == 0]
    try:
        assert engine.device_roles
        outputs = run_with_steady_steps_under(
            engine, [PROMPTS[i]["prompt_token_ids"] for i in greedy], max_tokens=12, warm_steps=3)
    finally:
        engine.shutdown()
    assert [outputs[f"r{n}"] for n in range(len(greedy))] == [single_gpu[i][0] for i in greedy]


# tcp: the host data plane (every frame through the transport, the worker's own included).
@pytest.mark.parametrize("attention_gpus", [None, (1, 0)])
def test_colocated_ep_over_two_gpus_equals_one_gpu(single_gpu, attention_gpus):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with LLM(dtype="bfloat16", device="cuda", data_parallel_size=2,
             enable_expert_parallel=True, transport="tcp", kv_cache_memory_bytes=1 << 28,
             attention_gpus=attention_gpus) as llm:
        engine = llm.engine
        got = _signature(llm.generate(PROMPTS, PARAMS))
    assert got == single_gpu
    stats = engine.expert_stats  # (sent by the expert roles as they stop)
    assert sorted(stats) == [0, 1] and all(s.rows > 0 for s in stats.values())
