"""Paged KV cache: blocks return to the pool after finish, abort and preemption, and
forced preemption does not change outputs."""

from __future__ import annotations

import pytest

from megaserve import LLM, SamplingParams
from megaserve.engine.kv_cache import BlockPool


def test_block_pool_reference_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and not pool.can_allocate(2)
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3  # the shared block still has one reference
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.free(a[:1])


def _prompts(n, length):
    return [{"prompt_token_ids": [(7 * i + j) % 400 for j in range(length)]} for i in range(n)]


def test_forced_preemption_gives_identical_outputs_and_frees_everything():
    params = [SamplingParams(max_tokens=48, temperature=t, seed=i, ignore_eos=True, logprobs=1)
              for i, t in enumerate([0, 0.7, 1.0, 0, 0.7, 1.0])]
    prompts = _prompts(6, 40)
    with LLM(dtype="float32", max_model_len=128) as llm:
        expected = llm.generate(prompts, params)
        assert llm.engine.stats().num_preemptions == 0
    # 6 requests × 88 tokens need 36 blocks of 16; 12 blocks force preemption.
    with LLM(dtype="float32", max_model_len=128, num_kv_blocks=12) as llm:
        got = llm.generate(prompts, params)
        stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks == 12
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == e.outputs[0].logprobs


def test_abort_frees_blocks_and_others_continue():
    with LLM(dtype="float32", max_model_len=256) as llm:
        engine = llm.engine
        alone = llm.generate(_prompts(1, 30), SamplingParams(max_tokens=10, temperature=0))[0]
        engine.add_request("victim", _prompts(2, 50)[1]["prompt_token_ids"],
                           SamplingParams(max_tokens=100, ignore_eos=True))
        engine.add_request("keeper", _prompts(1, 30)[0]["prompt_token_ids"],
                           SamplingParams(max_tokens=10, temperature=0))
        engine.step()
        engine.step()
        assert engine.pool.num_free < engine.pool.num_blocks
        aborted = engine.abort_request("victim")
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert final.request_id == "keeper"
        assert final.outputs[0].token_ids == alone.outputs[0].token_ids
        assert engine.pool.num_free == engine.pool.num_blocks
        assert engine.abort_request("victim") is None


def test_pool_too_small_for_one_request_is_rejected():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(dtype="float32", max_model_len=256, num_kv_blocks=4)
