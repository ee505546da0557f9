"""GPU, bf16, bitwise: penalties and grammars keep batch invariance on CUDA, where plain
decode steps replay CUDA graphs and steps with adjusted rows run eagerly (3 passed on an
H200).

Run: ``pytest -m gpu tests/server/test_logits_processing_gpu.py``
"""

from __future__ import annotations

import json
import random

import pytest

from megaserve.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["kind", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gpu_llm(model_cache):
    from megaserve import LLM

    with LLM(model="builtin:tiny-moe", dtype="bfloat16", device="cuda", max_num_seqs=64,
             max_model_len=512, seed=0) as llm:
        yield llm


def _crowd(rng: random.Random) -> tuple[list[str], list[SamplingParams]]:
    params = []
    for _ in range(50):
        kind = rng.choice(["json", "choice", "penalties", "plain"])
        params.append(SamplingParams(
            max_tokens=rng.randint(5, 60), temperature=rng.choice([0.0, 1.0]),
            seed=rng.randrange(1 << 30), ignore_eos=True,
            structured_output=(StructuredOutput("json", json.dumps(SCHEMA)) if kind == "json"
                               else StructuredOutput("choice", '["p", "q"]')
                               if kind == "choice" else None),
            presence_penalty=rng.uniform(-1, 1) if kind == "penalties" else 0.0,
            logit_bias={rng.randrange(512): 3.0} if kind == "penalties" else None))
    prompts = [" ".join(rng.choice(["a", "pet", "json"]) for _ in range(rng.randint(1, 30)))
               for _ in params]
    return prompts, params


@pytest.mark.parametrize("target", [
    SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, seed=5, logprobs=2, ignore_eos=True,
                   frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 2.0}),
    SamplingParams(max_tokens=120, temperature=0.0, logprobs=2,
                   structured_output=StructuredOutput("json", json.dumps(SCHEMA))),
], ids=["plain", "penalties", "grammar"])
def test_same_bits_alone_and_in_a_crowd_on_cuda(gpu_llm, target):
    prompts, crowd = _crowd(random.Random(2))
    alone = gpu_llm.generate("describe a pet", target)[0].outputs[0]
    together = gpu_llm.generate([*prompts[:20], "describe a pet", *prompts[20:]],
                                [*crowd[:20], target, *crowd[20:]])[20].outputs[0]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs
    if target.structured_output is not None:
        json.loads(alone.text)
