"""Recovery from a lost worker with the local launcher: real worker processes over tcp,
killed with SIGKILL while streaming and while idle."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megaserve import LLM, SamplingParams
from megaserve.engine.config import EngineConfig
from megaserve.runtime.cluster import DisaggregatedEngine, WorkerError
from megaserve.runtime.recovery import RestartPolicy
from tests.processes import alive

PROMPTS = ["Hello world, the", "Once upon a time", [5, 17, 99, 3, 250, 41, 7], "A B C D E F G"]
# Streams long enough that none ends before every one has 3 tokens, however unevenly a
# loaded machine runs the processes (data parallelism's engines do not step together: at
# 18-24 tokens one engine finished its requests before the other's had 3, beside two hogs).
PARAMS = [
    SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=96, temperature=0.8, seed=11, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=72, temperature=1.0, seed=4, top_k=30, ignore_eos=True),
    SamplingParams(max_tokens=88, temperature=0.7, seed=8, stop=["e t", "qq"], ignore_eos=True),
]
LAYOUT = dict(dtype="float32", attention_replicas=2, expert_workers=2, transport="tcp")


def signature(out):
    comp = out.outputs[0]
    return (comp.text, comp.token_ids, comp.logprobs, comp.finish_reason, comp.stop_reason,
            out.prompt_token_ids)


@pytest.fixture(scope="module")
def reference():
    """Undisturbed run (one process) of the same requests with the same seeds."""
    with LLM(dtype="float32") as llm:
        outs = llm.generate([p if isinstance(p, str) else {"prompt_token_ids": p}
                             for p in PROMPTS], PARAMS)
    return {f"r{i}": signature(o) for i, o in enumerate(outs)}


def worker_pid(engine, role="expert", index=0) -> int:
    (pid,) = [w.pid for w in engine._workers if w.name == f"megaserve-{role}-{index}"]
    return pid


def expert_pid(engine, index=0) -> int:
    return worker_pid(engine, "expert", index)


def add_all(engine):
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", prompt, params)


def run_to_end(engine, outputs, healths, limit_s=240.0):
    """Step until every request finished; record outputs and health states."""
    deadline = time.monotonic() + limit_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step(timeout=0.05):
            outputs.setdefault(out.request_id, []).append(out)
        healths.append(engine.health().state)


# One process of each kind of worker, killed mid-stream: an expert worker and an attention
# replica (lockstep: the front-end waits for that replica's step) of a disaggregated layout,
# a worker of co-located expert parallelism (replica and expert worker at once), and a
# whole engine of data parallelism.
KILLED = [("expert", 0, LAYOUT),
          ("attention", 1, dict(LAYOUT, aggregation="lockstep", microbatches=2)),
          ("colocated", 1, dict(dtype="float32", data_parallel_size=2,
                                enable_expert_parallel=True, transport="tcp")),
          ("engine", 0, dict(dtype="float32", data_parallel_size=2, transport="tcp"))]


@pytest.mark.parametrize("role, index, layout", KILLED, ids=[k[0] for k in KILLED])
def test_killed_worker_mid_stream_streams_complete_bitwise(reference, role, index, layout):
    engine = DisaggregatedEngine(EngineConfig(**layout, seed=0))
    try:
        add_all(engine)
        outputs: dict[str, list] = {}
        healths: list[str] = []
        # Stream until every request has delivered some tokens but none has finished.
        while not all(len(outputs.get(f"r{i}", [[]])[-1].outputs[0].token_ids) >= 3
                      if f"r{i}" in outputs else False for i in range(len(PROMPTS))):
            for out in engine.step(timeout=0.05):
                outputs.setdefault(out.request_id, []).append(out)
        assert not any(o[-1].finished for o in outputs.values())
        old_pid = worker_pid(engine, role, index)
        os.kill(old_pid, signal.SIGKILL)
        run_to_end(engine, outputs, healths)
        assert "recovering" in healths or engine.health().restarts == 1
        assert engine.health().state == "serving" and engine.health().restarts == 1
        assert worker_pid(engine, role, index) != old_pid
        for rid, outs in outputs.items():
            assert signature(outs[-1]) == reference[rid], rid
            for before, after in zip(outs, outs[1:]):  # a stream never takes tokens back
                b, a = before.outputs[0], after.outputs[0]
                assert a.token_ids[:len(b.token_ids)] == b.token_ids
                assert a.text.startswith(b.text)
        # Counters survive the restart (a Prometheus counter must not go backwards).
        stats = engine.stats()
        assert stats.generation_tokens_total >= sum(len(r[1]) for r in reference.values())
        assert stats.num_kv_blocks > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
        assert stats.num_running == stats.num_waiting == 0
    finally:
        engine.shutdown()


def test_killed_idle_worker_is_reported_and_replaced_without_a_request(reference):
    engine = DisaggregatedEngine(EngineConfig(**LAYOUT, seed=0))
    try:
        assert engine.health().serving
        os.kill(expert_pid(engine, 1), signal.SIGKILL)
        killed = time.monotonic()
        while engine.health().serving:
            # The liveness watch polls every 0.2 s; the bound is for a loaded machine.
            assert time.monotonic() - killed < 60, "health did not report the lost worker"
            time.sleep(0.02)
        assert engine.health().reason and "expert-1" in engine.health().reason
        while not engine.health().serving:  # replaced without any request arriving
            assert time.monotonic() - killed < 240
            time.sleep(0.05)
        assert engine.health().restarts == 1
        add_all(engine)
        outputs: dict[str, list] = {}
        run_to_end(engine, outputs, [])
        assert {rid: signature(o[-1]) for rid, o in outputs.items()} == reference
    finally:
        engine.shutdown()


def test_spent_restart_budget_fails_with_typed_error_and_health_says_why():
    engine = DisaggregatedEngine(EngineConfig(**LAYOUT), restart_policy=RestartPolicy(max_restarts=0))
    pids = [w.pid for w in engine._workers]
    try:
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step(timeout=1.0)
        os.kill(expert_pid(engine), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerError, match="gave up after 0 restarts"):
            while time.monotonic() - killed < 120:
                engine.step(timeout=0.1)
        assert engine.health().state == "failed" and "gave up" in engine.health().reason
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
