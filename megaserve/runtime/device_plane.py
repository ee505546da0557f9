"""The device-driven data plane: dispatch and combine with no host round trip per frame.

Shape legend: R = attention replicas, m = micro-batches, E = expert workers, C = rows a
micro-batch slot holds, c = rows a tick uses (<= C), T = tokens of a micro-batch,
D = hidden, k = top-k, P = the replicas taking part in a step.

Every buffer is allocated once, at start-up, in the memory of the worker that *receives*
it; the sender writes into it directly (same process: the same tensor; another process on
the host: a CUDA IPC mapping). One slot per micro-batch is enough: dispatch (l + 1, i)
is issued only after combine (l, i), which the expert side writes only after it has read
its rows of (l, i)::

    ExpertInbox (expert worker e's GPU)            ReplicaInbox (replica r's GPU, one each)
      rows    [R, m, C + 1, D]  (row C: dump row)    out   [m, E, C, k', D]  k' = k, or 1
      ids     [R, m, C + 1, k]  int32, -1: elsewhere       (pre-reduced, float32)
      weights [R, m, C + 1, k]  float32 (routing)    flags [m, E] int32  combine (i, e) done
      counts  [R, m] int32      rows packed
      flags   [R, m] int32      dispatch (r, i) done

NOTE (the combine's bits): the attention side sums a token's k expert outputs in fp32 in
ascending rank order (``kernels.combine``). With ``reduce_on_workers`` (one expert worker,
which then holds every rank of every token) the worker computes that sum itself, with the
same kernel over the same rows in the same order, and returns one float32 row per token
instead of k rows in the model's dtype (k = 8, bf16: 4x fewer bytes); the attention side
adds it with unit weight (exact), so the result is bitwise the one-GPU result. With several
expert workers each holds an arbitrary subset of a token's ranks, and a per-worker partial
sum would change the order of the fp32 additions: they return k rows.

Routing, packing rows per destination (stable: token order), counts, the expert-side
masking of rows beyond the count, the grouped GEMM and the combine's gather are kernels;
counts never leave the GPU. Arrival is a device flag (:mod:`megaserve.comm.stream_flags`, a toggle)
that the consumer's stream waits on.

Steps run in one of two ways:

* **graph steps** (decode): the attention worker replays one CUDA graph per batch bucket
  (all layers, all micro-batches, flags included) after one host message per expert worker
  (:class:`GraphStep`); the expert worker replays its CUDA graph of all layers and ticks for
  ``c`` rows. The host never waits inside a step. In one process the "message" is the
  launch itself: the replica's thread launches the worker's graph on the worker's stream
  (waking a Python thread cost ~1.5 ms a step on an H100, more than the data plane).
  With several replicas (R > 1) the replicas step in lockstep: at each global step the
  front-end names the participants (the replicas with requests); each says how it runs
  (its decode graph's rows, or eager) and the last of them sends one
  ``GraphStep(rows, replicas)`` per expert worker, rows being the largest. The expert graph
  of (c, P) serves the ticks of every replica in P with *one* grouped GEMM per tick over
  all their rows (counts mask each replica's part). A replica without requests takes no
  part: it sends nothing and the expert graph never waits for it (:class:`StepBarrier`).
* **eager steps** (prefill, mixed): one host message per tick, for one replica. In one process the message
  carries a CUDA event instead of using a flag (NOTE: a stream blocked on a flag while the
  *same process* loads a kernel module deadlocks: the load waits for every stream of the
  context; events are dependencies the driver knows about). Across processes the flags are
  used, as in graph steps.

Between hosts (``tcp``, ``rdma``) the bytes go through host memory instead
(:mod:`megaserve.comm.relay`): the sender packs into a local copy of the receiver's slot
and its stream puts the rows in use into a pinned mailbox and raises a host-memory flag; a
proxy thread sends them, the receiver's completion thread lands them and raises the
receiver's host flag, which its stream waits on before copying them in. The rest (counts
on the device, graphs, ticks, lockstep) is the same.

HAZARD: a flag that never comes (a dead expert worker) would block the attention stream for
ever: while the host waits for the step's completion event, a watchdog thread counts
``timeout_s``, then raises every flag the replica waits on to ``ABORT`` from a side stream
(:class:`megaserve.comm.stream_flags.Releaser`) until the stream drains; the step raises
:class:`comm.CommTimeoutError` and its outputs are lost.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from megaserve import kernels
from megaserve.comm import CommTimeoutError
from megaserve.comm import relay as rl
from megaserve.comm import stream_flags as sf
from megaserve.models.expert_part import ExpertPart
from megaserve.runtime.messages import Stop

_ALIGN = 256
# The expert side's dispatch wait inside its first kernel (plane_pack.local_ids) instead
# of a stream wait and a stream write before it (batch 256 on 2 x H200: 0.99x instead of
# 0.96x of one co-located GPU, docs/results/disaggregation.md); "0": the stream operations.
KERNEL_WAITS = os.environ.get("MEGASERVE_PLANE_KERNEL_WAIT", "1") != "0"

# Eager steps of a process that also serves other processes as an expert worker
# (co-located EP on the device plane): the replica's host thread enqueues at most this
# many dispatches ahead of its stream (DeviceExperts._pace), polling an event meanwhile.
EAGER_RUN_AHEAD = 4
_PACE_POLL_S = 50e-6


@dataclass(frozen=True)
class PlaneShape:
    """Sizes of the exchange buffers (one replica, ``num_workers`` expert workers)."""

    num_workers: int
    microbatches: int
    capacity: int  # C: rows of one micro-batch slot (the largest micro-batch)
    hidden: int
    top_k: int
    num_experts: int
    dtype: torch.dtype
    num_replicas: int = 1
    # The expert worker returns each token's combined row (module NOTE); one worker only.
    reduce_on_workers: bool = False

    def __post_init__(self) -> None:
        for name in ("num_workers", "microbatches", "capacity", "hidden", "top_k", "num_experts",
                     "num_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PlaneShape.{name} must be a positive integer, got {value!r}")
        if self.reduce_on_workers and self.num_workers != 1:
            raise ValueError(f"PlaneShape.reduce_on_workers keeps the combine's rank order "
                             f"only with one expert worker, got {self.num_workers}")

    @property
    def combine_rows(self) -> int:
        """k': rows a token gets back from a worker (1 once pre-reduced, else top-k)."""
        return 1 if self.reduce_on_workers else self.top_k

    @property
    def combine_dtype(self) -> torch.dtype:
        return torch.float32 if self.reduce_on_workers else self.dtype


def _capturing() -> bool:
    """True while the current CUDA stream captures a graph (never on a CPU-only build,
    where the relay's protocol runs on host threads)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _aligned_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a ``shape`` x ``dtype`` view, rounded up to the 256-byte alignment."""
    return -(-dtype.itemsize * math.prod(shape) // _ALIGN) * _ALIGN


def _carve(storage: torch.Tensor, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict:
    """Views of ``storage`` (uint8) for each (name, shape, dtype), 256-byte aligned."""
    views, offset = {}, 0
    for name, shape, dtype in specs:
        nbytes = dtype.itemsize * math.prod(shape)
        views[name] = storage[offset: offset + nbytes].view(dtype).view(shape)
        offset += _aligned_nbytes(shape, dtype)
    return views


# Allocations of at least this size get their own cudaMalloc segment (hence their own IPC
# handle) in PyTorch's caching allocator.
_OWN_SEGMENT_BYTES = 16 << 20


class _Buffers:
    """One uint8 allocation carved into named views (one IPC handle per worker)."""

    def __init__(self, specs, device: torch.device | str | None = None,
                 storage: torch.Tensor | None = None) -> None:
        size = sum(_aligned_nbytes(shape, dtype) for _, shape, dtype in specs)
        if storage is None:
            storage = torch.empty(max(size, _OWN_SEGMENT_BYTES), dtype=torch.uint8,
                                  device=device)[:size]
        self.storage = storage
        self.__dict__.update(_carve(storage, specs))


class ExpertInbox(_Buffers):
    """What the replicas write into expert worker ``e`` (see the module NOTE)."""

    def __init__(self, shape: PlaneShape, device=None, storage=None) -> None:
        r, m, c, d, k = (shape.num_replicas, shape.microbatches, shape.capacity, shape.hidden,
                         shape.top_k)
        super().__init__([("rows", (r, m, c + 1, d), shape.dtype),
                          ("ids", (r, m, c + 1, k), torch.int32),
                          ("weights", (r, m, c + 1, k), torch.float32),
                          ("counts", (r, m), torch.int32), ("flags", (r, m), torch.int32)],
                         device, storage)
        if storage is None:
            self.flags.zero_()
            self.counts.zero_()

    def slot(self, replica: int) -> InboxSlot:
        """Replica ``replica``'s part: rows `[m, C + 1, D]`, ids, weights, counts `[m]`,
        flags `[m]`."""
        return InboxSlot(self.rows[replica], self.ids[replica], self.counts[replica],
                         self.flags[replica], self.weights[replica])


@dataclass(frozen=True)
class InboxSlot:
    """One replica's views of an :class:`ExpertInbox` (what :func:`pack` writes)."""

    rows: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    flags: torch.Tensor
    weights: torch.Tensor


class ReplicaInbox(_Buffers):
    """What expert workers write into the attention replica (see the module NOTE)."""

    def __init__(self, shape: PlaneShape, device=None, storage=None) -> None:
        m, e, c, k, d = (shape.microbatches, shape.num_workers, shape.capacity,
                         shape.combine_rows, shape.hidden)
        super().__init__([("out", (m, e, c, k, d), shape.combine_dtype),
                          ("flags", (m, e), torch.int32)], device, storage)
        if storage is None:
            self.flags.zero_()


# -- eager steps in one process: per-tick messages carrying CUDA events ------------------


# -- messages to an expert worker (the host's whole share of the data plane) -------------


@dataclass(frozen=True)
class GraphStep:
    """Replay the step graph for ``rows`` rows per micro-batch slot of each replica in
    ``replicas`` (decode steps)."""

    rows: int
    replicas: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Tick:
    """Serve one (layer, micro-batch) tick of replica ``replica`` eagerly over ``rows``
    rows (prefill, mixed)."""

    layer: int
    microbatch: int
    rows: int
    # Same process: the dispatch's CUDA event (never a flag: module NOTE); across
    # processes None, and the dispatch flag says when the rows are in.
    event: torch.cuda.Event | None
    replica: int = 0


@dataclass(frozen=True)
class WorkerReady:
    """An expert worker process is up: its inbox, shared (comm.cuda_ipc.share_tensor)."""

    index: int
    inbox_handle: bytes | None  # None for host-proxied links (tcp, rdma)


@dataclass(frozen=True)
class WorkerFailed:
    """An expert worker process failed (the reason, for the front-end's error)."""

    index: int
    reason: str


class EagerCompletions:
    """Completions of eager ticks, (replica, layer, micro-batch) → event, handed across
    threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self.failed: str | None = None

    def put(self, key: tuple[int, int, int], event: torch.cuda.Event) -> None:
        with self._cond:
            self._events[key] = event
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        with self._cond:
            self.failed = why
            self._cond.notify_all()

    def take(self, key: tuple[int, int, int], timeout_s: float) -> torch.cuda.Event:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._events:
                if self.failed is not None:
                    raise CommTimeoutError(f"expert worker failed: {self.failed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"expert worker did not answer tick {key} "
                                           f"within {timeout_s:.0f}s")
                self._cond.wait(left)
            return self._events.pop(key)


def timing_event() -> torch.cuda.Event:
    """A timing event that a CUDA graph records as a node of its own (``external``), so its
    time can be read after each replay."""
    return torch.cuda.Event(enable_timing=True, external=True)


class _timed_wait:
    """Events around a wait inside a captured graph (when ``on``), appended to ``sink``."""

    def __init__(self, on: bool, sink: list) -> None:
        self.events = None
        if on:
            self.events = (timing_event(), timing_event())
            self.events[0].record()
            sink.append(self.events)

    def end(self) -> None:
        if self.events is not None:
            self.events[1].record()


def wait_times_ms(pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> list[float]:
    """Elapsed times of (start, end) event pairs of the last replay (synchronises)."""
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in pairs]


@dataclass
class PlaneStats:
    """Host-side work of the data plane (what a test bounds per step)."""

    host_messages: int = 0  # messages to expert workers
    graph_steps: int = 0
    eager_ticks: int = 0


@dataclass
class _Handle:
    layer: int
    microbatch: int
    num_tokens: int
    owners: torch.Tensor | None  # [T, k] expert worker of each (token, rank); E = 1: None
    positions: torch.Tensor | None  # [E, T] row of token t in worker e's slot (E > 1)


def plane_pack():
    """The data plane's Triton kernels (CUDA only; imported on first use)."""
    from megaserve.kernels.triton_impl import plane_pack as module

    return module


def pack(inbox: InboxSlot, microbatch: int, x: torch.Tensor, topk_ids: torch.Tensor,
         owners: torch.Tensor | None, worker: int, only_worker: bool,
         topk_weights: torch.Tensor | None = None,
         owner_table: torch.Tensor | None = None) -> torch.Tensor | None:
    """Write the rows of micro-batch ``microbatch`` that expert worker ``worker`` needs into
    the replica's slot of its inbox (``ExpertInbox.slot``), in token order, with their expert ids (-1 where another worker serves
    that rank) and their count; kernels only, no host synchronisation.

    x: `[T, D]`; topk_ids, owners: `[T, k]` int64 (owners = owner_table[topk_ids], the
    table `[N]` being what CUDA's one launch reads); topk_weights: `[T, k]` float32, written
    too where given (``only_worker``: the worker pre-reduces). Returns pos `[T]`, each
    token's row in the slot (-1 where none), or None for ``only_worker`` (row t is token t).
    """
    num_tokens = x.shape[0]
    slot_rows, slot_ids = inbox.rows[microbatch], inbox.ids[microbatch]
    if only_worker and x.is_cuda:  # one launch: rows, ids, weights and count
        plane_pack().pack_rows(x, topk_ids, topk_weights, slot_rows, slot_ids,
                               inbox.weights[microbatch],
                               inbox.counts[microbatch: microbatch + 1])
        return None
    if only_worker:  # every token goes to the one worker: a plain copy
        slot_rows[:num_tokens].copy_(x)
        slot_ids[:num_tokens].copy_(topk_ids)
        if topk_weights is not None:
            inbox.weights[microbatch, :num_tokens].copy_(topk_weights)
        inbox.counts[microbatch].fill_(num_tokens)
        return None
    if topk_weights is not None:
        raise ValueError("pre-reduced combines need one expert worker (module NOTE)")
    if x.is_cuda and owner_table is not None:  # one launch: the same rows, ids, count, pos
        return plane_pack().route_rows(x, topk_ids, owner_table, worker, slot_rows, slot_ids,
                                       inbox.counts[microbatch: microbatch + 1])
    capacity = slot_rows.shape[0] - 1
    mine = owners == worker  # [T, k]
    need = mine.any(dim=1)  # [T]
    pos = need.cumsum(0) - 1  # [T] row in the slot, in token order
    dest = torch.where(need, pos, capacity)  # tokens it does not need: the dump row
    slot_rows.index_copy_(0, dest, x)
    slot_ids.index_copy_(0, dest, torch.where(mine, topk_ids, -1).to(torch.int32))
    inbox.counts[microbatch: microbatch + 1].copy_(need.sum(0, keepdim=True))
    return pos


def gather(inbox: ReplicaInbox, microbatch: int, owners: torch.Tensor | None,
           positions: torch.Tensor | None, num_tokens: int | None = None) -> torch.Tensor:
    """The expert outputs of micro-batch ``microbatch`` in (token, rank) order: `[T, k, D]`
    (pre-reduced: `[T, 1, D]` float32, each token's combined row).

    owners: `[T, k]` expert worker of each (token, rank) (None with one worker, given
    ``num_tokens``); positions: `[E, T]` each token's row in each worker's slot (None with
    one worker: row t is token t, a view is returned).
    """
    out = inbox.out[microbatch]  # [E, C, k', D]
    if positions is None:
        rows = owners.shape[0] if owners is not None else num_tokens
        return out[0, :rows]  # read before dispatch (l + 1, i) reuses the slot
    if out.is_cuda:  # one launch, the same rows
        return plane_pack().gather_routed(out, owners, positions)
    num_tokens, k = owners.shape
    capacity, hidden = out.shape[1], out.shape[3]
    pos = positions.gather(0, owners.T).T  # [T, k] row in the owner's slot
    ranks = torch.arange(k, device=owners.device)
    flat = (owners * capacity + pos) * k + ranks  # [T, k] into out as [E*C*k, D]
    return out.reshape(-1, hidden)[flat.reshape(-1)].view(num_tokens, k, hidden)


@dataclass(frozen=True)
class RelaySlots:
    """One side's mailboxes of host-proxied links (:mod:`megaserve.comm.relay`): slot i
    towards / from peer p is mailbox ``base + p * m + i`` of ``outgoing`` / ``incoming``."""

    outgoing: rl.Mailboxes
    incoming: rl.Mailboxes
    microbatches: int
    base: int = 0

    def index(self, peer: int, microbatch: int) -> int:
        return self.base + peer * self.microbatches + microbatch

    @staticmethod
    def layouts(shape: PlaneShape) -> tuple[rl.MailboxLayout, rl.MailboxLayout]:
        """(dispatch, combine) mailbox layouts: rows + expert ids + routing weights, and
        k' outputs a row (ReplicaInbox.out)."""
        c, d, k = shape.capacity, shape.hidden, shape.top_k
        dispatch = rl.MailboxLayout(c, (rl.Section((d,), shape.dtype),
                                        rl.Section((k,), torch.int32),
                                        rl.Section((k,), torch.float32)))
        combine = rl.MailboxLayout(c, (rl.Section((shape.combine_rows, d),
                                                  shape.combine_dtype),))
        return dispatch, combine


@dataclass
class ExpertLink:
    """The replica's view of one expert worker: its inbox, its message queue, and (same
    process only) where its eager completions come back."""

    inbox: ExpertInbox
    messages: object  # queue.Queue or multiprocessing queue of GraphStep / Tick / Stop
    # Same process: eager ticks complete through CUDA events handed back here.
    done: EagerCompletions | None = None
    # Same process: the worker's server, whose step graph the replica's thread launches
    # itself (on the worker's stream) instead of waking the worker's thread for it.
    server: ExpertServer | None = None


def send_graph_step(links: list[ExpertLink], rows: int, replicas: tuple[int, ...]) -> None:
    """Start every expert worker's graph step: one message each (same process: the
    launch itself, on the worker's stream)."""
    for link in links:
        if link.server is not None:
            if link.server.serving:  # a stopped worker's steps never start: the
                link.server.graph_step(rows, replicas)  # replicas' waits then time out
        else:
            link.messages.put(GraphStep(rows, replicas))


class StepBarrier:
    """Lockstep of several replicas (module docstring): the expert workers' graph step of a
    global step starts once every participant has said how it runs.

    The front-end calls :meth:`begin` with the participants, each replica's DeviceExperts
    :meth:`report` (its decode graph's rows, or None for an eager step), and the front-end
    :meth:`report` (None) for each participant whose step ended, so that a replica that
    scheduled nothing or failed never leaves the others waiting. Nobody blocks here: a
    replica's stream waits on the expert workers' flags, not on this object.
    """

    def __init__(self, links: list[ExpertLink]) -> None:
        self.links = links
        self._lock = threading.Lock()
        self._waiting: set[int] = set()
        self._rows: dict[int, int] = {}
        self.host_messages = 0
        self.graph_steps = 0

    def begin(self, participants: list[int]) -> None:
        with self._lock:
            self._waiting, self._rows = set(participants), {}

    def report(self, replica: int, rows: int | None) -> None:
        with self._lock:
            if replica not in self._waiting:
                return
            self._waiting.discard(replica)
            if rows is not None:
                self._rows[replica] = rows
            if self._waiting or not self._rows:
                return
            rows, replicas = max(self._rows.values()), tuple(sorted(self._rows))
            self._rows = {}
            self.host_messages += len(self.links)
            self.graph_steps += 1
        send_graph_step(self.links, rows, replicas)


class DeviceExperts:
    """The attention side's ExpertClient over the device data plane (replica ``replica``).

    ``owner``: `[num_experts]` int64, the expert worker of each expert id. ``barrier``:
    the lockstep of several replicas (None: this is the only one). Raises ``ValueError``
    when a micro-batch has more tokens than the slots hold.
    """

    def __init__(self, shape: PlaneShape, links: list[ExpertLink], inbox: ReplicaInbox,
                 owner: torch.Tensor, timeout_s: float = 60.0, profile: bool = False,
                 replica: int = 0, barrier: StepBarrier | None = None,
                 relay: RelaySlots | None = None) -> None:
        """``relay``: host-proxied links (the links' inboxes are then this process's
        copies of the workers' slots, packed here and sent from host memory)."""
        if len(links) != shape.num_workers:
            raise ValueError(f"{len(links)} expert links for {shape.num_workers} workers")
        if (barrier is None) != (shape.num_replicas == 1):
            raise ValueError("several replicas step through a StepBarrier, one without")
        self.shape = shape
        self.links = links
        self.replica = replica
        self.barrier = barrier
        self._slots = [link.inbox.slot(replica) for link in links]
        self.relay = relay
        self.inbox = inbox
        self._count = torch.zeros(1, dtype=torch.int32, device=inbox.storage.device)
        self.device = inbox.storage.device
        self._owner = owner.to(self.device)
        self.timeout_s = timeout_s
        # Co-located: one expert role in this process (a local link) and others reached by
        # flags. An eager step's host thread must then never block inside the driver: a
        # stream stalled on another process's flag fills its launch queue, the next launch
        # blocks holding the driver, and this process's expert thread, whose tick that other
        # process waits for, cannot record an event (both co-located processes stuck so,
        # stacks of nvidia-h200, docs/results/disaggregation.md). _pace bounds the run-ahead.
        self._paced = (any(link.done is not None for link in links)
                       and any(link.done is None for link in links))
        self._dispatched: collections.deque[torch.cuda.Event] = collections.deque()
        self.stats = PlaneStats()
        # The worker returns one combined row per token (module NOTE): the model loop
        # passes topk_weights to dispatch and adds the combine's rows with unit weight.
        self.reduces_on_workers = shape.reduce_on_workers
        # Decode graphs return without waiting for the step (finish_step(block=False)) and
        # the step's token reader calls check_steps: the engine may schedule asynchronously.
        # Not over relays whose threads call the driver (nccl: device mailboxes): the host
        # must not launch new kernels while a stream waits for those threads (relay.take).
        self.overlaps_steps = relay is None or relay.incoming.device.type == "cpu"
        self._releaser: sf.Releaser | None = None
        self._watchdog: _Watchdog | None = None
        # profile: captured graphs record CUDA events around each combine wait, so the
        # attention GPU's idle time per tick can be read after a replay (wait_times_ms).
        self.profile = profile
        self._captured_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.waits_by_batch: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    # -- ExpertClient -----------------------------------------------------------------

    def begin_step(self, num_microbatches: int) -> None:
        """An eager step starts (its ticks are messages of their own)."""
        self._dispatched.clear()  # the last eager step was waited for (finish_step)
        if self.barrier is not None:
            self.barrier.report(self.replica, None)

    def graph_step(self, batch_size: int, num_microbatches: int) -> None:
        """A captured step of ``batch_size`` rows in ``num_microbatches`` equal parts is
        about to be replayed: one message per expert worker (R > 1: the barrier's, once
        per global step), nothing else."""
        rows = batch_size // num_microbatches
        if self._captured_waits:  # the graph of this size was captured just now
            self.waits_by_batch[batch_size] = self._captured_waits
            self._captured_waits = []
        self.stats.graph_steps += 1
        if self.barrier is not None:
            self.barrier.report(self.replica, rows)
            return
        send_graph_step(self.links, rows, (self.replica,))
        self.stats.host_messages += len(self.links)

    def dispatch(self, layer: int, microbatch: int, x: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None) -> _Handle:
        """x `[T, D]`, topk_ids `[T, k]` int64 → the handle :meth:`combine` takes.
        topk_weights `[T, k]` float32: required where :attr:`reduces_on_workers` (the
        worker combines), ignored otherwise."""
        num_tokens = x.shape[0]
        if num_tokens > self.shape.capacity:
            raise ValueError(f"micro-batch of {num_tokens} tokens exceeds the data plane's "
                             f"{self.shape.capacity}-row slots")
        if self.reduces_on_workers and topk_weights is None:
            raise ValueError("this data plane combines on the expert worker: pass topk_weights")
        weights = topk_weights if self.reduces_on_workers else None
        capturing = _capturing()
        if self._paced and not capturing:
            self._pace()
        only = len(self.links) == 1  # every row goes to the one worker: no routing table
        owners = None if only else self._owner[topk_ids]  # [T, k]
        positions = []
        for e, link in enumerate(self.links):
            pos = pack(self._slots[e], microbatch, x, topk_ids, owners, e, only, weights,
                       self._owner)
            if pos is not None:
                positions.append(pos)
            self._signal(link, e, layer, microbatch, num_tokens, capturing)
        stacked = torch.stack(positions) if positions else None
        return _Handle(layer, microbatch, num_tokens, owners, stacked)

    def combine(self, handle: _Handle) -> torch.Tensor:
        """Wait (on the stream) for every expert worker's rows; `[T, k, D]`, rank order
        (:attr:`reduces_on_workers`: `[T, 1, D]` float32, each token's combined row)."""
        i = handle.microbatch
        capturing = _capturing()
        timed = _timed_wait(self.profile and capturing, self._captured_waits)
        for e, link in enumerate(self.links):
            if self.relay is not None:  # eager: the host waits (relay.take's NOTE)
                rl.take(self.relay.incoming, self.relay.index(e, i), self._count,
                        [self.inbox.out[i, e]], handle.num_tokens, self.timeout_s,
                        host_wait=not capturing)
            elif link.done is not None and not capturing:
                event = link.done.take((self.replica, handle.layer, i), self.timeout_s)
                torch.cuda.current_stream().wait_event(event)
            else:
                sf.wait_and_clear(self.inbox.flags[i, e: e + 1])
        timed.end()
        return gather(self.inbox, i, handle.owners, handle.positions, handle.num_tokens)

    def _pace(self) -> None:
        """Wait on the host until the stream has passed the dispatch EAGER_RUN_AHEAD
        dispatches back (polling its event: ``query`` neither synchronises nor blocks in
        the driver), then mark this one. Raises CommTimeoutError after ``timeout_s``."""
        while len(self._dispatched) >= EAGER_RUN_AHEAD:
            event = self._dispatched.popleft()
            deadline = time.monotonic() + self.timeout_s
            while not event.query():
                if time.monotonic() > deadline:
                    raise CommTimeoutError(f"the expert workers did not complete a tick within "
                                           f"{self.timeout_s:.0f}s of an eager step")
                time.sleep(_PACE_POLL_S)
        event = torch.cuda.Event()
        event.record()
        self._dispatched.append(event)

    def _signal(self, link: ExpertLink, e: int, layer: int, microbatch: int,
                num_tokens: int, capturing: bool) -> None:
        slot, event = self._slots[e], None
        if self.relay is not None:  # host-proxied: the rows in use go out from host memory
            rl.put(self.relay.outgoing, self.relay.index(e, microbatch),
                   slot.counts[microbatch: microbatch + 1],
                   [slot.rows[microbatch], slot.ids[microbatch], slot.weights[microbatch]],
                   num_tokens)
        elif link.done is not None and not capturing:
            event = torch.cuda.Event()  # same process: an event, never a flag (module NOTE)
            event.record()
        else:
            sf.write(slot.flags[microbatch: microbatch + 1], sf.SET)
        if capturing:  # the graph step's one message covers every tick
            return
        link.messages.put(Tick(layer, microbatch, num_tokens, event, self.replica))
        self.stats.host_messages += 1
        self.stats.eager_ticks += 1

    # -- bounded waits ----------------------------------------------------------------

    def finish_step(self, block: bool = True) -> None:
        """The step launched so far on the current stream is complete, or will be, within
        ``timeout_s``: a watchdog thread (:class:`_Watchdog`) drains the stream by raising
        every combine flag to ABORT if it is not, and the step's outputs are then garbage.

        ``block``: wait for the step here (eager steps). Otherwise return at once (decode
        graphs with async scheduling: the host goes on to the next step) and let the
        reader of the step's tokens call :meth:`check_steps` after its wait, which the
        watchdog bounds too. Raises :class:`CommTimeoutError` for an abandoned step."""
        event = torch.cuda.Event()
        event.record()
        if self._watchdog is None:
            self._watchdog = _Watchdog(self._drain)
        self._watchdog.arm(event, time.monotonic() + self.timeout_s)
        if block or not self.overlaps_steps:
            event.synchronize()  # releases the GIL; the watchdog ends it if a flag never comes
        self.check_steps()

    def check_steps(self) -> None:
        """Raise :class:`CommTimeoutError` if the watchdog abandoned a step (call after
        waiting for a step's results: they are garbage then); resets the flags so that
        the next step starts clean."""
        if self._watchdog is None or not self._watchdog.take_fired():
            return
        torch.cuda.current_stream().synchronize()  # drained: the flags are ours again
        self.inbox.flags.zero_()
        if self.relay is not None:
            for i in range(self.shape.microbatches):
                for e in range(self.shape.num_workers):
                    self.relay.incoming.set_flag(self.relay.index(e, i), sf.CLEAR)
        raise CommTimeoutError(f"the expert workers did not complete a step within "
                               f"{self.timeout_s:.0f}s; the step was abandoned")

    def _drain(self, event: torch.cuda.Event) -> None:
        slots = [(i, e) for i in range(self.shape.microbatches)
                 for e in range(self.shape.num_workers)]
        if self.relay is not None:  # host flags: the host writes them itself
            while not event.query():
                for i, e in slots:
                    self.relay.incoming.set_flag(self.relay.index(e, i), sf.ABORT)
                time.sleep(0.001)
            return
        if self._releaser is None:
            self._releaser = sf.Releaser(self.device)
        flags = [self.inbox.flags[i, e: e + 1] for i, e in slots]
        while not event.query():
            self._releaser.release(flags)
            time.sleep(0.001)


class _Watchdog:
    """Drains a stream whose step passed its deadline (one thread, no polling).

    Steps are armed in launch order (one stream: they complete in that order). The thread
    sleeps until the oldest armed step's deadline; a step found complete by then is
    dropped (:meth:`arm` also drops completed ones), one still running makes it call
    ``drain(newest armed event)`` (everything launched so far is abandoned) and mark the
    watchdog fired, which :meth:`take_fired` reports once.
    """

    def __init__(self, drain) -> None:
        self._drain = drain
        self._cond = threading.Condition()
        self._armed: collections.deque[tuple[torch.cuda.Event, float]] = collections.deque()
        self._fired = False
        threading.Thread(target=self._loop, name="megaserve-plane-watchdog", daemon=True).start()

    def arm(self, event: torch.cuda.Event, deadline: float) -> None:
        with self._cond:
            while self._armed and self._armed[0][0].query():
                self._armed.popleft()
            self._armed.append((event, deadline))
            self._cond.notify()

    def take_fired(self) -> bool:
        """True once after a drain (the steps armed before it were abandoned)."""
        with self._cond:
            fired, self._fired = self._fired, False
            return fired

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._armed:
                    self._cond.wait()
                event, deadline = self._armed[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                if event.query():
                    self._armed.popleft()
                    continue
                newest = self._armed[-1][0]
                self._armed.clear()
                self._fired = True
            self._drain(newest)


class ExpertServer:
    """The expert worker's side: serves the replicas from its :class:`ExpertInbox`.

    ``replicas``: each replica's inbox (this process's tensor, or an IPC mapping).
    Runs on its own CUDA stream; graphs per (tick size ``c``, participants) are captured
    on first use
    (without ``torch.cuda.graph``'s device synchronisation, which would wait for the
    replica's stream, itself waiting for this worker).
    """

    def __init__(self, part: ExpertPart, index: int, shape: PlaneShape, inbox: ExpertInbox,
                 replicas: list[ReplicaInbox], moe_layers: list[int], device: torch.device,
                 profile: bool = False, relay: RelaySlots | None = None) -> None:
        """``relay``: host-proxied links; ``replicas`` are then this process's copies of
        the replicas' slots, sent from host memory."""
        if len(replicas) != shape.num_replicas:
            raise ValueError(f"{len(replicas)} replica inboxes for {shape.num_replicas} replicas")
        self.part = part
        self.index = index
        self.shape = shape
        self.inbox = inbox
        self.replicas = list(replicas)
        self.relay = relay
        self.moe_layers = list(moe_layers)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Global expert id → local index; -1 (routed elsewhere) indexes the last entry,
        # the sentinel past the local experts, whose rows the grouped GEMM skips.
        lookup = torch.full((shape.num_experts + 1,), len(part.expert_ids), dtype=torch.int64)
        lookup[torch.tensor(part.expert_ids, dtype=torch.int64)] = torch.arange(len(part.expert_ids))
        self._lookup = lookup.to(self.device)
        self._rows = torch.arange(shape.capacity, device=self.device, dtype=torch.int32)
        self._replica_ids: dict[tuple[int, ...], torch.Tensor] = {}  # [P] int64 each
        self._graphs: dict[tuple[int, tuple[int, ...]], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.ticks = 0
        self.serving = False  # True while serve() runs
        # profile: events around each dispatch wait in captured graphs (idle time of the
        # expert GPU).
        self.profile = profile
        self.waits_by_rows: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self._captured_waits: list = []
        # The index tensors of eager ticks (one replica) and of the full set are made now:
        # made at a first tick, their host-to-device copy synchronises (a serving process
        # may run under set_sync_debug_mode("error")).
        for r in range(shape.num_replicas):
            self._select((r,))
        self._select(tuple(range(shape.num_replicas)))

    def _select(self, replicas: tuple[int, ...]) -> torch.Tensor | slice:
        """Index of the replicas ``replicas`` in the inbox's first dimension."""
        if replicas not in self._replica_ids:  # made before any capture uses it
            self._replica_ids[replicas] = torch.tensor(replicas, dtype=torch.int64,
                                                       device=self.device)
        if replicas == tuple(range(self.shape.num_replicas)):
            return slice(None)  # all of them: views, no copy
        return self._replica_ids[replicas]

    def _tick(self, layer: int, i: int, c: int, use_flags: bool,
              replicas: tuple[int, ...] = (0,)) -> None:
        """Tick (layer, micro-batch i) over the first ``c`` rows of the slots of
        ``replicas``: one grouped GEMM over all their rows."""
        k, d = self.shape.top_k, self.shape.hidden
        # IPC flags on CUDA: the ids kernel itself waits for them (plane_pack.local_ids)
        kernel_waits = (use_flags and self.relay is None and self.device.type == "cuda"
                        and KERNEL_WAITS)
        timed = _timed_wait(use_flags and self.profile and _capturing(), self._captured_waits)
        if use_flags and not kernel_waits:
            for r in replicas:
                if self.relay is not None:  # eager: the host waits (relay.take's NOTE)
                    rl.take(self.relay.incoming, self.relay.index(r, i),
                            self.inbox.counts[r, i: i + 1],
                            [self.inbox.rows[r, i], self.inbox.ids[r, i],
                             self.inbox.weights[r, i]], c, host_wait=not _capturing())
                else:
                    sf.wait_and_clear(self.inbox.flags[r, i: i + 1])
            timed.end()
        p = len(replicas)
        select = self._select(replicas)
        local = self._local_ids(replicas, select, i, c,  # [P*c*k]; sentinel → never computed
                                self.inbox.flags[:, i] if kernel_waits else None)
        if kernel_waits:
            timed.end()  # the wait and the ids kernel
        rows = self.inbox.rows[select, i, :c].reshape(p * c, d)  # routed row r: x row r // k
        out = kernels.expert_ffn(rows, local, self.part.w_gate_up[layer],
                                 self.part.w_down[layer],
                                 rows_per_token=k).view(p, c, k, d)  # [P, c, k, D]
        for j, r in enumerate(replicas):
            replica = self.replicas[r]
            if self.shape.reduce_on_workers and out.is_cuda:  # module NOTE; one launch,
                plane_pack().combine_into(out[j], self.inbox.weights[r, i, :c],  # straight
                                          replica.out[i, self.index, :c, 0])  # into its inbox
            elif self.shape.reduce_on_workers:  # the attention side's combine (module NOTE)
                combined = kernels.combine(out[j], self.inbox.weights[r, i, :c])  # [c, D]
                replica.out[i, self.index, :c, 0].copy_(combined)
            elif out.is_cuda and replica.out.dtype == out.dtype:  # the entries it computed
                plane_pack().copy_routed(out[j], local[j * c * k: (j + 1) * c * k],
                                         len(self.part.expert_ids), replica.out[i, self.index, :c])
            else:
                replica.out[i, self.index, :c].copy_(out[j])
            if use_flags and self.relay is not None:
                rl.put(self.relay.outgoing, self.relay.index(r, i),
                       self.inbox.counts[r, i: i + 1], [replica.out[i, self.index]], c)
            elif use_flags:
                sf.write(replica.flags[i, self.index: self.index + 1], sf.SET)

    def _local_ids(self, replicas: tuple[int, ...], select, i: int, c: int,
                   flags: torch.Tensor | None = None) -> torch.Tensor:
        """`[P*c*k]` int64: the local expert of each routed row of micro-batch ``i``'s first
        ``c`` rows of ``replicas``; rows past a replica's count and ids routed elsewhere
        get the sentinel (:func:`plane_pack.local_ids`'s contract; CUDA: one launch,
        which first waits for and clears ``flags`` `[R]` where given)."""
        if self.device.type == "cuda":
            return plane_pack().local_ids(self.inbox.ids[:, i], self.inbox.counts[:, i],
                                          self._replica_ids[replicas], self._lookup, c, flags)
        counts = self.inbox.counts[select, i]  # [P]
        valid = self._rows[None, :c] < counts[:, None]  # [P, c] rows this tick really holds
        ids = torch.where(valid[..., None], self.inbox.ids[select, i, :c], -1)  # [P, c, k]
        return self._lookup[ids.long()].reshape(-1)

    def rows_per_gemm(self) -> float:
        """(token, expert) rows per expert GEMM of the ticks now in the slots (the last
        layer's; reads the slots: call between steps, for reports)."""
        rows = gemms = 0
        for i in range(self.shape.microbatches):
            local = []
            for r in range(self.shape.num_replicas):  # one GEMM per expert over all replicas
                count = int(self.inbox.counts[r, i])
                ids = self.inbox.ids[r, i, :count].long().reshape(-1)
                local.append(self._lookup[ids])
            local = torch.cat(local)
            local = local[local < len(self.part.expert_ids)]
            rows += local.numel()
            gemms += int(torch.unique(local).numel())
        return rows / gemms if gemms else 0.0

    def tick(self, layer: int, i: int, c: int, event: torch.cuda.Event | None,
             replica: int = 0) -> torch.cuda.Event:
        """An eager tick of one replica: after ``event`` (same process) or the dispatch
        flag (another process). Returns the event recorded after it."""
        with torch.cuda.stream(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            self._tick(layer, i, c, use_flags=event is None, replicas=(replica,))
            done = torch.cuda.Event()
            done.record(self.stream)
        self.ticks += 1
        return done

    def graph_step(self, c: int, replicas: tuple[int, ...] = (0,)) -> None:
        """Replay the all-layers, all-ticks graph for ``c`` rows of each replica in
        ``replicas`` (captured on first use)."""
        key = (c, tuple(replicas))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(*key)
        with torch.cuda.stream(self.stream):
            graph.replay()
        self.ticks += len(self.moe_layers) * self.shape.microbatches

    def prepare_graph(self, c: int, replicas: tuple[int, ...]) -> bool:
        """Capture the step graph of ``(c, replicas)`` now (False: it exists), after one
        eager tick of its shape that compiles and loads its kernels. That tick uses no
        flags: it reads the slots as they are and overwrites the replicas' outputs of
        micro-batch 0, so call it only before serving (start-up)."""
        if (c, tuple(replicas)) in self._graphs:
            return False
        self._select(replicas)
        with torch.cuda.stream(self.stream):
            self._tick(self.moe_layers[0], 0, c, use_flags=False, replicas=tuple(replicas))
        self._capture(c, tuple(replicas))
        return True

    def _capture(self, c: int, replicas: tuple[int, ...]) -> torch.cuda.CUDAGraph:
        self._select(replicas)  # its index tensor exists before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                for layer in self.moe_layers:
                    for i in range(self.shape.microbatches):
                        self._tick(layer, i, c, use_flags=True, replicas=replicas)
            finally:
                graph.capture_end()
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(c, replicas)] = graph
        if self._captured_waits:
            self.waits_by_rows[c] = self._captured_waits
            self._captured_waits = []
        return graph

    def serve(self, messages, done: EagerCompletions | None, should_stop,
              idle_s: float = 0.2) -> None:
        """Serve :class:`GraphStep` and :class:`Tick` messages until :class:`Stop` or
        ``should_stop()``; eager completions go to ``done`` (same process)."""
        self.serving = True
        try:
            while True:
                try:
                    message = messages.get(timeout=idle_s)
                except queue.Empty:
                    if should_stop():
                        return
                    continue
                if isinstance(message, Stop):
                    return
                if isinstance(message, GraphStep):
                    self.graph_step(message.rows, message.replicas)
                elif isinstance(message, Tick):
                    finished = self.tick(message.layer, message.microbatch, message.rows,
                                         message.event, message.replica)
                    if done is not None:
                        done.put((message.replica, message.layer, message.microbatch),
                                 finished)
                else:
                    raise ValueError(f"expert worker: unknown message {message!r}")
        except BaseException as e:
            if done is not None:
                done.fail(f"{type(e).__name__}: {e}")
            raise
        finally:
            self.serving = False
