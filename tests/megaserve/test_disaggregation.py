"""Disaggregated runtime: placement invariance (bitwise), failures, shutdown, routing."""

from __future__ import annotations

import itertools
import os
import signal
import time

import pytest

from megaserve.comm.rdma import rdma_unavailable
from megaserve import LLM, SamplingParams
from megaserve.engine.config import EngineConfig
from megaserve.runtime.cluster import DisaggregatedEngine, WorkerError
from megaserve.runtime.layout import nccl_gpu_clash
from megaserve.runtime.placement import ExpertPlacement
from megaserve.runtime.recovery import RestartPolicy
from tests.megaserve.layout_workload import PARAMS, PROMPTS, signature, single_engine_signature
from tests.processes import alive


@pytest.fixture(scope="module")
def single_worker():
    return single_engine_signature()


REPLICAS, EXPERTS, MICROBATCHES = [1, 2, 3], [1, 2, 3, 8], [1, 2, 4]
# In one process, every combination; over tcp, a covering array: each (R, E) pair once with m
# chosen so that every (R, m) and (E, m) pair occurs too (12 layouts for 36).
LAYOUTS = [("inproc", *layout) for layout in itertools.product(REPLICAS, EXPERTS, MICROBATCHES)]
LAYOUTS += [("tcp", r, e, MICROBATCHES[(i + j) % 3])
            for i, r in enumerate(REPLICAS) for j, e in enumerate(EXPERTS)]
# nccl on CPU: the torch.distributed (gloo) data plane, one process group per direction.
LAYOUTS += [("nccl", 1, 2, 2), ("nccl", 2, 3, 4), ("nccl", 3, 8, 1)]
# Attention replicas in processes of their own at R:E in {1:1, 2:1, 1:2, 3:2}, m = 3.
LAYOUTS += [("tcp", 1, 1, 3), ("tcp", 2, 1, 3), ("tcp", 1, 2, 3), ("tcp", 3, 2, 3)]


@pytest.mark.parametrize("transport, replicas, experts, microbatches", LAYOUTS,
                         ids=[f"{t}-R{r}-E{e}-m{m}" for t, r, e, m in LAYOUTS])
def test_outputs_equal_single_worker_bitwise(single_worker, transport, replicas, experts, microbatches):
    with LLM(dtype="float32", attention_replicas=replicas, expert_workers=experts,
             microbatches=microbatches, transport=transport) as llm:
        got = signature(llm.generate(PROMPTS, PARAMS))
    assert got == single_worker


def _worker_pids(engine: DisaggregatedEngine, role: str) -> list[int]:
    return [w.pid for w in engine._workers if w.name.startswith(f"megaserve-{role}")]


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_killed_expert_worker_raises_typed_error_without_hanging(transport):
    # No restart allowed: the lost worker must surface as WorkerError (recovery itself is
    # tested in tests/deploy/test_recovery_local.py).
    engine = DisaggregatedEngine(EngineConfig(dtype="float32", attention_replicas=2, expert_workers=2,
                                              transport=transport),
                                 restart_policy=RestartPolicy(max_restarts=0))
    pids = _worker_pids(engine, "attention") + _worker_pids(engine, "expert")
    try:
        for i in range(4):
            engine.add_request(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=10_000, ignore_eos=True))
        engine.step(timeout=2.0)
        os.kill(_worker_pids(engine, "expert")[0], signal.SIGKILL)
        start = time.monotonic()
        # A hang, not a slow machine, is what this bounds: the loss is seen by the
        # liveness check within seconds when quiet.
        with pytest.raises(WorkerError):
            while time.monotonic() - start < 180:
                engine.step(timeout=0.5)
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "worker processes outlived shutdown"


IDLE_LAYOUTS = [dict(attention_replicas=2, expert_workers=2),
                dict(data_parallel_size=2, enable_expert_parallel=True)]


@pytest.mark.parametrize("layout", IDLE_LAYOUTS, ids=["disaggregated", "colocated"])
def test_idle_workers_do_not_spin_and_shutdown_leaves_no_process(layout):
    llm = LLM(dtype="float32", transport="tcp", **layout)
    pids = [w.pid for w in llm.engine._workers]

    def cpu_seconds(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    llm.generate(PROMPTS[:2], PARAMS[:2])
    before = sum(cpu_seconds(p) for p in pids)
    time.sleep(2.0)
    used = sum(cpu_seconds(p) for p in pids) - before
    llm.shutdown()
    assert used < 0.5, f"{len(pids)} idle workers used {used:.2f} CPU-seconds in 2 s"
    assert not any(alive(p) for p in pids)


def test_requests_spread_over_replicas_by_outstanding_work():
    engine = DisaggregatedEngine(EngineConfig(dtype="float32", attention_replicas=3, expert_workers=1))
    try:
        engine.add_request("big", [1] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
        for i in range(4):
            engine.add_request(f"s{i}", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
        owners = {rid: engine._router.owner(rid) for rid in ["big", "s0", "s1", "s2", "s3"]}
        assert owners["s0"] != owners["big"] and owners["s1"] != owners["big"]
        assert owners["s2"] != owners["big"] and len(set(owners.values())) == 3
        while engine.has_unfinished_requests():
            engine.step()
        assert engine._router.loads == [0, 0, 0] and len(engine._router) == 0
        assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    finally:
        engine.shutdown()


def test_expert_gemms_aggregate_replicas():
    with LLM(dtype="float32", attention_replicas=3, expert_workers=1, transport="inproc") as llm:
        llm.generate(PROMPTS * 4, PARAMS * 4)
        engine = llm.engine
    stats = engine.expert_stats[0]
    assert stats.rows_per_gemm > 1 and stats.frames >= stats.passes


def test_placement_validation_and_uneven_split():
    p = ExpertPlacement.even(8, 3)
    assert p.workers == ((0, 1, 2), (3, 4, 5), (6, 7))
    assert p.owner_table().tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="held by no worker"):
        ExpertPlacement(4, ((0, 1), (2,)))
    with pytest.raises(ValueError, match="expert_workers"):
        ExpertPlacement.even(8, 9)
    with pytest.raises(ValueError, match="expert_workers"):
        LLM(dtype="float32", expert_workers=9)
    with pytest.raises(ValueError, match="transport"):
        LLM(dtype="float32", expert_workers=2, transport="carrier-pigeon")
    if rdma_unavailable() is not None:  # this machine: refused up front, no worker started
        with pytest.raises(ValueError, match="transport 'rdma': .*use tcp"):
            LLM(dtype="float32", expert_workers=2, transport="rdma")
    with pytest.raises(ValueError, match="aggregation"):
        EngineConfig(aggregation="whenever")
    # NCCL cannot put two ranks on one GPU: refused before any worker or GPU is touched.
    with pytest.raises(ValueError, match="transport 'nccl': attention replica 0 and expert "
                                         "worker 0 would both run on cuda:0"):
        LLM(dtype="float32", device="cuda:0", expert_workers=2, transport="nccl")
    assert nccl_gpu_clash(EngineConfig(device="cpu", attention_replicas=2,
                                       expert_workers=3)) is None  # gloo on the CPU
    assert nccl_gpu_clash(EngineConfig(device="cuda:1", expert_workers=2)) is not None
    # Explicit GPUs: attention on 0 and 1, experts on 2: NCCL connects them.
    assert nccl_gpu_clash(EngineConfig(device="cuda", attention_replicas=2, attention_gpus=(0, 1),
                                       expert_gpus=(2,)), num_gpus=3) is None


FRONT_END = """
import sys, time
from megaserve import LLM
if __name__ == "__main__":
    llm = LLM(dtype="float32", transport="tcp", **LAYOUT)
    print(" ".join(str(w.pid) for w in llm.engine._workers), flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("layout, workers", [(IDLE_LAYOUTS[0], 4), (IDLE_LAYOUTS[1], 2)],
                         ids=["disaggregated", "colocated"])
def test_workers_exit_when_the_front_end_is_killed(tmp_path, layout, workers):
    import subprocess
    import sys

    script = tmp_path / "front_end.py"
    script.write_text(f"LAYOUT = {layout!r}\n" + FRONT_END)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == workers and all(alive(p) for p in pids)
        proc.kill()
        proc.wait(60)
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "orphaned worker processes"
    finally:
        proc.kill()


LOCKSTEP_LAYOUTS = [("inproc", 2, 3, 2), ("inproc", 3, 1, 1), ("tcp", 1, 2, 4), ("tcp", 3, 8, 2),
                    ("tcp", 2, 3, 4)]


@pytest.mark.parametrize("transport, replicas, experts, microbatches", LOCKSTEP_LAYOUTS,
                         ids=[f"{t}-R{r}-E{e}-m{m}" for t, r, e, m in LOCKSTEP_LAYOUTS])
def test_lockstep_outputs_equal_single_worker_bitwise(single_worker, transport, replicas, experts,
                                                      microbatches):
    with LLM(dtype="float32", attention_replicas=replicas, expert_workers=experts,
             microbatches=microbatches, transport=transport, aggregation="lockstep") as llm:
        got = signature(llm.generate(PROMPTS, PARAMS))
    assert got == single_worker


def test_lockstep_gathers_every_replica_into_each_gemm():
    def rows_per_gemm(aggregation):
        with LLM(dtype="float32", attention_replicas=3, expert_workers=1, microbatches=1,
                 aggregation=aggregation) as llm:
            llm.generate(PROMPTS * 6, [SamplingParams(max_tokens=12, ignore_eos=True)] * 30)
            engine = llm.engine
        return engine.expert_stats[0].rows_per_gemm

    # Lockstep ticks hold the tokens of all three replicas; the per-layer window only
    # catches those that happen to arrive together.
    assert rows_per_gemm("lockstep") > rows_per_gemm("per_layer")


def test_lockstep_abort_and_idle_replica():
    engine = DisaggregatedEngine(EngineConfig(dtype="float32", attention_replicas=3, expert_workers=2,
                                              microbatches=2, aggregation="lockstep"))
    try:
        engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
        engine.add_request("short", [4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
        outs = engine.step() + engine.step()
        engine.abort_request("long")
        while engine.has_unfinished_requests():
            outs += engine.step()
        finals = {o.request_id: o.outputs[0].finish_reason for o in outs if o.finished}
        assert finals == {"long": "abort", "short": "length"}
        assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    finally:
        engine.shutdown()


def test_engines_implement_the_engine_client_interface():
    from megaserve.engine.engine import LLMEngine
    from megaserve.runtime.engine_client import ATTRIBUTES, EngineClient

    assert issubclass(LLMEngine, EngineClient)  # by shape: the engine layer cannot name it
    assert issubclass(DisaggregatedEngine, EngineClient)

    class NoStep:
        def validate(self, prompt, params): ...

    assert not issubclass(NoStep, EngineClient)
    _device_plane_engine_is_an_engine_client()
    with LLM(dtype="float32") as one, LLM(dtype="float32", data_parallel_size=2,
                                          enable_expert_parallel=True) as ep:
        for engine in (one.engine, ep.engine):
            assert isinstance(engine, EngineClient)
            missing = [a for a in ATTRIBUTES if not hasattr(engine, a)]
            assert not missing, f"{type(engine).__name__} lacks {missing}"
            assert (engine.vocab_size, engine.max_model_len) == (one.engine.vocab_size,
                                                                 one.engine.max_model_len)


def _device_plane_engine_is_an_engine_client():
    """DevicePlaneEngine (CUDA only, so checked here by its source) names EngineClient as
    its base, forwards nothing implicitly (no ``__getattr__``), and its constructor sets
    every attribute of the interface."""
    import ast
    import inspect
    import textwrap

    from megaserve.runtime.device_engine import DevicePlaneEngine
    from megaserve.runtime.engine_client import ATTRIBUTES, EngineClient

    assert EngineClient in DevicePlaneEngine.__mro__ and not DevicePlaneEngine.__abstractmethods__
    assert "__getattr__" not in vars(DevicePlaneEngine)
    init = ast.parse(textwrap.dedent(inspect.getsource(DevicePlaneEngine.__init__)))
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
                for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    assert set(ATTRIBUTES) <= assigned, sorted(set(ATTRIBUTES) - assigned)


def test_outputs_carry_their_prompts_though_workers_do_not_send_them():
    """A worker's StepOutputs leaves each prompt out (messages.StepOutputs: a step at 1,024
    sequences would pickle every prompt id); the front-end restores prompt ids and text
    from its in-flight table, as the one-process engine returns them."""
    from megaserve.runtime.messages import StepOutputs

    prompts = [PROMPTS[4], "hello there"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(dtype="float32") as llm:
        want = [(o.prompt, o.prompt_token_ids) for o in llm.generate(prompts, params)]
        one = llm.generate(prompts[:1], params)[0]
    with LLM(dtype="float32", attention_replicas=2, expert_workers=1, transport="tcp") as llm:
        got = [(o.prompt, o.prompt_token_ids) for o in llm.generate(prompts, params)]
    assert got == want and len(want[0][1]) == 39
    packed = StepOutputs.of(0, [one], None).outputs[0]
    assert one.prompt_token_ids not in packed and one.request_id == packed[0]
