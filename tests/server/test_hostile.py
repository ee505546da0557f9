"""Hostile and odd input (issue 17, section 2) against a real ``megaserve serve``.

Each test sends what an attacker or a careless client would, checks the status code and
the OpenAI error shape (or the gRPC status), and checks that the event loop keeps
answering (``/version``, a route it serves) within 100 ms while the hostile input is being
handled. The last test checks that after
the whole storm nothing is held: no request in flight, every KV block free.
"""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import time

import grpc
import pytest

from megaserve.server import generation_pb2 as pb
from megaserve.server.client import build_request, generation_stub

from .conftest import LABEL, ServerProcess, assert_idle, http_get, http_post

HEALTH_BUDGET_S = 0.1
REJECTED = 'megaserve:request_rejected_total{{code="{}",model_name="builtin:tiny-moe"}}'


@pytest.fixture(scope="module")
def hostile_server(model_cache, tmp_path_factory):
    """A small server (limit 8 + 8 requests) with a 1 s header timeout."""
    srv = ServerProcess(tmp_path_factory.mktemp("hostile") / "server.log", model_cache,
                        "--dtype", "float32", "--max-num-seqs", "8", "--max-waiting", "8",
                        "--max-model-len", "512", "--timeout-keep-alive", "1")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def assert_openai_error(status: int, body: dict, expected_status: int,
                        param: str | None = None) -> str:
    """The OpenAI error shape, a clean message (no traceback, nothing said twice)."""
    assert status == expected_status, body
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == expected_status and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    assert_clean(err["message"])
    return err["message"]


def assert_clean(message: str) -> None:
    assert "Traceback" not in message and 'File "' not in message, message
    parts = [p.strip() for p in message.replace("(", ":").replace(")", ":").split(":")]
    repeated = [p for p in parts if len(p) >= 12 and parts.count(p) > 1]
    assert not repeated, f"said twice in one error: {repeated} in {message!r}"


# Runs in a process of its own, so that what the test process does meanwhile (building
# and sending a hostile body) cannot delay it: what it measures is the server alone.
_POLLER = r"""
import http.client, json, select, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=5)
latencies, statuses = [], set()
conn.request("GET", "/version")  # untimed: the connection's set-up and the app's first
conn.getresponse().read()        # request (cold code paths) are not the loop's load
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.005)[0]:
    start = time.perf_counter()
    conn.request("GET", "/version")
    resp = conn.getresponse()
    resp.read()
    latencies.append(time.perf_counter() - start)
    statuses.add(resp.status)
print(json.dumps({"latencies": latencies, "statuses": sorted(statuses)}), flush=True)
"""


class LoopWatch:
    """Polls ``/version`` (one keep-alive connection, from another process) while a block
    runs; on exit asserts that every answer was 200 and came within ``budget_s``.

    ``/version`` is served by the event loop, so this measures the loop's responsiveness
    (``/health`` is answered by the listener process, off the loop: test_storm)."""

    def __init__(self, server: ServerProcess, budget_s: float = HEALTH_BUDGET_S) -> None:
        self.server = server
        self.budget_s = budget_s
        self.latencies: list[float] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LoopWatch:
        self._proc = subprocess.Popen([sys.executable, "-c", _POLLER, str(self.server.http_port)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout.readline().strip() == "ready"
        time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.02)
        out, _ = self._proc.communicate("stop\n", timeout=30)
        result = json.loads(out)
        self.latencies = result["latencies"]
        if exc[0] is not None:
            return
        assert self.latencies, "/version was never polled"
        assert result["statuses"] == [200], result["statuses"]
        assert max(self.latencies) < self.budget_s, \
            f"/version took {max(self.latencies) * 1e3:.0f} ms while hostile input was handled"


def post_raw(server, path: str, body: bytes, headers: dict[str, str] | None = None,
             method: str = "POST") -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.getheader("Content-Type", "").startswith("application/json"), data[:200]
    return resp.status, json.loads(data)


@pytest.fixture(scope="module")
def stub(hostile_server):
    with grpc.insecure_channel(hostile_server.grpc_address) as channel:
        yield generation_stub(channel)


def test_grpc_message_of_0xff_bytes_is_refused_in_linear_time(hostile_server):
    with grpc.insecure_channel(hostile_server.grpc_address) as channel:
        raw = channel.unary_stream("/megaserve.v1.Generation/Generate",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.GenerateResponse.FromString)
        with LoopWatch(hostile_server):
            for size in (1 << 20, 8 << 20):
                start = time.perf_counter()
                with pytest.raises(grpc.RpcError) as e:
                    list(raw(b"\xff" * size, timeout=30))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith("request: ")
                assert_clean(e.value.details())
                assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("case", ["deep JSON", "huge int", "huge int in range", "bad gzip"])
def test_malformed_bodies_are_json_400s(hostile_server, case):
    body, headers, param = {
        "deep JSON": (b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", {}, "body"),
        "huge int": (b'{"prompt": "a", "max_tokens": ' + b"7" * 5000 + b"}", {}, "body"),
        "huge int in range": (b'{"prompt": "a", "seed": ' + b"7" * 3000 + b"}", {}, "seed"),
        "bad gzip": (b'{"prompt": "not gzip at all"}', {"Content-Encoding": "gzip"}, "body"),
    }[case]
    with LoopWatch(hostile_server):
        for _ in range(5):
            status, reply = post_raw(hostile_server, "/v1/completions", body, headers)
            assert_openai_error(status, reply, 400, param)


def test_real_gzip_is_accepted(hostile_server):
    body = gzip.compress(json.dumps({"prompt": "gzip", "max_tokens": 2}).encode())
    status, reply = post_raw(hostile_server, "/v1/completions", body,
                             {"Content-Encoding": "gzip"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_404_and_405_are_json_in_openai_shape(hostile_server):
    status, reply = post_raw(hostile_server, "/v1/nothing", b"{}")
    assert_openai_error(status, reply, 404)
    status, reply = post_raw(hostile_server, "/v1/completions", b"", method="DELETE")
    assert_openai_error(status, reply, 405)
    status, body = http_get(hostile_server.url + "/no/such/page")
    assert_openai_error(status, json.loads(body), 404)


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
], ids=["bad request line", "9 KB header", "bad Content-Length"])
def test_malformed_http_is_a_json_400(hostile_server, raw):
    with socket.create_connection(("127.0.0.1", hostile_server.http_port), timeout=10) as s:
        s.sendall(raw)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400", reply[:300]
    assert b"application/json" in head
    assert_openai_error(400, json.loads(body), 400, "request")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e999}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "top_p": -Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}',
     "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "user": 42}',
     "user"),
    ("/v1/completions", b'{"prompt": "a", "user": ["x"]}', "user"),
])
def test_non_finite_numbers_unknown_roles_and_wrong_user_type_name_the_field(
        hostile_server, path, body, param):
    with LoopWatch(hostile_server):
        status, reply = post_raw(hostile_server, path, body)
    assert_openai_error(status, reply, 400, param)


def test_requests_that_can_never_fit_are_400_naming_the_limit(hostile_server):
    before = hostile_server.metrics().get(REJECTED.format("RESOURCE_EXHAUSTED"), 0)
    with LoopWatch(hostile_server):
        status, reply = http_post(hostile_server.url + "/v1/completions",
                                  {"prompt": ["p"] * 1000, "max_tokens": 1})
        message = assert_openai_error(status, reply, 400, "prompt")
        assert "max_num_seqs + max_waiting = 16" in message and "1000" in message
        status, reply = http_post(hostile_server.url + "/v1/completions",
                                  {"prompt": ["a", "b", "c"], "n": 6, "max_tokens": 1})
        message = assert_openai_error(status, reply, 400, "prompt")
        assert "18" in message and "max_num_seqs + max_waiting = 16" in message
        status, reply = http_post(hostile_server.url + "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x"}],
                                   "max_tokens": 600})
        message = assert_openai_error(status, reply, 400, "max_tokens")
        assert "max_model_len=512" in message
    # A request that fits exactly is served (all 16 choices admitted together).
    status, reply = http_post(hostile_server.url + "/v1/completions",
                              {"prompt": ["a", "b"], "n": 8, "max_tokens": 1})
    assert status == 200 and len(reply["choices"]) == 16
    assert hostile_server.metrics().get(REJECTED.format("RESOURCE_EXHAUSTED"), 0) == before


def test_grpc_logprobs_is_capped_at_20(hostile_server, stub):
    with LoopWatch(hostile_server):
        with pytest.raises(grpc.RpcError) as e:
            list(stub["Generate"](build_request("hi", logprobs=10**9), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("logprobs: ") and "20" in e.value.details()
    (done,) = [r.complete for r in stub["Generate"](
        build_request("hi", logprobs=20, max_tokens=2), timeout=30)]
    assert all(len(p.top) >= 19 for p in done.logprobs)


def test_top_logprobs_keep_every_alternative_with_its_real_bytes(hostile_server):
    # Greedy over raw bytes: the tiny model's top alternatives include lone bytes of
    # multi-byte characters, which all decode to U+FFFD on their own.
    status, chat = http_post(hostile_server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "héllo wörld ½ ☃"}], "max_tokens": 12,
        "temperature": 0.0, "logprobs": True, "top_logprobs": 8, "ignore_eos": True})
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 12
    for entry in content:
        assert len(entry["top_logprobs"]) >= 7  # 8 alternatives, less the sampled one
        assert len({t["token_id"] for t in entry["top_logprobs"]}) == len(entry["top_logprobs"])
    lone = [t for e in content for t in e["top_logprobs"] if t["token"].startswith("bytes:")]
    assert lone, "expected some alternatives that are pieces of a character"
    for t in lone:  # real bytes, not U+FFFD's
        assert t["bytes"] != list("\ufffd".encode()) and bytes(t["bytes"]).hex() in \
            t["token"].replace("\\x", "")
    text = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace")
    assert text == chat["choices"][0]["message"]["content"]

    status, comp = http_post(hostile_server.url + "/v1/completions", {
        "prompt": "héllo wörld ½ ☃", "max_tokens": 12, "temperature": 0.0, "logprobs": 8,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, comp
    for top in comp["choices"][0]["logprobs"]["top_logprobs"]:
        assert len(top) >= 8  # 8 alternatives (+ the sampled one when it is not among them)


def test_slow_header_is_cut_off_by_the_header_timeout(hostile_server):
    with LoopWatch(hostile_server):
        with socket.create_connection(("127.0.0.1", hostile_server.http_port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Typ")
            start = time.monotonic()
            assert s.recv(1024) == b""  # the server closed the connection
            assert 0.5 < time.monotonic() - start < 5


def test_huge_content_length_is_refused_before_the_body_is_read(hostile_server):
    with LoopWatch(hostile_server):
        with socket.create_connection(("127.0.0.1", hostile_server.http_port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    assert_openai_error(413, json.loads(body), 413, "body")


def test_after_the_storm_nothing_is_held(hostile_server):
    status, reply = http_post(hostile_server.url + "/v1/completions",
                              {"prompt": "still fine", "max_tokens": 3})
    assert status == 200
    assert_idle(hostile_server)
    m = hostile_server.metrics()
    assert m[f"megaserve:num_requests_in_flight{LABEL}"] == 0
    assert "Traceback" not in hostile_server.log()
