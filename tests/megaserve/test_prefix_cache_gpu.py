"""GPU, bf16, bitwise: prefix-cache hits (roomy, odd chunk sizes, a cramped pool that
evicts and preempts) leave token ids and logprobs unchanged; CUDA graphs stay on.

Run: ``pytest -m gpu tests/megaserve/test_prefix_cache_gpu.py``
"""

from __future__ import annotations

import random

import pytest

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from tests.megaserve.test_prefix_cache import run, shared_prefix_arrivals, signature

pytestmark = pytest.mark.gpu

MAX_MODEL_LEN = 160


def _engine(**overrides) -> LLMEngine:
    # An explicit pool: several engines share the GPU (gpu_memory_utilization would give
    # the first one nearly all of it).
    overrides = {"num_kv_blocks": 400, **overrides}
    return LLMEngine(EngineConfig(dtype="bfloat16", device="cuda", max_model_len=MAX_MODEL_LEN,
                                  max_num_seqs=32, **overrides))


@pytest.fixture(scope="module")
def engines():
    return {
        "reference": _engine(enable_prefix_caching=False),
        "roomy": _engine(),
        "chunked": _engine(max_num_batched_tokens=23),
        "cramped": _engine(max_num_batched_tokens=40, num_kv_blocks=24),
    }


@pytest.mark.parametrize("which", ["roomy", "chunked", "cramped"])
@pytest.mark.parametrize("seed", range(4))
def test_prefix_cache_hits_are_bitwise_invisible_on_gpu(engines, which, seed):
    rng = random.Random(seed)
    reference, engine = engines["reference"], engines[which]
    arrivals = shared_prefix_arrivals(rng, reference.vocab_size, 12)
    expected = {a[1]: run(reference, [(0,) + a[1:]])[a[1]] for a in arrivals}
    hits = engine.stats().prefix_cache_hits
    got = run(engine, arrivals)
    assert engine.stats().prefix_cache_hits > hits
    for request_id, out in expected.items():
        assert signature(got[request_id]) == signature(out), request_id
