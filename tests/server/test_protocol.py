"""Pure parts of the server: request mapping, wire checks, SSE framing, metrics text."""

from __future__ import annotations

import json
import math

import pytest

from megaserve.server import generation_pb2 as pb
from megaserve.server.client import build_request
from megaserve.server.errors import ErrorCode, RequestError
from megaserve.server.grpc_protocol import BadMessage, deserialize_generate, parse_generate
from megaserve.server.metrics import ServerMetrics, parse_text
from megaserve.server.openai_protocol import parse_body, parse_request, sse_event


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


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": math.inf}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"top_p": -math.inf}, "top_p"), ({"logprobs": 10**9}, "logprobs"),
    ({"logprobs": 21}, "logprobs"), ({"stop": ["x"] * 65}, "stop"),
])
def test_grpc_non_finite_and_unbounded_params_are_refused(kwargs, field):
    with pytest.raises(RequestError) as e:
        parse_generate(build_request("hi", **kwargs))
    assert e.value.param == field and e.value.message.startswith(f"{field}: ")


def test_grpc_parse_is_linear_on_repeated_0xff():
    import time

    start = time.perf_counter()
    bad = deserialize_generate(b"\xff" * (4 << 20))
    assert isinstance(bad, BadMessage) and bad.error.param == "request"
    assert time.perf_counter() - start < 1.0  # was quadratic: 18 s for 1 MB


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
        parse_body(b'{"prompt": ', chat=False)
    with pytest.raises(RequestError, match="^body: malformed JSON"):
        parse_body(b'{"prompt": "\xff"}', chat=False)
    with pytest.raises(RequestError, match="^body: malformed JSON"):
        parse_body(b'{"prompt": "\\ud800"}', chat=False)
    with pytest.raises(RequestError, match="^body: must be a JSON object"):
        parse_body(b'[1]', chat=False)
    with pytest.raises(RequestError, match="^frobnicate: unknown field"):
        parse_request({"prompt": "a", "frobnicate": 1}, chat=False)
    with pytest.raises(RequestError, match="^presence_penalty: input should be less than"):
        parse_request({"prompt": "a", "presence_penalty": 2.5}, chat=False)
    with pytest.raises(RequestError, match="^logit_bias: keys must be token ids"):
        parse_request({"prompt": "a", "logit_bias": {"x": 1}}, chat=False)
    with pytest.raises(RequestError, match="^stream_options: "):
        parse_request({"prompt": "a", "stream_options": {"include_usage": True}}, chat=False)
    req = parse_request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                         "top_logprobs": 3, "max_completion_tokens": 7, "seed": 1}, chat=True)
    assert (req.top_logprobs, req.max_tokens, req.sampling["seed"]) == (3, 7, 1)
    assert parse_request({"prompt": [[1, 2], [3]], "n": 2}, chat=False).prompts == ((1, 2), (3,))


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "a", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "a", "top_p": NaN}', "top_p"),
    (b'{"prompt": "a", "seed": ' + b"9" * 2000 + b"}", "seed"),
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "body"),
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "body"),
    (b'{"prompt": "a", "user": 5}', "user"),
    (b'{"prompt": [1, "a"]}', "prompt[1]"),
    (b'{"prompt": [[1], [-2]]}', "prompt[1][0]"),
    (b'{"prompt": {}}', "prompt"),
    (b'{"prompt": "a", "stop": ["x", ""]}', "stop"),
])
def test_hostile_bodies_name_the_field(body, param):
    with pytest.raises(RequestError) as e:
        parse_body(body, chat=False)
    assert e.value.code is ErrorCode.INVALID_ARGUMENT and e.value.param == param
    assert e.value.message.startswith(f"{param}: ") and len(e.value.message) < 300


def test_chat_roles_and_content_are_checked():
    with pytest.raises(RequestError) as e:
        parse_request({"messages": [{"role": "wizard", "content": "hi"}]}, chat=True)
    assert e.value.param == "messages[0].role" and "'user'" in e.value.message
    with pytest.raises(RequestError, match=r"^messages\[0\].content: must be a string or a "):
        parse_request({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, chat=True)


def test_bodies_of_too_many_values_are_refused_before_decoding():
    from megaserve.server.openai_protocol import MAX_JSON_VALUES

    body = json.dumps({"prompt": [[1]] * (MAX_JSON_VALUES + 1)}).encode()
    with pytest.raises(RequestError) as e:
        parse_body(body, chat=False)
    assert e.value.code is ErrorCode.TOO_LARGE and e.value.param == "body"


def test_sse_event_framing():
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
    event = sse_event({"text": "é\n", "lp": -0.1})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == {"text": "é\n", "lp": -0.1}


class _Stats:
    num_running, num_waiting, num_kv_blocks, num_free_kv_blocks = 1, 2, 10, 4
    prompt_tokens_total, generation_tokens_total = 30, 12


def test_metrics_use_vllm_names_with_a_model_name_label():
    m = ServerMetrics("some/model", lambda: _Stats(), lambda: 3)
    m.finished("stop")
    m.rejected("RESOURCE_EXHAUSTED")
    for v in (0.05, 0.5, 5.0):
        m.request_done(v)
    m.first_token(0.2)
    m.inter_token(0.02, 2)
    s = parse_text(m.render().decode())
    lab = '{model_name="some/model"}'
    assert s[f"vllm:num_requests_running{lab}"] == 1 and s[f"vllm:num_requests_waiting{lab}"] == 2
    assert s[f"vllm:kv_cache_usage_perc{lab}"] == 0.6
    assert s[f"vllm:prompt_tokens_total{lab}"] == 30
    assert s[f"vllm:generation_tokens_total{lab}"] == 12
    assert s[f"megaserve:num_requests_in_flight{lab}"] == 3
    assert s['vllm:request_success_total{finished_reason="stop",model_name="some/model"}'] == 1
    assert s['megaserve:request_rejected_total{code="RESOURCE_EXHAUSTED",model_name="some/model"}'] == 1
    assert s[f"vllm:inter_token_latency_seconds_count{lab}"] == 2
    buckets = [s[f'vllm:e2e_request_latency_seconds_bucket{{le="{le}",model_name="some/model"}}']
               for le in ("0.3", "1.0", "+Inf")]
    assert buckets == [1, 2, 3]
    assert math.isclose(s[f"vllm:e2e_request_latency_seconds_sum{lab}"], 5.55)
