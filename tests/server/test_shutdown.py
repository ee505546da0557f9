"""SIGTERM under load: the process is gone within the grace period (a kubelet sends
SIGKILL when it ends), streams in flight end cleanly."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

from .conftest import ServerProcess

GRACE = 4.0


def _stream(port: int, results: list, started: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": "a long story", "max_tokens": 4000, "ignore_eos": True, "stream": True,
            "temperature": 0.0}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        last = None
        for line in resp:
            started.set()
            if line.startswith(b"data: {"):
                last = json.loads(line[len(b"data: "):])
        results.append(last["choices"][0]["finish_reason"] if last else None)
    except OSError as e:
        results.append(e)
    finally:
        conn.close()


def test_sigterm_under_load_exits_within_the_grace_period(model_cache, tmp_path):
    srv = ServerProcess(tmp_path / "server.log", model_cache, "--dtype", "float32",
                        "--max-num-seqs", "8", "--max-model-len", "4096",
                        "--grace-period", str(GRACE))
    try:
        srv.wait_ready()
        results: list = []
        started = [threading.Event() for _ in range(16)]
        threads = [threading.Thread(target=_stream, args=(srv.http_port, results, e))
                   for e in started]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while sum(e.is_set() for e in started) < 8:  # 8 running (streaming), 8 waiting
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(GRACE + 30)
        elapsed = time.monotonic() - sent
        for t in threads:
            t.join(30)
    finally:
        srv.stop()
    assert code == 0, srv.log()
    assert elapsed < GRACE, f"exited {elapsed:.2f} s after SIGTERM, grace period {GRACE} s"
    # Every stream ended with a last chunk: finished, or aborted at the end of the grace
    # period (the waiting ones at least: 8 x 4,000 tokens outlast it).
    assert len(results) == 16 and set(results) <= {"length", "abort"}, results
    assert "abort" in results, results
