"""GPU, bf16, bitwise: greedy speculative decoding (n-gram, a draft model) equals decoding
without it (whose decode steps replay CUDA graphs, while verification steps run eagerly),
with prefix caching, chunking and a cramped pool; seeded sampling is reproducible in a crowd.

Run: ``pytest -m gpu tests/megaserve/test_spec_decode_gpu.py``
"""

from __future__ import annotations

import random

import pytest

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.models.builtin import resolve_model
from tests.megaserve.hf_models import make_checkpoint
from tests.megaserve.test_spec_decode import repetitive_arrivals, run, signature

pytestmark = pytest.mark.gpu

MAX_MODEL_LEN = 160
VARIANTS = {"roomy": {}, "chunked": dict(max_num_batched_tokens=23),
            "cramped": dict(max_num_batched_tokens=40, num_kv_blocks=24)}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    other = tmp_path_factory.mktemp("draft") / "other"
    make_checkpoint(other, "qwen3_moe", seed=3, vocab_size=512, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                    num_experts_per_tok=2)
    return {"same": str(resolve_model("builtin:tiny-moe")), "other": str(other)}


def _engine(spec=None, **overrides) -> LLMEngine:
    # An explicit pool: several engines share the GPU (gpu_memory_utilization would give
    # the first one nearly all of it).
    overrides = {"num_kv_blocks": 400, **overrides}
    return LLMEngine(EngineConfig(dtype="bfloat16", device="cuda", max_model_len=MAX_MODEL_LEN,
                                  max_num_seqs=32, speculative_config=spec, **overrides))


@pytest.fixture(scope="module")
def reference():
    return _engine(enable_prefix_caching=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("method, k", [("ngram", 1), ("ngram", 4), ("same", 3), ("other", 6)])
def test_greedy_speculation_is_bitwise_invisible_on_gpu(reference, drafts, method, k, variant):
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    else:
        spec = {"model": drafts[method], "num_speculative_tokens": k}
    engine = _engine(spec, **VARIANTS[variant])
    roomy = _engine(spec)
    for seed in range(3):
        arrivals = repetitive_arrivals(random.Random(seed), 10, greedy_only=False)
        got = run(engine, arrivals)
        for _, request_id, prompt, params in arrivals:
            alone_engine = reference if params.greedy else roomy
            alone = run(alone_engine, [(0, request_id, prompt, params)])[request_id]
            assert signature(got[request_id]) == signature(alone), (request_id, seed)
    assert engine.stats().spec_num_draft_tokens > 0
