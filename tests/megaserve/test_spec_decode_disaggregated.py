"""Speculative decoding through disaggregated layouts: verification is an ordinary
multi-token step through the expert workers, so greedy outputs equal the single-process
engine without speculation, bitwise, and seeded sampling equals the single-process
engine with the same speculation."""

from __future__ import annotations

import pytest

from megaserve import LLM, SamplingParams
from megaserve.models.builtin import resolve_model

PROMPTS = [{"prompt_token_ids": ([3, 14, 15, 92, 65] * 12)[: 10 + 9 * i] + [i]} for i in range(5)]
GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=4, logprobs=1, ignore_eos=True)


def _signature(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _spec(method: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    return {"model": str(resolve_model("builtin:tiny-moe")), "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def references():
    with LLM(dtype="float32") as llm:
        greedy = _signature(llm.generate(PROMPTS, GREEDY))
    out = {"greedy": greedy}
    for method in ("ngram", "draft"):
        with LLM(dtype="float32", speculative_config=_spec(method)) as llm:
            out[method] = _signature(llm.generate(PROMPTS, SEEDED))
    return out


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("transport, replicas, experts, microbatches, aggregation",
                         [("inproc", 2, 2, 2, "per_layer"), ("tcp", 1, 2, 1, "per_layer"),
                          ("tcp", 2, 2, 1, "lockstep")])
def test_speculation_through_disaggregated_layouts(references, method, transport, replicas,
                                                   experts, microbatches, aggregation):
    with LLM(dtype="float32", attention_replicas=replicas, expert_workers=experts,
             microbatches=microbatches, transport=transport, aggregation=aggregation,
             speculative_config=_spec(method)) as llm:
        greedy = _signature(llm.generate(PROMPTS, GREEDY))
        seeded = _signature(llm.generate(PROMPTS, SEEDED))
        stats = llm.engine.stats()
    assert greedy == references["greedy"]
    assert seeded == references[method]
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
