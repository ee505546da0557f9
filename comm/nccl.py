"""``nccl``: the M:N protocol with torch.distributed P2P as the data plane.

NCCL on GPUs (``backend="nccl"``), gloo on CPU (``backend="gloo"``: the same code path,
so the whole runtime path is testable without a GPU). Control plane, credits, liveness and
failure handling are the tcp provider's (one tcp connection per (sender, receiver)); only
the payload bytes move over torch.distributed.

NOTE: one process group per DIRECTION. Torch's NCCL backend runs all P2P traffic of a
rank pair on one communicator and one stream, so a ``recv(A<-B)`` posted before a
``send(A->B)`` serialises the two directions and can deadlock a ping-pong. Here every
ordered pair (s -> r) gets its own two-member process group (s is group rank 0, r group
rank 1), hence its own NCCL communicator and stream::

    sender s                              receiver r (reader thread for s)
    credit(slot) ... acquire              ring[s] = slots_per_peer x slot_bytes (r's device)
    tcp  NOTIFY(imm, n) ───────────────▶  check slot free; post recv(ring[s][slot][:n])
    pg(s->r).send(staged payload) ═════▶  on pg(s->r)'s stream; wait until it completed
                                          -> Completion(s, imm, n, slot view)
    credit back   ◀──────── tcp CREDIT ─  release(completion)

The groups are built without the default process group: every receiver hosts a
``TCPStore`` and names it in its WELCOME; the two members of a direction meet there under
the prefix ``megaserve-comm/<s>-><r>``, so nothing is collective over all ranks and no
global ``init_process_group`` is needed (the caller may use its own).

The NOTIFY goes out *before* the payload send, under the per-receiver lock, so the
receiver posts its receives in the sender's send order and the lazy NCCL communicator
initialisation of the first send meets the receiver's first receive.

HAZARDS: (1) the receiver waits for a receive by polling its work (NCCL) or blocking on it
(gloo); a sender that dies between its NOTIFY and its send is noticed through the tcp
connection (EOF) within ~10 ms, or after ``timeout_s`` if it hangs. (2) A receive into a
released slot is ordered after the work already queued on the receiving thread's current
(default) stream; consumers reading slots on another stream must synchronise before
``release``. (3) ``send`` stages the payload (NCCL: a fresh device buffer from the caching
allocator, kept alive by the process group until its send completed; gloo: a reusable
host buffer per receiver, free again when the synchronous gloo send returns), so the caller
may reuse its buffer at once. NCCL sends complete asynchronously; ``close`` waits up to 2 s
for them so that peers' receives finish.
"""

from __future__ import annotations

import datetime
import logging
import select
import socket
import time
from collections import deque
from typing import Any

import numpy as np

from .errors import PeerLostError, ProtocolError
from .protocol import ChannelConfig, as_byte_views
from .tcp import ConnectionEnded, InPeer, TcpEndpoint, parse_address
from .wire import Hello

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
# Busy-poll a pending NCCL receive this long before backing off to short sleeps.
_SPIN_S = 200e-6
_MAX_SLEEP_S = 1e-3
_LIVENESS_EVERY_S = 0.01
_DRAIN_S = 2.0


def _peer_closed(sock: socket.socket) -> bool:
    """True if the tcp connection ended (EOF or error); never blocks, consumes nothing."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


class NcclEndpoint(TcpEndpoint):
    """Endpoint of one worker process over torch.distributed P2P.

    backend: "nccl" (``device`` a CUDA device; payloads are tensors on any device, slots
    are CUDA memory and ``Completion.data`` a ``[nbytes]`` uint8 CUDA tensor) or "gloo"
    (CPU; payloads as for tcp, ``Completion.data`` a memoryview). Default: "nccl" when
    ``device`` is CUDA (or None with CUDA available), else "gloo".
    """

    provider = "nccl"

    def __init__(self, rank: int, world_size: int, config: ChannelConfig | None = None, *,
                 backend: str | None = None, device: Any = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            raise ValueError("the nccl provider needs torch.distributed; use tcp")
        if backend is None:
            cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
            backend = "nccl" if cuda else "gloo"
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: use one of {list(BACKENDS)}")
        dev = torch.device(device if device is not None else ("cuda" if backend == "nccl" else "cpu"))
        if backend == "nccl" and (dev.type != "cuda" or not torch.cuda.is_available()):
            raise ValueError(f"backend 'nccl' needs a CUDA device (got {dev}); use backend='gloo' on CPU")
        if backend == "gloo" and dev.type != "cpu":
            raise ValueError(f"backend 'gloo' moves host memory (got device {dev}); use backend='nccl'")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        cfg = config or ChannelConfig()
        self._torch, self._dist = torch, dist
        self.backend, self.device = backend, dev
        self._timeout = datetime.timedelta(seconds=cfg.timeout_s)
        # The store the senders' direction groups meet at (one per receiving endpoint).
        self._store_host = host
        self._store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=cfg.connect_timeout_s),
                                    wait_for_workers=False)
        self._in_groups: dict[int, Any] = {}  # src -> pg(src -> self)
        self._pending: dict[int, deque] = {}  # dst -> NCCL send works not yet seen complete
        self._staging: dict[int, Any] = {}  # dst -> gloo host staging buffer
        super().__init__(rank, world_size, cfg, host=host, port=port)

    # -- direction groups ---------------------------------------------------------------
    def _make_group(self, src: int, dst: int, store: Any) -> Any:
        """The two-member process group of direction src -> dst (src is group rank 0)."""
        dist = self._dist
        prefixed = dist.PrefixStore(f"megaserve-comm/{src}->{dst}", store)
        me = 0 if self.rank == src else 1
        try:
            if self.backend == "gloo":
                return dist.ProcessGroupGloo(prefixed, me, 2, self._timeout)
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = self._timeout
            return dist.ProcessGroupNCCL(prefixed, me, 2, options)
        except RuntimeError as e:
            peer = dst if self.rank == src else src
            raise ProtocolError(f"rank {self.rank}: no {self.backend} group with rank {peer} ({e})") from e

    def _ring_storage(self, hello: Hello) -> tuple[Any, bytes]:
        torch = self._torch
        ring = torch.empty(self.config.ring_bytes, dtype=torch.uint8, device=self.device)
        host_view = memoryview(ring.numpy()).cast("B") if self.device.type == "cpu" else None
        return (ring, host_view), f"{self._store_host}:{self._store.port}".encode()

    def _register_sender(self, hello: Hello, sock: socket.socket) -> InPeer:
        peer = super()._register_sender(hello, sock)  # WELCOME is out: the sender joins now
        self._in_groups[hello.rank] = self._make_group(hello.rank, self.rank, self._store)
        return peer

    def _attach(self, welcome: Hello) -> Any:
        host, port = parse_address(welcome.extra.decode())
        try:
            store = self._dist.TCPStore(host, port, None, False,
                                        datetime.timedelta(seconds=self.config.connect_timeout_s))
        except RuntimeError as e:
            raise PeerLostError(welcome.rank, f"its group store {host}:{port} is unreachable ({e})") from e
        self._pending[welcome.rank] = deque()
        return self._make_group(self.rank, welcome.rank, store)

    # -- data plane ---------------------------------------------------------------------
    def _prepare(self, payload: Any) -> tuple[Any, int]:
        """NCCL: stage the parts back to back in a fresh device buffer (caching allocator;
        the process group keeps it alive until its send completed). gloo: byte views, copied
        into the per-receiver staging buffer under the send lock by ``_write``."""
        torch = self._torch
        if self.backend == "gloo":
            views = as_byte_views(payload)
            return views, sum(v.nbytes for v in views)
        parts = payload if isinstance(payload, (list, tuple)) else [payload]
        flats = []
        for part in parts:
            if isinstance(part, torch.Tensor):
                flats.append(part.detach().contiguous().reshape(-1).view(torch.uint8))
            else:
                flats += [torch.from_numpy(np.frombuffer(v, np.uint8).copy()) for v in as_byte_views(part)]
        nbytes = sum(int(f.numel()) for f in flats)
        staged = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        offset = 0
        for f in flats:
            n = int(f.numel())
            if f.device.type == "cpu" and n:
                # Through pinned memory, so the host never waits for the stream (a pageable
                # copy would); the caching host allocator keeps the block until the copy ran.
                f = torch.empty(n, dtype=torch.uint8, pin_memory=True).copy_(f)
            staged[offset:offset + n].copy_(f, non_blocking=True)
            offset += n
        return staged, nbytes

    def _gloo_stage(self, dst: int, views: list[memoryview], nbytes: int) -> Any:
        """Copy ``views`` into ``dst``'s reusable host staging buffer (caller holds the lock;
        gloo sends complete before the lock is released, so the buffer is free again)."""
        buf = self._staging.get(dst)
        if buf is None or buf.numel() < nbytes:
            buf = self._torch.empty(nbytes, dtype=self._torch.uint8)
            self._staging[dst] = buf
        flat = buf.numpy()
        offset = 0
        for v in views:
            flat[offset:offset + v.nbytes] = np.frombuffer(v, np.uint8)
            offset += v.nbytes
        return buf[:nbytes]

    def _write(self, dst: int, slot: int, imm: int, obj: Any, nbytes: int) -> None:
        peer = self._out[dst]
        with peer.lock:
            self._notify(peer, imm, nbytes)
            if not nbytes:
                return
            try:
                if self.backend == "gloo":
                    # gloo sends only progress on wait(); the receiver is posting its receive.
                    peer.remote.send([self._gloo_stage(dst, obj, nbytes)], 1, 0).wait()
                    return
                work = peer.remote.send([obj], 1, 0)
                pending = self._pending[dst]
                while pending and pending[0].is_completed():
                    pending.popleft()
                pending.append(work)
            except RuntimeError as e:
                self._break(peer, str(e))
                raise PeerLostError(dst, f"{self.backend} send failed ({e})") from e

    def _on_notify(self, peer: InPeer, slot: int, nbytes: int) -> Any:
        ring, host_view = peer.storage
        start = slot * self.config.slot_bytes
        if nbytes:
            try:
                work = self._in_groups[peer.src].recv([ring[start:start + nbytes]], 0, 0)
                if self.backend == "gloo":
                    work.wait()
                else:
                    self._wait_nccl(work, peer)
            except RuntimeError as e:
                raise ConnectionEnded(f"{self.backend} receive failed ({e})") from e
        if host_view is not None:
            return host_view[start:start + nbytes]
        return ring[start:start + nbytes]

    def _wait_nccl(self, work: Any, peer: InPeer) -> None:
        """Poll a receive until it completed; ConnectionEnded if the sender is gone or silent."""
        begin = time.monotonic()
        deadline = begin + self.config.timeout_s
        next_check = begin + _LIVENESS_EVERY_S
        sleep = 0.0
        while not work.is_completed():
            now = time.monotonic()
            if self._closing.is_set():
                raise ConnectionEnded("closing")
            if now >= next_check:
                if _peer_closed(peer.sock):
                    raise ConnectionEnded("connection closed while its payload was in flight")
                next_check = now + _LIVENESS_EVERY_S
            if now >= deadline:
                raise ConnectionEnded(f"no payload within {self.config.timeout_s:.3g}s after its notification")
            if now - begin > _SPIN_S:
                sleep = min(_MAX_SLEEP_S, max(20e-6, sleep * 2))
            time.sleep(sleep)
        work.wait()  # raises if the receive failed (a completed work may carry an error)

    # -- teardown -----------------------------------------------------------------------
    def _shutdown(self) -> None:
        deadline = time.monotonic() + _DRAIN_S
        for pending in self._pending.values():  # let peers' receives finish first
            while pending and time.monotonic() < deadline:
                if pending[0].is_completed():
                    pending.popleft()
                else:
                    time.sleep(1e-4)
        super()._shutdown()

    def _release_storage(self) -> None:
        groups = list(self._in_groups.values()) + [p.remote for p in self._out.values() if p.remote is not None]
        for pg in groups:
            for name in ("abort", "shutdown"):
                stop = getattr(pg, name, None)
                if stop is not None:
                    try:
                        stop()
                    except RuntimeError as e:  # already torn down by a peer's failure
                        log.debug("rank %d: %s.%s(): %s", self.rank, type(pg).__name__, name, e)
                    break
        for peer in self._out.values():
            peer.remote = None
        self._in_groups.clear()
        self._pending.clear()
        self._staging.clear()
