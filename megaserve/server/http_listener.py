"""The HTTP port's listener: ``/health`` answered on a thread of its own, every other
request handed to the aiohttp app on the event loop.

Why: the event loop parses bodies, validates prompts and streams tokens. A storm of large
requests keeps it busy, and a health probe queued behind that work times out (a kubelet
probe's default timeout is 1 s) although the server is fine. Here a thread owns the
listening sockets and looks at the head of each connection's first request without
consuming it (``MSG_PEEK``)::

    accept (backlog LISTEN_BACKLOG) ──▶ peek the request head
        GET|HEAD /health, complete head, no body ──▶ answered here from the published
            health (keep-alive: the next request on the connection is peeked again)
        anything else (or a head not complete in the first segment) ──▶ the socket, its
            bytes unread, goes to the event loop (``loop.connect_accepted_socket`` with
            aiohttp's handler): served exactly as before, to the end of the connection

NOTE: what this thread answers is a *published* ``Health``: the event loop publishes one
at least every ``PUBLISH_EVERY_S`` (``HealthPublisher``), so health keeps following the
server's state, and a loop that has not published for ``STALE_AFTER_S`` is reported as
503 ``UNRESPONSIVE``: a wedged loop still fails its probe, a busy one does not.

The thread's own work is a few system calls and a few hundred bytecodes per probe, and it
never waits on the event loop; it still shares the interpreter lock with the loop, so a
probe can wait a switch interval (5 ms) for it per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megaserve.server.core import Health

logger = logging.getLogger(__name__)

# Connections the kernel queues before accept(): a burst of 1,000 connections fits (the
# kernel caps it at net.core.somaxconn; aiohttp's default, 128, refused or delayed a burst).
LISTEN_BACKLOG = 4096
# A request head longer than this goes to aiohttp (which refuses heads over 8 KiB).
MAX_HEAD_BYTES = 8192
PUBLISH_EVERY_S = 0.1
STALE_AFTER_S = 10.0
_HEALTH_PATHS = (b"/health", b"/health?")


@dataclass(frozen=True)
class _Published:
    health: Health
    at: float  # time.monotonic() of publication


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float  # monotonic: closed if no request head arrives before it


class HttpListener:
    """Owns the HTTP listening sockets of ``host:port`` (every address ``host`` resolves
    to) and the thread that accepts on them; see the module docstring.

    ``adopt(sock)`` is called on the event loop's thread with each connection that is not
    a health probe (its bytes unread). ``idle_timeout`` closes connections held here
    (probes' keep-alive) that send nothing for that long. A health published more than
    ``stale_after`` seconds ago is answered as 503 ``UNRESPONSIVE``. ``request_id_headers`` and
    ``cors``: the app's options, honoured here (a probe with an ``Origin`` header goes to
    the app when CORS is configured). Raises OSError if a port cannot be bound.
    """

    def __init__(self, host: str, port: int, loop: asyncio.AbstractEventLoop,
                 adopt: Callable[[socket.socket], Any], *, idle_timeout: float = 5.0,
                 request_id_headers: bool = False, cors: bool = False,
                 stale_after: float = STALE_AFTER_S) -> None:
        self._loop = loop
        self._stale_after = stale_after
        self._adopt = adopt
        self._idle_timeout = idle_timeout
        self._request_id_headers = request_id_headers
        self._cors = cors
        self._published = _Published(Health("LOADING", False), time.monotonic())
        self._listeners = _bind(host, port)
        self.port = self._listeners[0].getsockname()[1]  # the bound one (port 0: any free)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        for sock in self._listeners:
            self._selector.register(sock, selectors.EVENT_READ, "listen")
        self._conns: dict[int, _Conn] = {}  # fd -> connection held by this thread
        self._accepting = True
        self._closed = False
        self.num_answered = 0  # probes answered by this thread (for tests and logs)
        self._thread = threading.Thread(target=self._run, name="megaserve-http-listener",
                                        daemon=True)

    # -- owner's side (the event loop) --------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def publish(self, health: Health) -> None:
        """The health probes get from now on (and a heartbeat of the event loop)."""
        self._published = _Published(health, time.monotonic())

    def stop_accepting(self) -> None:
        """Closes the listening sockets: new connections are refused; the ones open stay."""
        self._accepting = False
        self._wake()

    def close(self, timeout: float = 1.0) -> None:
        """Stops the thread and closes every socket it holds (not the adopted ones)."""
        self._closed = True
        self._wake()
        self._thread.join(timeout)

    # -- the listener thread -------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        try:
            while not self._closed:
                if not self._accepting and self._listeners:
                    self._close_listeners()
                for key, _ in self._selector.select(timeout=0.5):
                    if key.data == "listen":
                        self._accept(key.fileobj)
                    elif key.data is None:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._on_readable(key.data)
                self._expire(time.monotonic())
        except Exception:  # a bug here must not take the port down silently
            logger.exception("megaserve: the HTTP listener thread failed")
        finally:
            self._close_listeners()
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self, listener: socket.socket) -> None:
        deadline = time.monotonic() + self._idle_timeout
        for _ in range(LISTEN_BACKLOG):  # whatever the kernel has queued, bounded
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: retried shortly
                logger.warning("megaserve: accept failed: %s", e)
                time.sleep(0.01)  # (the listener stays readable: do not spin on it)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, deadline)
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(MAX_HEAD_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset) the connection
            self._drop(conn)
            return
        probe = self._parse_probe(data)
        if probe is None:
            self._hand_off(conn)
            return
        head_len, keep_alive, request_id, head_only = probe
        try:
            conn.sock.recv(head_len)  # consume exactly the probe's head
            conn.sock.send(self._response(keep_alive, request_id, head_only))
        except OSError:  # gone already (or a full send buffer: a client not reading)
            self._drop(conn)
            return
        self.num_answered += 1
        if keep_alive:
            conn.deadline = time.monotonic() + self._idle_timeout
        else:
            self._drop(conn)

    def _parse_probe(self, data: bytes) -> tuple[int, bool, str | None, bool] | None:
        """``(head length, keep-alive, X-Request-Id, HEAD)`` if ``data`` starts with a
        complete health probe this thread answers; None for anything else."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return None
        lines = data[:end].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") \
                or not (parts[1] == _HEALTH_PATHS[0] or parts[1].startswith(_HEALTH_PATHS[1])) \
                or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
            return None
        keep_alive = parts[2] == b"HTTP/1.1"
        request_id = None
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                return None  # malformed: aiohttp answers it
            name, value = name.lower(), value.strip()
            if name in (b"content-length", b"transfer-encoding", b"expect", b"upgrade"):
                if name != b"content-length" or value != b"0":
                    return None  # a body or a protocol switch: the app's business
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                keep_alive = b"close" not in tokens and (keep_alive or b"keep-alive" in tokens)
            elif name == b"origin" and self._cors:
                return None
            elif name == b"x-request-id":
                request_id = value.decode("latin-1")[:256]
        return end + 4, keep_alive, request_id, parts[0] == b"HEAD"

    def _response(self, keep_alive: bool, request_id: str | None, head_only: bool) -> bytes:
        published = self._published
        health = published.health
        age = time.monotonic() - published.at
        if age > self._stale_after:
            health = Health("UNRESPONSIVE", False,
                            f"the server's event loop has not run for {age:.0f} s")
        body = {"status": health.state}
        if health.reason:
            body["reason"] = health.reason
        payload = json.dumps(body).encode()
        status = b"200 OK" if health.serving else b"503 Service Unavailable"
        headers = [b"HTTP/1.1 " + status,
                   b"Content-Type: application/json; charset=utf-8",
                   b"Content-Length: %d" % len(payload),
                   b"Connection: " + (b"keep-alive" if keep_alive else b"close")]
        if self._request_id_headers:
            rid = request_id or uuid.uuid4().hex
            headers.append(b"X-Request-Id: " + rid.encode("latin-1", "replace"))
        return b"\r\n".join(headers) + b"\r\n\r\n" + (b"" if head_only else payload)

    def _hand_off(self, conn: _Conn) -> None:
        self._selector.unregister(conn.sock)
        del self._conns[conn.sock.fileno()]
        try:
            self._loop.call_soon_threadsafe(self._adopt, conn.sock)
        except RuntimeError:  # the loop is closed: nobody can serve it
            conn.sock.close()

    def _drop(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline < now]:
            self._drop(conn)

    def _close_listeners(self) -> None:
        for sock in self._listeners:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
        self._listeners = []


def _bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address of ``host`` (as asyncio's create_server binds)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, type_, proto, _, address in dict.fromkeys(
                (i[0], i[1], i[2], i[3], i[4]) for i in infos):
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def publish_health(listener: HttpListener, health: Callable[[], Health],
                         every_s: float = PUBLISH_EVERY_S) -> None:
    """Publishes ``health()`` to ``listener`` every ``every_s`` seconds, forever (a task of
    the event loop: its publications are also the loop's heartbeat)."""
    while True:
        listener.publish(health())
        await asyncio.sleep(every_s)
