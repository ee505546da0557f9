"""CPU KV pools against the host's memory, and a worker the kernel kills.

A CPU KV pool is zero-filled at startup: a pool larger than the memory left does not fail
its allocation, the kernel's OOM killer ends the process while it fills it, and the peers
of a co-located worker then report only a lost connection. Pools that cannot fit are
refused before any worker starts; a worker killed by a signal is named, with the signal.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megaserve import SamplingParams
from megaserve.engine import memory
from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.runtime.cluster import DisaggregatedEngine, WorkerError
from megaserve.runtime.recovery import RestartPolicy
from tests.processes import descendants

GIB = 1 << 30


def _available() -> int:
    available = memory.host_available_bytes()
    if available is None:
        pytest.skip("this host does not say how much memory is available")
    return available


def test_host_check_refuses_pools_that_do_not_fit_together():
    memory.check_host_kv_memory(3 * GIB, 2, "kv_cache_memory_bytes", available_bytes=6 * GIB)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes: 2 KV pools of 4\.00 GiB need 8\.00 GiB"):
        memory.check_host_kv_memory(4 * GIB, 2, "kv_cache_memory_bytes", available_bytes=6 * GIB)
    with pytest.raises(ValueError, match=r"num_kv_blocks: a KV pool of 7\.00 GiB"):
        memory.check_host_kv_memory(7 * GIB, 1, "num_kv_blocks", available_bytes=6 * GIB)
    assert memory.host_available_bytes() is None or memory.host_available_bytes() > 0


@pytest.mark.parametrize("layout", [dict(data_parallel_size=2, enable_expert_parallel=True),
                                    dict(data_parallel_size=2)], ids=["colocated-ep", "dp"])
def test_cpu_workers_whose_pools_overfill_the_host_are_refused_before_starting(layout):
    # Each pool alone fits (0.6 of what is free), two do not: before the check, both
    # workers started filling theirs and the OOM killer ended one mid-start.
    per_replica = int(0.6 * _available())
    before = set(descendants(os.getpid()))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes: 2 KV pools"):
        DisaggregatedEngine(EngineConfig(device="cpu", dtype="float32", transport="tcp",
                                         kv_cache_memory_bytes=per_replica, **layout))
    assert set(descendants(os.getpid())) <= before, "a worker started"


def test_one_cpu_engine_whose_pool_exceeds_the_host_is_refused():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes: a KV pool of"):
        LLMEngine(EngineConfig(device="cpu", dtype="float32", kv_cache_memory_bytes=2 * _available()))


def test_a_killed_colocated_worker_is_named_with_its_signal():
    # Its peer (the other worker's expert rank) fails first with a lost connection; the
    # error must name the worker that died and how, not only the peer's symptom.
    engine = DisaggregatedEngine(EngineConfig(device="cpu", dtype="float32", transport="tcp",
                                              data_parallel_size=2, enable_expert_parallel=True),
                                 restart_policy=RestartPolicy(max_restarts=0))
    try:
        for i in range(4):
            engine.add_request(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=10_000, ignore_eos=True))
        engine.step(timeout=2.0)
        victim = engine._workers[1]
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError) as failure:
            while time.monotonic() - start < 180:  # bounds a hang, not a slow machine
                engine.step(timeout=0.5)
    finally:
        engine.shutdown()
    assert f"{victim.name} was killed by SIGKILL" in str(failure.value) \
        or f"{victim.name} (killed by SIGKILL" in str(failure.value), str(failure.value)
