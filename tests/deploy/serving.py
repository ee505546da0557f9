"""Helpers for the deploy tests: streaming gRPC clients, a health poller, waiting."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megaserve.server.client import build_request, stream_generate
from tests.processes import wait_for
from tests.server.conftest import http_get


@contextlib.contextmanager
def built_model_cache(path: str, model: str):
    """``MEGASERVE_CACHE=path`` for this process (its workers inherit it) with ``model``
    built there first; the old value comes back on exit."""
    old = os.environ.get("MEGASERVE_CACHE")
    os.environ["MEGASERVE_CACHE"] = path
    try:
        from megaserve.models.builtin import resolve_model

        resolve_model(model)
        yield path
    finally:
        if old is None:
            os.environ.pop("MEGASERVE_CACHE", None)
        else:
            os.environ["MEGASERVE_CACHE"] = old

# Long enough that a kill after the first tokens lands mid-stream; seeds fixed so the
# in-process reference is the same computation.
REQUESTS = [
    ("The quick brown fox", dict(max_tokens=160, temperature=0.0, ignore_eos=True)),
    ("Once upon a time", dict(max_tokens=150, temperature=0.8, seed=3, ignore_eos=True)),
    ("1, 2, 3, 4,", dict(max_tokens=170, temperature=1.0, seed=7, top_k=40, ignore_eos=True)),
    ("Serving MoE models", dict(max_tokens=140, temperature=0.7, seed=1, ignore_eos=True)),
]


class Stream(threading.Thread):
    """One streaming Generate call; records chunks and the final message."""

    def __init__(self, address: str, prompt: str, sampling: dict) -> None:
        super().__init__(daemon=True)
        self.address, self.prompt, self.sampling = address, prompt, sampling
        self.chunk_ids: list[int] = []
        self.chunk_text = ""
        self.complete = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for resp in stream_generate(self.address, build_request(
                    self.prompt, stream=True, **self.sampling), timeout=300):
                kind = resp.WhichOneof("response")
                if kind == "chunk":
                    self.chunk_ids += list(resp.chunk.token_ids)
                    self.chunk_text += resp.chunk.text
                elif kind == "complete":
                    self.complete = resp.complete
                else:
                    self.error = RuntimeError(f"error message: {resp.error}")
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            self.error = e


class HealthPoller(threading.Thread):
    """Polls grpc.health.v1 every 20 ms (``service``: "" for the server overall, or a name
    such as the liveness probe's); ``history`` is [(monotonic, status)]."""

    def __init__(self, address: str, service: str = "") -> None:
        super().__init__(daemon=True)
        self.address = address
        self.service = service
        self.history: list[tuple[float, str]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._halt.is_set():
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=self.service),
                                          timeout=5)
                    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
                except grpc.RpcError as e:
                    name = f"RPC_{e.code().name}"
                self.history.append((time.monotonic(), name))
                time.sleep(0.02)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(5)

    def first(self, status: str, after: float) -> float | None:
        """Time of the first ``status`` at or after ``after``."""
        return next((t for t, s in self.history if t >= after and s == status), None)


def wait_http_serving(url: str) -> None:
    """Waits (60 s) for the server's HTTP /health to answer 200: it is the listener
    process's copy of what the event loop publishes (every 0.1 s), so it follows gRPC
    health back to SERVING a moment later on a loaded machine."""
    wait_for(lambda: http_get(url + "/health")[0] == 200, 60,
             "HTTP /health to follow gRPC health back to 200", poll_s=0.1)


def kill_mid_stream(grpc_address: str, poller: HealthPoller, expected, victim_pid: int) -> None:
    """Stream REQUESTS; once every stream has tokens and none is complete, SIGKILL
    ``victim_pid`` (a worker). Asserts that every stream then completes with the ids and
    text of ``expected`` (the undisturbed run, in REQUESTS order), that health turned
    NOT_SERVING after the kill, and that it came back to SERVING. (How fast health reacts
    is not asserted: on a loaded machine the polls behind it are late by seconds.)"""
    streams = [Stream(grpc_address, p, s) for p, s in REQUESTS]
    for s in streams:
        s.start()
    wait_for(lambda: all(len(s.chunk_ids) >= 3 or s.error for s in streams), 300,
             "first tokens of every stream")
    os.kill(victim_pid, signal.SIGKILL)
    killed = time.monotonic()
    assert not any(s.complete is not None for s in streams), "a stream ended before the kill"
    for s in streams:
        s.join(600)  # a recovery: a new worker imports torch and loads its shard
    for s, exp in zip(streams, expected):
        assert s.error is None, s.error
        assert list(s.complete.output_ids) == exp.token_ids
        assert s.complete.text == exp.text
        assert s.chunk_ids == exp.token_ids and s.chunk_text == exp.text
    assert poller.first("NOT_SERVING", killed) is not None, "health did not dip"
    wait_for(lambda: poller.history[-1][1] == "SERVING", 600, "health back")
