"""The device data plane on one GPU (megaserve.runtime.device_plane): attention and experts
as separate workers, threads (inproc, ``disaggregate=True``) or processes (cuda_ipc; tcp:
host-proxied links),
bitwise equal to the co-located engine with CUDA graphs; no host synchronisation inside a
decode step; host messages per step bounded by the number of expert workers; a dead expert
worker is a typed error within the timeout, not a hang."""

from __future__ import annotations

import pytest
import torch

from megaserve import LLM, SamplingParams
from tests.megaserve.layout_workload import run_with_steady_steps_under

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello", "The capital of", "a b c d e f g", "Once upon a time there was"]


def _run(**options):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    # Uneven lengths: with several replicas, one goes on alone once the other is done.
    uneven = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (3, 30, 9, 17)]
    with LLM(model="builtin:tiny-moe", device="cuda", dtype="bfloat16", max_num_seqs=8,
             kv_cache_memory_bytes=1 << 28,
             **options) as llm:
        outs = [llm.generate(PROMPTS, p) for p in (greedy, seeded, uneven)]
        engine = llm.engine
        stats = getattr(engine, "experts", None)
        kind = type(engine).__name__
        barrier = getattr(engine, "barrier", None)
    if kind == "DisaggregatedEngine":  # device-plane processes: their counters, at stop
        stats = engine.expert_stats
    if barrier is not None:  # lockstep: one message per expert worker per global step
        assert barrier.graph_steps > 0, "the replicas' decode steps did not run as graphs"
        assert barrier.host_messages == barrier.graph_steps * options["expert_workers"]
    seqs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for batch in outs for o in batch]
    return seqs, kind, stats


@pytest.fixture(scope="module")
def colocated():
    seqs, kind, _ = _run()
    assert kind == "LLMEngine"
    return seqs


@pytest.mark.parametrize("transport,replicas,workers,m", [
    ("inproc", 1, 1, 1), ("inproc", 1, 1, 2), ("inproc", 1, 2, 2), ("inproc", 1, 1, 4),
    *(("cuda_ipc", r, e, m) for r in (1, 2) for e in (1, 2) for m in (1, 2, 4)),
    # host-proxied links (megaserve.comm.relay), as between hosts
    ("tcp", 1, 1, 1), ("tcp", 1, 2, 2), ("tcp", 2, 2, 2),
])
def test_device_plane_is_bitwise_colocated(colocated, transport, replicas, workers, m) -> None:
    seqs, kind, experts = _run(attention_replicas=replicas, expert_workers=workers,
                               microbatches=m, transport=transport, disaggregate=True)
    if transport == "cuda_ipc" and replicas > 1:  # every role a process
        _assert_device_roles_ran_graphs(kind, experts, replicas, workers)
    else:
        assert kind == "DevicePlaneEngine"
        assert experts.stats.graph_steps > 0, "decode steps did not run as graphs"
    assert seqs == colocated


def _assert_device_roles_ran_graphs(kind, stats, replicas, workers) -> None:
    """Device-plane processes (megaserve.runtime.device_workers): every replica ran decode
    steps as graphs, every expert worker replayed expert graphs, and each replica sent one
    StepReport per expert worker per step it took part in."""
    assert kind == "DisaggregatedEngine"
    every = list(stats.values())
    assert len(every) >= max(replicas, workers)
    assert sum(s.replica_graph_steps for s in every) > 0, "no replica ran a decode graph"
    assert sum(s.expert_graph_steps > 0 for s in every) == workers
    for s in every:
        assert s.step_reports % workers == 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
@pytest.mark.parametrize("transport,m", [("cuda_ipc", 1), ("cuda_ipc", 2), ("nccl", 1),
                                         ("nccl", 2)])
def test_two_attention_processes_on_gpu0_experts_on_gpu1_are_bitwise(colocated, transport,
                                                                      m) -> None:
    """MegaScale-Infer's shape on one host: two attention replica processes on GPU 0, one
    expert process on GPU 1, bitwise equal to the co-located engine on one GPU (greedy
    with logprobs, seeded, uneven lengths: the replicas step alone once the other is
    done). cuda_ipc: device-plane processes (lockstep, CUDA graphs on both roles). nccl:
    the host data plane's processes over NCCL frames (the device-plane processes map
    each other's buffers over CUDA IPC; nccl there is the one-replica front-end's relay)."""
    seqs, kind, stats = _run(attention_replicas=2, expert_workers=1, microbatches=m,
                             transport=transport, attention_gpus=(0, 0), expert_gpus=(1,))
    if transport == "cuda_ipc":
        _assert_device_roles_ran_graphs(kind, stats, 2, 1)
    else:
        assert kind == "DisaggregatedEngine"
        assert sorted(stats) == [0] and stats[0].rows > 0  # the expert worker's, at stop
    assert seqs == colocated


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
def test_two_attention_processes_steady_decode_never_synchronises(colocated) -> None:
    """Two attention processes on GPU 0, one expert process on GPU 1 (cuda_ipc), async
    scheduling: once the decode graphs run, six steady steps of every role run under
    ``set_sync_debug_mode("error")`` (each replica's whole step; the expert process's
    graph launches, under its StepReports' mode). A synchronisation fails the process
    and forces a restart, so none may happen; the tokens stay bitwise one GPU's."""
    from megaserve.engine.config import EngineConfig
    from megaserve.runtime.factory import make_engine

    engine = make_engine(EngineConfig(
        model="builtin:tiny-moe", device="cuda", dtype="bfloat16", max_num_seqs=8,
        kv_cache_memory_bytes=1 << 28, attention_replicas=2, expert_workers=1,
        transport="cuda_ipc", attention_gpus=(0, 0), expert_gpus=(1,),
        async_scheduling=True))
    try:
        assert engine.device_roles
        outputs = run_with_steady_steps_under(engine, PROMPTS, max_tokens=24, warm_steps=4)
    finally:
        engine.shutdown()
    # The expert process replayed its step graphs (one per global graph step).
    assert sum(s.expert_graph_steps for s in engine.expert_stats.values()) >= 6
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == [
        token_ids for token_ids, _ in colocated[:len(PROMPTS)]]


def test_decode_steps_have_no_host_sync_and_constant_host_messages() -> None:
    from megaserve.engine.config import EngineConfig
    from megaserve.runtime.device_engine import DevicePlaneEngine

    engine = DevicePlaneEngine(EngineConfig(model="builtin:tiny-moe", device="cuda",
                                            dtype="bfloat16", disaggregate=True,
                                            kv_cache_memory_bytes=1 << 28,
                                            expert_workers=2, microbatches=2))
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(8):  # prefill, then decode steps until the graphs are captured
            engine.step()
        graphs = engine.engine.runner.decode_graphs
        assert graphs is not None and graphs.captured_sizes
        run = graphs.run
        servers = engine.servers

        graphs.run = _sync_checked(run)
        finish_step = engine.experts.finish_step

        def end_of_step(block=True):  # eager steps wait here; decode steps do not
            assert not block, "a decode step waited for its end"
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("default")
            try:
                return finish_step(block=block)
            finally:
                torch.cuda.set_sync_debug_mode(previous)

        engine.experts.finish_step = end_of_step
        for server in servers:  # the expert side's replays, too
            server.graph_step = _sync_checked(server.graph_step)
        before = engine.experts.stats.host_messages
        steps_before = engine.experts.stats.graph_steps
        for _ in range(10):
            engine.step()
        steps = engine.experts.stats.graph_steps - steps_before
        assert steps == 10
        # One message per expert worker per step: not layers x micro-batches.
        assert engine.experts.stats.host_messages - before == 10 * 2
    finally:
        engine.shutdown()


def _sync_checked(fn):
    """``fn`` under ``set_sync_debug_mode("error")``: any synchronising call raises."""
    def wrapped(*args):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return wrapped


def test_a_lost_expert_worker_is_a_typed_error_not_a_hang() -> None:
    import time

    from megaserve.comm import CommError
    from megaserve.engine.config import EngineConfig
    from megaserve.runtime.device_engine import DevicePlaneEngine
    from megaserve.runtime.device_plane import Stop

    engine = DevicePlaneEngine(EngineConfig(model="builtin:tiny-moe", device="cuda",
                                            dtype="bfloat16", disaggregate=True,
                                            kv_cache_memory_bytes=1 << 28),
                               timeout_s=3.0)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        engine.add_request("r0", "Hello", params)
        for _ in range(6):
            engine.step()
        engine._queues[0].put(Stop())  # the expert worker goes away between steps
        engine._threads[0].join(5)
        start = time.monotonic()
        with pytest.raises(CommError):
            for _ in range(3):
                engine.step()
        assert time.monotonic() - start < 15
        torch.cuda.synchronize()  # the stream was drained: nothing is left waiting
    finally:
        engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs several GPUs (expert workers on the other GPUs)")
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("workers,m", [(1, 1), (1, 2), (1, 3), (3, 2)])
def test_device_plane_across_gpus_is_bitwise_colocated(colocated, workers, m, transport) -> None:
    from megaserve.runtime.device_engine import expert_device

    seqs, kind, experts = _run(expert_workers=workers, microbatches=m, transport=transport)
    assert kind == "DevicePlaneEngine" and experts.stats.graph_steps > 0
    assert expert_device("cuda", torch.device("cuda:0"), 0) != "cuda:0"
    assert seqs == colocated


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs several GPUs (expert workers on the other GPUs)")
@pytest.mark.parametrize("transport", ["cuda_ipc"])  # nccl relays through host threads
def test_steady_decode_across_gpus_never_synchronises(colocated, transport) -> None:
    """Attention on GPU 0, one expert process on GPU 1, async scheduling (the host
    prepares step n + 1 while the GPUs run step n): steady decode steps of the
    attention role run whole (schedule, launch, read) under
    ``set_sync_debug_mode("error")``, the expert process serves under it from start to
    end, and the outputs stay bitwise the co-located engine's."""
    from megaserve.engine.config import EngineConfig
    from megaserve.runtime.device_engine import DevicePlaneEngine

    engine = DevicePlaneEngine(EngineConfig(model="builtin:tiny-moe", device="cuda",
                                            dtype="bfloat16", transport=transport,
                                            kv_cache_memory_bytes=1 << 28, max_num_seqs=8,
                                            async_scheduling=True),
                               sync_debug="error")
    try:
        assert engine.engine.async_scheduling and engine.experts.reduces_on_workers
        # No logprobs: a step that returns them reads its tokens first (sample_decode), a
        # host wait by design; the sync-free claim is for the token path.
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        outputs = {}

        def collect(outs):
            for out in outs:
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids

        for _ in range(4):  # prefill, then decode steps until the graphs are captured
            collect(engine.step())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            steady = 0
            while engine.has_unfinished_requests() and steady < 12:
                collect(engine.step())
                steady += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert steady >= 10
        while engine.has_unfinished_requests():
            collect(engine.step())
    finally:
        engine.shutdown()
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == [
        token_ids for token_ids, _ in colocated[:len(PROMPTS)]]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
def test_a_killed_expert_process_mid_stream_on_gpus_streams_complete_bitwise() -> None:
    """Two attention processes on GPU 0, one expert process on GPU 1 (device plane): the
    expert process is killed (SIGKILL) while every request streams; the front-end reports
    "recovering", restarts the processes, re-runs each request from its prompt and the
    tokens it delivered, and every stream completes with the undisturbed run's tokens and
    logprobs, never taking a token back; health is "serving" again after one restart."""
    import os
    import signal
    import time

    from megaserve.engine.config import EngineConfig
    from megaserve.runtime.factory import make_engine

    params = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)] * 2
    with LLM(model="builtin:tiny-moe", device="cuda:0", dtype="bfloat16",
             kv_cache_memory_bytes=1 << 28) as llm:
        want = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(PROMPTS, params)]
    engine = make_engine(EngineConfig(
        model="builtin:tiny-moe", device="cuda", dtype="bfloat16", max_num_seqs=8,
        kv_cache_memory_bytes=1 << 28, attention_replicas=2, expert_workers=1,
        transport="cuda_ipc", attention_gpus=(0, 0), expert_gpus=(1,)))
    try:
        assert engine.device_roles
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            engine.add_request(f"r{i}", prompt, p)
        outputs: dict[str, list] = {}
        while len(outputs) < len(PROMPTS) or any(
                len(o[-1].outputs[0].token_ids) < 3 for o in outputs.values()):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        assert not any(o[-1].finished for o in outputs.values())
        (pid,) = [w.pid for w in engine._workers if w.name == "megaserve-expert-0"]
        os.kill(pid, signal.SIGKILL)
        healths, deadline = [], time.monotonic() + 400
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "requests did not finish"
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
            healths.append(engine.health().state)
        assert "recovering" in healths or engine.health().restarts == 1
        assert engine.health().state == "serving" and engine.health().restarts == 1
        got = [(outputs[f"r{i}"][-1].outputs[0].token_ids, outputs[f"r{i}"][-1].outputs[0].logprobs)
               for i in range(len(PROMPTS))]
        assert got == want
        for outs in outputs.values():  # a stream never takes tokens back
            for before, after in zip(outs, outs[1:]):
                b, a = before.outputs[0].token_ids, after.outputs[0].token_ids
                assert a[:len(b)] == b
    finally:
        engine.shutdown()
