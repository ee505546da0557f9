"""What vLLM users reach for first, against a real server started with vLLM's flags:
``--served-model-name`` (two names), ``--allowed-origins``, ``--enable-request-id-headers``;
``/tokenize``, ``/detokenize``, ``/version``, ``/v1/models/{id}``, ``echo``, OpenAI
fields accepted and ignored; and the official ``openai`` client."""

from __future__ import annotations

import http.client
import json

import pytest

from megaserve import __version__

from .conftest import http_get, http_post, ready_server

ORIGIN = "https://app.example"
NAMES = ("tiny", "tiny-alias")


@pytest.fixture(scope="module")
def vserver(model_cache, tmp_path_factory):
    with ready_server(tmp_path_factory.mktemp("vllm-routes") / "server.log", model_cache,
                      "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "512",
                      "--served-model-name", *NAMES, "--allowed-origins", ORIGIN,
                      "--enable-request-id-headers") as srv:
        yield srv


def request(server, method: str, path: str, body: dict | None = None,
            headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp, data


def test_served_model_names_and_model_cards(vserver):
    status, body = http_get(vserver.url + "/v1/models")
    assert status == 200
    assert [c["id"] for c in json.loads(body)["data"]] == list(NAMES)
    status, body = http_get(vserver.url + "/v1/models/tiny-alias")
    assert status == 200 and json.loads(body)["id"] == "tiny-alias"
    status, body = http_get(vserver.url + "/v1/models/builtin:tiny-moe")
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    base = {"prompt": "hi", "max_tokens": 2}
    for asked, answered in ((None, "tiny"), ("tiny", "tiny"), ("tiny-alias", "tiny-alias")):
        status, reply = http_post(vserver.url + "/v1/completions",
                                  {**base, **({"model": asked} if asked else {})})
        assert status == 200 and reply["model"] == answered, reply
    status, reply = http_post(vserver.url + "/v1/completions", {**base, "model": "gpt-4"})
    assert status == 404 and "tiny-alias" in reply["error"]["message"]
    status, body = http_get(vserver.url + "/version")
    assert status == 200 and json.loads(body) == {"version": __version__}


def test_tokenize_detokenize_round_trip(vserver, llm):
    text = "Hello, wörld! The quick brown fox."
    status, tok = http_post(vserver.url + "/tokenize", {"prompt": text, "model": "tiny"})
    assert status == 200, tok
    expected = llm.get_tokenizer().encode(text)
    assert tok["tokens"] == expected and tok["count"] == len(expected)
    assert tok["max_model_len"] == 512 and tok["token_strs"] is None
    status, detok = http_post(vserver.url + "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    status, chat = http_post(vserver.url + "/tokenize",
                             {"messages": messages, "return_token_strs": True})
    assert status == 200
    assert chat["tokens"] == llm.get_tokenizer().encode(
        llm.get_tokenizer().apply_chat_template(messages), add_special_tokens=False)
    assert len(chat["token_strs"]) == chat["count"]
    for bad, param in (({"tokens": [10**9]}, "tokens"), ({"tokens": "x"}, "tokens"),
                       ({"tokens": [1], "model": "nope"}, "model")):
        status, err = http_post(vserver.url + "/detokenize", bad)
        assert status in (400, 404) and err["error"]["param"] == param, err


def test_echo_puts_the_prompt_before_the_completion(vserver):
    body = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    status, plain = http_post(vserver.url + "/v1/completions", body)
    status, echoed = http_post(vserver.url + "/v1/completions", {**body, "echo": True})
    assert status == 200, echoed
    assert echoed["choices"][0]["text"] == "Once upon" + plain["choices"][0]["text"]
    resp, raw = request(vserver, "POST", "/v1/completions", {**body, "echo": True,
                                                             "stream": True})
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n")
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == echoed["choices"][0]["text"]
    status, err = http_post(vserver.url + "/v1/completions", {**body, "echo": True,
                                                             "logprobs": 1})
    assert status == 400 and err["error"]["param"] == "echo"


def test_openai_fields_clients_send_by_default_are_accepted_and_ignored(vserver):
    status, reply = http_post(vserver.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "metadata": {"team": "a"}, "store": False, "user": "u1", "service_tier": "auto",
        "parallel_tool_calls": True})
    assert status == 200, reply
    status, reply = http_post(vserver.url + "/v1/completions",
                              {"prompt": "hi", "max_tokens": 2, "frobnicate": 1})
    assert status == 400 and reply["error"]["param"] == "frobnicate"  # truly unknown
    assert "ignored the OpenAI field(s) user, metadata, store, service_tier, " \
        "parallel_tool_calls" in vserver.log()


def test_cors_preflight_and_allowed_origins(vserver):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    resp, _ = request(vserver, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert resp.status == 204
    assert resp.getheader("Access-Control-Allow-Origin") == ORIGIN
    assert "POST" in resp.getheader("Access-Control-Allow-Methods")
    assert resp.getheader("Access-Control-Allow-Headers") == "authorization, content-type"
    resp, _ = request(vserver, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                      {"Origin": ORIGIN})
    assert resp.status == 200 and resp.getheader("Access-Control-Allow-Origin") == ORIGIN
    resp, _ = request(vserver, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                      {"Origin": "https://evil.example"})
    assert resp.getheader("Access-Control-Allow-Origin") is None
    # A probe from a browser gets the CORS headers too (the app answers it).
    resp, _ = request(vserver, "GET", "/health", headers={"Origin": ORIGIN})
    assert resp.status == 200 and resp.getheader("Access-Control-Allow-Origin") == ORIGIN


def test_x_request_id_is_echoed_or_made_up(vserver):
    body = {"prompt": "hi", "max_tokens": 1}
    resp, _ = request(vserver, "POST", "/v1/completions", body, {"X-Request-Id": "trace-42"})
    assert resp.getheader("X-Request-Id") == "trace-42"
    resp, _ = request(vserver, "POST", "/v1/completions", {**body, "stream": True},
                      {"X-Request-Id": "trace-43"})
    assert resp.getheader("X-Request-Id") == "trace-43"
    resp, _ = request(vserver, "POST", "/v1/completions", body)
    assert len(resp.getheader("X-Request-Id")) == 32
    resp, _ = request(vserver, "GET", "/v1/models/nope", headers={"X-Request-Id": "t-44"})
    assert resp.status == 404 and resp.getheader("X-Request-Id") == "t-44"
    # /health, answered by the listener process, too.
    resp, _ = request(vserver, "GET", "/health", headers={"X-Request-Id": "t-45"})
    assert resp.status == 200 and resp.getheader("X-Request-Id") == "t-45"
    resp, _ = request(vserver, "GET", "/health")
    assert len(resp.getheader("X-Request-Id")) == 32


def test_official_openai_client(vserver):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=vserver.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == list(NAMES)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0.0, logprobs=True, top_logprobs=3, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"97": 5}, seed=3, user="me")
    assert chat.choices[0].finish_reason in ("stop", "length")
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
    kw = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
          "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(model="tiny-alias", **kw)
    chunks = list(client.chat.completions.create(
        model="tiny-alias", stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and whole.model == "tiny-alias"
    assert chunks[-1].usage.completion_tokens == 6
    done = client.completions.create(model="tiny", prompt="Once upon", max_tokens=3,
                                     echo=True, temperature=0.0)
    assert done.choices[0].text.startswith("Once upon")
