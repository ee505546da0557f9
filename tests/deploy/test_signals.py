"""Signals on ``megaserve serve`` with the local launcher's worker processes (tcp).

* Ctrl-C: the terminal sends SIGINT to the whole foreground process group, workers
  included. The server drains (streams in flight finish), its workers are not lost on the
  way (no recovery mid-drain), and it exits 0.
* SIGTERM while a lost worker is being replaced, with a grace period shorter than the
  replacement: the engine cannot answer the aborts in time, yet every stream still ends
  with finish reason "abort" (the prefix of the undisturbed output), and the exit code is 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megaserve.sampling_params import SamplingParams
from tests.processes import alive, comm, descendants
from tests.server.conftest import free_port, http_get

from .serving import REQUESTS, Stream, built_model_cache, wait_for

MODEL = "builtin:tiny-moe"


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    with built_model_cache(str(tmp_path_factory.mktemp("megaserve-cache")), MODEL) as cache:
        yield cache


@pytest.fixture(scope="module")
def expected(model_cache):
    from megaserve import LLM

    with LLM(model=MODEL, dtype="float32", max_model_len=512, seed=0) as llm:
        return [llm.generate(p, SamplingParams(**s))[0].outputs[0] for p, s in REQUESTS]


@contextlib.contextmanager
def serving(cache: str, log_path: Path, *args: str):
    """A ready server with 2 attention replicas and 2 expert workers as processes, in a
    process group of its own (as a foreground job); yields (process, gRPC address)."""
    grpc_port, http_port = free_port(), free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "megaserve.cli", "serve", "--host", "127.0.0.1",
             "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--dtype", "float32",
             "--max-model-len", "512", "--attention-replicas", "2", "--expert-workers", "2",
             "--transport", "tcp", *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MEGASERVE_CACHE": cache})
    try:
        def ready() -> bool:
            assert server.poll() is None, log_path.read_text()
            try:
                return http_get(f"http://127.0.0.1:{http_port}/health", timeout=5)[0] == 200
            except OSError:
                return False

        wait_for(ready, 300, "the server to serve", poll_s=0.2)
        yield server, f"127.0.0.1:{grpc_port}"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def start_streams(address: str) -> list[Stream]:
    streams = [Stream(address, p, s) for p, s in REQUESTS]
    for s in streams:
        s.start()
    wait_for(lambda: all(len(s.chunk_ids) >= 3 or s.error for s in streams), 300,
             "first tokens of every stream")
    return streams


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_drains_without_losing_workers(model_cache, expected,
                                                                   tmp_path):
    log_path = tmp_path / "server.log"
    with serving(model_cache, log_path) as (server, address):
        workers = descendants(server.pid)
        assert workers
        streams = start_streams(address)
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
        code = server.wait(300)  # the drain is bounded by the grace period; exiting, by the load
        for s, exp in zip(streams, expected):
            s.join(300)
            assert s.error is None, s.error
            # The default grace period (30 s) is ample for these: each stream finishes.
            assert s.complete.finish_reason == "length", s.complete
            assert list(s.complete.output_ids) == exp.token_ids and s.chunk_ids == exp.token_ids
    log = log_path.read_text()
    assert code == 0, log
    assert "KeyboardInterrupt" not in log and "restarting the worker group" not in log, log
    wait_for(lambda: not any(alive(p) for p in workers), 120, "workers to exit")


@pytest.mark.slow
def test_sigterm_while_recovering_ends_every_stream_with_a_finish_reason(model_cache, expected,
                                                                         tmp_path):
    log_path = tmp_path / "server.log"
    with serving(model_cache, log_path, "--grace-period", "1") as (server, address):
        streams = start_streams(address)
        (victim,) = [p for p in descendants(server.pid) if comm(p) == "megaserve-E0"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: "restarting the worker group" in log_path.read_text(), 300,
                 "the recovery to start")
        server.send_signal(signal.SIGTERM)  # the replacement takes longer than 1 s
        code = server.wait(300)
        for s, exp in zip(streams, expected):
            s.join(300)
            assert s.error is None, s.error
            assert s.complete is not None and s.complete.finish_reason in ("abort", "length")
            ids = list(s.complete.output_ids)
            assert ids == exp.token_ids[:len(ids)] and s.chunk_ids == ids
    assert code == 0, log_path.read_text()
