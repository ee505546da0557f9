"""Ctrl-C on ``megaserve serve`` with the local launcher's worker processes: the terminal
sends SIGINT to the whole foreground process group, workers included. The server drains
(streams in flight finish), its workers are not lost on the way (no recovery mid-drain),
and it exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megaserve.sampling_params import SamplingParams
from tests.processes import alive, descendants
from tests.server.conftest import free_port, http_get

from .serving import REQUESTS, Stream, built_model_cache, wait_for

MODEL = "builtin:tiny-moe"


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    with built_model_cache(str(tmp_path_factory.mktemp("megaserve-cache")), MODEL) as cache:
        yield cache


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_drains_without_losing_workers(model_cache, tmp_path):
    from megaserve import LLM

    with LLM(model=MODEL, dtype="float32", max_model_len=512, seed=0) as llm:
        expected = [llm.generate(p, SamplingParams(**s))[0].outputs[0] for p, s in REQUESTS]
    grpc_port, http_port = free_port(), free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "megaserve.cli", "serve", "--host", "127.0.0.1",
             "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--dtype", "float32",
             "--max-model-len", "512", "--attention-replicas", "2", "--expert-workers", "2",
             "--transport", "tcp"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # a foreground job's
            env={**os.environ, "MEGASERVE_CACHE": model_cache})            # process group
    workers: list[int] = []
    try:
        def ready() -> bool:
            assert server.poll() is None, log_path.read_text()
            try:
                return http_get(f"http://127.0.0.1:{http_port}/health", timeout=5)[0] == 200
            except OSError:
                return False

        wait_for(ready, 300, "the server to serve", poll_s=0.2)
        workers = descendants(server.pid)
        assert workers
        streams = [Stream(f"127.0.0.1:{grpc_port}", p, s) for p, s in REQUESTS]
        for s in streams:
            s.start()
        wait_for(lambda: all(len(s.chunk_ids) >= 3 or s.error for s in streams), 120,
                 "first tokens of every stream")
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
        code = server.wait(120)
        for s, exp in zip(streams, expected):
            s.join(60)
            assert s.error is None, s.error
            # The default grace period (30 s) is ample for these: each stream finishes.
            assert s.complete.finish_reason == "length", s.complete
            assert list(s.complete.output_ids) == exp.token_ids and s.chunk_ids == exp.token_ids
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    log = log_path.read_text()
    assert code == 0, log
    assert "KeyboardInterrupt" not in log and "restarting the worker group" not in log, log
    wait_for(lambda: not any(alive(p) for p in workers), 60, "workers to exit")
