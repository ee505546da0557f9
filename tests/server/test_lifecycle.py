"""Start-up, overload and shutdown of a real ``megaserve serve`` process."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megaserve.server import generation_pb2 as pb
from megaserve.server.cli import main as serve_main
from megaserve.server.client import build_request, generation_stub

from tests.processes import wait_for

from .conftest import ServerProcess, assert_idle, http_get, http_post

GRACE = 3.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def small_server(model_cache, tmp_path_factory):
    """2 running + 1 waiting at most, 3 s grace. Yielded before it is ready, with a cache
    of its own: it generates the built-in model while loading, so loading lasts."""
    srv = ServerProcess(tmp_path_factory.mktemp("small") / "server.log",
                        str(tmp_path_factory.mktemp("small-cache")),
                        "--dtype", "float32", "--max-num-seqs", "2", "--max-waiting", "1",
                        "--grace-period", str(GRACE))
    try:
        yield srv
    finally:
        srv.stop()


LONG = 4000  # tokens: more than the grace period decodes (max_model_len 4096)


def long_request(request_id: str) -> pb.GenerateRequest:
    return build_request("long " + request_id, stream=True, request_id=request_id,
                         max_tokens=LONG, ignore_eos=True, temperature=0.0)


def test_health_is_not_serving_until_the_model_is_loaded(small_server):
    seen, refused_while_loading = [], None
    deadline = time.monotonic() + 60
    # Reconnect fast: grpc's default backoff (1 s) can outlast the loading phase.
    fast = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
            ("grpc.max_reconnect_backoff_ms", 50)]
    with grpc.insecure_channel(small_server.grpc_address, options=fast) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = generation_stub(channel)
        while time.monotonic() < deadline:
            try:
                overall = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                ready = health.Check(health_pb2.HealthCheckRequest(
                    service="megaserve.v1.Generation"), timeout=5).status
            except grpc.RpcError as e:  # not listening yet, or a check that a loaded box
                # (loading holds both cores) did not answer in time: ask again
                assert e.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED), e.details()
                time.sleep(0.005)
                continue
            if not seen or seen[-1] != overall:
                seen.append(overall)
            if overall == NOT_SERVING and refused_while_loading is None:
                with pytest.raises(grpc.RpcError) as e:
                    list(stub["Generate"](build_request("too early"), timeout=60))
                refused_while_loading = e.value.code()
                assert http_get(small_server.url + "/health")[0] == 503
            if overall == SERVING:
                assert ready == SERVING
                break
            time.sleep(0.02)
    assert seen == [NOT_SERVING, SERVING], small_server.log()
    assert refused_while_loading == grpc.StatusCode.UNAVAILABLE
    assert http_get(small_server.url + "/health")[0] == 200


def test_waiting_cap_gives_resource_exhausted_and_429(small_server):
    small_server.wait_ready()
    with grpc.insecure_channel(small_server.grpc_address) as channel:
        stub = generation_stub(channel)
        calls = [stub["Generate"](long_request(f"busy{i}"), timeout=600) for i in range(3)]
        # A loaded CI box can take many seconds to admit the first two; the long requests
        # (4,000 tokens, cancelled below) outlast this bound.
        deadline = time.monotonic() + 120
        while True:  # which two run first is up to the engine
            info = stub["GetServerInfo"](pb.GetServerInfoRequest(), timeout=60)
            if (info.num_in_flight, info.num_running, info.num_waiting) == (3, 2, 1):
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as e:
            list(stub["Generate"](build_request("one too many"), timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting" in e.value.details()
        status, body = http_post(small_server.url + "/v1/completions", {"prompt": "too many"})
        assert status == 429 and "retry later" in body["error"]["message"]
        for call in calls:
            call.cancel()
    assert_idle(small_server)
    rejected = small_server.metrics()[
        'megaserve:request_rejected_total{code="RESOURCE_EXHAUSTED",model_name="builtin:tiny-moe"}']
    assert rejected == 2


def test_sigterm_finishes_short_work_aborts_long_work_and_exits_cleanly(small_server):
    small_server.wait_ready()
    results: dict[str, pb.Complete] = {}
    started = {name: threading.Event() for name in ("short", "long")}

    def consume(name: str, request: pb.GenerateRequest) -> None:
        with grpc.insecure_channel(small_server.grpc_address) as channel:
            for r in generation_stub(channel)["Generate"](request, timeout=60):
                started[name].set()
                if r.WhichOneof("response") == "complete":
                    results[name] = r.complete

    short = build_request("short", stream=True, max_tokens=40, ignore_eos=True, temperature=0.0)
    threads = [threading.Thread(target=consume, args=("short", short)),
               threading.Thread(target=consume, args=("long", long_request("long")))]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started.values())
    sent = time.monotonic()
    small_server.proc.send_signal(signal.SIGTERM)
    # The server logs the drain in the same step that starts refusing work; the HTTP
    # listener process closes its port when it next runs.
    wait_for(lambda: "shutting down" in small_server.log(), 60, "the drain's log line")
    with grpc.insecure_channel(small_server.grpc_address) as channel:  # no new work
        with pytest.raises(grpc.RpcError) as e:
            list(generation_stub(channel)["Generate"](build_request("late"), timeout=60))
        # UNAVAILABLE: the closed port, or the draining server's refusal; CANCELLED: a
        # connection gRPC accepted just before its stop closed the port (seen beside two
        # CPU hogs), whose call its stop then cancels. Either way the work is refused.
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    wait_for(lambda: not _answers(small_server.url + "/health"), 60, "the HTTP port closed")
    for t in threads:
        t.join(30)
    assert small_server.proc.wait(60) == 0  # bounds a hang; the log times the shutdown
    elapsed = time.monotonic() - sent
    assert results["short"].finish_reason == "length"
    assert len(results["short"].output_ids) == 40
    assert results["long"].finish_reason == "abort"
    assert 0 < len(results["long"].output_ids) < LONG
    log = small_server.log()
    assert "aborted 1 request" in log and "Traceback" not in log
    # The server's own shutdown fits in the grace period, timed by its log: the
    # interpreter's exit after it (torch teardown) goes at the machine's pace, unbounded.
    shutdown = _log_time(log, "shutting down")
    assert 0 < _log_time(log, "megaserve: stopped") - shutdown < GRACE
    assert GRACE - 1.5 < elapsed, elapsed  # the long request had its grace period


def _answers(url: str) -> bool:
    """Whether an HTTP GET of ``url`` gets any reply (False: refused, reset or timed out)."""
    try:
        http_get(url, timeout=2)
    except OSError:
        return False
    return True


def _log_time(log: str, marker: str) -> float:
    """Seconds since midnight of the first log line containing ``marker``."""
    line = next(line for line in log.splitlines() if marker in line)
    hms = line.split()[1]  # "2026-01-01 12:34:56,789 INFO ..."
    h, m, rest = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(rest.replace(",", "."))


@pytest.mark.parametrize("argv, message", [
    (["--grpc-port", "70000"], "grpc_port"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--grpc-port", "9000", "--http-port", "9000"], "must differ"),
    (["--grace-period", "-1"], "grace_period"),
    (["--max-waiting", "x"], "invalid int value"),
    (["--transport", "carrier-pigeon"], "transport"),
])
def test_serve_cli_refuses_bad_flags(argv, message, capsys):
    assert serve_main(argv) == 2
    assert message in capsys.readouterr().err
