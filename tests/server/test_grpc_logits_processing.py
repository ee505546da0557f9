"""Penalties, logit bias, min_tokens, bad words and structured outputs over gRPC: the same
tokens and logprobs as the offline engine (and, for bad words, as HTTP), and bad values
refused with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from megaserve.sampling_params import SamplingParams, StructuredOutput
from megaserve.server import generation_pb2 as pb
from megaserve.server.client import build_request, generation_stub
from megaserve.server.grpc_protocol import logprobs_from_proto

from .conftest import http_post

PROMPT = "the the the cat sat on the mat and the"
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}},
          "required": ["x"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield generation_stub(channel)


def complete(stub, request) -> pb.Complete:
    (response,) = list(stub["Generate"](request, timeout=120))
    return response.complete


# (gRPC fields, the SamplingParams they mean)
CASES = [
    ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"presence_penalty": 1.5,
                                                           "frequency_penalty": 0.5}),
    ({"repetition_penalty": 2.0}, {"repetition_penalty": 2.0}),
    ({"logit_bias": {97: 100.0, 12: -5.0}}, {"logit_bias": {97: 100.0, 12: -5.0}}),
    ({"min_tokens": 5, "logit_bias": {2: 100.0}, "stop_token_ids": [2]},
     {"min_tokens": 5, "logit_bias": {2: 100.0}, "stop_token_ids": [2]}),
    ({"structured_output": pb.StructuredOutput(json_schema=json.dumps(SCHEMA))},
     {"structured_output": StructuredOutput("json", json.dumps(SCHEMA))}),
    ({"structured_output": pb.StructuredOutput(json_object=True)},
     {"structured_output": StructuredOutput("json_object")}),
    ({"structured_output": pb.StructuredOutput(regex="[0-9]{3}-[a-z]{2}")},
     {"structured_output": StructuredOutput("regex", "[0-9]{3}-[a-z]{2}")}),
    ({"structured_output": pb.StructuredOutput(choice=pb.Choices(choices=["on", "off"]))},
     {"structured_output": StructuredOutput("choice", '["on", "off"]')}),
    ({"structured_output": pb.StructuredOutput(grammar='root ::= "A" [0-9] [0-9]')},
     {"structured_output": StructuredOutput("grammar", 'root ::= "A" [0-9] [0-9]')}),
]


@pytest.mark.parametrize("grpc_fields,params", CASES,
                         ids=["presence+frequency", "repetition", "logit_bias", "min_tokens",
                              "json_schema", "json_object", "regex", "choice", "grammar"])
def test_grpc_logits_processing_equals_the_engine(stub, llm, grpc_fields, params):
    common = {"max_tokens": 60 if "structured_output" in params else 24,
              "temperature": 0.7, "seed": 11, "logprobs": 2}
    done = complete(stub, build_request(PROMPT, **common, **grpc_fields))
    ref = llm.generate(PROMPT, SamplingParams(**common, **params))[0].outputs[0]
    assert list(done.output_ids) == ref.token_ids
    assert done.text == ref.text and done.finish_reason == ref.finish_reason
    assert logprobs_from_proto(done.logprobs) == ref.logprobs  # the same bits
    kind = params["structured_output"].kind if "structured_output" in params else None
    if kind == "json_object" and done.finish_reason == "length":
        assert done.text.lstrip().startswith("{"), done.text  # an object, cut short
    elif kind is not None:
        assert done.finish_reason == "stop", done.text
        checks = {"json": lambda t: 0 <= json.loads(t)["x"] <= 9,
                  "json_object": lambda t: isinstance(json.loads(t), dict),
                  "regex": lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t),
                  "choice": lambda t: t in ("on", "off"),
                  "grammar": lambda t: re.fullmatch("A[0-9]{2}", t)}
        assert checks[kind](done.text), done.text


def test_grpc_bad_words_equal_http(stub, server, llm):
    base = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    plain = complete(stub, build_request(PROMPT, **base))
    tokenizer = llm.get_tokenizer()
    # A generated token that is a word of its own (its text encodes back to it alone).
    token = next(t for t in plain.output_ids if (w := tokenizer.decode([t])).strip()
                 and tokenizer.encode(w.strip(), add_special_tokens=False) == [t])
    word = tokenizer.decode([token]).strip()
    banned = complete(stub, build_request(PROMPT, **base, bad_words=[word]))
    assert token not in banned.output_ids and list(banned.output_ids) != list(plain.output_ids)
    status, body = http_post(server.url + "/v1/completions", {
        "prompt": PROMPT, **base, "bad_words": [word], "return_token_ids": True})
    assert status == 200, body
    assert list(banned.output_ids) == body["choices"][0]["token_ids"]


@pytest.mark.parametrize("fields,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {10 ** 9: 1.0}}, "logit_bias"),
    ({"min_tokens": 99}, "min_tokens"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["w"] * 65}, "bad_words"),
    ({"structured_output": pb.StructuredOutput(regex="(unclosed")}, "structured_output"),
    ({"structured_output": pb.StructuredOutput(json_schema="{not json")}, "structured_output"),
    ({"structured_output": pb.StructuredOutput(grammar="root ::= ")}, "structured_output"),
    ({"structured_output": pb.StructuredOutput(json_object=False)}, "structured_output"),
    ({"structured_output": pb.StructuredOutput(choice=pb.Choices())}, "structured_output"),
    ({"structured_output": pb.StructuredOutput()}, "structured_output"),
])
def test_bad_values_are_invalid_argument_naming_the_field(stub, fields, param):
    with pytest.raises(grpc.RpcError) as e:
        complete(stub, build_request(PROMPT, max_tokens=8, **fields))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert param in e.value.details(), e.value.details()


def test_two_grammar_kinds_on_the_wire_are_refused(server):
    """protobuf keeps the last member of a oneof it parses twice; the server refuses both."""
    one = build_request(PROMPT, structured_output=pb.StructuredOutput(regex="a"))
    two = build_request(PROMPT, structured_output=pb.StructuredOutput(grammar='root ::= "b"'))
    payload = one.SerializeToString() + two.SerializeToString()
    with grpc.insecure_channel(server.grpc_address) as channel:
        call = channel.unary_stream("/megaserve.v1.Generation/Generate",
                                    request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(payload, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output" in e.value.details() and "exactly one" in e.value.details()
