"""DevicePlaneEngine: R attention replicas and E expert workers over the device data plane.

Each attention replica is an :class:`~megaserve.engine.engine.LLMEngine` in this process,
on a CUDA stream of its own, whose experts are a
:class:`~megaserve.runtime.device_plane.DeviceExperts`. Expert workers are threads of this
process (``transport="inproc"`` with ``disaggregate=True``: each with its own stream; only
the byte mover is local; one replica) or processes (``transport="cuda_ipc"``: the buffers
are CUDA IPC mappings; ``tcp``, ``rdma``, ``nccl``: relayed, megaserve.comm.relay). Either
way, decode steps are one CUDA graph per role and one host message per expert worker
(megaserve.runtime.device_plane).

Several replicas step in lockstep: each global step, every replica with requests runs its
step on a thread of its own, and a :class:`~megaserve.runtime.device_plane.StepBarrier`
starts the expert workers' graph step over all of their rows. A new request goes where
megaserve.runtime.routing puts it (cache-aware where prefix caching is on, else the least
outstanding work); its seed is derived here from the arrival order, as the single engine
derives it, so outputs never depend on the replica. With R > 1 the replicas capture every
decode graph size at start-up: a capture synchronises the device, which must never happen
while another replica's stream waits for the expert workers.

``make_engine`` builds this front-end for one attention replica, and for several over
relayed links; several over ``cuda_ipc`` run as processes instead, one per replica
(megaserve.runtime.device_workers, driven by ``DisaggregatedEngine``). Constructed
directly (benchmarks), this class still runs several ``cuda_ipc`` replicas as threads.

It implements :class:`~megaserve.runtime.engine_client.EngineClient`, so ``LLM`` and
``AsyncLLMEngine`` use it unchanged. Raises ``ValueError`` for a layout it does not run
(CPU, nccl with the expert workers on the replicas' GPU, several replicas with in-process
expert workers).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch

from megaserve.comm import ChannelConfig, RendezvousServer, create_endpoint, exchange
from megaserve.comm.relay import Mailboxes, Relay, Route
from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import EngineStats, LLMEngine, Prompt, derive_seed
from megaserve.engine.gc_heap import freeze_for_life
from megaserve.models.loader import load_model
from megaserve.models.resolved import ResolvedModel
from megaserve.outputs import RequestOutput
from megaserve.runtime.device_plane import (DeviceExperts, EagerCompletions, ExpertInbox,
                                            ExpertLink, ExpertServer, PlaneShape, RelaySlots,
                                            ReplicaInbox, StepBarrier, Stop, WorkerFailed,
                                            WorkerReady)
from megaserve.runtime.engine_client import EngineClient
from megaserve.runtime.layout import device_plane_reason
from megaserve.runtime.placement import ExpertPlacement
from megaserve.runtime.routing import replica_router
from megaserve.runtime.step_trace import START_FILE, TRACE_ENV
from megaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class ExpertWorkerSpec:
    """What an expert worker process needs (picklable)."""

    index: int
    model: ResolvedModel  # the front-end's resolution (never re-resolved in the worker)
    dtype: str
    device: str
    expert_ids: tuple[int, ...]
    shape: PlaneShape
    moe_layers: tuple[int, ...]
    replica_handles: tuple[bytes, ...]  # each replica's ReplicaInbox (cuda_ipc.share_tensor)
    parent_pid: int
    # tcp / rdma / nccl: relayed links (megaserve.comm.relay) instead of IPC handles; the
    # front-end is rank 0 of the endpoint group, expert worker e rank 1 + e.
    transport: str = "cuda_ipc"
    rendezvous: str | None = None
    channel: ChannelConfig | None = None
    # torch.cuda.set_sync_debug_mode of the serving loop ("error": tests prove that the
    # expert role never synchronises with the host while it serves)
    sync_debug: str = "default"
    quantization: str | None = None  # EngineConfig.quantization: the replica's weights



def expert_device(requested: str, replica: torch.device, index: int) -> str:
    """Expert worker ``index``'s GPU: with ``device="cuda"`` and several GPUs visible, the
    GPUs after the replica's, round-robin (the replica keeps its GPU to itself while there
    are others); with one GPU or ``cuda:N``, the replica's GPU."""
    count = torch.cuda.device_count()
    if requested != "cuda" or count < 2:
        return str(replica)
    others = [d for d in range(count) if d != replica.index]
    return f"cuda:{others[index % len(others)]}"


def _load_experts(model: ResolvedModel, dtype: str, device: str, expert_ids,
                  quantization: str | None = None) -> object:
    return load_model(model, dtype, device, attention=False,
                      expert_ids=list(expert_ids), quantization=quantization).experts


def _endpoint_options(transport: str, device) -> dict:
    return {"device": str(device)} if transport == "nccl" else {}


def _mailbox_device(transport: str, device) -> str:
    """nccl moves device memory (fixed-size frames); tcp and rdma send from host memory."""
    return str(device) if transport == "nccl" else "cpu"


def _front_mailbox(shape: PlaneShape, replica: int, worker: int, microbatch: int) -> int:
    """The front-end's mailbox of (replica, expert worker, micro-batch), in both directions:
    the worker's routes name it, and replica r's RelaySlots start at (r, 0, 0)."""
    return (replica * shape.num_workers + worker) * shape.microbatches + microbatch


def _worker_relay(spec: ExpertWorkerSpec) -> tuple[Relay, RelaySlots]:
    """Expert worker ``spec.index``'s end of the host-proxied links: its endpoint (rank
    1 + index), mailboxes per (replica, micro-batch) and the relay threads."""
    shape, m = spec.shape, spec.shape.microbatches
    world = 1 + shape.num_workers
    endpoint = create_endpoint(spec.transport, 1 + spec.index, world, spec.channel,
                               **_endpoint_options(spec.transport, spec.device))
    endpoint.connect(exchange(spec.rendezvous, 1 + spec.index, world, endpoint.address,
                              timeout_s=STARTUP_TIMEOUT_S),
                     send_to=[0])
    Relay.warm_up(endpoint, [0], timeout_s=STARTUP_TIMEOUT_S)
    dispatch, combine = RelaySlots.layouts(shape)
    where = _mailbox_device(spec.transport, spec.device)
    slots = RelaySlots(Mailboxes(combine, shape.num_replicas * m, where),
                       Mailboxes(dispatch, shape.num_replicas * m, where), m)
    routes = [Route(local=slots.index(r, i), dst=0,
                    remote=_front_mailbox(shape, r, spec.index, i))
              for r in range(shape.num_replicas) for i in range(m)]
    return Relay(endpoint, slots.outgoing, routes, slots.incoming), slots


TRACED_STEPS = 3


def _traced_graph_steps(server: ExpertServer, trace_dir: str):
    """``server.graph_step``, wrapped for benchmarks: once the file ``<trace_dir>/start``
    exists, the next :data:`TRACED_STEPS` graph steps run under torch.profiler and their
    kernel timeline goes to ``<trace_dir>/expert<index>.json`` (chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    step = server.graph_step
    state = {"prof": None, "left": TRACED_STEPS, "done": False}

    def traced(rows: int, replicas: tuple[int, ...] = (0,)) -> None:
        if state["done"] or (state["prof"] is None
                             and not os.path.exists(os.path.join(trace_dir, START_FILE))):
            return step(rows, replicas)
        if state["prof"] is None:
            state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["prof"].__enter__()
        step(rows, replicas)
        state["left"] -= 1
        if state["left"] == 0:
            server.stream.synchronize()
            state["prof"].__exit__(None, None, None)
            state["prof"].export_chrome_trace(
                os.path.join(trace_dir, f"expert{server.index}.json"))
            state["done"] = True

    return traced


def run_expert_process(spec: ExpertWorkerSpec, messages, replies) -> None:
    """Entry point of an expert worker process (``cuda_ipc``; tcp, rdma, nccl: relayed)."""
    from megaserve.comm.cuda_ipc import open_tensor, share_tensor

    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand (hangs)
    relay = None
    try:
        device = torch.device(spec.device)
        torch.cuda.set_device(device)
        part = _load_experts(spec.model, spec.dtype, spec.device, spec.expert_ids, spec.quantization)
        inbox = ExpertInbox(spec.shape, device)
        if spec.transport == "cuda_ipc":
            replicas = [ReplicaInbox(spec.shape, storage=open_tensor(handle, user=device))
                        for handle in spec.replica_handles]
            slots = None
        else:  # this process's copies of the replicas' slots, sent from host memory
            replicas = [ReplicaInbox(spec.shape, device)
                        for _ in range(spec.shape.num_replicas)]
            relay, slots = _worker_relay(spec)
        server = ExpertServer(part, spec.index, spec.shape, inbox, replicas,
                              list(spec.moe_layers), device, relay=slots)
        trace_dir = os.environ.get(TRACE_ENV)
        if trace_dir:
            server.graph_step = _traced_graph_steps(server, trace_dir)
        torch.cuda.synchronize()
        handle = share_tensor(inbox.storage) if spec.transport == "cuda_ipc" else None
        freeze_for_life()  # this process serves until it exits (megaserve/engine/gc_heap.py)
        replies.put(WorkerReady(spec.index, handle))

        def parent_gone() -> bool:
            try:
                os.kill(spec.parent_pid, 0)
            except ProcessLookupError:
                return True
            return False

        torch.cuda.set_sync_debug_mode(spec.sync_debug)
        try:
            server.serve(messages, None, parent_gone)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    except BaseException as e:  # noqa: BLE001 - reported to the front-end
        logger.exception("expert worker %d failed", spec.index)
        replies.put(WorkerFailed(spec.index, f"{type(e).__name__}: {e}"))
    finally:
        if relay is not None:
            relay.close()
            relay.endpoint.close()


class DevicePlaneEngine(EngineClient):
    """Front-end; see the module docstring.

    Besides :class:`~megaserve.runtime.engine_client.EngineClient`'s attributes it holds
    ``model_path`` and ``model_config`` (the resolved checkpoint), ``engines`` (the
    replicas' LLMEngines, ``engine`` the first), ``experts`` / ``experts_by_replica``
    (their DeviceExperts), ``servers`` (in-process expert workers) and ``placement``.
    """

    def __init__(self, config: EngineConfig, placement: ExpertPlacement | None = None,
                 timeout_s: float = 60.0, profile: bool = False,
                 sync_debug: str = "default", model: ResolvedModel | None = None) -> None:
        """``profile``: record wait times and GEMM sizes (benchmarks; in-process workers).
        ``sync_debug``: torch.cuda.set_sync_debug_mode of expert processes while they
        serve ("error" in tests: any host synchronisation there fails the worker).
        ``model``: ``config.model`` resolved by the caller (None: resolved here); the
        replicas and expert workers receive this one."""
        reason = device_plane_reason(config)
        if reason is not None:
            raise ValueError(reason)
        self.resolved_model = model or ResolvedModel.resolve(config.model)
        path, model_config = self.resolved_model.path, self.resolved_model.config
        if placement is None:
            placement = (ExpertPlacement(model_config.num_experts, config.expert_placement)
                         if config.expert_placement is not None
                         else ExpertPlacement.even(model_config.num_experts, config.expert_workers))
        self.placement = placement
        self.device = torch.device(config.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        num_replicas = config.attention_replicas
        self.shape = PlaneShape(
            num_workers=placement.num_workers, microbatches=config.microbatches,
            capacity=max(config.max_num_batched_tokens, config.max_num_seqs),
            hidden=model_config.hidden_size, top_k=model_config.top_k,
            num_experts=model_config.num_experts,
            dtype=self.resolved_model.dtype(config.dtype), num_replicas=num_replicas,
            reduce_on_workers=placement.num_workers == 1)
        self.moe_layers = [i for i, moe in enumerate(model_config.moe_layers) if moe]
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._processes: list = []
        self._queues: list = []
        self._stop = threading.Event()
        self.replica_inboxes = [ReplicaInbox(self.shape, self.device) for _ in range(num_replicas)]
        self.servers: list[ExpertServer] = []  # in-process workers (for stats and tests)
        self.profile = profile
        self.sync_debug = sync_debug
        self.config = config
        self.model_name = config.model
        self._router = replica_router(config, self.resolved_model)
        self._arrivals = itertools.count()
        self._pool: ThreadPoolExecutor | None = None
        self.relay: Relay | None = None  # tcp / rdma / nccl: relayed links
        self._rendezvous: RendezvousServer | None = None
        try:
            if config.transport == "inproc":
                links = self._start_threads(config)
            else:
                links = self._start_processes(config)
            self.barrier = StepBarrier(links) if num_replicas > 1 else None
            replica = {"model": str(path)}
            if num_replicas > 1 and config.kv_cache_memory_bytes is None \
                    and config.num_kv_blocks is None:  # the replicas share the GPU's share
                replica["gpu_memory_utilization"] = config.gpu_memory_utilization / num_replicas
            engine_config = config.replica(**replica)
            self.experts_by_replica: list[DeviceExperts] = []
            self.engines: list[LLMEngine] = []
            self.streams: list[torch.cuda.Stream] = []
            for r in range(num_replicas):
                relay = None
                if self.relay is not None:
                    relay = RelaySlots(self.relay.outgoing, self.relay.incoming,
                                       self.shape.microbatches,
                                       base=_front_mailbox(self.shape, r, 0, 0))
                experts = DeviceExperts(self.shape, links, self.replica_inboxes[r],
                                        placement.owner_table(), timeout_s=timeout_s,
                                        profile=profile, replica=r, barrier=self.barrier,
                                        relay=relay)
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(stream):
                    engine = LLMEngine(engine_config, experts=experts, model=self.resolved_model)
                    if num_replicas > 1:  # module docstring: no capture while others step
                        engine.runner.capture_decode_graphs()
                self.experts_by_replica.append(experts)
                self.engines.append(engine)
                self.streams.append(stream)
            self.experts, self.engine, self.stream = (self.experts_by_replica[0],
                                                      self.engines[0], self.streams[0])
            # The same on every replica (one checkpoint, one engine config).
            self.tokenizer = self.engine.tokenizer
            self.max_model_len = self.engine.max_model_len
            self.vocab_size = self.engine.vocab_size
            self.eos_token_ids = self.engine.eos_token_ids
            self.model_path = self.engine.model_path
            self.model_config = self.engine.model_config
            if num_replicas > 1:
                self._pool = ThreadPoolExecutor(num_replicas, thread_name_prefix="megaserve-replica",
                                                initializer=torch.cuda.set_device,
                                                initargs=(self.device,))
        except BaseException:
            self.shutdown()
            raise

    # -- workers ----------------------------------------------------------------------

    def _start_threads(self, config: EngineConfig) -> list[ExpertLink]:
        links = []
        for index, expert_ids in enumerate(self.placement.workers):
            part = _load_experts(self.resolved_model, config.dtype, config.device, expert_ids, config.quantization)
            inbox = ExpertInbox(self.shape, self.device)
            server = ExpertServer(part, index, self.shape, inbox, self.replica_inboxes,
                                  self.moe_layers, self.device, profile=self.profile)
            messages: queue.Queue = queue.Queue()
            done = EagerCompletions()
            thread = threading.Thread(
                target=self._serve_thread, args=(server, messages, done),
                name=f"megaserve-expert-{index}", daemon=True)
            thread.start()
            self.servers.append(server)
            self._threads.append(thread)
            self._queues.append(messages)
            links.append(ExpertLink(inbox, messages, done, server))
        torch.cuda.synchronize()  # buffers zeroed before any flag is read
        return links

    def _serve_thread(self, server: ExpertServer, messages, done: EagerCompletions) -> None:
        torch.cuda.set_device(self.device)
        try:
            server.serve(messages, done, self._stop.is_set)
        except BaseException:  # noqa: BLE001 - surfaced to the replica through `done`
            logger.exception("expert worker %d failed", server.index)

    def _relay_channel(self) -> ChannelConfig:
        """Slots big enough for a full mailbox, one per (replica, micro-batch) in flight."""
        dispatch, combine = RelaySlots.layouts(self.shape)
        slot_bytes = max(dispatch.payload_bytes(self.shape.capacity),
                         combine.payload_bytes(self.shape.capacity))
        return ChannelConfig(slot_bytes=slot_bytes,
                             slots_per_peer=self.shape.num_replicas * self.shape.microbatches,
                             connect_timeout_s=STARTUP_TIMEOUT_S)

    def _start_relay(self, transport: str, channel: ChannelConfig) -> None:
        """The front-end's end of the host-proxied links (rank 0): mailboxes per
        (replica, expert worker, micro-batch) and the relay threads."""
        shape, m = self.shape, self.shape.microbatches
        workers = shape.num_workers
        endpoint = create_endpoint(transport, 0, 1 + workers, channel,
                                   **_endpoint_options(transport, self.device))
        try:
            endpoint.connect(exchange(self._rendezvous.address, 0, 1 + workers, endpoint.address,
                                      timeout_s=STARTUP_TIMEOUT_S),
                             send_to=range(1, 1 + workers))
            Relay.warm_up(endpoint, list(range(1, 1 + workers)), timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            endpoint.close()
            raise
        dispatch, combine = RelaySlots.layouts(shape)
        n = shape.num_replicas * workers * m
        routes = [Route(local=_front_mailbox(shape, r, e, i), dst=1 + e, remote=r * m + i)
                  for r in range(shape.num_replicas) for e in range(workers) for i in range(m)]
        where = _mailbox_device(transport, self.device)
        self.relay = Relay(endpoint, Mailboxes(dispatch, n, where), routes,
                           Mailboxes(combine, n, where))

    def _start_processes(self, config: EngineConfig) -> list[ExpertLink]:
        from megaserve.comm.cuda_ipc import open_tensor, share_tensor

        relayed = config.transport != "cuda_ipc"
        ctx = multiprocessing.get_context("spawn")
        self._replies = ctx.Queue()
        torch.cuda.synchronize()  # the replicas' buffers are zeroed before they are shared
        handles, channel = (), None
        if relayed:
            self._rendezvous = RendezvousServer(1 + self.placement.num_workers,
                                                timeout_s=STARTUP_TIMEOUT_S)
            channel = self._relay_channel()
        else:
            handles = tuple(share_tensor(inbox.storage) for inbox in self.replica_inboxes)
        for index, expert_ids in enumerate(self.placement.workers):
            device = expert_device(config.device, self.device, index)
            spec = ExpertWorkerSpec(index, self.resolved_model, config.dtype, device,
                                    tuple(expert_ids), self.shape, tuple(self.moe_layers),
                                    handles, os.getpid(), config.transport,
                                    self._rendezvous.address if relayed else None, channel,
                                    self.sync_debug, quantization=config.quantization)
            messages = ctx.Queue()
            process = ctx.Process(target=run_expert_process, args=(spec, messages, self._replies),
                                  name=f"megaserve-expert-{index}", daemon=True)
            process.start()
            self._processes.append(process)
            self._queues.append(messages)
        if relayed:
            self._start_relay(config.transport, channel)
        inboxes: dict[int, ExpertInbox] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(inboxes) < len(self._processes):
            try:
                message = self._replies.get(timeout=1.0)
            except queue.Empty:
                self._check_processes()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"expert workers did not start within {STARTUP_TIMEOUT_S:.0f}s")
                continue
            if isinstance(message, WorkerFailed):
                raise RuntimeError(f"expert worker {message.index} failed: {message.reason}")
            inboxes[message.index] = (ExpertInbox(self.shape, self.device) if relayed else
                                      ExpertInbox(self.shape,
                                                  storage=open_tensor(message.inbox_handle,
                                                                      user=self.device)))
        return [ExpertLink(inboxes[i], self._queues[i]) for i in range(len(self._processes))]

    def _check_processes(self) -> None:
        dead = [p.name for p in self._processes if not p.is_alive()]
        if dead and not self._closed:
            from megaserve.runtime.cluster import WorkerError

            raise WorkerError(f"{', '.join(dead)} exited unexpectedly")

    def shutdown(self) -> None:
        """Stop the expert workers (idempotent); kills processes that do not exit in time."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for messages in self._queues:
            messages.put(Stop())
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in [*self._threads, *self._processes]:
            worker.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                logger.warning("killing %s after %.0fs", process.name, STOP_GRACE_S)
                process.kill()
                process.join(5)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self.relay is not None:
            self.relay.close()
            self.relay.endpoint.close()
        if self._rendezvous is not None:
            self._rendezvous.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass

    # -- the engine interface -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One global step of every replica with requests (each on its stream); raises
        WorkerError for a dead worker, CommTimeoutError for one that stopped answering."""
        self._check_processes()
        participants = [r for r, engine in enumerate(self.engines)
                        if engine.has_unfinished_requests()]
        if len(self.engines) == 1 or not participants:
            outputs = self._replica_step(0) if participants else []
        else:
            self.barrier.begin(participants)
            futures = [self._pool.submit(self._replica_step, r) for r in participants]
            outputs, error = [], None
            for future in futures:  # every replica's step ends before this one does
                try:
                    outputs += future.result()
                except BaseException as e:  # noqa: BLE001 - the first one is raised below
                    error = error or e
            if error is not None:
                raise error
        for out in outputs:
            if out.finished:
                self._router.forget(out.request_id)
        return outputs

    def _replica_step(self, replica: int):
        try:
            with torch.cuda.stream(self.streams[replica]):
                return self.engines[replica].step()
        finally:
            if self.barrier is not None:  # a step that ran no MoE layer holds nobody up
                self.barrier.report(replica, None)

    @property
    def runner(self):
        """Replica 0's ModelRunner, for warming up its decode graphs before serving (with
        several replicas every replica captured them at start-up)."""
        return self.engine.runner

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids (every replica validates alike: one config)."""
        return self.engine.validate(prompt, params)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    seed: int | None = None) -> None:
        """Queue a request on a replica (megaserve.runtime.routing: cache-aware, else the
        least outstanding work)."""
        if request_id in self._router:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids = self.engine.validate(prompt, params)
        arrival = next(self._arrivals)
        if seed is None:
            seed = derive_seed(self.config.seed, arrival)
        replica = self._router.place(request_id, ids, params.max_tokens)
        try:
            with torch.cuda.stream(self.streams[replica]):
                self.engines[replica].add_request(request_id, prompt, params, seed)
        except BaseException:
            self._router.forget(request_id)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        replica = self._router.owner(request_id)
        if replica is None:
            return None
        with torch.cuda.stream(self.streams[replica]):
            out = self.engines[replica].abort_request(request_id)
        self._router.forget(request_id)
        return out

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines)

    def stats(self) -> EngineStats:
        """The replicas' stats, summed."""
        every = [engine.stats() for engine in self.engines]
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in every)
                              for f in fields(EngineStats)})
