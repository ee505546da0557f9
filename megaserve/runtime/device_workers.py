"""Device-plane workers: every role a process on its GPU, the bytes over CUDA IPC.

A layout's processes (``WorkerSpec.plane == "device"``, started by the launcher like the
host plane's workers, driven by :class:`~megaserve.runtime.cluster.DisaggregatedEngine`)::

    attention r   LLMEngine(experts=DeviceExperts)   owns ReplicaInbox r
    expert e      ExpertServer over its experts      owns ExpertInbox e
    colocated i   both (co-located expert parallelism: replica i + expert worker i)

Start-up: each process allocates the buffers it owns, shares them (``cuda_ipc``) and
meets the others at the front-end's rendezvous (one round; each process's card carries
its handles and the address of its expert role's socket), then maps the others' buffers.
Its *own* buffers are the local tensors, never an IPC mapping (CUDA opens no IPC handle
in the process that exported it): a co-located process's replica writes its own expert
role's inbox directly, and its eager ticks there carry CUDA events, not flags (the device
plane's NOTE on flags and kernel-module loads).

Lockstep, one host message per role per step: the front-end sends ``RunStep(replicas,
step)`` to each participating replica; each replica sends every expert worker one
:class:`~megaserve.runtime.messages.StepReport` (its decode graph's rows, or None for an
eager step) and replays its graph; an expert worker's :class:`StepGate` starts the expert
graph of ``(c, P)`` (``c`` the largest rows, ``P`` the graph replicas) once every
participant has reported: one grouped GEMM per tick over every replica in P. Nobody waits
on the host inside a step: replica streams wait on the experts' flags.

HAZARD (deadlock): a kernel-module load or a capture's synchronisation waits for every
stream of its process, and holds that process's other threads' launches meanwhile; a
stream must then never wait on work that another process can only launch once *its*
load is done (two co-located processes loading at once, each waiting on the other's
expert role). Hence: one process at a time builds, compiles and captures at start-up
(:func:`_startup_turn`, a host file lock), capturing every decode graph of its replica,
every expert graph ``(c, P)`` (each after one eager tick of that shape) and running a few
eager prefill steps (:data:`WARM_UP_PROMPT_LENGTHS`, greedy with logprobs and seeded
sampling, then one prompt at each of :func:`warm_up_prompt_lengths` up to the largest
prefill step) so that serving rarely loads a kernel; a replica reports before it replays, and
eager ticks are sent after their dispatch is enqueued (every flag an expert waits on is
already on some stream). A new kernel variant first met inside a step by two processes
at once can still deadlock (the step's watchdog then raises after ``timeout_s``).
Where the synchronisation comes from: CUDA loads a module's data lazily by default, when a
function of it is first needed (CUDA_MODULE_DATA_LOADING, inherited from
CUDA_MODULE_LOADING=LAZY), and that lazy load "may require context synchronization" (the
CUDA programming guide's environment variables). A device-plane process therefore starts
with ``CUDA_MODULE_DATA_LOADING=EAGER`` unless the user set it (:func:`run_device_worker`):
a Triton kernel compiled mid-step is loaded whole by its ``cuModuleLoadData``. That alone
did not end the co-located hang seen on a GPU: a replica's host thread blocked inside a
launch (its stream's queue full) held the driver from its own expert thread
(``device_plane.DeviceExperts._pace`` bounds that run-ahead).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import queue
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener

import torch

from megaserve.engine.cuda_graphs import capture_sizes
from megaserve.engine.gc_heap import freeze_for_life
from megaserve.runtime.device_plane import (DeviceExperts, EagerCompletions, ExpertInbox,
                                            ExpertLink, ExpertServer, GraphStep, PlaneShape,
                                            ReplicaInbox, Tick)
from megaserve.runtime.messages import (AbortRequest, AddRequest, RunStep, StepOutputs,
                                        StepReport, Stop, WorkerFailure, WorkerReady,
                                        WorkerStats)
from megaserve.runtime.step_trace import StepTrace
from megaserve.runtime.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.2
# Expert graphs of every participant subset are captured at start-up up to this many
# replicas (2^R - 1 subsets); above it only the full set is, and others on first use.
MAX_REPLICAS_ALL_SUBSETS = 3


def plane_shape(spec: WorkerSpec) -> PlaneShape:
    """The exchange buffers' sizes of ``spec``'s layout (every process computes the same)."""
    config, model = spec.engine, spec.model.config
    return PlaneShape(
        num_workers=spec.placement.num_workers, microbatches=config.microbatches,
        capacity=max(config.max_num_batched_tokens, config.max_num_seqs),
        hidden=model.hidden_size, top_k=model.top_k, num_experts=model.num_experts,
        dtype=spec.model.dtype(config.dtype), num_replicas=spec.num_replicas,
        reduce_on_workers=spec.placement.num_workers == 1)


@dataclass(frozen=True)
class DeviceRoleStats:
    """A device-plane process's counters, sent as it stops (``WorkerStats.stats``)."""

    replica_graph_steps: int = 0  # decode steps its replica ran as one CUDA graph
    replica_eager_ticks: int = 0  # ticks its replica sent as messages of their own
    step_reports: int = 0  # StepReports its replica sent (one per expert worker per step)
    expert_graph_steps: int = 0  # expert graphs its expert role replayed
    expert_ticks: int = 0  # (layer, micro-batch) ticks its expert role served


class StepGate:
    """An expert worker's lockstep: which graph step to run once every participant of a
    global step has reported (pure bookkeeping; the caller launches).

    Reports of different steps may interleave (each replica's socket is ordered, the
    sockets between them are not), so they are kept per step; a replica's second report
    of a step is ignored.
    """

    def __init__(self) -> None:
        self._steps: dict[int, tuple[set[int], dict[int, int]]] = {}

    def add(self, report: StepReport) -> GraphStep | None:
        """Record ``report``; the step's :class:`GraphStep` (rows: the largest, replicas:
        those with a graph) when it was the last one missing and someone runs a graph,
        else None."""
        waiting, rows = self._steps.setdefault(report.step, (set(report.participants), {}))
        if report.replica not in waiting:
            return None
        waiting.discard(report.replica)
        if report.rows is not None:
            rows[report.replica] = report.rows
        if waiting:
            return None
        del self._steps[report.step]
        if not rows:
            return None
        return GraphStep(max(rows.values()), tuple(sorted(rows)))

    @property
    def open_steps(self) -> int:
        """Steps some participant has not reported yet."""
        return len(self._steps)


@contextlib.contextmanager
def sync_debug_mode(mode: str | None):
    """Run the body under ``torch.cuda.set_sync_debug_mode(mode)`` and restore the previous
    mode after it (None: leave the mode as it is)."""
    if mode is None:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class ExpertRole:
    """The expert role of a process: its server, behind one lock (the process's replica
    thread and its socket readers all launch on the server's stream).

    ``own_sync_debug``: the process runs no replica, so a graph step is launched under
    its StepReport's ``sync_debug`` (``torch.cuda.set_sync_debug_mode`` is per process:
    a co-located process's replica thread sets it for the whole step instead)."""

    def __init__(self, server: ExpertServer, own_sync_debug: bool = False) -> None:
        self.server = server
        self.own_sync_debug = own_sync_debug
        self.gate = StepGate()
        self._lock = threading.Lock()
        self.failed: str | None = None
        self.graph_steps = 0

    def receive(self, message, done: EagerCompletions | None = None) -> None:
        """A StepReport (may start a graph step) or a Tick (eager: serve it now; a local
        one's completion event goes to ``done``)."""
        with self._lock:
            if isinstance(message, StepReport):
                step = self.gate.add(message)
                if step is not None:
                    with sync_debug_mode(message.sync_debug if self.own_sync_debug else None):
                        self.server.graph_step(step.rows, step.replicas)
                    self.graph_steps += 1
            elif isinstance(message, GraphStep):  # one replica: no lockstep to gate
                self.server.graph_step(message.rows, message.replicas)
                self.graph_steps += 1
            elif isinstance(message, Tick):
                event = self.server.tick(message.layer, message.microbatch, message.rows,
                                         message.event, message.replica)
                if done is not None:
                    done.put((message.replica, message.layer, message.microbatch), event)
            else:
                raise ValueError(f"expert worker {self.server.index}: unexpected {message!r}")

    def capture_all(self, rows: list[int], subsets: list[tuple[int, ...]]) -> int:
        """Capture the expert graph of every (c, P) now (module HAZARD), each after one
        eager tick of its shape on the server's stream; the number captured."""
        with self._lock:
            captured = sum(self.server.prepare_graph(c, replicas)
                           for replicas in subsets for c in rows)
            self.server.stream.synchronize()
        return captured


class _LocalLink:
    """A co-located replica's messages to its own process's expert role: served on the
    replica's thread (no thread to wake), eager completions through CUDA events."""

    def __init__(self, role: ExpertRole, done: EagerCompletions) -> None:
        self.role, self.done = role, done

    def put(self, message) -> None:
        self.role.receive(message, self.done)


class _SocketLink:
    """A replica's messages to another process's expert role (one ordered socket)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def put(self, message) -> None:
        with self._lock:
            self.conn.send(message)


class ProcessBarrier:
    """The replica side of the lockstep across processes (duck-types
    :class:`~megaserve.runtime.device_plane.StepBarrier` for DeviceExperts): the first
    report of a step goes to every expert worker as a StepReport; later ones (the
    end-of-step report after a graph's) are dropped."""

    def __init__(self, replica: int, links: list) -> None:
        self.replica = replica
        self.links = links  # each with .put(message)
        self._step: int | None = None
        self._participants: tuple[int, ...] = ()
        self._sync_debug: str | None = None
        self._reported = True
        self.host_messages = 0
        self.graph_steps = 0

    def begin(self, step: int, participants: tuple[int, ...],
              sync_debug: str | None = None) -> None:
        """Global step ``step`` of ``participants`` starts (``sync_debug``: its RunStep's,
        passed on in the StepReport)."""
        if self.replica not in participants:
            raise ValueError(f"replica {self.replica} runs step {step} without taking part "
                             f"in it (participants {participants})")
        self._step, self._participants, self._reported = step, tuple(participants), False
        self._sync_debug = sync_debug

    def report(self, replica: int, rows: int | None) -> None:
        if self._reported:
            return
        self._reported = True
        message = StepReport(self._step, self.replica, rows, self._participants,
                             self._sync_debug)
        for link in self.links:
            link.put(message)
        self.host_messages += len(self.links)
        self.graph_steps += rows is not None


def _card(replica: int | None, expert: int | None, replica_inbox, expert_inbox,
          address) -> str:
    from megaserve.comm.cuda_ipc import share_tensor

    def encode(inbox):
        return (base64.b64encode(share_tensor(inbox.storage)).decode()
                if inbox is not None else None)

    return json.dumps({"replica": replica, "expert": expert, "replica_inbox": encode(replica_inbox),
                       "expert_inbox": encode(expert_inbox),
                       "address": list(address) if address is not None else None})


def _subsets(num_replicas: int) -> list[tuple[int, ...]]:
    everyone = tuple(range(num_replicas))
    if num_replicas > MAX_REPLICAS_ALL_SUBSETS:
        return [everyone]
    return [c for n in range(num_replicas, 0, -1)
            for c in itertools.combinations(everyone, n)]


# Prompt lengths of the start-up warm-up (Triton specialises integer arguments on 1, on
# multiples of 16, and the rest).
WARM_UP_PROMPT_LENGTHS = (1, 17, 32)
WARM_UP_TALL_FROM = 64  # above this many rows a linear picks a tall launch by the row count


def warm_up_prompt_lengths(longest: int) -> list[int]:
    """Lengths of the warm-up's one-prompt prefill steps from :data:`WARM_UP_TALL_FROM`
    tokens up to ``longest`` (the largest prefill step the replica can run): 2^i and
    2^i + 1 (Triton's multiple-of-16 specialisation) and ``longest`` itself. Linears choose
    their launch by the row count (``kernels/triton_impl/matmul.py:plan_launch``: the
    cheapest of four tall configurations above 64 rows), so a step of many prompt tokens
    meets kernel variants a short warm-up never compiled. Empty below 64 tokens."""
    lengths, n = [], WARM_UP_TALL_FROM
    while n <= longest:
        lengths += [n, n + 1] if n < longest else [n]
        n *= 2
    if longest > WARM_UP_TALL_FROM and longest not in lengths:
        lengths.append(longest)
    return lengths


@contextlib.contextmanager
def _startup_turn(spec: WorkerSpec):
    """Hold the layout's start-up turn (a host file lock named by its rendezvous round):
    one process at a time builds its engine, compiles and captures, while the others'
    expert roles serve it (module HAZARD)."""
    import fcntl
    import tempfile

    name = f"megaserve-device-start-{spec.rendezvous.replace(':', '-')}.lock"
    with open(os.path.join(tempfile.gettempdir(), name), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _share_of_gpu(spec: WorkerSpec) -> float:
    """gpu_memory_utilization of this replica: the layout's, split among the replicas on
    its GPU (no split where the KV cache size is given)."""
    from megaserve.runtime.layout import worker_devices

    config = spec.engine
    attention, _ = worker_devices(config)
    sharing = max(1, sum(d == spec.device for d in attention))
    return config.gpu_memory_utilization / sharing


def run_device_worker(spec: WorkerSpec, inbox, outbox) -> None:
    """Entry point of a device-plane process (module docstring); failures go to
    ``outbox`` as WorkerFailure."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand (hangs)
    # Before CUDA starts in this process (module docstring: HAZARD).
    os.environ.setdefault("CUDA_MODULE_DATA_LOADING", "EAGER")
    listener = None
    try:
        device = torch.device(spec.device)
        torch.cuda.set_device(device)
        worker = _DeviceWorker(spec, device, outbox)
        listener = worker.listener
        worker.serve(inbox)
    except BaseException as e:  # noqa: BLE001 - forwarded to the front-end
        logger.exception("device %s worker %d failed", spec.role, spec.index)
        outbox.put(WorkerFailure(spec.role, spec.index,
                                 f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
    finally:
        if listener is not None:
            listener.close()


def serve_replica_sockets(listener: Listener, expected: int, receive, failed,
                          device: torch.device | None = None) -> None:
    """Accept ``expected`` replica connections on ``listener`` and hand every message of
    each to ``receive`` (in that socket's order) on a thread of its own, started as soon
    as the socket is accepted; returns once all are accepted. The first exception of a
    reader or of the accepting goes to ``failed``; a closed socket ends its reader.

    Replicas connect during their start-up turns, one at a time, and the first one's
    warm-up ticks need this expert role while the next still waits for its turn:
    accepting every socket before reading any would deadlock with two or more remote
    replicas."""
    def read(conn) -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            while True:
                try:
                    message = conn.recv()
                except EOFError:
                    return
                receive(message)
        except BaseException as e:  # noqa: BLE001 - the caller reports it
            failed(e)

    try:
        for n in range(expected):
            conn = listener.accept()
            threading.Thread(target=read, args=(conn,), daemon=True,
                             name=f"megaserve-replica-socket-{n}").start()
    except BaseException as e:  # noqa: BLE001 - the caller reports it
        failed(e)


@dataclass
class _Peers:
    replica_inboxes: list
    expert_inboxes: list
    addresses: list


class _DeviceWorker:
    """One device-plane process: builds its roles (constructor), then serves."""

    def __init__(self, spec: WorkerSpec, device: torch.device, outbox) -> None:
        from megaserve.comm import exchange
        from megaserve.models.loader import load_model

        self.spec, self.device, self.outbox = spec, device, outbox
        self.shape = shape = plane_shape(spec)
        self.replica = spec.index if spec.role in ("attention", "colocated") else None
        self.expert_index = spec.index if spec.role in ("expert", "colocated") else None
        self.moe_layers = [i for i, moe in enumerate(spec.model.config.moe_layers) if moe]
        part = None
        if self.expert_index is not None:
            part = load_model(spec.model, spec.engine.dtype, spec.device, attention=False,
                              expert_ids=list(spec.placement.workers[self.expert_index]),
                              quantization=spec.engine.quantization).experts
        own_replica = ReplicaInbox(shape, device) if self.replica is not None else None
        own_expert = ExpertInbox(shape, device) if self.expert_index is not None else None
        self.listener = (Listener(("127.0.0.1", 0), authkey=spec.secret)
                         if self.expert_index is not None else None)
        torch.cuda.synchronize()  # the buffers are zeroed before anyone maps them
        world = spec.world_size
        cards = [json.loads(c) for c in exchange(
            spec.rendezvous, spec.rank, world,
            _card(self.replica, self.expert_index, own_replica, own_expert,
                  self.listener.address if self.listener is not None else None),
            timeout_s=spec.channel.connect_timeout_s)]
        peers = self._map_peers(cards, own_replica, own_expert)
        self.expert = None
        self._reader = None
        if self.expert_index is not None:
            server = ExpertServer(part, self.expert_index, shape, own_expert,
                                  peers.replica_inboxes, self.moe_layers, device)
            self.expert = ExpertRole(server, own_sync_debug=self.replica is None)
            remote = sum(1 for c in cards if c["replica"] is not None
                         and c["expert"] != self.expert_index)
            self._reader = threading.Thread(target=self._read_sockets, args=(remote,),
                                            name=f"megaserve-expert-{self.expert_index}",
                                            daemon=True)
            self._reader.start()
        self.engine = self.barrier = self.experts = self.stream = None
        self.trace = StepTrace.from_env(f"{spec.role}{spec.index}")
        with _startup_turn(spec):  # module HAZARD: one process at a time compiles and captures
            if self.replica is not None:
                self._build_replica(peers, own_replica)
            if self.expert is not None:
                sizes = capture_sizes(spec.engine.max_num_seqs, shape.microbatches)
                rows = sorted({b // shape.microbatches for b in sizes})
                captured = self.expert.capture_all(rows, _subsets(shape.num_replicas))
                logger.info("expert worker %d: %d graphs captured", self.expert_index, captured)

    def _map_peers(self, cards, own_replica, own_expert) -> _Peers:
        from megaserve.comm.cuda_ipc import open_tensor

        shape = self.shape
        replicas = [None] * shape.num_replicas
        experts = [None] * shape.num_workers
        addresses = [None] * shape.num_workers
        for card in cards:
            r, e = card["replica"], card["expert"]
            if r is not None:
                replicas[r] = (own_replica if r == self.replica else ReplicaInbox(
                    shape, storage=open_tensor(base64.b64decode(card["replica_inbox"]),
                                               user=self.device)))
            if e is not None:
                addresses[e] = tuple(card["address"])
                experts[e] = (own_expert if e == self.expert_index else ExpertInbox(
                    shape, storage=open_tensor(base64.b64decode(card["expert_inbox"]),
                                               user=self.device)))
        if any(x is None for x in replicas + experts):
            raise RuntimeError("device plane: some roles are missing from the rendezvous")
        return _Peers(replicas, experts, addresses)

    def _build_replica(self, peers: _Peers, own_replica: ReplicaInbox) -> None:
        from megaserve.engine.engine import LLMEngine

        spec, shape = self.spec, self.shape
        links, senders = [], []
        for e in range(shape.num_workers):
            if e == self.expert_index:
                done = EagerCompletions()
                sender = _LocalLink(self.expert, done)
                links.append(ExpertLink(peers.expert_inboxes[e], sender, done))
            else:
                sender = _SocketLink(Client(peers.addresses[e], authkey=spec.secret))
                links.append(ExpertLink(peers.expert_inboxes[e], sender))
            senders.append(sender)
        # One replica: DeviceExperts sends its GraphStep itself (no lockstep).
        self.barrier = ProcessBarrier(self.replica, senders) if shape.num_replicas > 1 else None
        self.experts = DeviceExperts(shape, links, own_replica, spec.placement.owner_table(),
                                     replica=self.replica, barrier=self.barrier)
        changes = {"device": spec.device}
        if spec.engine.kv_cache_memory_bytes is None and spec.engine.num_kv_blocks is None:
            changes["gpu_memory_utilization"] = _share_of_gpu(spec)
        self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            self.engine = LLMEngine(spec.engine.replica(**changes), experts=self.experts,
                                    model=spec.model)
            self.engine.runner.capture_decode_graphs()  # module HAZARD
            self._warm_up_eager_steps()

    def _warm_up_eager_steps(self) -> None:
        """Run one-token requests of a few prompt lengths and sampling kinds eagerly, so
        that the kernels of prefill steps are compiled and loaded now, alone (module
        HAZARD), not by two processes at once inside a step. Counted in the replica's
        stats like any request."""
        from megaserve.sampling_params import SamplingParams

        kinds = [SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, ignore_eos=True),
                 SamplingParams(max_tokens=1, temperature=0.8, top_p=0.95, top_k=20, seed=1,
                                ignore_eos=True)]
        for n, length in enumerate(WARM_UP_PROMPT_LENGTHS):
            for k, params in enumerate(kinds):
                self.engine.add_request(f"megaserve-warm-up-{n}-{k}",
                                        [(7 * i + n) % 100 for i in range(length)], params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        # Tall prefill steps, one prompt each (the prompts above run as one step of ~100
        # tokens): within the step size, the model length and the KV pool.
        engine, config = self.engine, self.spec.engine
        longest = min(config.max_num_batched_tokens, engine.max_model_len - 1,
                      (engine.pool.num_blocks - 1) * config.block_size)
        for n, length in enumerate(warm_up_prompt_lengths(longest)):
            engine.add_request(f"megaserve-warm-up-tall-{n}",
                               [(7 * i + n + 3) % 100 for i in range(length)], kinds[0])
            while engine.has_unfinished_requests():
                engine.step()

    def _read_sockets(self, expected: int) -> None:
        """The expert role's messages from the other processes' replicas
        (:func:`serve_replica_sockets`)."""
        def failed(e: BaseException) -> None:
            logger.error("expert worker %d: socket reader failed", self.expert_index, exc_info=e)
            self.expert.failed = f"{type(e).__name__}: {e}"

        serve_replica_sockets(self.listener, expected, self.expert.receive, failed,
                              self.device)

    def _parent_gone(self) -> bool:
        try:
            os.kill(self.spec.parent_pid, 0)
        except ProcessLookupError:
            return True
        return False

    def serve(self, inbox) -> None:
        """Answer the front-end's commands until Stop (or the front-end is gone)."""
        freeze_for_life()  # this process serves until it exits (megaserve/engine/gc_heap.py)
        self.outbox.put(WorkerReady(self.spec.role, self.spec.index,
                                    self.engine.stats() if self.engine is not None else None))
        while True:
            if self.expert is not None and self.expert.failed is not None:
                raise RuntimeError(f"expert role failed: {self.expert.failed}")
            try:
                message = inbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                if self._parent_gone():
                    return
                continue
            if isinstance(message, Stop):
                # Keyed by rank: a replica and an expert worker may share an index.
                self.outbox.put(WorkerStats(self.spec.role, self.spec.rank, self.stats()))
                return
            if self.engine is None:
                raise ValueError(f"expert worker {self.spec.index}: unexpected {message!r}")
            with torch.cuda.stream(self.stream):
                if isinstance(message, RunStep):
                    self._run_step(message)
                elif isinstance(message, AddRequest):
                    self.engine.add_request(message.request_id, message.token_ids,
                                            message.params, seed=message.seed)
                elif isinstance(message, AbortRequest):
                    out = self.engine.abort_request(message.request_id)
                    if out is not None:
                        self.outbox.put(StepOutputs.of(self.replica, [out], self.engine.stats()))
                else:
                    raise ValueError(f"attention worker {self.replica}: unexpected {message!r}")

    def stats(self) -> DeviceRoleStats:
        plane = self.experts.stats if self.experts is not None else None
        return DeviceRoleStats(
            replica_graph_steps=plane.graph_steps if plane else 0,
            replica_eager_ticks=plane.eager_ticks if plane else 0,
            step_reports=self.barrier.host_messages if self.barrier is not None else 0,
            expert_graph_steps=self.expert.graph_steps if self.expert is not None else 0,
            expert_ticks=self.expert.server.ticks if self.expert is not None else 0)

    def _run_step(self, message: RunStep) -> None:
        if self.trace is not None:
            self.trace.before_step()
        if self.barrier is not None:
            self.barrier.begin(message.step, message.replicas, message.sync_debug)
        with sync_debug_mode(message.sync_debug):
            try:
                outputs = self.engine.step()
            finally:
                if self.barrier is not None:  # a step that ran no MoE layer holds nobody up
                    self.barrier.report(self.replica, None)
        self.outbox.put(StepOutputs.of(self.replica, outputs, self.engine.stats(), stepped=True))
