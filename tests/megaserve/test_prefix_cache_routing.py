"""Cache-aware routing over attention replicas: a request goes to the replica holding its
prefix unless that replica's extra load exceeds the prefill the hit saves; outputs are
bitwise those of one engine either way."""

from __future__ import annotations

import random

from megaserve import LLM, SamplingParams
from megaserve.engine.prefix_cache import PrefixRouter, root_hash


def test_router_prefers_the_prefix_unless_overloaded():
    router = PrefixRouter(2, block_size=16, root=root_hash("m"))
    prefix = list(range(48))
    assert router.route(prefix + [1, 2], [0, 0]) == 0
    # Replica 0 holds 3 blocks (48 tokens) of the prefix.
    assert router.route(prefix + [3], [10, 0]) == 0  # 10 extra tokens < 48 saved
    assert router.route(prefix + [4], [60, 0]) == 1  # 60 extra tokens > 48 saved
    assert router.route(list(range(100, 140)), [5, 0]) == 1  # no prefix: least loaded
    # Replica 1 now also holds the prefix (sent there above): ties go to the lower load.
    assert router.route(prefix + [5], [7, 3]) == 1


def test_router_forgets_beyond_capacity():
    router = PrefixRouter(2, block_size=4, root=root_hash("m"), capacity_blocks=2)
    first = list(range(13))  # 3 full blocks, only the last 2 remembered
    assert router.route(first, [0, 0]) == 0
    assert router.route(first, [1, 0]) == 1  # its first block was forgotten on replica 0


def test_shared_prefix_is_routed_to_its_replica_and_hits():
    rng = random.Random(0)
    prefix = [rng.randrange(500) for _ in range(48)]
    other = [rng.randrange(500) for _ in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    first = {"prompt_token_ids": prefix + [7, 8, 9]}
    second = {"prompt_token_ids": prefix + [10, 11]}
    with LLM(dtype="float32", max_model_len=160) as llm:
        expected = llm.generate([second], params)[0]
    with LLM(dtype="float32", max_model_len=160, attention_replicas=2) as llm:
        # "other" goes to replica 0 and "first" to replica 1 (least loaded); when both are
        # done the loads are equal, and plain least-load routing would pick replica 0.
        llm.generate([{"prompt_token_ids": other}, first], params)
        got = llm.generate([second], params)[0]
        stats = llm.engine.stats()
    assert got.num_cached_tokens == 48
    assert stats.prefix_cache_hits >= 48
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].logprobs == expected.outputs[0].logprobs
