"""The DeepSeek-V3 family end to end on CUDA (bf16, and block-FP8 with ``quantization="fp8"``):
a request's tokens and logprobs are bitwise the same alone, among others arriving at random
steps, in prefill chunks of two budgets and on a prefix-cache hit; decode steps run through
CUDA graphs (the default). The CPU twin is tests/megaserve/test_deepseek.py, whose runner
this reuses; values against HF are checked there (float32) and for the kernels in
tests/kernels/test_mla_gpu.py and test_fp8_gpu.py."""

from __future__ import annotations

import json
import random

import pytest

from megaserve import SamplingParams
from tests.megaserve.hf_models import DEEPSEEK_VARIANTS, make_deepseek_checkpoint
from tests.megaserve.test_deepseek import _crowd, _run, _signature

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-gpu")
    make_deepseek_checkpoint(path, **DEEPSEEK_VARIANTS["deepseek-qlora-yarn-groups"])
    return path


def _engine(path, quantization, **overrides):
    from megaserve.engine.config import EngineConfig
    from megaserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                  quantization=quantization, max_model_len=160, max_num_seqs=16,
                                  kv_cache_memory_bytes=1 << 28, **overrides))


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_alone_crowded_chunked_and_cached_are_bitwise_equal_on_cuda(deepseek_path, quantization):
    rng = random.Random(11)
    vocab = json.loads((deepseek_path / "config.json").read_text())["vocab_size"]
    target = [rng.randrange(vocab) for _ in range(45)]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    alone = _run(_engine(deepseek_path, quantization, enable_prefix_caching=False),
                 [(0, "target", target, params)])["target"]
    assert len(alone.outputs[0].token_ids) == 10
    arrivals = _crowd(rng, vocab, target, params)
    for budget in (23, 64):
        engine = _engine(deepseek_path, quantization, max_num_batched_tokens=budget)
        crowded = _run(engine, arrivals)["target"]
        assert _signature(crowded) == _signature(alone), f"budget {budget}"
        again = _run(engine, [(0, "again", target, params)])["again"]
        assert again.num_cached_tokens >= 32
        assert _signature(again) == _signature(alone), f"prefix-cache hit, budget {budget}"


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_speculative_decoding_is_bitwise_equal_on_cuda(deepseek_path, quantization):
    """Greedy with n-gram speculation on CUDA (verification steps of several tokens a
    sequence through MLA and, in fp8, the FP8 linears and expert GEMMs): the tokens and
    logprobs of the engine without it."""
    prompts = [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 2, [11] * 20]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    arrivals = [(0, f"p{i}", p, params) for i, p in enumerate(prompts)]
    ref = _run(_engine(deepseek_path, quantization, enable_prefix_caching=False), arrivals)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    got = _run(_engine(deepseek_path, quantization, speculative_config=spec), arrivals)
    assert all(len(out.outputs[0].token_ids) == 12 for out in ref.values())
    assert {k: _signature(v) for k, v in got.items()} == {k: _signature(v) for k, v in ref.items()}
