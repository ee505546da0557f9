"""Against HF transformers: greedy tokens, logprobs and prompt logprobs, float32."""

from __future__ import annotations

import pytest
import torch

from megaserve import LLM, SamplingParams
from tests.megaserve.hf_models import VARIANTS, make_checkpoint

STEPS = 32
LOGPROB_TOL = 1e-4
# Below this top-2 margin the greedy choice is a near tie: stop comparing tokens there.
TIE_MARGIN = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(path, family, shard="sharded" in request.param, **overrides)
    return path, model


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 7, 23, 70)]


def test_greedy_and_logprobs_match_transformers(checkpoint):
    path, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    with LLM(model=str(path), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == STEPS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].double()
        ref = torch.log_softmax(logits, dim=-1)  # [len, V]
        # Prompt logprobs: entry i scores prompt token i given the tokens before it.
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            got = out.prompt_logprobs[i][prompt[i]]
            assert abs(got - ref[i - 1, prompt[i]].item()) < LOGPROB_TOL
        compared = 0
        for step, token in enumerate(tokens):
            row = ref[len(prompt) - 1 + step]
            top2 = torch.topk(row, 2)
            got = out.outputs[0].logprobs[step]
            assert abs(got[token] - row[token].item()) < LOGPROB_TOL
            if (top2.values[0] - top2.values[1]).item() < TIE_MARGIN:
                break
            assert token == top2.indices[0].item(), f"step {step}: greedy token differs"
            compared += 1
        assert compared >= 8, "too few steps compared: the test model is degenerate"


def test_bfloat16_close_to_float32(checkpoint):
    path, _ = checkpoint
    prompt = {"prompt_token_ids": _prompts(100)[2]}
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    with LLM(model=str(path), dtype="float32") as llm:
        ref = llm.generate(prompt, params)[0].outputs[0].logprobs[0]
    with LLM(model=str(path), dtype="bfloat16") as llm:
        got = llm.generate(prompt, params)[0].outputs[0].logprobs[0]
    common = set(ref) & set(got)
    assert common
    for token in common:
        assert abs(ref[token] - got[token]) < 0.1
