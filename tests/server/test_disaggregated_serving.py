"""A server over a disaggregated layout (worker processes over tcp) answers exactly as the
single-process engine, and shuts down without leaving workers behind."""

from __future__ import annotations

import concurrent.futures
import time

from megaserve.sampling_params import SamplingParams
from tests.processes import alive, descendants

from .conftest import LABEL, ServerProcess, assert_idle, http_post


def test_disaggregated_server_equals_llm_and_leaves_no_workers(model_cache, llm, tmp_path):
    server = ServerProcess(tmp_path / "server.log", model_cache, "--dtype", "float32",
                           "--max-num-seqs", "64", "--max-model-len", "2048",
                           "--attention-replicas", "2", "--expert-workers", "3",
                           "--microbatches", "2", "--transport", "tcp")
    try:
        server.wait_ready()
        # Before the first request: the gauges count both replicas' KV pools (each the
        # size of the one-process engine's), and the counters are 0 (the server's warm-up
        # request, run before it reports ready, is not counted).
        pool = llm.engine.stats().num_kv_blocks
        m = server.metrics()
        assert m[f"megaserve:num_kv_blocks{LABEL}"] == 2 * pool
        assert m[f"megaserve:num_free_kv_blocks{LABEL}"] == 2 * pool
        assert m[f"vllm:kv_cache_usage_perc{LABEL}"] == 0
        for counter in ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                        "prefix_cache_hits"):
            assert m[f"vllm:{counter}_total{LABEL}"] == 0, counter
        bodies = [{"model": "builtin:tiny-moe", "prompt": f"Request number {i}:", "max_tokens": 12,
                   "temperature": 0.8 if i % 2 else 0.0, "seed": i} for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda b: http_post(server.url + "/v1/completions", b), bodies))
        for body, (status, reply) in zip(bodies, replies):
            assert status == 200
            expected = llm.generate(body["prompt"], SamplingParams(
                max_tokens=12, temperature=body["temperature"], seed=body["seed"]))[0]
            assert reply["choices"][0]["text"] == expected.outputs[0].text
        m = assert_idle(server)
        for counter in ("prompt_tokens", "completion_tokens"):  # these requests' only
            total = sum(reply["usage"][counter] for _, reply in replies)
            name = "generation_tokens" if counter == "completion_tokens" else counter
            assert m[f"vllm:{name}_total{LABEL}"] == total, counter
        workers = descendants(server.proc.pid)
        assert len(workers) >= 5  # 2 attention + 3 expert workers (+ the fork server)
    finally:
        assert server.stop() == 0
    deadline = time.monotonic() + 60
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if alive(p)], "worker processes outlived the server"
