"""Security (issue 17, section 3) against a real ``megaserve serve``: API key, aborts that
act only on the caller's own requests, and errors without internals."""

from __future__ import annotations

import http.client
import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megaserve.server import generation_pb2 as pb
from megaserve.server.client import auth_metadata, build_request, generation_stub

from .conftest import ServerProcess, assert_idle, http_get
from .test_hostile import LoopWatch, assert_clean, assert_openai_error

KEY = "s3cret-key"
OTHER_KEY = "other-tenant-key"


@pytest.fixture(scope="module")
def keyed_server(model_cache, tmp_path_factory, monkeypatch_module):
    """A server with two API keys (two caller identities), with the default
    ``--dtype auto``."""
    srv = ServerProcess(tmp_path_factory.mktemp("keyed") / "server.log", model_cache,
                        "--max-model-len", "512", "--api-key", KEY, OTHER_KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def post(server, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def test_api_key_guards_http_v1_and_leaves_health_open(keyed_server):
    body = {"prompt": "hi", "max_tokens": 2}
    with LoopWatch(keyed_server):  # /version needs no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            status, reply = post(keyed_server, "/v1/completions", body, headers)
            assert_openai_error(status, reply, 401, "authorization")
        status, reply = post(keyed_server, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x"}]}, {})
        assert_openai_error(status, reply, 401, "authorization")
    status, _ = http_get(keyed_server.url + "/v1/models")
    assert status == 401
    status, reply = post(keyed_server, "/v1/completions", body,
                         {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    assert http_get(keyed_server.url + "/metrics")[0] == 200
    status, doc = http_get(keyed_server.url + "/openapi.json")
    assert status == 200 and "/v1/completions" in json.loads(doc)["paths"]


def test_api_key_guards_grpc_and_leaves_grpc_health_open(keyed_server):
    with grpc.insecure_channel(keyed_server.grpc_address) as channel:
        stub = generation_stub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub["Generate"](build_request("hi", max_tokens=2), timeout=60,
                                      metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert_clean(e.value.details())
            with pytest.raises(grpc.RpcError) as e:
                stub["GetModelInfo"](pb.GetModelInfoRequest(), timeout=60, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=60)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        (done,) = [r.complete for r in stub["Generate"](
            build_request("hi", max_tokens=2), timeout=30, metadata=auth_metadata(KEY))]
        assert len(done.output_ids) == 2
        info = stub["GetModelInfo"](pb.GetModelInfoRequest(), timeout=60,
                                    metadata=auth_metadata(KEY))
        assert info.model_name == "builtin:tiny-moe"
        assert info.dtype == "float32"  # resolved from the checkpoint, not "auto"


def test_serve_refuses_an_empty_api_key(model_cache):
    from megaserve.server.cli import main as serve_main

    assert serve_main(["--api-key", " ", "--http-port", "1", "--grpc-port", "2"]) == 2


def _start_http_stream(server, result: dict) -> threading.Thread:
    """A long HTTP completion stream; ``result`` gets its id and finish reason."""
    def run():
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "victim", "max_tokens": 300, "ignore_eos": True, "stream": True,
             "temperature": 0.0}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                result.setdefault("id", event["id"])
                reason = event["choices"][0]["finish_reason"]
                if reason:
                    result["finish_reason"] = reason
        conn.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_grpc_abort_cannot_touch_other_callers_requests(server):
    http_result: dict = {}
    thread = _start_http_stream(server, http_result)
    deadline = time.monotonic() + 120
    while "id" not in http_result:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # Its own subchannel pool: a connection of its own, as another client process has
    # (channels of one process to one target otherwise share a connection).
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(server.grpc_address, options=own_connection) as attacker_channel, \
            grpc.insecure_channel(server.grpc_address, options=own_connection) as owner_channel:
        attacker, owner = generation_stub(attacker_channel), generation_stub(owner_channel)
        # The HTTP stream's engine id is "<id>-<choice>": a guess must not abort it.
        for guess in (http_result["id"], f"{http_result['id']}-0"):
            assert not attacker["Abort"](pb.AbortRequest(request_id=guess), timeout=60).found
        # Another gRPC caller's request: not found for the attacker, found for its owner.
        call = owner["Generate"](build_request("mine", stream=True, request_id="owned-1",
                                               max_tokens=300, ignore_eos=True), timeout=60)
        first = next(call)
        assert first.WhichOneof("response") == "chunk"
        assert not attacker["Abort"](pb.AbortRequest(request_id="owned-1"), timeout=60).found
        # Request ids are per connection: the same id elsewhere neither clashes nor leaks.
        (done,) = [r.complete for r in attacker["Generate"](
            build_request("same id", request_id="owned-1", max_tokens=2), timeout=30)]
        assert done.request_id == "owned-1" and len(done.output_ids) == 2
        assert owner["Abort"](pb.AbortRequest(request_id="owned-1"), timeout=60).found
        last = list(call)[-1]
        assert last.complete.finish_reason == "abort"
    thread.join(60)
    assert http_result["finish_reason"] == "length"  # the HTTP stream ran to the end
    assert_idle(server)


def test_generate_client_sends_the_api_key(keyed_server, capsys, monkeypatch):
    from megaserve.entrypoints.generate_cli import main as generate_main

    monkeypatch.delenv("MEGASERVE_API_KEY", raising=False)
    args = ["hi", "--server", keyed_server.grpc_address, "--max-tokens", "2"]
    assert generate_main(args) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert generate_main([*args, "--api-key", KEY]) == 0
    monkeypatch.setenv("MEGASERVE_API_KEY", KEY)
    assert generate_main(args) == 0
    assert "completion_tokens=2" in capsys.readouterr().err


def test_bearer_scheme_is_case_insensitive(keyed_server):
    body = {"prompt": "hi", "max_tokens": 1}
    for scheme in ("bearer", "BEARER", "Bearer"):
        status, reply = post(keyed_server, "/v1/completions", body,
                             {"Authorization": f"{scheme} {OTHER_KEY}"})
        assert status == 200, reply
    with grpc.insecure_channel(keyed_server.grpc_address) as channel:
        info = generation_stub(channel)["GetModelInfo"](
            pb.GetModelInfoRequest(), timeout=60, metadata=(("authorization", f"bearer {KEY}"),))
        assert info.model_name == "builtin:tiny-moe"


def test_request_ids_are_scoped_by_api_key_not_by_connection(keyed_server):
    """Two tenants behind one gateway (one multiplexed connection): the same request id
    neither collides nor lets one abort the other's; the same tenant can abort its own
    request from another connection."""
    mine, theirs = auth_metadata(KEY), auth_metadata(OTHER_KEY)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(keyed_server.grpc_address) as gateway, \
            grpc.insecure_channel(keyed_server.grpc_address, options=own_connection) as other:
        stub = generation_stub(gateway)
        call = stub["Generate"](build_request("mine", stream=True, request_id="job-1",
                                              max_tokens=400, ignore_eos=True),
                                timeout=60, metadata=mine)
        assert next(call).WhichOneof("response") == "chunk"
        # The other tenant, on the same connection: its own "job-1", and no abort of ours.
        (done,) = [r.complete for r in stub["Generate"](
            build_request("theirs", request_id="job-1", max_tokens=2), timeout=30,
            metadata=theirs)]
        assert done.request_id == "job-1" and len(done.output_ids) == 2
        assert not stub["Abort"](pb.AbortRequest(request_id="job-1"), timeout=60,
                                 metadata=theirs).found
        # The owner, from a connection of its own.
        assert generation_stub(other)["Abort"](pb.AbortRequest(request_id="job-1"),
                                               timeout=60, metadata=mine).found
        assert list(call)[-1].complete.finish_reason == "abort"
