"""Host-proxied links of the device data plane: tcp and rdma between hosts.

MegaScale-Infer's scheme. Each direction of a link has *mailboxes* (one per slot: a
(replica, micro-batch) pair): a region of pinned host memory (a header with the row count,
then sections of rows) and one int32 flag word, also in pinned host memory, which a GPU
stream reaches by its host address (mapped: unified addressing)::

    sender stream       put(): count and the first `rows` rows of each section into its
                        outgoing mailbox (copies to host), then SET the mailbox's flag
    Proxy thread        sees the flag, CLEARs it, sends the header and the `count` rows
                        that are in use (Endpoint.send: a tcp frame, an RDMA write with
                        immediate) to the receiver's mailbox of the same slot
    Completion thread   polls the endpoint, lands the frame in that incoming mailbox,
                        SETs its flag
    receiver stream     take(): waits for the flag (cuStreamWaitValue32 on host memory),
                        CLEARs it, copies the count and the rows to its device buffers

Host threads poll flags; streams wait on them; neither waits for the other's work. On
CPU the "stream" is the calling thread and its waits poll the same words, so the tests
run this exact protocol, over real sockets between real processes, without a GPU.

``nccl`` (two-sided, device to device) uses the same threads with *fixed-size* frames:
the mailboxes live in device memory (flags stay in pinned host memory) and the proxy
never reads the device-side count. Instead ``put`` also writes the tick's *static* row
count (the graph's rows, a constant captured with it) into a host word beside the flag,
and the proxy sends the header and that many rows of each section: the same size for
every tick of a step on every rank, whatever the routing. The completion thread copies
the frame into the mailbox and synchronises that copy before it raises the flag. The
provider's per-direction process groups keep both directions of a ping-pong apart
(docs/comm.md), so m > 1 cannot deadlock. On CPU its gloo backend runs the same path over
host memory.

One mailbox per slot is enough for the data plane's order: a slot is sent again only
after the answer to its previous use came back, which the receiver sends only after it
has copied the previous contents out (``take`` precedes the work that produces the
answer on the receiver's stream).

Shape legend: C = rows a mailbox holds, n = mailboxes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import stream_flags as sf
from .errors import CommError, CommTimeoutError, EndpointClosedError

log = logging.getLogger(__name__)

HEADER_BYTES = 64  # int32 row count, then padding (keeps sections 64-byte aligned)
_FLAG_STRIDE = 16  # int32 words between flags: one 64-byte line each


@dataclass(frozen=True)
class Section:
    """Rows of one kind in a mailbox: each row ``shape`` x ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class MailboxLayout:
    """A header and ``sections`` of ``capacity`` rows each."""

    capacity: int
    sections: tuple[Section, ...]

    def offsets(self) -> list[int]:
        out, offset = [], HEADER_BYTES
        for section in self.sections:
            out.append(offset)
            offset += -(-section.row_bytes * self.capacity // 64) * 64
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of one mailbox, a multiple of 64 (the next one's views stay aligned)."""
        last = self.sections[-1]
        return -(-(self.offsets()[-1] + last.row_bytes * self.capacity) // 64) * 64

    def payload_bytes(self, count: int) -> int:
        return HEADER_BYTES + count * sum(s.row_bytes for s in self.sections)


class Mailboxes:
    """``n`` mailboxes of one layout, and their flags. The data is in pinned host memory
    (pageable on a CPU-only machine), or on ``device`` (fixed-size frames: nccl); the
    flags, and each mailbox's fixed frame size in rows, are always in host memory."""

    def __init__(self, layout: MailboxLayout, n: int, device: Any = "cpu") -> None:
        pin = torch.cuda.is_available()
        self.layout = layout
        self.n = n
        self.device = torch.device(device)
        on_host = self.device.type == "cpu"
        self.data = torch.zeros(n, layout.nbytes, dtype=torch.uint8, device=self.device,
                                pin_memory=pin and on_host)
        self.flag_words = torch.zeros(n * _FLAG_STRIDE, dtype=torch.int32, pin_memory=pin)
        self._flags_np = self.flag_words.numpy()
        self._data_np = self.data.numpy() if on_host else None
        self._offsets = layout.offsets()

    def flag(self, i: int) -> torch.Tensor:
        """Mailbox ``i``'s flag: a one-element int32 view (what stream_flags takes)."""
        return self.flag_words[i * _FLAG_STRIDE: i * _FLAG_STRIDE + 1]

    def flag_value(self, i: int) -> int:
        return int(self._flags_np[i * _FLAG_STRIDE])

    def rows_word(self, i: int) -> torch.Tensor:
        """Mailbox ``i``'s frame size in rows (fixed-size frames): the word after its flag."""
        return self.flag_words[i * _FLAG_STRIDE + 1: i * _FLAG_STRIDE + 2]

    def rows_value(self, i: int) -> int:
        return int(self._flags_np[i * _FLAG_STRIDE + 1])

    def set_rows(self, i: int, rows: int) -> None:
        self._flags_np[i * _FLAG_STRIDE + 1] = rows

    def set_flag(self, i: int, value: int) -> None:
        self._flags_np[i * _FLAG_STRIDE] = value

    def count(self, i: int) -> torch.Tensor:
        """Mailbox ``i``'s row count: a one-element int32 view."""
        return self.data[i, :4].view(torch.int32)

    def section(self, i: int, j: int) -> torch.Tensor:
        """Section ``j`` of mailbox ``i``: `[C, *shape]`."""
        s, c = self.layout.sections[j], self.layout.capacity
        start = self._offsets[j]
        return self.data[i, start: start + s.row_bytes * c].view(s.dtype).view(c, *s.shape)

    def count_value(self, i: int) -> int:
        """Mailbox ``i``'s row count, read on the host (mailboxes in host memory only)."""
        count = int(self._data_np[i, :4].view("int32")[0])
        if not 0 <= count <= self.layout.capacity:
            raise CommError(f"mailbox {i}: row count {count} outside 0..{self.layout.capacity}")
        return count

    def frame(self, i: int, rows: int) -> list[torch.Tensor]:
        """What the proxy sends for mailbox ``i``: the header, then the first ``rows`` rows
        of each section (views of the mailbox on its device; the endpoint concatenates
        them). ``rows``: the count (host mailboxes), or the size ``put`` noted (fixed)."""
        if not 0 <= rows <= self.layout.capacity:
            raise CommError(f"mailbox {i}: a frame of {rows} rows outside "
                            f"0..{self.layout.capacity}")
        parts = [self.data[i, :HEADER_BYTES]]
        for s, start in zip(self.layout.sections, self._offsets):
            parts.append(self.data[i, start: start + rows * s.row_bytes])
        return parts

    def land(self, i: int, frame: torch.Tensor) -> int:
        """Copy a received frame into mailbox ``i`` (the completion thread); returns its
        rows, which follow from its size. On a GPU the copy is finished when this returns
        (the flag may be raised next)."""
        frame = frame.reshape(-1)
        per_row = sum(s.row_bytes for s in self.layout.sections)
        rows, rest = divmod(frame.numel() - HEADER_BYTES, per_row)
        if rest or not 0 <= rows <= self.layout.capacity:
            raise CommError(f"mailbox {i}: a frame of {frame.numel()} bytes does not hold "
                            f"whole rows of this layout")
        gpu = self.device.type == "cuda"
        self.data[i, :HEADER_BYTES].copy_(frame[:HEADER_BYTES], non_blocking=gpu)
        offset = HEADER_BYTES
        for s, start in zip(self.layout.sections, self._offsets):
            size = rows * s.row_bytes
            self.data[i, start: start + size].copy_(frame[offset: offset + size],
                                                    non_blocking=gpu)
            offset += size
        if gpu:
            torch.cuda.current_stream(self.device).synchronize()
        return rows


def _on_gpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def put(box: Mailboxes, i: int, count: torch.Tensor, sections: list[torch.Tensor],
        rows: int) -> None:
    """The sender's half, on the current stream: copy ``count`` (`[1]` int32) and the first
    ``rows`` rows of each section (each `[>= rows, *shape]`) into mailbox ``i``, note
    ``rows`` (a fixed-size frame's size), then SET its flag. On the GPU this is queued (no
    host wait), so it can be captured in a graph (``rows`` is then the graph's constant)."""
    gpu = _on_gpu(count)
    box.count(i).copy_(count.reshape(1), non_blocking=gpu)
    for j, src in enumerate(sections):
        box.section(i, j)[:rows].copy_(src[:rows], non_blocking=gpu)
    if gpu:
        sf.write(box.rows_word(i), rows)
        sf.write(box.flag(i), sf.SET)
    else:
        box.set_rows(i, rows)
        box.set_flag(i, sf.SET)


def take(box: Mailboxes, i: int, count: torch.Tensor, sections: list[torch.Tensor],
         rows: int, timeout_s: float = 60.0, host_wait: bool = False) -> None:
    """The receiver's half, on the current stream: wait for mailbox ``i``'s flag, CLEAR
    it, copy the count and the first ``rows`` rows of each section out (rows past the
    count hold stale bytes: the count masks them). On the GPU the wait is the stream's
    (queued; a watchdog must release it, see megaserve.runtime.device_plane) unless
    ``host_wait``; on the CPU, or with ``host_wait``, the calling thread polls, up to
    ``timeout_s`` (CommTimeoutError), and the copies are queued after the frame is in.

    NOTE: ``host_wait`` is for steps that are not captured (eager). A stream blocked on a
    flag that a host thread raises deadlocks as soon as this process loads a kernel module
    (a first launch, a Triton compile: the load waits for every stream of the context)
    while that thread needs the driver itself, as the nccl relay's threads do (sends,
    receives, copies); eager steps launch such kernels, replayed graphs do not."""
    gpu = _on_gpu(count)
    if gpu and not host_wait:
        sf.wait_and_clear(box.flag(i))
    else:
        deadline = time.monotonic() + timeout_s
        while box.flag_value(i) < sf.SET:
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"mailbox {i}: nothing arrived within {timeout_s:.0f}s")
            time.sleep(20e-6)
        box.set_flag(i, sf.CLEAR)
    count.reshape(1).copy_(box.count(i), non_blocking=gpu)
    for j, dst in enumerate(sections):
        dst[:rows].copy_(box.section(i, j)[:rows], non_blocking=gpu)


@dataclass(frozen=True)
class Route:
    """Outgoing mailbox ``local`` goes to rank ``dst``'s incoming mailbox ``remote``."""

    local: int
    dst: int
    remote: int


class Relay:
    """The host's share of a host-proxied link: one proxy thread (outgoing mailboxes →
    ``endpoint.send``) and one completion thread (``endpoint.poll`` → incoming mailboxes).

    ``outgoing``: mailboxes the streams fill, with a :class:`Route` each; ``incoming``: the
    mailboxes frames land in, by the frame's mailbox id (the immediate's layer field).
    ``fixed_size``: frames of the rows ``put`` noted, not of the count (default: for the
    nccl provider; needed for mailboxes in device memory).
    A failure (peer lost, bad frame) stops both threads; :attr:`error` says why, and the
    streams waiting on incoming flags must then be released by the caller's watchdog.
    """

    def __init__(self, endpoint: Any, outgoing: Mailboxes, routes: list[Route],
                 incoming: Mailboxes, poll_s: float = 20e-6,
                 fixed_size: bool | None = None) -> None:
        self.endpoint = endpoint
        self.fixed_size = (getattr(endpoint, "provider", None) == "nccl"
                           if fixed_size is None else fixed_size)
        if not self.fixed_size and (outgoing.device.type != "cpu" or
                                    incoming.device.type != "cpu"):
            raise ValueError("mailboxes in device memory need fixed-size frames (nccl)")
        self.outgoing = outgoing
        self.routes = routes
        self.incoming = incoming
        self.poll_s = poll_s
        self.error: BaseException | None = None
        self.frames_sent = 0
        self.frames_received = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._guard, args=(self._proxy,), name="relay-proxy",
                             daemon=True),
            threading.Thread(target=self._guard, args=(self._complete,),
                             name="relay-completion", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _guard(self, loop) -> None:
        try:
            loop()
        except EndpointClosedError:
            pass
        except BaseException as e:  # noqa: BLE001 - kept for the caller
            if not self._stop.is_set():
                log.exception("relay thread failed")
                self.error = e
                self._stop.set()

    def _proxy(self) -> None:
        box = self.outgoing
        while not self._stop.is_set():
            sent = False
            for route in self.routes:
                if box.flag_value(route.local) >= sf.SET:
                    box.set_flag(route.local, sf.CLEAR)
                    rows = (box.rows_value(route.local) if self.fixed_size
                            else box.count_value(route.local))
                    self.endpoint.send(route.dst, box.frame(route.local, rows),
                                       layer=route.remote, microbatch=0)
                    self.frames_sent += 1
                    sent = True
            if not sent:
                time.sleep(self.poll_s)

    def _complete(self) -> None:
        box = self.incoming
        while not self._stop.is_set():
            try:
                completion = self.endpoint.poll(timeout=0.1)
            except CommTimeoutError:
                continue
            mailbox = completion.layer
            if not 0 <= mailbox < box.n:
                raise CommError(f"a frame for mailbox {mailbox} of {box.n}")
            rows = box.land(mailbox, completion.tensor())
            self.endpoint.release(completion)
            if not self.fixed_size and box.count_value(mailbox) != rows:
                raise CommError(f"mailbox {mailbox}: a frame of {rows} rows says it holds "
                                f"{box.count_value(mailbox)}")
            box.set_flag(mailbox, sf.SET)
            self.frames_received += 1

    def wait_sent(self, frames: int, timeout_s: float = 60.0) -> None:
        """Block until the proxy has sent ``frames`` frames in all (CommTimeoutError after
        ``timeout_s``; the relay's own error if it failed)."""
        deadline = time.monotonic() + timeout_s
        while self.frames_sent < frames:
            if self.error is not None:
                raise CommError(f"relay failed: {self.error}") from self.error
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"{self.frames_sent} of {frames} frames sent "
                                       f"within {timeout_s:.0f}s")
            time.sleep(self.poll_s)

    @staticmethod
    def warm_up(endpoint: Any, peers: list[int], timeout_s: float = 180.0) -> None:
        """Exchange one small frame with each of ``peers`` (every peer must call this too)
        before a Relay over ``endpoint`` starts: the nccl provider then creates its
        communicators and loads its kernels here, before any stream waits on a flag that
        the relay's threads raise (see :func:`take`'s NOTE). CommTimeoutError after
        ``timeout_s``."""
        token = torch.zeros(16, dtype=torch.uint8)
        if getattr(endpoint, "provider", None) == "nccl" and endpoint.device.type == "cuda":
            token = token.to(endpoint.device)
        for peer in peers:
            endpoint.send(peer, token, layer=0, microbatch=0)
        deadline = time.monotonic() + timeout_s
        pending = set(peers)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(f"relay warm-up: nothing from ranks {sorted(pending)} "
                                       f"within {timeout_s:.0f}s")
            completion = endpoint.poll(timeout=left)
            pending.discard(completion.src)
            endpoint.release(completion)

    def close(self) -> None:
        """Stop both threads (idempotent); the endpoint is the caller's to close."""
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
