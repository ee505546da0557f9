"""Fixtures: the real ``megaserve serve`` as a subprocess, and an in-process reference LLM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megaserve.server.metrics import parse_text

MODEL = "builtin:tiny-moe"
LABEL = '{model_name="builtin:tiny-moe"}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post(url: str, body: bytes | dict, timeout: float = 60.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class ServerProcess:
    """``python -m megaserve.cli serve`` on 127.0.0.1 with free ports, logging to a file."""

    def __init__(self, log_path: Path, cache: str, *args: str) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "MEGASERVE_CACHE": cache}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megaserve.cli", "serve", "--host", "127.0.0.1",
             "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if http_get(self.url + "/health", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.url + "/metrics")
        assert status == 200
        return parse_text(body.decode())

    def wait_idle(self, timeout: float = 120.0) -> dict[str, float]:
        """Polls /metrics until nothing runs, waits or holds KV blocks; returns them."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m[f"vllm:num_requests_running{LABEL}"] == 0
                    and m[f"vllm:num_requests_waiting{LABEL}"] == 0
                    and m[f"megaserve:num_requests_in_flight{LABEL}"] == 0
                    and m[f"megaserve:num_free_kv_blocks{LABEL}"] == m[f"megaserve:num_kv_blocks{LABEL}"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:  # a drain, then worker processes stopping: tens of seconds on a loaded box
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def ready_server(log_path: Path, cache: str, *args: str):
    """A ServerProcess, once ready; stopped on exit."""
    srv = ServerProcess(log_path, cache, *args)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def assert_idle(server: ServerProcess) -> dict[str, float]:
    """Asserts that nothing runs, waits or holds KV blocks; returns the metrics."""
    m = server.wait_idle()
    assert m[f"vllm:num_requests_running{LABEL}"] == 0
    assert m[f"vllm:num_requests_waiting{LABEL}"] == 0
    assert m[f"megaserve:num_requests_in_flight{LABEL}"] == 0
    assert m[f"megaserve:num_free_kv_blocks{LABEL}"] == m[f"megaserve:num_kv_blocks{LABEL}"]
    assert m[f"vllm:kv_cache_usage_perc{LABEL}"] == 0
    return m


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """A MEGASERVE_CACHE shared by this process and the servers, with the model built."""
    cache = str(tmp_path_factory.mktemp("megaserve-cache"))
    old = os.environ.get("MEGASERVE_CACHE")
    os.environ["MEGASERVE_CACHE"] = cache
    from megaserve.models.builtin import resolve_model

    resolve_model(MODEL)  # build it once, before any server races to
    yield cache
    if old is None:
        os.environ.pop("MEGASERVE_CACHE", None)
    else:
        os.environ["MEGASERVE_CACHE"] = old


@pytest.fixture(scope="session")
def server(model_cache, tmp_path_factory) -> ServerProcess:
    """One default server shared by the gRPC and HTTP test modules."""
    srv = ServerProcess(tmp_path_factory.mktemp("server") / "server.log", model_cache,
                        "--dtype", "float32", "--max-num-seqs", "64", "--max-model-len", "2048")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def llm(model_cache):
    """The offline engine with the server's settings: the reference for outputs."""
    from megaserve import LLM

    with LLM(model=MODEL, dtype="float32", device="cpu", max_num_seqs=64,
             max_model_len=2048, seed=0) as engine:
        yield engine
