"""Tool calling: forced calls (a named function, "required") constrained by the tools'
schemas, streamed as OpenAI streams them; the tool role; the Hermes parser of "auto"."""

from __future__ import annotations

import json

import pytest

from megaserve.server.tool_calls import HermesStream, ToolStream, parse_hermes

from .conftest import http_post

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def test_hermes_blocks_parse_whole_and_streamed_in_any_pieces():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"days": 2}}\n</tool_call><tool_call>{"name": "get_time", "arguments": '
            '{"zone": "UTC"}}</tool_call> done <tool_call>not json</tool_call> <tool_')
    content, calls = parse_hermes(text)
    assert content == "Let me check.  done <tool_call>not json</tool_call> <tool_"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    for size in (1, 2, 5, 13):
        stream = ToolStream("auto")
        deltas = [stream.delta(text[i:i + size], i + size >= len(text))
                  for i in range(0, len(text), size)]
        assert "".join(d.get("content", "") for d in deltas) == content
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in streamed] == [0, 1]
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    assert parse_hermes("plain text") == ("plain text", [])
    held = HermesStream()
    assert held.feed("a <tool") == "a " and held.finish() == "<tool"


def test_named_tool_choice_over_the_openai_client(server):
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = {"model": "builtin:tiny-moe", "messages": MESSAGES, "tools": [WEATHER, TIME],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "max_tokens": 100, "temperature": 1.0, "seed": 11}
    reply = client.chat.completions.create(**kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.index == 0 and first.function.name == "get_weather" and first.id
    streamed = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert json.loads(streamed) == args  # same seed: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_and_a_tool_round_trip(server):
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required",
            "max_tokens": 150, "temperature": 1.0, "seed": 3}
    status, reply = http_post(server.url + "/v1/chat/completions", body)
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls", reply
    assert message["tool_calls"] and {c["function"]["name"] for c in message["tool_calls"]} <= \
        {"get_weather", "get_time"}
    for c in message["tool_calls"]:
        json.loads(c["function"]["arguments"])
    # The conversation goes on with the calls and their results (the tool role).
    history = MESSAGES + [message] + [
        {"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 21}'}
        for c in message["tool_calls"]]
    status, reply = http_post(server.url + "/v1/chat/completions", {
        "messages": history, "tools": [WEATHER, TIME], "tool_choice": "none",
        "max_tokens": 5})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] is not None


def test_tool_requests_that_cannot_run_are_400(server):
    base = {"messages": MESSAGES, "max_tokens": 5}
    for extra, param in (
            ({"tools": [WEATHER]}, "tool_choice"),  # "auto" without --tool-call-parser
            ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                  "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
              "tool_choice": "none"}, "tools[0].function.name"),
            ({"tools": [WEATHER], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice")):
        status, reply = http_post(server.url + "/v1/chat/completions", {**base, **extra})
        assert status == 400 and reply["error"]["param"] == param, (extra, reply)
    status, reply = http_post(server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": None}], "max_tokens": 2})
    assert status == 400 and reply["error"]["param"] == "content", reply
