"""The M:N protocol's pure parts: configuration, credits, slot accounting, completions.

Every provider shares these; none of them touches a socket, a GPU or a verbs object, so
they are unit-tested on CPU and reused by the ``rdma`` mapping unchanged.

NOTE: the invariant that makes the protocol safe without retries. For each ordered pair
(sender s, receiver r) the receiver registers ``slots_per_peer`` slots of ``slot_bytes``
and the sender starts with exactly one credit per slot::

    sender s                                   receiver r (ring for s)
    CreditPool: free = {0,1,2,3}               SlotRing:  busy = {}
    acquire() -> 0 ── write slot 0 + imm ────▶ land(0)    busy = {0}   -> Completion
                                               release(0) busy = {}
    give(0)   ◀────────── credit(0) ──────────

A sender never writes a slot it holds no credit for, so a landed write never overwrites
data the receiver has not released; a sender with no credit blocks (bounded by
``timeout_s``) instead of retrying.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import CommTimeoutError, EndpointClosedError, PeerLostError, ProtocolError
from .imm import MAX_SLOT, decode_imm

MiB = 1 << 20


@dataclass(frozen=True)
class ChannelConfig:
    """Shape and timing of every (sender, receiver) channel of one endpoint.

    slot_bytes: capacity of one slot; a payload larger than this is refused (ValueError).
    slots_per_peer: ring depth per sender = credits a sender starts with (1..256).
    timeout_s: bound of every blocking wait (credit, poll); past it CommTimeoutError.
    connect_timeout_s: bound of connecting to / handshaking with a peer.
    """

    slot_bytes: int = 8 * MiB
    slots_per_peer: int = 4
    timeout_s: float = 30.0
    connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.slot_bytes, int) or not 1 <= self.slot_bytes <= (1 << 32) - 1:
            raise ValueError(f"slot_bytes={self.slot_bytes!r}: must be an int in 1..2**32-1")
        if not isinstance(self.slots_per_peer, int) or not 1 <= self.slots_per_peer <= MAX_SLOT + 1:
            raise ValueError(
                f"slots_per_peer={self.slots_per_peer!r}: must be in 1..{MAX_SLOT + 1} "
                "(the slot index has 8 bits in the immediate)"
            )
        for name in ("timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: must be a positive number of seconds")

    @property
    def ring_bytes(self) -> int:
        """Bytes of one sender's ring at the receiver."""
        return self.slot_bytes * self.slots_per_peer


class CreditPool:
    """Sender-side credits towards one receiver: one credit per free remote slot.

    Thread-safe. ``acquire`` blocks until a credit is back, the pool fails (the peer was
    lost) or the timeout passes.
    """

    def __init__(self, peer: int, num_slots: int) -> None:
        self.peer = peer
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: set[int] = set()
        self._cond = threading.Condition()
        self._failure: BaseException | None = None

    @property
    def available(self) -> int:
        """Credits in hand now."""
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float) -> int:
        """Take a credit and return its slot index.

        Raises the pool's failure (e.g. PeerLostError) if it failed, CommTimeoutError if no
        credit came back within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._free:
                if self._failure is not None:
                    raise self._failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(
                        f"no credit towards rank {self.peer} for {timeout:.3g}s: the receiver "
                        f"holds all {self.num_slots} slots unreleased (does it call release()?)"
                    )
                self._cond.wait(left)
            if self._failure is not None:
                raise self._failure
            slot = self._free.popleft()
            self._held.add(slot)
            return slot

    def give(self, slot: int) -> None:
        """A credit came back for ``slot``. ProtocolError if that slot was not in flight."""
        with self._cond:
            if slot not in self._held:
                raise ProtocolError(f"rank {self.peer} returned credit for slot {slot}, not in flight")
            self._held.discard(slot)
            self._free.append(slot)
            self._cond.notify()

    def undo(self, slot: int) -> None:
        """Return a credit taken by ``acquire`` whose write was never issued."""
        self.give(slot)

    def fail(self, error: BaseException) -> None:
        """Make every current and future ``acquire`` raise ``error`` (first failure wins)."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()


class SlotRing:
    """Receiver-side accounting of one sender's ring: which slots hold unreleased data."""

    def __init__(self, peer: int, num_slots: int, slot_bytes: int) -> None:
        self.peer = peer
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._busy: set[int] = set()
        self._lock = threading.Lock()

    def check_landing(self, slot: int, nbytes: int) -> None:
        """Validate a write before its bytes land; ProtocolError if it would corrupt data."""
        if not 0 <= slot < self.num_slots:
            raise ProtocolError(f"rank {self.peer} wrote slot {slot}; the ring has {self.num_slots}")
        if not 0 <= nbytes <= self.slot_bytes:
            raise ProtocolError(f"rank {self.peer} wrote {nbytes} bytes; slots hold {self.slot_bytes}")
        with self._lock:
            if slot in self._busy:
                raise ProtocolError(f"rank {self.peer} wrote slot {slot} before it was released")

    def land(self, slot: int, nbytes: int) -> None:
        """Mark ``slot`` as holding a completed write (after ``check_landing``)."""
        self.check_landing(slot, nbytes)
        with self._lock:
            self._busy.add(slot)

    def release(self, slot: int) -> None:
        """Free ``slot``; ProtocolError (a caller bug) if it was not holding data."""
        with self._lock:
            if slot not in self._busy:
                raise ProtocolError(f"slot {slot} of rank {self.peer} released twice or never landed")
            self._busy.discard(slot)

    @property
    def busy(self) -> int:
        with self._lock:
            return len(self._busy)


@dataclass(frozen=True)
class Completion:
    """One landed write, as the receiver sees it.

    src: sender rank. imm: the 32-bit immediate (see comm.imm). nbytes: payload length.
    data: view of the slot's first ``nbytes`` bytes — a ``memoryview`` for host providers, a
    ``[nbytes]`` uint8 CUDA tensor for ``cuda_ipc``. Valid only until ``release``.
    """

    src: int
    imm: int
    nbytes: int
    data: Any

    @property
    def layer(self) -> int:
        return decode_imm(self.imm).layer

    @property
    def microbatch(self) -> int:
        return decode_imm(self.imm).microbatch

    @property
    def slot(self) -> int:
        return decode_imm(self.imm).slot

    @property
    def tag(self) -> int:
        return decode_imm(self.imm).tag

    def numpy(self, dtype: Any = "uint8", shape: Sequence[int] | None = None) -> Any:
        """Zero-copy numpy view of the payload (host providers only); valid until release."""
        import numpy as np

        arr = np.frombuffer(self.data, dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    def tensor(self, dtype: Any = None, shape: Sequence[int] | None = None) -> Any:
        """Zero-copy torch view of the payload (CUDA for cuda_ipc, CPU otherwise).

        dtype: reinterpret the bytes (e.g. ``torch.bfloat16``); shape: reshape after that.
        Valid until release.
        """
        import torch

        if isinstance(self.data, torch.Tensor):
            t = self.data
        elif self.nbytes == 0:
            t = torch.empty(0, dtype=torch.uint8)
        else:
            t = torch.frombuffer(self.data, dtype=torch.uint8)
        if dtype is not None:
            t = t.view(dtype)
        return t if shape is None else t.reshape(shape)


class _Lost:
    __slots__ = ("peer", "detail")

    def __init__(self, peer: int, detail: str) -> None:
        self.peer, self.detail = peer, detail


_CLOSED = object()


class CompletionQueue:
    """Completions of one endpoint, in arrival order, with peer losses in-band.

    A loss is delivered after the completions that peer landed before it died, and stays
    sticky: every later ``get`` on an empty queue raises it again at once.
    """

    def __init__(self) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._lost: _Lost | None = None
        self._closed = False

    def put(self, completion: Completion) -> None:
        self._q.put(completion)

    def put_lost(self, peer: int, detail: str) -> None:
        self._q.put(_Lost(peer, detail))

    def close(self) -> None:
        self._closed = True
        self._q.put(_CLOSED)

    def get(self, timeout: float) -> Completion:
        """Next completion; PeerLostError, CommTimeoutError or EndpointClosedError otherwise."""
        try:
            item = self._q.get(block=self._lost is None, timeout=timeout)
        except queue.Empty:
            if self._lost is not None:
                raise PeerLostError(self._lost.peer, self._lost.detail) from None
            raise CommTimeoutError(f"no completion within {timeout:.3g}s") from None
        return self._unwrap(item)

    def get_nowait(self) -> Completion | None:
        """Next completion if one is queued, else None (a loss still raises)."""
        try:
            item = self._q.get_nowait()
        except queue.Empty:
            if self._lost is not None:
                raise PeerLostError(self._lost.peer, self._lost.detail) from None
            return None
        return self._unwrap(item)

    def _unwrap(self, item: Any) -> Completion:
        if item is _CLOSED:
            self._q.put(_CLOSED)  # wake the next waiter too
            raise EndpointClosedError("endpoint closed while polling")
        if isinstance(item, _Lost):
            if self._lost is None:
                self._lost = item
            raise PeerLostError(item.peer, item.detail)
        return item


def as_byte_views(payload: Any) -> list[memoryview]:
    """Flat byte views of a payload: bytes-like, numpy array, CPU torch tensor, or a
    list/tuple of those (sent back to back into one slot, no intermediate copy).

    Raises ValueError for anything else (e.g. a CUDA tensor on a host provider).
    """
    parts = payload if isinstance(payload, (list, tuple)) else (payload,)
    views = []
    for part in parts:
        views.append(_one_view(part))
    return views


def _one_view(part: Any) -> memoryview:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(part, torch.Tensor):
        if part.device.type != "cpu":
            raise ValueError(f"a {part.device} tensor cannot go over a host provider; use cuda_ipc")
        flat = part.detach().contiguous().reshape(-1)
        return memoryview(flat.view(torch.uint8).numpy()).cast("B")
    try:
        view = memoryview(part)
    except TypeError:
        raise ValueError(
            f"payload of type {type(part).__name__} is not bytes-like, numpy or a CPU tensor"
        ) from None
    if not view.contiguous:
        import numpy as np

        view = memoryview(np.ascontiguousarray(part))
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def total_bytes(views: Sequence[memoryview]) -> int:
    return sum(v.nbytes for v in views)
