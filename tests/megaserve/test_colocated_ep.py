"""Co-located expert parallelism (vLLM's ``--data-parallel-size N --enable-expert-parallel``)
and data parallelism: token ids and logprobs bitwise equal to the one-process engine."""

from __future__ import annotations

import pytest

from megaserve import LLM, SamplingParams
from megaserve.engine.config import EngineConfig
from megaserve.runtime.cluster import DisaggregatedEngine
from megaserve.runtime.factory import uses_device_plane
from megaserve.runtime.layout import transport_refusal, worker_devices
from tests.megaserve.layout_workload import PARAMS, PROMPTS, signature, single_engine_signature
from tests.processes import alive, comm


@pytest.fixture(scope="module")
def single_engine():
    return single_engine_signature()


# (transport, N, micro-batches, aggregation); nccl on the CPU is its gloo data plane.
LAYOUTS = [("inproc", 2, 1, "per_layer"), ("inproc", 3, 2, "per_layer"),
           ("tcp", 2, 2, "per_layer"), ("tcp", 3, 1, "per_layer"), ("tcp", 3, 3, "lockstep"),
           ("nccl", 2, 1, "per_layer")]


@pytest.mark.parametrize("transport, size, microbatches, aggregation", LAYOUTS,
                         ids=[f"{t}-N{n}-m{m}-{a}" for t, n, m, a in LAYOUTS])
def test_colocated_ep_equals_one_engine_bitwise(single_engine, transport, size, microbatches,
                                               aggregation):
    with LLM(dtype="float32", data_parallel_size=size, enable_expert_parallel=True,
             microbatches=microbatches, transport=transport, aggregation=aggregation) as llm:
        engine = llm.engine
        got = signature(llm.generate(PROMPTS, PARAMS))
        if transport != "inproc":  # one process per rank pair, named for ps
            pids = [w.pid for w in engine._workers]
            assert len(pids) == size and all(alive(p) for p in pids)
            assert sorted(comm(p) for p in pids) == [f"megaserve-EP{i}" for i in range(size)]
    assert got == single_engine
    # Every worker served its share of the experts (the exchange really crossed workers).
    assert sorted(engine.expert_stats) == list(range(size))
    assert all(s.rows > 0 for s in engine.expert_stats.values())
    if transport != "inproc":
        assert not any(alive(p) for p in pids), "workers outlived shutdown"


def test_colocated_ep_uneven_placement_equals_one_engine(single_engine):
    with LLM(dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
             expert_placement=((0, 5), (1, 2, 3, 4, 6, 7))) as llm:
        assert signature(llm.generate(PROMPTS, PARAMS)) == single_engine


def test_data_parallel_without_ep_runs_whole_engines_bitwise(single_engine):
    with LLM(dtype="float32", data_parallel_size=2, transport="tcp") as llm:
        engine = llm.engine
        assert [comm(w.pid) for w in engine._workers] == ["megaserve-DP0", "megaserve-DP1"]
        got = signature(llm.generate(PROMPTS, PARAMS))
        assert engine.expert_stats == {}  # no expert workers: experts inside each engine
        served = [s for s in engine._stats if s is not None]
        assert len(served) == 2  # both replicas took requests
    assert got == single_engine


def test_data_parallel_flags_resolve_to_a_layout():
    ep = EngineConfig(device="cpu", data_parallel_size=3, enable_expert_parallel=True)
    assert (ep.attention_replicas, ep.expert_workers, ep.colocated) == (3, 3, True)
    assert not ep.single_engine and ep.cpu_threads == 1
    dp = EngineConfig(device="cpu", data_parallel_size=2)
    assert (dp.attention_replicas, dp.expert_workers, dp.data_parallel) == (2, 1, True)
    assert not dp.colocated
    one = EngineConfig(device="cpu", enable_expert_parallel=True)  # EP over 1: one engine
    assert one.single_engine and not one.colocated
    # The replica each worker runs is a one-process engine again.
    assert ep.replica().layout == EngineConfig().layout
    # Co-located EP puts expert worker i on replica i's GPU; explicit GPUs are kept.
    gpus = EngineConfig(device="cuda", data_parallel_size=2, enable_expert_parallel=True,
                        attention_gpus=[1, 0])
    assert gpus.attention_gpus == (1, 0)
    assert worker_devices(gpus, num_gpus=2) == (["cuda:1", "cuda:0"], ["cuda:1", "cuda:0"])
    split = EngineConfig(device="cuda", attention_replicas=2, attention_gpus=(0, 0),
                         expert_gpus=(1,))
    assert worker_devices(split, num_gpus=2) == (["cuda:0", "cuda:0"], ["cuda:1"])
    assert worker_devices(EngineConfig(device="cuda", attention_replicas=2, expert_workers=2),
                          num_gpus=2) == (["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"])


@pytest.mark.parametrize("options, match", [
    (dict(data_parallel_size=0), "data_parallel_size must be a positive integer"),
    (dict(data_parallel_size=2, enable_expert_parallel="yes"), "enable_expert_parallel must be"),
    (dict(data_parallel_size=2, attention_replicas=3), "attention_replicas=3 contradicts"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, expert_workers=3),
     "expert_workers=3 contradicts"),
    (dict(data_parallel_size=2, expert_workers=2), "need enable_expert_parallel"),
    (dict(data_parallel_size=2, aggregation="lockstep"), "aggregation applies to expert"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, disaggregate=True),
     "exclude disaggregate"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, expert_placement=((0, 1),)),
     "expert_placement lists 1 workers"),
    (dict(attention_gpus=(0,)), "needs device='cuda'"),
    (dict(device="cuda", attention_gpus=(0,), launcher="ray"), "places them by GPU type"),
    (dict(device="cuda", attention_gpus=(0, 1)), "2 GPUs for 1 attention replica"),
    (dict(device="cuda", attention_gpus=(-1,)), "GPU indices"),
    (dict(device="cuda", attention_gpus="0"), "GPU indices"),
    (dict(device="cuda", data_parallel_size=2, enable_expert_parallel=True,
          attention_gpus=(0, 1), expert_gpus=(1, 0)), "expert_gpus must match"),
])
def test_bad_layout_flags_raise_value_error(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{"device": "cpu", **options})


def test_invisible_gpu_and_nccl_on_shared_gpus_are_refused_before_any_worker_starts():
    # These layouts run on the host data plane: asking for the device plane is an error.
    with pytest.raises(ValueError, match="data_plane='device': data_parallel_size runs"):
        uses_device_plane(EngineConfig(device="cuda", data_parallel_size=2,
                                       enable_expert_parallel=True, data_plane="device"))
    assert not uses_device_plane(EngineConfig(device="cuda", data_parallel_size=2,
                                              enable_expert_parallel=True, transport="cuda_ipc"))
    with pytest.raises(ValueError, match=r"GPU\(s\) \[3\] are not visible"):
        worker_devices(EngineConfig(device="cuda", expert_gpus=(3,)), num_gpus=2)
    # NCCL cannot connect replica i with expert worker i on one GPU; CUDA IPC cannot map a
    # buffer of the worker's own process.
    with pytest.raises(ValueError, match="transport 'nccl': attention replica 0 and expert "
                                         "worker 0 would both run on cuda:0, .*; use tcp"):
        DisaggregatedEngine(EngineConfig(device="cuda", data_parallel_size=2,
                                         enable_expert_parallel=True, transport="nccl"))
    # On the host data plane only: the device plane maps no buffer of a worker's own
    # process (megaserve.runtime.device_workers), so it connects co-located workers.
    with pytest.raises(ValueError, match="transport 'cuda_ipc': each co-located worker .*; "
                                         "use tcp"):
        DisaggregatedEngine(EngineConfig(device="cuda", data_parallel_size=2,
                                         enable_expert_parallel=True, transport="cuda_ipc",
                                         data_plane="host"))
    assert transport_refusal(EngineConfig(device="cuda", data_parallel_size=2,
                                          enable_expert_parallel=True,
                                          transport="cuda_ipc")) is None


def test_speculative_decoding_through_colocated_ep_equals_one_engine():
    # Verification is an ordinary multi-token step through the experts of every worker:
    # greedy outputs equal the one-process engine's without speculation.
    prompts = [{"prompt_token_ids": ([3, 14, 15, 92, 65] * 12)[: 10 + 9 * i] + [i]}
               for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    with LLM(dtype="float32") as llm:
        reference = signature(llm.generate(prompts, params))
    with LLM(dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        got = signature(llm.generate(prompts, params))
        stats = llm.engine.stats()
    assert got == reference
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0


COLOCATED_PLAN = """\
version: 1
model: tiny-moe
objective: throughput
units:
  - copies: 1
    layout: colocated
    attention: {{gpu: H100, tp: 1, replicas: {ep}, max_batch_per_replica: 16}}
    experts: {{gpu: H100, tp: 1, workers: {ep}, placement: {placement}}}
    microbatches: 1
"""


def test_a_colocated_plan_unit_runs_colocated_ep(tmp_path):
    from megaserve.runtime.plan import engine_options_from_plan

    plan = tmp_path / "plan.yaml"
    plan.write_text(COLOCATED_PLAN.format(ep=2, placement=[[0, 1, 2, 3], [4, 5, 6, 7]]))
    options = engine_options_from_plan(str(plan))
    config = EngineConfig(device="cpu", **options)
    assert config.colocated and (config.attention_replicas, config.expert_workers) == (2, 2)
    assert config.expert_placement == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert config.max_num_seqs == 16
    # One GPU: the one-process engine (the whole model on it).
    plan.write_text(COLOCATED_PLAN.format(ep=1, placement=[list(range(8))]))
    assert EngineConfig(device="cpu", **engine_options_from_plan(str(plan))).single_engine
