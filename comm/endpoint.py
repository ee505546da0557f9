"""The endpoint every provider implements, and the provider registry.

An endpoint is one worker's view of the fabric: it is a receiver (it registers a slot
ring for every peer that connects to it and yields completions) and a sender (it holds
credits towards every peer it connected to). Providers fill in four hooks:
``_prepare`` (payload → what ``_write`` moves), ``_write`` (move bytes into the remote slot
and make the receiver post the completion), ``_return_credit`` and ``_shutdown``.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Iterable, Sequence

from .errors import EndpointClosedError
from .imm import encode_imm
from .protocol import ChannelConfig, Completion, CompletionQueue, CreditPool, SlotRing

log = logging.getLogger(__name__)

# module:class, the module relative to this package (comm never names where it is installed).
PROVIDERS: dict[str, str] = {
    "inproc": ".inproc:InprocEndpoint",
    "tcp": ".tcp:TcpEndpoint",
    "cuda_ipc": ".cuda_ipc:CudaIpcEndpoint",
    "rdma": ".rdma:RdmaEndpoint",
    "nccl": ".nccl:NcclEndpoint",
}


class Endpoint(ABC):
    """One worker's endpoint: send into peers' slots, poll and release its own.

    Lifecycle: construct (binds; ``address`` is then valid) → ``connect(addresses)`` →
    ``send`` / ``poll`` / ``release`` from any threads → ``close()`` (idempotent).
    """

    provider = "abstract"

    def __init__(self, rank: int, world_size: int, config: ChannelConfig | None = None) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: must be a positive int")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}: must be in 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.config = config or ChannelConfig()
        self._pools: dict[int, CreditPool] = {}  # dst -> credits towards dst
        self._remote_slot_bytes: dict[int, int] = {}  # dst -> its slot size for us
        self._rings: dict[int, SlotRing] = {}  # src -> accounting of src's ring here
        self._cq = CompletionQueue()
        self._closed = False
        self._close_lock = threading.Lock()

    # -- public API --------------------------------------------------------------------
    @property
    @abstractmethod
    def address(self) -> str:
        """Where peers reach this endpoint (e.g. ``"127.0.0.1:40123"``)."""

    @abstractmethod
    def connect(self, addresses: Sequence[str], send_to: Iterable[int] | None = None) -> None:
        """Open send channels to ``send_to`` (default: every other rank).

        ``addresses[r]`` is rank r's ``address``. Blocks until each receiver registered our
        ring and returned its credits; CommTimeoutError after ``connect_timeout_s``.
        """

    def send(self, dst: int, payload: Any, *, layer: int, microbatch: int, tag: int = 0,
             timeout: float | None = None) -> int:
        """Write ``payload`` into a free slot of ``dst`` with immediate (layer, microbatch, slot, tag).

        payload: bytes-like, numpy array, CPU tensor, or a list of those (concatenated in
        the slot); ``cuda_ipc`` takes CUDA tensors. Blocks while no credit is in hand.
        Returns the immediate sent. When it returns, the payload buffer may be reused.
        Raises ValueError (bad field, payload over the receiver's slot size, unknown dst),
        CommTimeoutError (no credit within ``timeout``, default ``config.timeout_s``),
        PeerLostError (``dst`` died), EndpointClosedError.
        """
        self._check_open()
        pool = self._pools.get(dst)
        if pool is None:
            raise ValueError(f"rank {dst} is not connected for sending: pass it to connect()")
        encode_imm(layer, microbatch, 0, tag)  # validate fields before taking a credit
        obj, nbytes = self._prepare(payload)
        limit = self._remote_slot_bytes[dst]
        if nbytes > limit:
            raise ValueError(f"payload of {nbytes} bytes exceeds rank {dst}'s slot size {limit}")
        slot = pool.acquire(self.config.timeout_s if timeout is None else timeout)
        imm = encode_imm(layer, microbatch, slot, tag)
        self._write(dst, slot, imm, obj, nbytes)
        return imm

    def poll(self, timeout: float | None = None) -> Completion:
        """Block for the next completion, in arrival order (not send order).

        Raises CommTimeoutError (none within ``timeout``, default ``config.timeout_s``),
        PeerLostError (a peer died; sticky), EndpointClosedError.
        """
        self._check_open()
        return self._cq.get(self.config.timeout_s if timeout is None else timeout)

    def try_poll(self) -> Completion | None:
        """A completion if one is ready, else None; never blocks."""
        self._check_open()
        return self._cq.get_nowait()

    def poll_many(self, count: int, timeout: float | None = None) -> list[Completion]:
        """``count`` completions (any sources, any order) within one overall ``timeout``.

        NOTE: nothing is released until all ``count`` arrived, so ``count`` must not exceed
        what the senders can have in flight (``slots_per_peer`` each) — e.g. one frame per
        peer per (layer, micro-batch) — or it ends in CommTimeoutError.
        """
        deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
        return [self.poll(max(0.0, deadline - time.monotonic())) for _ in range(count)]

    def release(self, completion: Completion) -> None:
        """Give the completion's slot back to its sender (returns one credit).

        The completion's ``data`` must not be used afterwards. ProtocolError if released twice.
        """
        ring = self._rings[completion.src]
        ring.release(completion.slot)
        self._return_credit(completion.src, completion.slot)

    def credits(self, dst: int) -> int:
        """Credits in hand towards ``dst`` (free slots at the receiver)."""
        return self._pools[dst].available

    def close(self) -> None:
        """Say goodbye to peers, stop threads, free slots. Idempotent; never raises."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._cq.close()
        try:
            self._shutdown()
        except Exception:  # noqa: BLE001 - close must not raise
            log.exception("rank %d: error while closing the %s endpoint", self.rank, self.provider)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_targets(self, addresses: Sequence[str], send_to: Iterable[int] | None) -> list[int]:
        """Check ``connect``'s arguments; returns the ranks to open send channels to."""
        self._check_open()
        if len(addresses) != self.world_size:
            raise ValueError(f"got {len(addresses)} addresses for world_size {self.world_size}")
        if send_to is None:
            return [r for r in range(self.world_size) if r != self.rank]
        return list(send_to)

    # -- provider hooks ----------------------------------------------------------------
    def _prepare(self, payload: Any) -> tuple[Any, int]:
        from .protocol import as_byte_views, total_bytes

        views = as_byte_views(payload)
        return views, total_bytes(views)

    @abstractmethod
    def _write(self, dst: int, slot: int, imm: int, obj: Any, nbytes: int) -> None: ...

    @abstractmethod
    def _return_credit(self, src: int, slot: int) -> None: ...

    @abstractmethod
    def _shutdown(self) -> None: ...

    def _check_open(self) -> None:
        if self._closed:
            raise EndpointClosedError(f"rank {self.rank}: endpoint is closed")


def create_endpoint(provider: str, rank: int, world_size: int,
                    config: ChannelConfig | None = None, **options: Any) -> Endpoint:
    """Construct the endpoint of ``provider`` (see ``PROVIDERS``).

    ``options`` go to the provider (e.g. ``host`` for tcp, ``device`` for cuda_ipc).
    Raises ValueError naming the valid providers if ``provider`` is unknown.
    """
    target = PROVIDERS.get(provider)
    if target is None:
        raise ValueError(f"unknown comm provider {provider!r}; valid: {sorted(PROVIDERS)}")
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name, __package__), cls_name)
    return cls(rank, world_size, config, **options)
