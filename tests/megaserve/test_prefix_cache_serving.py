"""Prefix-cache hits reported over HTTP (usage.prompt_tokens_details.cached_tokens), gRPC
(Usage.cached_tokens) and /metrics (vLLM's prefix_cache_queries / prefix_cache_hits and
a hit-rate gauge), against a real ``megaserve serve``; the outputs of a hit equal a miss."""

from __future__ import annotations

import os

import grpc
import pytest

from megaserve.kernels import cpu_ext
from megaserve.models.builtin import resolve_model
from megaserve.server.client import build_request, generation_stub
from tests.server.conftest import LABEL, MODEL, ServerProcess, http_post

PROMPT = [(11 * i + 5) % 500 for i in range(40)]  # 2 full blocks of 16 can be reused


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of its own: its prefix cache lives in its memory, so it starts empty. It
    shares the session's MEGASERVE_CACHE (tests/conftest.py) with the model and the CPU
    kernels built here first, so the server neither generates the model nor compiles the
    kernels while wait_ready counts (a cache of its own made it do both)."""
    resolve_model(MODEL)
    cpu_ext.build(cpu_ext.default_isa())  # into this cache (a loaded library may be elsewhere)
    srv = ServerProcess(tmp_path_factory.mktemp("server") / "server.log",
                        os.environ["MEGASERVE_CACHE"], "--dtype", "float32",
                        "--max-model-len", "256")
    try:
        srv.wait_ready(timeout=120)
        yield srv
    finally:
        srv.stop()


def _complete(server, prompt):
    status, body = http_post(server.url + "/v1/completions",
                             {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                              "logprobs": 1, "return_token_ids": True})
    assert status == 200, body
    return body


def test_cached_tokens_over_http_grpc_and_metrics(server):
    # The server's start-up warm-up request is counted too: assert what these requests add.
    before = server.wait_idle()
    miss = _complete(server, PROMPT)
    hit = _complete(server, PROMPT)
    assert miss["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert hit["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert hit["choices"][0]["token_ids"] == miss["choices"][0]["token_ids"]
    assert hit["choices"][0]["logprobs"] == miss["choices"][0]["logprobs"]
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = generation_stub(channel)
        responses = list(stub["Generate"](build_request(PROMPT, max_tokens=5, temperature=0.0),
                                          timeout=60))
    complete = responses[-1].complete
    assert complete.usage.cached_tokens == 32
    assert list(complete.output_ids) == hit["choices"][0]["token_ids"]
    metrics = server.wait_idle()
    queries, hits = (f"vllm:prefix_cache_{name}_total{LABEL}" for name in ("queries", "hits"))
    assert metrics[queries] - before[queries] == 3 * len(PROMPT)
    assert metrics[hits] - before[hits] == 64
    assert metrics[f"megaserve:prefix_cache_hit_rate{LABEL}"] == pytest.approx(
        metrics[hits] / metrics[queries])
