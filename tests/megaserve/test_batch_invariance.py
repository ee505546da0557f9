"""Batch invariance on CPU, float32, bitwise: a request's tokens and logprobs do not
depend on the other requests, when they arrive, chunked prefill or preemption."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def engines():
    """A roomy engine, and a cramped one (small token budget → chunked prefill, few KV
    blocks → preemption), sharing nothing but the checkpoint."""
    roomy = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32))
    cramped = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
                                     max_num_batched_tokens=40, num_kv_blocks=24))
    return roomy, cramped


def _run(engine: LLMEngine, arrivals: list[tuple[int, str, list[int], SamplingParams]]):
    """Add each request at its step; run to completion; returns request id → output."""
    pending = sorted(arrivals, key=lambda a: a[0])
    done = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert engine.pool.num_free == engine.pool.num_blocks
    return done


def crowd_arrivals(rng: random.Random, vocab: int, target: list[int], target_params: SamplingParams,
                   num_others: int) -> list[tuple[int, str, list[int], SamplingParams]]:
    """The target request plus ``num_others`` random requests, each at a random step."""
    arrivals = [(rng.randrange(6), "target", target, target_params)]
    for i in range(num_others):
        params = SamplingParams(
            max_tokens=rng.randrange(1, 14), temperature=rng.choice([0.0, 0.8, 1.3]),
            seed=rng.randrange(1000), top_k=rng.choice([0, 5]), logprobs=rng.choice([None, 1]),
            ignore_eos=True,
        )
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        arrivals.append((rng.randrange(10), f"other-{i}", prompt, params))
    return arrivals


def _signature(out):
    c = out.outputs[0]
    return c.token_ids, [sorted(d.items()) for d in c.logprobs], c.finish_reason


request_params = st.sampled_from([
    SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, seed=7, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, seed=11, top_p=0.9, top_k=50, logprobs=1),
])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target_params=request_params,
    target_len=st.integers(1, 60),
    num_others=st.integers(1, 31),
    seed=st.integers(0, 2**16),
    cramped=st.booleans(),
)
def test_request_alone_equals_request_in_a_crowd(engines, target_params, target_len, num_others, seed, cramped):
    roomy, crowded_engine = engines
    rng = random.Random(seed)
    vocab = roomy.vocab_size
    target = [rng.randrange(vocab) for _ in range(target_len)]
    alone = _run(roomy, [(0, "target", target, target_params)])["target"]
    engine = crowded_engine if cramped else roomy
    crowd = _run(engine, crowd_arrivals(rng, vocab, target, target_params, num_others))["target"]
    assert _signature(crowd) == _signature(alone)


def test_cramped_engine_really_chunks_and_preempts(engines):
    _, cramped = engines
    rng = random.Random(0)
    before = cramped.scheduler.total_preemptions
    arrivals = [(0, f"r{i}", [rng.randrange(100) for _ in range(70)],
                 SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for i in range(6)]
    _run(cramped, arrivals)
    assert cramped.scheduler.total_preemptions > before
