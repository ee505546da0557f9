"""Prefix caching on CPU, float32, bitwise: token ids and logprobs are the same with and
without cache hits (any chunk size, a cramped pool that evicts and preempts), the pool
returns to full, eviction never takes a block in use, and the hit counters add up."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.engine.kv_cache import BlockPool
from megaserve.engine.prefix_cache import hash_block, prompt_block_hashes, root_hash
from megaserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 160


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
                                  **overrides))


@pytest.fixture(scope="module")
def engines():
    """No cache (the reference); a roomy cached engine; a cached engine with odd chunk
    sizes; a cramped cached engine (evicts and preempts)."""
    return {
        "reference": make_engine(enable_prefix_caching=False),
        "roomy": make_engine(),
        "chunked": make_engine(max_num_batched_tokens=23),
        "cramped": make_engine(max_num_batched_tokens=40, num_kv_blocks=24),
    }


def run(engine: LLMEngine, arrivals) -> dict[str, object]:
    """Add each (step, id, prompt, params) at its step; run to completion; id → output.
    Checks that every block is free afterwards (cached blocks count as free)."""
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


def signature(out):
    c = out.outputs[0]
    logprobs = [sorted(d.items()) for d in c.logprobs] if c.logprobs is not None else None
    prompt_logprobs = ([None if d is None else sorted(d.items()) for d in out.prompt_logprobs]
                       if out.prompt_logprobs is not None else None)
    return c.token_ids, logprobs, c.finish_reason, prompt_logprobs


PARAMS = [
    SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, seed=5, logprobs=1, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.2, seed=9, top_k=20, top_p=0.9, logprobs=0,
                   ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1, logprobs=1, ignore_eos=True),
]


def shared_prefix_arrivals(rng: random.Random, vocab: int, num_requests: int):
    """Requests built from a few random prefixes (some block-aligned, some not) plus random
    suffixes, arriving at random steps; a few repeat an earlier prompt exactly."""
    prefixes = [[rng.randrange(vocab) for _ in range(rng.choice([16, 32, 48, rng.randrange(1, 70)]))]
                for _ in range(rng.randrange(1, 4))]
    arrivals = []
    prompts = []
    for i in range(num_requests):
        if prompts and rng.random() < 0.2:
            prompt = list(rng.choice(prompts))
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt = prompt[: MAX_MODEL_LEN - 20]
        prompts.append(prompt)
        arrivals.append((rng.randrange(12), f"r{i}", prompt, rng.choice(PARAMS)))
    return arrivals


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), num_requests=st.integers(2, 14),
       which=st.sampled_from(["roomy", "chunked", "cramped", "budget"]), budget=st.integers(1, 48))
def test_outputs_equal_with_and_without_prefix_cache(engines, seed, num_requests, which, budget):
    """``budget``: a random chunk size (tokens per step) for the "budget" engine."""
    rng = random.Random(seed)
    if which == "budget" and ("budget", budget) not in engines:
        engines[("budget", budget)] = make_engine(max_num_batched_tokens=budget)
    reference = engines["reference"]
    engine = engines[("budget", budget) if which == "budget" else which]
    arrivals = shared_prefix_arrivals(rng, reference.vocab_size, num_requests)
    # The reference runs every request alone: nothing can be shared, nothing chunked.
    expected = {a[1]: run(reference, [(0,) + a[1:]])[a[1]] for a in arrivals}
    got = run(engine, arrivals)
    for request_id, out in expected.items():
        assert signature(got[request_id]) == signature(out), request_id
        assert out.num_cached_tokens == 0


def test_hits_happen_and_are_reported(engines):
    """Two requests with a 40-token shared prefix: the second reuses two full blocks,
    and a repeat of a whole 48-token prompt reuses all but its last block."""
    engine = engines["roomy"]
    rng = random.Random(1)
    prefix = [rng.randrange(engine.vocab_size) for _ in range(40)]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1, ignore_eos=True)
    before = engine.stats()
    first = run(engine, [(0, "a", prefix + [1, 2, 3], params)])["a"]
    second = run(engine, [(0, "b", prefix + [4, 5], params)])["b"]
    whole = prefix + [6] * 8  # 48 tokens: 3 full blocks, the last token must run
    third = run(engine, [(0, "c", whole, params)])["c"]
    again = run(engine, [(0, "d", whole, params)])["d"]
    after = engine.stats()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32
    assert third.num_cached_tokens == 32
    assert again.num_cached_tokens == 32  # 47 // 16 = 2 blocks
    assert after.prefix_cache_hits - before.prefix_cache_hits == 96
    assert after.prefix_cache_queries - before.prefix_cache_queries == 43 + 42 + 48 + 48
    assert signature(again) == signature(third)


def test_prompt_logprobs_requests_take_no_hits(engines):
    engine = engines["roomy"]
    prompt = list(range(3, 60))
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with_prompt_lp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2, ignore_eos=True)
    run(engine, [(0, "warm", prompt, plain)])
    out = run(engine, [(0, "p", prompt, with_prompt_lp)])["p"]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt)
    ref = run(engines["reference"], [(0, "p", prompt, with_prompt_lp)])["p"]
    assert signature(out) == signature(ref)


def test_cramped_pool_evicts_and_preempts(engines):
    engine = engines["cramped"]
    rng = random.Random(3)
    evictions, preemptions = engine.pool.num_evictions, engine.scheduler.total_preemptions
    shared = [rng.randrange(engine.vocab_size) for _ in range(48)]
    # 8 requests of 48 shared + 20 own + 40 generated tokens: 3 + 8 * 4 blocks > 24.
    arrivals = [(i // 4, f"x{i}", shared + [rng.randrange(100) for _ in range(20)],
                 SamplingParams(max_tokens=40, temperature=0, logprobs=1, ignore_eos=True))
                for i in range(8)]
    got = run(engine, arrivals)
    assert engine.pool.num_evictions > evictions
    assert engine.scheduler.total_preemptions > preemptions
    reference = engines["reference"]
    for _, request_id, prompt, params in arrivals:
        alone = run(reference, [(0, request_id, prompt, params)])[request_id]
        assert signature(got[request_id]) == signature(alone)


def test_block_pool_never_evicts_a_block_in_use():
    """Random allocate / share-by-hash / cache / free against a model of the pool."""
    rng = random.Random(0)
    pool = BlockPool(8)
    held: list[list[int]] = []
    refs = [0] * 8
    cached: dict[bytes, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.35 and pool.can_allocate(n := rng.randrange(1, 4)):
            blocks = pool.allocate(n)
            for b in blocks:
                assert refs[b] == 0, "allocated a block in use"
                refs[b] = 1
                cached = {h: c for h, c in cached.items() if c != b}
            held.append(blocks)
        elif op < 0.5 and cached:
            block_hash = rng.choice(sorted(cached))
            hits = pool.lookup([block_hash])
            assert hits == [cached[block_hash]]
            pool.share(hits)
            refs[hits[0]] += 1
            held.append(hits)
        elif op < 0.7 and held:
            blocks = rng.choice(held)
            b = rng.choice(blocks)
            block_hash = hash_block(b"", [step])
            pool.cache(b, block_hash)
            if b not in cached.values():
                cached[block_hash] = b
        elif held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.free(blocks)
            for b in blocks:
                refs[b] -= 1
        assert pool.num_free == sum(1 for r in refs if r == 0)
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == 8


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    ha, hb = [hash_block(b"", [1]), hash_block(b"", [2])], [hash_block(b"", [3]), hash_block(b"", [4])]
    for blocks, hashes in ((a, ha), (b, hb)):
        for block, h in zip(blocks, hashes):
            pool.cache(block, h)
    pool.free(b[::-1])
    pool.free(a[::-1])
    pool.allocate(2)  # evicts b's blocks (freed first), a's stay cached
    assert pool.lookup(hb) == [] and pool.lookup(ha) == a
    pool.share(a)
    assert pool.num_free == 0


def test_block_hashes_chain_over_the_prefix():
    root = root_hash("model", "float32", 4)
    x = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, root)
    y = prompt_block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, root)
    assert len(x) == 2 and len(y) == 2
    assert x[1] != y[1]  # same tokens in block 1, different prefix
    assert prompt_block_hashes([1, 2, 3, 4], 4, root_hash("other", "float32", 4)) != x[:1]
