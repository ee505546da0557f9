"""``inproc``: endpoints that are threads of one process.

A write copies the payload straight into the receiver's registered slot (the one copy an
RDMA NIC would make) and posts the completion on the receiver's queue; a release hands the
credit straight back to the sender's pool. Addresses are ``inproc://<fabric>/<rank>`` and
resolve through a process-wide table of live endpoints.

Failure model: threads cannot be killed, so a peer is "lost" only when it closes: senders
blocked on its credits get PeerLostError at once.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from .endpoint import Endpoint
from .errors import PeerLostError
from .protocol import ChannelConfig, Completion, CreditPool, SlotRing

_LIVE: "weakref.WeakValueDictionary[str, InprocEndpoint]" = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()
_FABRIC_IDS = itertools.count()


class InprocEndpoint(Endpoint):
    """Endpoint for one worker thread.

    ``fabric`` only makes the address unique (default: a fresh name per endpoint); peers
    find each other through the addresses they report, as with every provider.
    """

    provider = "inproc"

    def __init__(self, rank: int, world_size: int, config: ChannelConfig | None = None,
                 *, fabric: str | None = None) -> None:
        super().__init__(rank, world_size, config)
        fabric = fabric or f"f{next(_FABRIC_IDS)}"
        self._address = f"inproc://{fabric}/{rank}"
        self._buffers: dict[int, memoryview] = {}  # src -> its ring's bytes here
        self._senders: dict[int, InprocEndpoint] = {}
        self._receivers: dict[int, InprocEndpoint] = {}
        self._lock = threading.Lock()
        with _LIVE_LOCK:
            if self._address in _LIVE:
                raise ValueError(f"{self._address} is already in use; pick another fabric name")
            _LIVE[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    def connect(self, addresses: Sequence[str], send_to: Iterable[int] | None = None) -> None:
        targets = self._send_targets(addresses, send_to)
        for dst in targets:
            with _LIVE_LOCK:
                peer = _LIVE.get(addresses[dst])
            if peer is None or peer.closed:
                raise PeerLostError(dst, f"no live inproc endpoint at {addresses[dst]}")
            self._pools[dst] = CreditPool(dst, peer.config.slots_per_peer)
            self._remote_slot_bytes[dst] = peer.config.slot_bytes
            self._receivers[dst] = peer
            peer._register_sender(self)

    def _register_sender(self, sender: "InprocEndpoint") -> None:
        cfg = self.config
        with self._lock:
            if sender.rank in self._buffers:
                raise ValueError(f"rank {sender.rank} connected twice to rank {self.rank}")
            self._buffers[sender.rank] = memoryview(np.empty(cfg.ring_bytes, np.uint8)).cast("B")
            self._rings[sender.rank] = SlotRing(sender.rank, cfg.slots_per_peer, cfg.slot_bytes)
            self._senders[sender.rank] = sender

    def _write(self, dst: int, slot: int, imm: int, obj: Any, nbytes: int) -> None:
        peer = self._receivers[dst]
        if peer.closed:
            self._pools[dst].fail(PeerLostError(dst, "it closed its endpoint"))
            raise PeerLostError(dst, "it closed its endpoint")
        peer._land(self.rank, slot, imm, obj, nbytes)

    def _land(self, src: int, slot: int, imm: int, views: list[memoryview], nbytes: int) -> None:
        ring, sb = self._rings[src], self.config.slot_bytes
        ring.check_landing(slot, nbytes)
        base = slot * sb
        dest = self._buffers[src]
        for view in views:
            dest[base:base + view.nbytes] = view
            base += view.nbytes
        ring.land(slot, nbytes)
        self._cq.put(Completion(src, imm, nbytes, dest[slot * sb: slot * sb + nbytes]))

    def _return_credit(self, src: int, slot: int) -> None:
        sender = self._senders[src]
        pool = sender._pools.get(self.rank)
        if pool is not None and not sender.closed:
            pool.give(slot)

    def _shutdown(self) -> None:
        for src, sender in list(self._senders.items()):
            pool = sender._pools.get(self.rank)
            if pool is not None:
                pool.fail(PeerLostError(self.rank, "it closed its endpoint"))
        with _LIVE_LOCK:
            if _LIVE.get(self._address) is self:
                del _LIVE[self._address]
        self._buffers.clear()
