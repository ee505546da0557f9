"""The OpenAI-compatible HTTP API against a real ``megaserve serve`` subprocess."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from megaserve.sampling_params import SamplingParams

from .conftest import LABEL, assert_idle, http_get, http_post

PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def sse(server, path: str, body: dict) -> list[dict | str]:
    """POSTs a streaming request; returns the decoded `data:` events ("[DONE]" as a str)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    raw = resp.read().decode()
    conn.close()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def ref(llm, prompt, **kw):
    p = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return llm.generate(p, SamplingParams(**kw))[0]


def test_completion_equals_llm_generate(server, llm):
    kw = {"max_tokens": 20, "temperature": 0.8, "top_p": 0.95, "seed": 5}
    status, body = http_post(server.url + "/v1/completions",
                             {"model": "builtin:tiny-moe", "prompt": PROMPT, "logprobs": 2,
                              "return_token_ids": True, **kw})
    assert status == 200, body
    expected = ref(llm, PROMPT, logprobs=2, **kw)
    choice = body["choices"][0]
    assert choice["text"] == expected.outputs[0].text
    assert choice["token_ids"] == expected.outputs[0].token_ids
    assert choice["prompt_token_ids"] == expected.prompt_token_ids
    assert choice["finish_reason"] == expected.outputs[0].finish_reason
    lps = choice["logprobs"]
    assert lps["token_ids"] == expected.outputs[0].token_ids
    assert lps["token_logprobs"] == [d[t] for t, d in zip(expected.outputs[0].token_ids,
                                                           expected.outputs[0].logprobs)]
    cached = body["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < len(expected.prompt_token_ids)  # earlier tests may have cached PROMPT
    assert body["usage"] == {"prompt_tokens": len(expected.prompt_token_ids),
                             "completion_tokens": 20, "total_tokens": len(expected.prompt_token_ids) + 20}


def test_streamed_completion_equals_llm_generate_and_ends_with_done(server, llm):
    prompt_ids = [5, 77, 301, 12, 9]
    kw = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    events = sse(server, "/v1/completions", {"prompt": prompt_ids, "stream": True,
                                             "return_token_ids": True,
                                             "stream_options": {"include_usage": True}, **kw})
    assert events[-1] == "[DONE]"
    usage_event, chunks = events[-2], events[:-2]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 16
    # How many chunks carry the 16 tokens is up to the consumer's speed (a slow reader gets
    # merged deltas): only their concatenation is asserted.
    assert chunks and all(c["usage"] is None for c in chunks)
    expected = ref(llm, prompt_ids, **kw).outputs[0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected.token_ids
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_uses_the_chat_template(server, llm):
    prompt = llm.get_tokenizer().apply_chat_template(MESSAGES)
    kw = {"max_tokens": 12, "temperature": 0.0}
    expected = ref(llm, prompt, **kw).outputs[0]
    status, body = http_post(server.url + "/v1/chat/completions",
                             {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, **kw})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == expected.token_ids
    events = sse(server, "/v1/chat/completions", {"messages": MESSAGES, "stream": True, **kw})
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == expected.text
    assert events[-2]["object"] == "chat.completion.chunk"


def test_n_and_several_prompts_with_seed(server, llm):
    status, body = http_post(server.url + "/v1/completions",
                             {"prompt": ["Once upon a time", "a"], "n": 2, "seed": 40,
                              "max_tokens": 8, "temperature": 1.0, "return_token_ids": True})
    assert status == 200, body
    got = {c["index"]: c["token_ids"] for c in body["choices"]}
    for p_index, prompt in enumerate(["Once upon a time", "a"]):
        for j in range(2):
            expected = ref(llm, prompt, max_tokens=8, temperature=1.0, seed=40 + j)
            assert got[p_index * 2 + j] == expected.outputs[0].token_ids
    assert got[0] != got[1]  # seed + j: the choices differ


def test_streamed_n_choices_and_stop_strings(server, llm):
    kw = {"max_tokens": 30, "temperature": 1.0, "stop": ["e"]}
    events = sse(server, "/v1/completions", {"prompt": "Once upon a time", "n": 3, "seed": 9,
                                             "stream": True, **kw})
    assert events[-1] == "[DONE]"
    texts, reasons = {0: "", 1: "", 2: ""}, {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    for j in range(3):
        expected = ref(llm, "Once upon a time", seed=9 + j, **kw).outputs[0]
        assert (texts[j], reasons[j]) == (expected.text, expected.finish_reason)
    assert "stop" in reasons.values()


def test_models_health_and_metrics_names(server):
    status, body = http_get(server.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "builtin:tiny-moe"
    assert http_get(server.url + "/health")[0] == 200
    status, text = http_get(server.url + "/metrics")
    text = text.decode()
    for name, kind in [("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                       ("kv_cache_usage_perc", "gauge"), ("prompt_tokens_total", "counter"),
                       ("generation_tokens_total", "counter"),
                       ("time_to_first_token_seconds", "histogram"),
                       ("inter_token_latency_seconds", "histogram"),
                       ("e2e_request_latency_seconds", "histogram")]:
        assert f"# TYPE vllm:{name} {kind}" in text
    m = server.metrics()
    assert m[f"vllm:generation_tokens_total{LABEL}"] > 0
    assert m[f"vllm:time_to_first_token_seconds_count{LABEL}"] > 0
    assert m[f'vllm:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="builtin:tiny-moe"}}'] > 0


def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    body = json.dumps({"prompt": "disconnect", "stream": True, "max_tokens": 1900,
                       "ignore_eos": True, "temperature": 0.0}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data: ") < 3:
            received += s.recv(65536)
        assert server.metrics()[f"vllm:num_requests_running{LABEL}"] == 1
    assert_idle(server)


BAD = {
    "empty prompt": ({"prompt": ""}, 400, "prompt"),
    "token id outside vocab": ({"prompt": [1, 2, 10**7]}, 400, "prompt"),
    "max_tokens 0": ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens above limit": ({"prompt": "hi", "max_tokens": 4096}, 400, "max_tokens"),
    "negative temperature": ({"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    "top_p 0": ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    "10 MB prompt": ({"prompt": "b" * (10 * 1024 * 1024)}, 400, "prompt"),
    "invalid UTF-8": (b'{"prompt": "caf\xe9"}', 400, "body"),
    "unpaired surrogate": (b'{"prompt": "x\\udc80"}', 400, "body"),
    "unknown field": ({"prompt": "hi", "temprature": 0.5}, 400, "temprature"),
    "malformed JSON": (b'{"prompt": "hi",', 400, "body"),
    "not an object": (b'["hi"]', 400, "body"),
    "wrong model": ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    "n 0": ({"prompt": "hi", "n": 0}, 400, "n"),
    "string max_tokens": ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_an_error_naming_the_field(server, case):
    body, status, field = BAD[case]
    got, reply = http_post(server.url + "/v1/completions", body)
    assert got == status, reply
    assert reply["error"]["message"].startswith(f"{field}: "), reply
    assert reply["error"]["param"] == field


def test_body_over_16_mib_is_413(server):
    status, reply = http_post(server.url + "/v1/completions",
                              json.dumps({"prompt": "c" * (17 << 20)}).encode())
    assert status == 413 and reply["error"]["param"] == "body"


def test_bad_chat_messages(server):
    status, reply = http_post(server.url + "/v1/chat/completions", {"messages": []})
    assert status == 400 and reply["error"]["param"] == "messages"
    status, reply = http_post(server.url + "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": 3}]})
    assert status == 400 and reply["error"]["message"].startswith("messages[0].content: ")


def test_still_serving_after_bad_inputs_and_nothing_leaked(server, llm):
    status, body = http_post(server.url + "/v1/completions",
                             {"prompt": "ok", "max_tokens": 4, "temperature": 0.0})
    assert status == 200
    assert body["choices"][0]["text"] == ref(llm, "ok", max_tokens=4, temperature=0.0).outputs[0].text
    assert_idle(server)


def test_responses_match_the_openapi_document(server):
    """Real responses, unary and streamed, validate against the documented models (which
    forbid undocumented fields); so do error bodies and the model list."""
    from megaserve.server import openai_models as om

    status, body = http_post(server.url + "/v1/completions", {
        "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "logprobs": 2, "seed": 1,
        "return_token_ids": True})
    assert status == 200
    assert len(om.CompletionResponse.model_validate(body).choices) == 4
    status, body = http_post(server.url + "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    assert status == 200
    om.ChatCompletionResponse.model_validate(body)
    for path, model, extra in [
            ("/v1/chat/completions", om.ChatCompletionChunk, {"messages": MESSAGES}),
            ("/v1/completions", om.CompletionResponse, {"prompt": PROMPT, "logprobs": 1})]:
        events = sse(server, path, {"max_tokens": 3, "stream": True,
                                    "stream_options": {"include_usage": True}, **extra})
        assert events[-1] == "[DONE]"
        chunks = [model.model_validate(e) for e in events[:-1]]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    status, body = http_get(server.url + "/v1/models")
    om.ModelList.model_validate_json(body)
    status, body = http_post(server.url + "/v1/completions", {"prompt": 5})
    assert status == 400
    om.ErrorResponse.model_validate(body)
    status, doc = http_get(server.url + "/openapi.json")
    doc = json.loads(doc)
    assert doc["openapi"].startswith("3.1")
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
