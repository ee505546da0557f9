"""The HTTP port's listener: ``/health`` answered by a small process of its own, every
other connection handed to the aiohttp app on the server's event loop.

Why: the event loop parses bodies, validates prompts and streams tokens, and it shares one
interpreter lock with the tokenizer threads. A storm of large requests keeps them busy,
and a health probe queued behind that work times out (a kubelet probe's default timeout is
1 s) although the server is fine. A thread of the server's process would still wait for
the interpreter lock at every system call (a switch interval, 5 ms, each time under
contention), so the listener is a process: it imports nothing but the standard library,
owns the listening sockets, and looks at the head of each connection's first request
without consuming it (``MSG_PEEK``)::

    accept (backlog LISTEN_BACKLOG) ──▶ peek the request head
        GET|HEAD /health, complete head, no body ──▶ answered here from the published
            health (keep-alive: the next request on the connection is peeked again)
        anything else (or a head not complete in the first segment) ──▶ the socket, its
            bytes unread, is passed (SCM_RIGHTS) to the server, whose event loop serves
            it with aiohttp's handler exactly as before, to the end of the connection

NOTE: what the listener answers is a *published* health: the event loop publishes one at
least every ``PUBLISH_EVERY_S`` (``publish_health``), so health keeps following the
server's state, and a loop that has not published for ``STALE_AFTER_S`` is reported as
503 ``UNRESPONSIVE``: a wedged loop still fails its probe, a busy one does not.

The listener exits when its channel to the server closes (the server stopped or died);
it ignores SIGINT and SIGTERM (the server drains, then closes the channel).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the listener process imports the standard library only)
    import asyncio
    from collections.abc import Callable

logger = logging.getLogger(__name__)

# Connections the kernel queues before accept(): a burst of 1,000 connections fits (the
# kernel caps it at net.core.somaxconn; aiohttp's default, 128, delayed a burst by the
# clients' 1 s SYN retries).
LISTEN_BACKLOG = 4096
# A request head longer than this goes to aiohttp (which refuses heads over 8 KiB).
MAX_HEAD_BYTES = 8192
PUBLISH_EVERY_S = 0.1
STALE_AFTER_S = 10.0
_MAX_MESSAGE = 4096  # a channel message (JSON) from the server, at most
_HEALTH_PATH = b"/health"


class HttpListener:
    """The server's handle on the listener process of ``host:port`` (every address
    ``host`` resolves to); see the module docstring.

    The sockets are bound here (OSError if a port cannot be bound), the process starts in
    ``start()``. ``adopt(sock)`` is called on ``loop`` with each connection that is not a
    health probe (its bytes unread). ``idle_timeout``: connections held by the listener
    (probes' keep-alive) that send nothing for that long are closed. A health published
    more than ``stale_after`` seconds ago is answered as 503 ``UNRESPONSIVE``.
    ``request_id_headers`` and ``cors``: the app's options, honoured by the listener (a
    probe with an ``Origin`` header goes to the app when CORS is configured).
    ``on_exit(reason)`` is called on the loop if the listener process exits before
    ``close()`` (the HTTP port is then closed).
    """

    def __init__(self, host: str, port: int, loop: asyncio.AbstractEventLoop,
                 adopt: Callable[[socket.socket], None], *,
                 idle_timeout: float = 5.0, request_id_headers: bool = False,
                 cors: bool = False, stale_after: float = STALE_AFTER_S,
                 on_exit: Callable[[str], None] | None = None) -> None:
        self._loop = loop
        self._adopt = adopt
        self._on_exit = on_exit
        self._listeners = _bind(host, port)
        self.port = self._listeners[0].getsockname()[1]  # the bound one (port 0: any free)
        self._chan, self._child_chan = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._options = {"idle_timeout": idle_timeout, "request_id_headers": request_id_headers,
                         "cors": cors, "stale_after": stale_after}
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Starts the listener process (it answers 503 LOADING until the first publish)."""
        listen_fds = [s.fileno() for s in self._listeners]
        config = {**self._options, "listen_fds": listen_fds,
                  "chan_fd": self._child_chan.fileno()}
        # -I -S: the standard library only (no site-packages, no environment): it starts
        # in tens of milliseconds and never imports torch.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(config)],
            pass_fds=(*listen_fds, self._child_chan.fileno()), stdin=subprocess.DEVNULL)
        for sock in self._listeners:  # the listener's now: the server never accepts
            sock.close()
        self._child_chan.close()
        self._chan.setblocking(False)
        self._loop.add_reader(self._chan.fileno(), self._receive)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def publish(self, health: Any) -> None:
        """The health probes get from now on (``state``, ``serving``, ``reason``), and a
        heartbeat of the event loop."""
        self._send({"health": [health.state, bool(health.serving), health.reason or ""],
                    "at": time.monotonic()})  # (one clock for every process of the host)

    def stop_accepting(self) -> None:
        """The listener closes its listening sockets: new connections are refused, the
        open ones stay."""
        self._send({"stop_accepting": True})

    def close(self, timeout: float = 2.0) -> None:
        """Closes the channel (the listener closes every socket it holds and exits) and
        waits up to ``timeout`` s for it (then kills it)."""
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._chan.fileno())
        self._chan.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _send(self, message: dict) -> None:
        try:
            self._chan.send(json.dumps(message).encode())
        except (BlockingIOError, InterruptedError):  # the listener is behind: next time
            pass
        except OSError:  # the listener is gone (logged where its channel ended)
            pass

    def _receive(self) -> None:
        """On the loop: the connections the listener handed over (their descriptors)."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._chan, 16, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:  # the listener exited
                self._loop.remove_reader(self._chan.fileno())
                reason = (f"the HTTP listener process exited (code "
                          f"{self._proc.poll() if self._proc else None}): the HTTP port is closed")
                logger.error("megaserve: %s", reason)
                if self._on_exit is not None:
                    self._on_exit(reason)
                return
            for fd in fds:
                self._adopt(socket.socket(fileno=fd))


async def publish_health(listener: HttpListener, health: Any,
                         every_s: float = PUBLISH_EVERY_S) -> None:
    """Publishes ``health()`` to ``listener`` every ``every_s`` seconds, forever (a task of
    the event loop: its publications are also the loop's heartbeat)."""
    import asyncio

    while True:
        listener.publish(health())
        await asyncio.sleep(every_s)


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


# -- the listener process -------------------------------------------------------------------


class _Conn:
    __slots__ = ("sock", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline  # monotonic: closed if no request head arrives before it


class _Listener:
    """The listener process's loop: accept, answer probes, hand the rest over."""

    def __init__(self, listeners: list[socket.socket], chan: socket.socket, *,
                 idle_timeout: float, request_id_headers: bool, cors: bool,
                 stale_after: float) -> None:
        self._listeners = listeners
        self._chan = chan
        self._idle_timeout = idle_timeout
        self._request_id_headers = request_id_headers
        self._cors = cors
        self._stale_after = stale_after
        self._health = ("LOADING", False, "")
        self._published_at = time.monotonic()
        self._conns: dict[int, _Conn] = {}
        self._next_expiry = 0.0
        self._handoffs: collections.deque[socket.socket] = collections.deque()
        self._selector = selectors.DefaultSelector()
        chan.setblocking(False)
        self._selector.register(chan, selectors.EVENT_READ, "chan")
        for sock in listeners:
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, "listen")

    def run(self) -> None:
        while True:
            # The server's messages first: a probe sent after a publish sees it.
            ready = sorted(self._selector.select(timeout=0.5), key=lambda e: e[0].data != "chan")
            for key, events in ready:
                if key.data == "listen":
                    self._accept(key.fileobj)
                elif key.data == "chan":
                    if events & selectors.EVENT_READ and not self._read_channel():
                        return
                    if events & selectors.EVENT_WRITE:
                        self._flush_handoffs()
                else:
                    self._on_readable(key.data)
            now = time.monotonic()
            if now >= self._next_expiry:  # (a pass over every connection: not per wake-up)
                self._expire(now)
                self._next_expiry = now + 0.25

    def _read_channel(self) -> bool:
        """Applies the server's messages; False once the channel is closed."""
        while True:
            try:
                data = self._chan.recv(_MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            if not data:
                return False
            message = json.loads(data)
            if "health" in message:
                self._health = tuple(message["health"])
                self._published_at = message["at"]
            if message.get("stop_accepting"):
                for sock in self._listeners:
                    self._selector.unregister(sock)
                    sock.close()
                self._listeners = []

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
            self._on_readable(conn)  # the head has usually arrived with the connection

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
        if keep_alive:
            conn.deadline = time.monotonic() + self._idle_timeout
        else:
            self._drop(conn)

    def _parse_probe(self, data: bytes) -> tuple[int, bool, str | None, bool] | None:
        """``(head length, keep-alive, X-Request-Id, HEAD)`` if ``data`` starts with a
        complete health probe this process answers; None for anything else."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return None
        lines = data[:end].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") \
                or parts[1].partition(b"?")[0] != _HEALTH_PATH \
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
        state, serving, reason = self._health
        age = time.monotonic() - self._published_at
        if age > self._stale_after:
            state, serving = "UNRESPONSIVE", False
            reason = f"the server's event loop has not run for {age:.0f} s"
        body = {"status": state}
        if reason:
            body["reason"] = reason
        payload = json.dumps(body).encode()
        status = b"200 OK" if serving else b"503 Service Unavailable"
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
        self._handoffs.append(conn.sock)
        self._flush_handoffs()

    def _flush_handoffs(self) -> None:
        """Passes queued connections to the server; waits for the channel when full."""
        while self._handoffs:
            sock = self._handoffs[0]
            try:
                socket.send_fds(self._chan, [b"c"], [sock.fileno()])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # the server is gone: nobody can serve it
                pass
            self._handoffs.popleft()
            sock.close()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._handoffs else 0)
        self._selector.modify(self._chan, events, "chan")

    def _drop(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline < now]:
            self._drop(conn)


def _main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains, then closes us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s megaserve-http: %(message)s")
    config = json.loads(argv[1])
    listeners = [socket.socket(fileno=fd) for fd in config.pop("listen_fds")]
    chan = socket.socket(fileno=config.pop("chan_fd"))
    _Listener(listeners, chan, **config).run()


if __name__ == "__main__":
    _main(sys.argv)
