"""Pure parts of the server: request mapping, wire checks, SSE framing, metrics text."""

from __future__ import annotations

import json
import math

import pytest

from megaserve.server import generation_pb2 as pb
from megaserve.server.client import build_request
from megaserve.server.errors import ErrorCode, RequestError
from megaserve.server.grpc_protocol import BadMessage, deserialize_generate, parse_generate
from megaserve.server.metrics import Counter, Gauge, Histogram, Registry, parse_text
from megaserve.server.openai_protocol import decode_body, parse_request, sse_event


def test_proto_maps_to_sampling_params_with_defaults_for_unset_fields():
    req = build_request([5, 6, 7], stream=True, max_tokens=9, temperature=0.5, seed=3,
                        stop=["x"], ignore_eos=True, logprobs=2)
    parsed = parse_generate(deserialize_generate(req.SerializeToString()))
    assert parsed.prompt == [5, 6, 7] and parsed.stream
    p = parsed.params
    assert (p.max_tokens, p.temperature, p.seed, p.stop, p.ignore_eos, p.logprobs) == \
        (9, 0.5, 3, ("x",), True, 2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)  # SamplingParams defaults


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"), ({"min_p": 2.0}, "min_p"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(RequestError) as e:
        parse_generate(build_request("hi", **kwargs))
    assert e.value.code is ErrorCode.INVALID_ARGUMENT and e.value.param == field
    assert e.value.message.startswith(f"{field}: ")


def test_wire_with_both_text_and_token_ids_is_refused():
    both = (pb.GenerateRequest(text="hi").SerializeToString()
            + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])).SerializeToString())
    # protobuf alone would keep the last member of the oneof and accept it
    assert pb.GenerateRequest.FromString(both).WhichOneof("input") == "token_ids"
    bad = deserialize_generate(both)
    assert isinstance(bad, BadMessage) and bad.error.param == "input"


def test_wire_with_invalid_utf8_text_names_the_field():
    raw = b"\x12\x03a\xff\xfe"  # field 2 (text), 3 bytes, not UTF-8
    bad = deserialize_generate(raw)
    assert isinstance(bad, BadMessage) and bad.error.message.startswith("text: ")


def test_http_body_checks():
    with pytest.raises(RequestError, match="^body: malformed JSON"):
        decode_body(b'{"prompt": ')
    with pytest.raises(RequestError, match="^body: is not valid UTF-8"):
        decode_body(b'{"prompt": "\xff"}')
    with pytest.raises(RequestError, match="^prompt: is not valid UTF-8"):
        decode_body(b'{"prompt": "\\ud800"}')
    with pytest.raises(RequestError, match="^frobnicate: unknown field"):
        parse_request({"prompt": "a", "frobnicate": 1}, chat=False)
    with pytest.raises(RequestError, match="^presence_penalty: is not supported"):
        parse_request({"prompt": "a", "presence_penalty": 0.5}, chat=False)
    with pytest.raises(RequestError, match="^stream_options: "):
        parse_request({"prompt": "a", "stream_options": {"include_usage": True}}, chat=False)
    req = parse_request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                         "top_logprobs": 3, "max_completion_tokens": 7, "seed": 1}, chat=True)
    assert (req.top_logprobs, req.max_tokens, req.sampling["seed"]) == (3, 7, 1)
    assert parse_request({"prompt": [[1, 2], [3]], "n": 2}, chat=False).prompts == ((1, 2), (3,))


def test_sse_event_framing():
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
    event = sse_event({"text": "é\n", "lp": -0.1})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == {"text": "é\n", "lp": -0.1}


def test_metrics_text_format():
    reg = Registry()
    c = reg.register(Counter("megaserve:x_total", "x"))
    c.inc(2, {"a": 'q"1'})
    reg.register(Gauge("megaserve:g", "g", callback=lambda: 0.25, labels={"m": "n"}))
    h = reg.register(Histogram("megaserve:h_seconds", "h", [0.1, 1.0]))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = reg.render()
    assert "# TYPE megaserve:h_seconds histogram" in text
    s = parse_text(text)
    assert s['megaserve:x_total{a="q\\"1"}'] == 2 and s['megaserve:g{m="n"}'] == 0.25
    assert [s[f'megaserve:h_seconds_bucket{{le="{le}"}}'] for le in ("0.1", "1", "+Inf")] == [1, 2, 3]
    assert s["megaserve:h_seconds_count"] == 3 and math.isclose(s["megaserve:h_seconds_sum"], 5.55)
    with pytest.raises(ValueError):
        c.inc(-1)
