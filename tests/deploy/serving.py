"""Helpers for the deploy tests: streaming gRPC clients, a health poller, process lookup."""

from __future__ import annotations

import os
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megaserve.server.client import build_request, stream_generate

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
    """Polls grpc.health.v1 (overall) every 20 ms; ``history`` is [(monotonic, status)]."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.history: list[tuple[float, str]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._halt.is_set():
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
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


def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll_s)


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    parents = {int(d): parent_of(int(d)) for d in os.listdir("/proc") if d.isdigit()}
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid]
        found += children
        frontier += children
    return found


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
