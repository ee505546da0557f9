"""Address exchange for W workers: a tiny TCP rendezvous server and its client.

The launcher runs a :class:`RendezvousServer` (one thread) and passes its address to every
worker; each worker binds its endpoint (port 0), then calls :func:`exchange` with its own
address and gets every rank's address back, in rank order::

    server = RendezvousServer(world_size=4)          # launcher
    ... start workers with server.address ...
    addresses = exchange(server.address, rank, 4, endpoint.address)   # each worker
    endpoint.connect(addresses)

Wire format: one JSON line per direction (``{"rank": r, "address": "h:p"}`` in, the list of
addresses out). A duplicate rank or a worker that never shows up is an error, not a hang.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

from .errors import CommTimeoutError, ProtocolError

log = logging.getLogger(__name__)


class RendezvousServer:
    """Collects ``world_size`` (rank, address) pairs, then answers each with the full list.

    Serves one round and stops. ``close()`` is idempotent.
    """

    def __init__(self, world_size: int, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        self.world_size = world_size
        self._timeout_s = timeout_s
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.1)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._serve, name="comm-rendezvous", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conns: dict[int, socket.socket] = {}
        addresses: dict[int, str] = {}
        deadline = time.monotonic() + self._timeout_s
        try:
            while len(conns) < self.world_size and not self._stop.is_set():
                if time.monotonic() > deadline:
                    self.error = f"only ranks {sorted(conns)} of {self.world_size} registered"
                    log.error("rendezvous: %s", self.error)
                    return
                try:
                    conn, _ = self._sock.accept()
                except socket.timeout:
                    continue
                conn.settimeout(self._timeout_s)
                try:
                    msg = json.loads(conn.makefile("r").readline())
                    rank, address = int(msg["rank"]), str(msg["address"])
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("rendezvous: dropped a malformed registration: %s", e)
                    conn.close()
                    continue
                if rank in conns or not 0 <= rank < self.world_size:
                    self.error = f"bad or duplicate rank {rank}"
                    conn.sendall(json.dumps({"error": self.error}).encode() + b"\n")
                    conn.close()
                    continue
                conns[rank], addresses[rank] = conn, address
            if len(conns) == self.world_size:
                reply = json.dumps({"addresses": [addresses[r] for r in range(self.world_size)]})
                for conn in conns.values():
                    try:
                        conn.sendall(reply.encode() + b"\n")
                    except OSError as e:
                        log.warning("rendezvous: a worker left before the reply: %s", e)
        finally:
            for conn in conns.values():
                conn.close()
            self._sock.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


def exchange(server_address: str, rank: int, world_size: int, address: str,
             timeout_s: float = 60.0) -> list[str]:
    """Register ``address`` as ``rank`` and return all ``world_size`` addresses in rank order.

    Raises CommTimeoutError if the server or some rank does not answer within ``timeout_s``,
    ProtocolError if the server rejects the rank.
    """
    from .tcp import parse_address

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(parse_address(server_address), timeout=1.0)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"rendezvous server {server_address} unreachable: {e}") from e
            time.sleep(0.05)
    with sock:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.sendall(json.dumps({"rank": rank, "address": address}).encode() + b"\n")
        try:
            line = sock.makefile("r").readline()
        except socket.timeout:
            raise CommTimeoutError(f"rendezvous: not every one of {world_size} ranks arrived in {timeout_s}s") from None
    if not line:
        raise CommTimeoutError("rendezvous server closed before every rank arrived")
    reply = json.loads(line)
    if "error" in reply:
        raise ProtocolError(f"rendezvous refused rank {rank}: {reply['error']}")
    addresses = list(reply["addresses"])
    if len(addresses) != world_size:
        raise ProtocolError(f"rendezvous returned {len(addresses)} addresses, expected {world_size}")
    return addresses
