"""HttpListener: /health answered by the listener process while the event loop is
blocked, every other request served by the aiohttp app it hands connections to, a
keep-alive connection moving from one to the other, and a stale publication reported."""

from __future__ import annotations

import asyncio
import http.client
import socket
import time

from aiohttp import web

from megaserve.server.core import Health
from megaserve.server.http_listener import HttpListener


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": "test"})


async def _health_on_loop(request: web.Request) -> web.Response:
    return web.json_response({"status": "FROM_THE_APP"})


async def _with_listener(body, *, stale_after: float = 10.0, on_exit=None,
                         idle_timeout: float = 5.0) -> None:
    """Runs ``body(listener, loop)`` in a thread while an app with a listener serves on this loop."""
    app = web.Application()
    app.router.add_get("/version", _version)
    app.router.add_get("/health", _health_on_loop)
    runner = web.AppRunner(app)
    await runner.setup()
    loop = asyncio.get_running_loop()

    def adopt(sock: socket.socket) -> None:
        loop.create_task(loop.connect_accepted_socket(runner.server, sock))

    listener = HttpListener("127.0.0.1", 0, loop, adopt, stale_after=stale_after,
                            on_exit=on_exit, idle_timeout=idle_timeout)
    listener.publish(Health("SERVING", True))
    listener.start()
    try:
        await asyncio.to_thread(body, listener, loop)
    finally:
        listener.close()
        await runner.cleanup()


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read()


def _probe(port: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        return _get(conn, "/health")
    finally:
        conn.close()


def _until(read, done, timeout: float = 60.0) -> list:
    """Calls ``read()`` until ``done(result)`` (every 10 ms, AssertionError after
    ``timeout`` s); the results, in order."""
    seen = [read()]
    deadline = time.monotonic() + timeout
    while not done(seen[-1]):
        assert time.monotonic() < deadline, f"still {seen[-1]!r} after {timeout} s"
        time.sleep(0.01)
        seen.append(read())
    return seen


def test_health_is_answered_while_the_event_loop_is_blocked():
    blocked_s = 3.0
    answered: list[float] = []

    def body(listener: HttpListener, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(time.sleep, blocked_s)  # the loop does nothing else
        time.sleep(0.2)  # (the block has begun)
        conn = http.client.HTTPConnection("127.0.0.1", listener.port, timeout=30)
        started = time.monotonic()
        assert _get(conn, "/health") == (200, b'{"status": "SERVING"}')
        answered.append(time.monotonic() - started)
        conn.close()

    asyncio.run(_with_listener(body))
    # Served by the loop, the probe would have waited for the rest of the block (2.8 s).
    assert answered and answered[0] < blocked_s / 2, answered


def test_other_requests_go_to_the_app_and_keep_alive_follows():
    def body(listener: HttpListener, _loop) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", listener.port, timeout=30)
        # Probes on one keep-alive connection stay with the listener ...
        assert _get(conn, "/health") == (200, b'{"status": "SERVING"}')
        assert _get(conn, "/health?verbose=1") == (200, b'{"status": "SERVING"}')
        # ... and its first other request moves it, unread, to the app for good.
        assert _get(conn, "/version") == (200, b'{"version": "test"}')
        assert _get(conn, "/health") == (200, b'{"status": "FROM_THE_APP"}')
        conn.close()
        fresh = http.client.HTTPConnection("127.0.0.1", listener.port, timeout=30)
        assert _get(fresh, "/version")[0] == 200
        fresh.close()
        # The listener process applies a publication when it next runs: on a busy machine a
        # probe may still get the state before it, never another one.
        listener.publish(Health("DRAINING", False))
        seen = _until(lambda: _probe(listener.port),
                      lambda got: got == (503, b'{"status": "DRAINING"}'))
        assert set(seen) <= {(200, b'{"status": "SERVING"}'), (503, b'{"status": "DRAINING"}')}
        listener.stop_accepting()

        def connect() -> str:
            try:
                socket.create_connection(("127.0.0.1", listener.port), timeout=5).close()
            except ConnectionRefusedError:
                return "refused"
            except ConnectionResetError:  # queued as the listening socket closed
                return "reset"
            return "accepted"

        _until(connect, lambda got: got == "refused")

    asyncio.run(_with_listener(body))


def test_a_stale_publication_is_unresponsive():
    def body(listener: HttpListener, _loop) -> None:
        time.sleep(0.6)  # nothing publishes after the first
        conn = http.client.HTTPConnection("127.0.0.1", listener.port, timeout=30)
        status, reply = _get(conn, "/health")
        assert status == 503 and b'"UNRESPONSIVE"' in reply, reply
        listener.publish(Health("SERVING", True))
        assert _get(conn, "/health")[0] == 200
        conn.close()

    asyncio.run(_with_listener(body, stale_after=0.5))


_PARENT = r"""
import asyncio, sys, time
from megaserve.server.http_listener import HttpListener

async def main():
    listener = HttpListener("127.0.0.1", 0, asyncio.get_running_loop(), lambda sock: sock.close())
    listener.start()
    print(listener.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_the_listener_process_exits_with_a_killed_server():
    import os
    import signal
    import subprocess
    import sys

    from tests.processes import alive

    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
    finally:
        os.kill(parent.pid, signal.SIGKILL)  # no close(): the channel just ends
        parent.wait()
    deadline = time.monotonic() + 30
    while alive(child):
        assert time.monotonic() < deadline, "the listener process outlived its server"
        time.sleep(0.05)


def test_a_lost_listener_process_is_reported():
    import os
    import signal

    reasons: list[str] = []

    def body(listener: HttpListener, _loop) -> None:
        os.kill(listener.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not reasons:
            assert time.monotonic() < deadline, "the lost listener was not reported"
            time.sleep(0.05)

    asyncio.run(_with_listener(body, on_exit=reasons.append))
    assert "HTTP listener process exited" in reasons[0], reasons


def test_a_silent_connection_is_closed_after_the_idle_timeout():
    def body(listener: HttpListener, _loop) -> None:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=30) as silent:
            started = time.monotonic()
            assert silent.recv(1) == b""  # closed by the listener, nothing sent
            assert time.monotonic() - started >= 0.4

    asyncio.run(_with_listener(body, idle_timeout=0.5))
