"""The workload the layout tests compare bitwise with one engine: five prompts of uneven
length under greedy, seeded, seed-derived and top-k sampling, with and without logprobs."""

from __future__ import annotations

from megaserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 500 for j in range(3 + 9 * i)]} for i in range(5)]
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=1),  # seed derived
    SamplingParams(max_tokens=6, temperature=0.8, seed=9, top_k=20, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
]


def signature(outs):
    """What must be bitwise equal: each request's token ids and logprobs."""
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def single_engine_signature():
    """The workload on the one-process engine (builtin:tiny-moe, float32)."""
    with LLM(dtype="float32") as llm:
        return signature(llm.generate(PROMPTS, PARAMS))
