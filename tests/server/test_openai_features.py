"""OpenAI / vLLM request features of the HTTP API against the shared real server."""

from __future__ import annotations

import pytest

from .conftest import http_post

MESSAGES = [{"role": "user", "content": "Tell me about foxes"}]


@pytest.mark.parametrize("top_n", [1, 5, 20])
def test_chat_top_logprobs_are_the_n_most_likely_with_the_sampled_one_where_it_ranks(
        server, top_n):
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        status, body = http_post(server.url + "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True, "logprobs": True,
            "top_logprobs": top_n, **sampling})
        assert status == 200, body
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 8
        for entry in content:
            top = entry["top_logprobs"]
            values = [t["logprob"] for t in top]
            assert len(top) == top_n and values == sorted(values, reverse=True)
            ids = [t["token_id"] for t in top]
            assert len(set(ids)) == top_n
            # The sampled token is there exactly when it ranks among the top n.
            assert (entry["token_id"] in ids) == (entry["logprob"] >= values[-1])
            if sampling["temperature"] == 0.0:  # greedy: the sampled token is the first
                assert ids[0] == entry["token_id"] and values[0] == entry["logprob"]
