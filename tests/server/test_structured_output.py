"""Structured outputs (xgrammar): every sampled completion follows its grammar, a request
gets the same bits alone and among others with other grammars and penalties, and the
OpenAI API (response_format, vLLM's structured_outputs) through the official client."""

from __future__ import annotations

import json
import random
import re

import pytest

from megaserve.sampling_params import SamplingParams, StructuredOutput

from .conftest import http_post

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        # (a pattern, not maxLength: xgrammar 0.2.9's maxLength rule lets control
        # characters into the string, which is not JSON)
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                 "admin": {"type": "boolean"}},
                  "required": ["id", "admin"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "kind", "owner", "tags"],
    "additionalProperties": False,
}
OTHER_SCHEMAS = [
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["x"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 5},
    {"enum": ["red", "green", "blue"]},
]


def test_fifty_sampled_completions_follow_a_nested_schema(server):
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = []
    for seed in range(5):
        reply = client.chat.completions.create(
            model="builtin:tiny-moe", messages=[{"role": "user", "content": "a pet, as JSON"}],
            n=10, seed=seed, temperature=1.0, max_tokens=300,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            texts.append(choice.message.content)
    assert len(texts) == 50 and len(set(texts)) > 10  # sampled, not one answer
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_every_kind_of_constraint_over_http(server):
    chat = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 60,
            "temperature": 1.0, "seed": 5}
    cases = [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
         lambda t: t in ("yes", "no", "maybe")),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
         lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"json": OTHER_SCHEMAS[0]}},
         lambda t: 0 <= json.loads(t)["x"] <= 9),
        ({"structured_outputs": {"grammar": 'root ::= "A" [0-9] [0-9]'}},
         lambda t: re.fullmatch("A[0-9]{2}", t)),
    ]
    for extra, check in cases:
        status, body = http_post(server.url + "/v1/chat/completions", {**chat, **extra})
        assert status == 200, (extra, body)
        text = body["choices"][0]["message"]["content"]
        assert body["choices"][0]["finish_reason"] == "stop" and check(text), (extra, text)
    status, body = http_post(server.url + "/v1/completions", {
        "prompt": "x", "max_tokens": 10, "structured_outputs": {"choice": ["on", "off"]}})
    assert status == 200 and body["choices"][0]["text"] in ("on", "off")
    for bad, param in (
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format"),
            ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
            ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
            ({"response_format": {"type": "json_schema"}}, "response_format")):
        status, body = http_post(server.url + "/v1/chat/completions", {**chat, **bad})
        assert status == 400 and body["error"]["param"] == param, (bad, body)


def test_a_constrained_request_gets_the_same_bits_alone_and_in_a_crowd(llm):
    rng = random.Random(1)
    target = SamplingParams(max_tokens=200, temperature=0.0, logprobs=2,
                            structured_output=StructuredOutput("json", json.dumps(SCHEMA)),
                            presence_penalty=0.3)
    crowd = []
    for _ in range(50):
        kind = rng.choice(["json", "choice", "none"])
        grammar = (StructuredOutput("json", json.dumps(rng.choice(OTHER_SCHEMAS)))
                   if kind == "json" else StructuredOutput("choice", json.dumps(["p", "q"]))
                   if kind == "choice" else None)
        crowd.append(SamplingParams(max_tokens=rng.randint(5, 60),
                                    temperature=rng.choice([0.0, 1.0]),
                                    seed=rng.randrange(1 << 30), structured_output=grammar,
                                    frequency_penalty=rng.uniform(0, 1)))
    prompts = [" ".join(rng.choice(["a", "pet", "json"]) for _ in range(rng.randint(1, 30)))
               for _ in crowd]
    alone = llm.generate("describe a pet", target)[0].outputs[0]
    json.loads(alone.text)
    together = llm.generate([*prompts[:20], "describe a pet", *prompts[20:]],
                            [*crowd[:20], target, *crowd[20:]])[20].outputs[0]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs
