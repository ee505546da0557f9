"""A server over a disaggregated layout (worker processes over tcp) answers exactly as the
single-process engine, and shuts down without leaving workers behind."""

from __future__ import annotations

import concurrent.futures
import time

from megaserve.sampling_params import SamplingParams
from tests.processes import alive, descendants

from .conftest import ServerProcess, assert_idle, http_post


def test_disaggregated_server_equals_llm_and_leaves_no_workers(model_cache, llm, tmp_path):
    server = ServerProcess(tmp_path / "server.log", model_cache, "--dtype", "float32",
                           "--max-num-seqs", "64", "--max-model-len", "2048",
                           "--attention-replicas", "2", "--expert-workers", "3",
                           "--microbatches", "2", "--transport", "tcp")
    try:
        server.wait_ready()
        bodies = [{"model": "builtin:tiny-moe", "prompt": f"Request number {i}:", "max_tokens": 12,
                   "temperature": 0.8 if i % 2 else 0.0, "seed": i} for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda b: http_post(server.url + "/v1/completions", b), bodies))
        for body, (status, reply) in zip(bodies, replies):
            assert status == 200
            expected = llm.generate(body["prompt"], SamplingParams(
                max_tokens=12, temperature=body["temperature"], seed=body["seed"]))[0]
            assert reply["choices"][0]["text"] == expected.outputs[0].text
        assert_idle(server)
        workers = descendants(server.proc.pid)
        assert len(workers) >= 5  # 2 attention + 3 expert workers (+ the fork server)
    finally:
        assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if alive(p)], "worker processes outlived the server"
