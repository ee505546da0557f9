"""``megaserve serve`` (local launcher, worker processes over tcp) survives a SIGKILLed expert
worker: streams in flight complete bitwise, health dips and comes back; an idle death is
reported without a request. The liveness name of the Kubernetes probe stays SERVING all along
(a recovery must not get the pod restarted)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megaserve.sampling_params import SamplingParams
from megaserve.service import LIVENESS_NAME
from tests.processes import alive, comm, descendants
from tests.server.conftest import ServerProcess, http_get

from .serving import (REQUESTS, HealthPoller, Stream, built_model_cache, kill_mid_stream,
                      wait_for, wait_http_serving)

MODEL = "builtin:tiny-moe"


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    with built_model_cache(str(tmp_path_factory.mktemp("megaserve-cache")), MODEL) as cache:
        yield cache


def reference_outputs():
    from megaserve import LLM

    with LLM(model=MODEL, dtype="float32", max_model_len=512, seed=0) as llm:
        return [llm.generate(p, SamplingParams(**s))[0].outputs[0] for p, s in REQUESTS]


def expert_pid(server: ServerProcess, index: int) -> int:
    pids = [p for p in descendants(server.proc.pid) if comm(p) == f"megaserve-E{index}"]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.slow
def test_server_survives_killed_expert_worker(model_cache, tmp_path):
    expected = reference_outputs()
    server = ServerProcess(tmp_path / "server.log", model_cache, "--dtype", "float32",
                           "--max-model-len", "512", "--attention-replicas", "2",
                           "--expert-workers", "2", "--transport", "tcp")
    poller = HealthPoller(server.grpc_address)
    liveness = HealthPoller(server.grpc_address, LIVENESS_NAME)
    workers: list[int] = []
    try:
        server.wait_ready(600)  # four worker processes import torch: minutes beside CPU hogs
        poller.start()
        liveness.start()
        wait_for(lambda: poller.history and poller.history[-1][1] == "SERVING", 300, "SERVING")

        # 1. Mid-stream: every stream has tokens, none is complete, then E0 dies.
        victim = expert_pid(server, 0)
        kill_mid_stream(server.grpc_address, poller, expected, victim)
        assert expert_pid(server, 0) != victim

        # 2. Idle: E1 dies with no request in flight; health reports it, no request needed.
        victim = expert_pid(server, 1)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: poller.first("NOT_SERVING", killed) is not None, 300, "NOT_SERVING")
        status, body = http_get(server.url + "/health")
        assert status in (200, 503)  # 503 RECOVERING unless the restart already finished
        wait_for(lambda: poller.first("SERVING", poller.first("NOT_SERVING", killed)) is not None,
                 600, "health back after the idle kill")
        wait_http_serving(server.url)
        again = Stream(server.grpc_address, *REQUESTS[1])
        again.run()
        assert again.error is None and list(again.complete.output_ids) == expected[1].token_ids
        workers = descendants(server.proc.pid)
        live = {status for _, status in liveness.history}
        assert live == {"SERVING"}, liveness.history  # through both recoveries
    finally:
        code = server.stop()  # first: nothing may leave the server running
        poller.stop()
        liveness.stop()
    assert code == 0, server.log()
    wait_for(lambda: not any(alive(p) for p in workers), 120, "workers to exit")
