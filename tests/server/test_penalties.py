"""Penalties, logit bias, min_tokens and bad words: what each does, that a request gets
the same bits alone and in a crowd of others with other adjustments, and the HTTP API."""

from __future__ import annotations

import random

import pytest

from megaserve.sampling_params import SamplingParams

from .conftest import http_post

PROMPT = "the the the cat sat on the mat and the"


def run(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params)[0].outputs[0]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, **kw)


def test_each_adjustment_does_what_it_says(llm):
    plain = run(llm, greedy())
    # A large bias makes one token the greedy choice everywhere.
    target = 97
    biased = run(llm, greedy(logit_bias={target: 100.0}))
    assert biased.token_ids == [target] * 24
    # The reported logprobs are the model's, not the adjusted ones (vLLM's default).
    assert biased.logprobs[0][target] < 0 and biased.logprobs[0][target] != 0.0
    # A banned single-token word never appears; a banned pair is never completed.
    first = plain.token_ids[0]
    banned = run(llm, greedy(bad_words_token_ids=((first,),)))
    assert first not in banned.token_ids
    pair = tuple(plain.token_ids[:2])
    no_pair = run(llm, greedy(bad_words_token_ids=(pair,)))
    assert all(tuple(no_pair.token_ids[i:i + 2]) != pair for i in range(23))
    # Frequency and repetition penalties reduce repeats.
    def repeats(ids):
        return len(ids) - len(set(ids))
    assert repeats(run(llm, greedy(frequency_penalty=2.0)).token_ids) < repeats(plain.token_ids)
    assert repeats(run(llm, greedy(presence_penalty=2.0)).token_ids) < repeats(plain.token_ids)
    assert repeats(run(llm, greedy(repetition_penalty=3.0)).token_ids) < repeats(plain.token_ids)


def test_min_tokens_holds_back_eos_and_stop_token_ids(llm):
    eos = llm.get_tokenizer().eos_token_ids[0]
    # Biased towards EOS: without min_tokens it stops at once.
    params = dict(max_tokens=12, temperature=0.0, logit_bias={eos: 100.0})
    assert run(llm, SamplingParams(**params)).token_ids == [eos]
    held = run(llm, SamplingParams(min_tokens=5, **params))
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5] and held.token_ids[5] == eos
    stop = run(llm, SamplingParams(max_tokens=12, temperature=0.0, logit_bias={42: 100.0},
                                   stop_token_ids=[42], min_tokens=3))
    assert len(stop.token_ids) == 4 and stop.token_ids[3] == 42


def test_adjusted_request_gets_the_same_bits_alone_and_in_a_crowd(llm):
    rng = random.Random(0)
    target = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3,
                            presence_penalty=0.7, frequency_penalty=0.3,
                            repetition_penalty=1.3, logit_bias={5: 3.0, 9: -4.0},
                            min_tokens=4, bad_words_token_ids=((11,), (12, 13)))
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234,
                             logprobs=3, frequency_penalty=0.5, logit_bias={7: 2.0})
    crowd = [SamplingParams(max_tokens=rng.randint(4, 30), temperature=rng.choice([0.0, 1.0]),
                            seed=rng.randrange(1 << 30), ignore_eos=True,
                            presence_penalty=rng.uniform(-2, 2),
                            repetition_penalty=rng.choice([1.0, 1.5]),
                            logit_bias={rng.randrange(512): rng.uniform(-5, 5)},
                            bad_words_token_ids=((rng.randrange(512),),))
             for _ in range(50)]
    crowd_prompts = [" ".join(rng.choice(["a", "dog", "ran", "the", "x"])
                              for _ in range(rng.randint(1, 40))) for _ in crowd]
    alone = [llm.generate(PROMPT, p)[0].outputs[0] for p in (target, sampled)]
    together = llm.generate([PROMPT, *crowd_prompts[:25], PROMPT, *crowd_prompts[25:]],
                            [target, *crowd[:25], sampled, *crowd[25:]])
    for one, out in zip(alone, (together[0].outputs[0], together[26].outputs[0])):
        assert out.token_ids == one.token_ids
        assert out.logprobs == one.logprobs  # float equality: the same bits


def test_http_penalties_and_logit_bias(server):
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    status, body = http_post(server.url + "/v1/completions",
                             {**base, "logit_bias": {"97": 100}})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == [97] * 8
    status, plain = http_post(server.url + "/v1/completions", base)
    status, pen = http_post(server.url + "/v1/completions",
                            {**base, "frequency_penalty": 2.0, "presence_penalty": 1.0,
                             "repetition_penalty": 1.5, "min_tokens": 2})
    assert status == 200, pen
    assert pen["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]
    word = plain["choices"][0]["text"].split()[0]
    status, banned = http_post(server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
        "temperature": 0.0, "bad_words": [word]})
    assert status == 200, banned
    for bad in ({"logit_bias": {"999999": 1}}, {"presence_penalty": 3},
                {"min_tokens": 9}, {"repetition_penalty": 0}):
        status, err = http_post(server.url + "/v1/completions", {**base, **bad})
        assert status == 400, (bad, err)
        assert err["error"]["param"] == next(iter(bad)), err


def test_async_scheduling_sees_the_token_still_in_flight(model_cache):
    """With --async-scheduling a request's last token may still be on the device when
    its next row is adjusted: the penalties must count it all the same."""
    from megaserve import LLM

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1,
                            presence_penalty=1.5, frequency_penalty=0.5,
                            repetition_penalty=1.3, bad_words_token_ids=((11,),))
    outs = []
    for async_scheduling in (False, True):
        with LLM(model="builtin:tiny-moe", dtype="float32", device="cpu", max_num_seqs=8,
                 max_model_len=512, async_scheduling=async_scheduling) as llm:
            outs.append([o.outputs[0] for o in llm.generate([PROMPT, "a dog"], params)])
    for sync, overlapped in zip(*outs):
        assert overlapped.token_ids == sync.token_ids
        assert overlapped.logprobs == sync.logprobs
