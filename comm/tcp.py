"""``tcp``: the protocol over sockets, for worker processes on one or several hosts.

Topology: every endpoint listens; ``connect`` dials one connection per receiver it sends
to. On that connection data goes sender → receiver and credits come back receiver →
sender, so each endpoint runs one reader thread per incoming connection (it lands each
payload *directly* in the registered slot with ``recv_into``, then posts the completion)
and one credit thread per outgoing connection.

Failure: a connection that ends without a BYE frame (process killed, reset, keepalive or
``TCP_USER_TIMEOUT`` expiry) makes the peer lost: pollers get PeerLostError, senders blocked
on its credits too. Subclasses (``cuda_ipc``, ``rdma``) reuse this control plane and replace
the data plane through ``_ring_storage`` / ``_attach`` / ``_write`` / ``_on_notify``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Iterable, Sequence

import numpy as np

from .endpoint import Endpoint
from .errors import CommTimeoutError, PeerLostError, ProtocolError
from .imm import slot_of
from .protocol import ChannelConfig, Completion, CreditPool, SlotRing
from .wire import HEADER, Hello, Kind, pack_header, unpack_header

log = logging.getLogger(__name__)


class ConnectionEnded(Exception):
    """The connection ended (the peer closed it, or this endpoint is closing). Raised by the
    receive paths of TcpEndpoint and of the providers built on it (cuda_ipc, nccl); the
    reader loops turn it into a lost peer."""


def _recv_exact_into(sock: socket.socket, view: memoryview, closing: threading.Event) -> None:
    while view.nbytes:
        try:
            n = sock.recv_into(view)
        except socket.timeout:
            if closing.is_set():
                raise ConnectionEnded("closing") from None
            continue
        if n == 0:
            raise ConnectionEnded("connection closed")
        view = view[n:]


def _recv_exact(sock: socket.socket, nbytes: int, closing: threading.Event) -> bytes:
    buf = bytearray(nbytes)
    _recv_exact_into(sock, memoryview(buf), closing)
    return bytes(buf)


def _send_all(sock: socket.socket, buffers: list[Any]) -> None:
    """sendmsg until every buffer went out (sendmsg may send a prefix)."""
    views = [memoryview(b).cast("B") for b in buffers if len(memoryview(b).cast("B"))]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` → (host, port); ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class InPeer:
    """A sender connected to us: its socket, its ring's storage and accounting. Providers
    built on TcpEndpoint receive it in their ``_register_sender`` / ``_on_notify`` hooks."""

    def __init__(self, src: int, sock: socket.socket, ring: SlotRing, storage: Any) -> None:
        self.src, self.sock, self.ring, self.storage = src, sock, ring, storage
        self.lock = threading.Lock()  # serialises credit frames
        self.said_bye = False


class OutPeer:
    """A receiver we connected to: socket, credits, its ring's description."""

    def __init__(self, dst: int, sock: socket.socket, pool: CreditPool, welcome: Hello) -> None:
        self.dst, self.sock, self.pool, self.welcome = dst, sock, pool, welcome
        self.lock = threading.Lock()  # serialises frames of concurrent senders
        self.said_bye = False
        self.remote: Any = None  # provider's attachment to the remote ring


class TcpEndpoint(Endpoint):
    """Endpoint of one worker process. Listens on ``host:port`` (port 0 = any free)."""

    provider = "tcp"

    def __init__(self, rank: int, world_size: int, config: ChannelConfig | None = None,
                 *, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(rank, world_size, config)
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.1)
        self._address = f"{host}:{self._listener.getsockname()[1]}"
        self._in: dict[int, InPeer] = {}
        self._out: dict[int, OutPeer] = {}
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._peers_lock = threading.Lock()
        self._spawn(self._accept_loop, "accept")

    @property
    def address(self) -> str:
        return self._address

    # -- sockets -----------------------------------------------------------------------
    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=f"comm-r{self.rank}-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = max(1, int(self.config.timeout_s / 3))
        for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", idle), ("TCP_KEEPCNT", 3),
                           ("TCP_USER_TIMEOUT", int(self.config.timeout_s * 1000))):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        sock.settimeout(self.config.timeout_s)

    def _read_frame(self, sock: socket.socket) -> tuple[Kind, int, int]:
        return unpack_header(_recv_exact(sock, HEADER.size, self._closing))

    # -- receiver side -----------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._tune(sock)
            self._spawn(self._serve_sender, "in", sock)

    def _serve_sender(self, sock: socket.socket) -> None:
        peer = None
        try:
            sock.settimeout(self.config.connect_timeout_s)
            kind, _, nbytes = self._read_frame(sock)
            if kind != Kind.HELLO:
                raise ProtocolError(f"expected HELLO, got {kind.name}")
            hello = Hello.unpack(_recv_exact(sock, nbytes, self._closing))
            peer = self._register_sender(hello, sock)
            sock.settimeout(self.config.timeout_s)
            self._reader_loop(peer)
        except (ConnectionEnded, OSError) as e:
            if peer is not None and not peer.said_bye and not self._closing.is_set():
                log.warning("rank %d: lost sender rank %d: %s", self.rank, peer.src, e)
                self._cq.put_lost(peer.src, f"its connection to rank {self.rank} broke ({e})")
        except ProtocolError as e:
            log.error("rank %d: protocol error from a sender: %s", self.rank, e)
            self._cq.put_lost(peer.src if peer else -1, f"protocol error: {e}")
        finally:
            sock.close()

    def _register_sender(self, hello: Hello, sock: socket.socket) -> InPeer:
        if hello.provider != self.provider or hello.world_size != self.world_size:
            raise ProtocolError(
                f"rank {hello.rank} speaks {hello.provider}/world {hello.world_size}, "
                f"this endpoint {self.provider}/world {self.world_size}"
            )
        cfg = self.config
        storage, extra = self._ring_storage(hello)
        peer = InPeer(hello.rank, sock, SlotRing(hello.rank, cfg.slots_per_peer, cfg.slot_bytes), storage)
        with self._peers_lock:
            if hello.rank in self._in:
                raise ProtocolError(f"rank {hello.rank} connected twice")
            self._in[hello.rank] = peer
            self._rings[hello.rank] = peer.ring
        welcome = Hello(self.rank, self.world_size, self.provider, cfg.slot_bytes, cfg.slots_per_peer, extra)
        body = welcome.pack()
        _send_all(sock, [pack_header(Kind.WELCOME, 0, len(body)), body])
        return peer

    def _ring_storage(self, hello: Hello) -> tuple[Any, bytes]:
        """Allocate the ring for ``hello.rank``; return (storage, WELCOME extra blob)."""
        buf = np.empty(self.config.ring_bytes, np.uint8)
        return memoryview(buf).cast("B"), b""

    def _reader_loop(self, peer: InPeer) -> None:
        sb = self.config.slot_bytes
        while True:
            kind, imm, nbytes = self._read_frame(peer.sock)
            if kind == Kind.BYE:
                peer.said_bye = True
                return
            slot = slot_of(imm)
            peer.ring.check_landing(slot, nbytes)
            if kind == Kind.DATA:
                view = peer.storage[slot * sb: slot * sb + nbytes]
                _recv_exact_into(peer.sock, view, self._closing)
            elif kind == Kind.NOTIFY:
                view = self._on_notify(peer, slot, nbytes)
            else:
                raise ProtocolError(f"unexpected {kind.name} frame from rank {peer.src}")
            peer.ring.land(slot, nbytes)
            self._cq.put(Completion(peer.src, imm, nbytes, view))

    def _on_notify(self, peer: InPeer, slot: int, nbytes: int) -> Any:
        raise ProtocolError("tcp carries payloads inline; NOTIFY is for cuda_ipc / rdma")

    def _return_credit(self, src: int, slot: int) -> None:
        peer = self._in[src]
        try:
            with peer.lock:
                _send_all(peer.sock, [pack_header(Kind.CREDIT, slot, 0)])
        except OSError as e:  # the sender is gone; its loss is reported by the reader
            log.debug("rank %d: credit to rank %d not delivered: %s", self.rank, src, e)

    # -- sender side -------------------------------------------------------------------
    def connect(self, addresses: Sequence[str], send_to: Iterable[int] | None = None) -> None:
        targets = self._send_targets(addresses, send_to)
        for dst in targets:
            if dst in self._out:
                continue
            self._connect_one(dst, addresses[dst])

    def _dial(self, dst: int, address: str) -> socket.socket:
        deadline = time.monotonic() + self.config.connect_timeout_s
        while True:
            try:
                return socket.create_connection(parse_address(address), timeout=1.0)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise CommTimeoutError(f"rank {self.rank}: cannot reach rank {dst} at {address}: {e}") from e
                time.sleep(0.05)

    def _connect_one(self, dst: int, address: str) -> None:
        sock = self._dial(dst, address)
        self._tune(sock)
        sock.settimeout(self.config.connect_timeout_s)
        try:
            body = Hello(self.rank, self.world_size, self.provider, extra=self._hello_extra(dst)).pack()
            _send_all(sock, [pack_header(Kind.HELLO, 0, len(body)), body])
            kind, _, nbytes = self._read_frame(sock)
            if kind != Kind.WELCOME:
                raise ProtocolError(f"rank {dst} answered {kind.name} to HELLO")
            welcome = Hello.unpack(_recv_exact(sock, nbytes, self._closing))
        except socket.timeout:
            sock.close()
            raise CommTimeoutError(f"rank {dst} at {address} did not complete the handshake") from None
        except (ConnectionEnded, OSError) as e:
            sock.close()
            raise PeerLostError(dst, f"handshake failed: {e}") from e
        if welcome.rank != dst:
            sock.close()
            raise ProtocolError(f"{address} is rank {welcome.rank}, expected rank {dst}: address list mismatch")
        sock.settimeout(self.config.timeout_s)
        peer = OutPeer(dst, sock, CreditPool(dst, welcome.slots_per_peer), welcome)
        peer.remote = self._attach(welcome)
        self._out[dst] = peer
        self._remote_slot_bytes[dst] = welcome.slot_bytes
        self._pools[dst] = peer.pool
        self._spawn(self._credit_loop, f"credit{dst}", peer)

    def _hello_extra(self, dst: int) -> bytes:
        return b""

    def _attach(self, welcome: Hello) -> Any:
        """Map the receiver's ring described by ``welcome.extra`` (nothing for tcp)."""
        return None

    def _credit_loop(self, peer: OutPeer) -> None:
        try:
            while True:
                kind, imm, _ = self._read_frame(peer.sock)
                if kind == Kind.CREDIT:
                    peer.pool.give(imm)
                elif kind == Kind.BYE:
                    peer.said_bye = True
                    peer.pool.fail(PeerLostError(peer.dst, "it closed its endpoint"))
                    return
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame on a credit channel")
        except (ConnectionEnded, OSError, ProtocolError) as e:
            err = PeerLostError(peer.dst, f"its connection from rank {self.rank} broke ({e})")
            peer.pool.fail(err)
            if not peer.said_bye and not self._closing.is_set():
                log.warning("rank %d: lost receiver rank %d: %s", self.rank, peer.dst, e)
                self._cq.put_lost(peer.dst, str(err))

    def _write(self, dst: int, slot: int, imm: int, obj: Any, nbytes: int) -> None:
        peer = self._out[dst]
        try:
            with peer.lock:
                _send_all(peer.sock, [pack_header(Kind.DATA, imm, nbytes), *obj])
        except socket.timeout:
            self._break(peer, "send timed out")
            raise CommTimeoutError(f"rank {dst} did not take {nbytes} bytes within {self.config.timeout_s}s") from None
        except OSError as e:
            self._break(peer, str(e))
            raise PeerLostError(dst, f"send failed ({e})") from e

    def _notify(self, peer: OutPeer, imm: int, nbytes: int) -> None:
        """Tell ``peer`` that slot data (moved out of band) is there: a NOTIFY frame.

        The caller holds ``peer.lock``. PeerLostError (and a broken channel) if it fails.
        """
        try:
            _send_all(peer.sock, [pack_header(Kind.NOTIFY, imm, nbytes)])
        except OSError as e:
            self._break(peer, str(e))
            raise PeerLostError(peer.dst, f"notify failed ({e})") from e

    def _break(self, peer: OutPeer, why: str) -> None:
        """A half-sent frame desynchronises the stream: the channel is dead from here on."""
        peer.pool.fail(PeerLostError(peer.dst, why))
        try:
            peer.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- teardown ----------------------------------------------------------------------
    def _shutdown(self) -> None:
        self._closing.set()
        bye = pack_header(Kind.BYE)
        for peer in list(self._out.values()) + list(self._in.values()):
            # a sender stuck mid-frame holds the lock: then skip the BYE (peer sees a loss)
            if peer.lock.acquire(timeout=0.5):
                try:
                    peer.sock.settimeout(0.5)
                    _send_all(peer.sock, [bye])
                except OSError:
                    pass
                finally:
                    peer.lock.release()
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for peer in self._out.values():
            peer.pool.fail(PeerLostError(peer.dst, "this endpoint is closed"))
        self._listener.close()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=2.0)
        for peer in self._out.values():
            peer.sock.close()
        self._release_storage()

    def _release_storage(self) -> None:
        """Free provider resources (IPC mappings, MRs) after threads stopped."""
