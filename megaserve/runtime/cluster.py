"""DisaggregatedEngine: the front-end over R attention replicas and E expert workers
(or N co-located workers, each both: megaserve.runtime.layout).

It implements :class:`~megaserve.runtime.engine_client.EngineClient`, so ``LLM`` and
``AsyncLLMEngine`` use it unchanged. Requests go to the replica with the least outstanding work; each replica
steps on its own and streams its outputs back, so a long prefill on one replica never
holds the others. Unseeded requests get their seed here, from the arrival order, so the
replica that serves a request cannot change its output.

With ``transport="inproc"`` workers are threads of this process; otherwise each worker is
a spawned process on this host. Shutdown stops them and kills stragglers; a worker whose
parent dies exits by itself.
"""

from __future__ import annotations

import itertools
import logging
import functools
import signal
import threading
import time
from dataclasses import fields, replace

from megaserve.comm import ChannelConfig, RendezvousServer
from megaserve.engine.config import EngineConfig
from megaserve.engine.memory import check_host_kv_memory
from megaserve.engine.engine import (EngineStats, Prompt, derive_seed, load_tokenizer,
                                     resolve_eos_token_ids, resolve_max_model_len,
                                     validate_prompt)
from megaserve.models.resolved import ResolvedModel
from megaserve.outputs import RequestOutput
from megaserve.runtime.engine_client import EngineClient
from megaserve.runtime.frames import frame_bytes
from megaserve.runtime.placement import ExpertPlacement
from megaserve.runtime.routing import replica_router
from megaserve.engine.output_processor import OutputProcessor
from megaserve.runtime.launcher import WorkerLauncher, make_launcher
from megaserve.runtime.messages import (AbortRequest, AddRequest, RunStep, StepOutputs,
                                        WorkerFailure, WorkerReady, WorkerStats,
                                        unpack_output)
from megaserve.runtime.recovery import (InFlightTable, LivenessWatch, RestartBudget,
                                        RestartPolicy, WorkerHealth, add_counters, restarted,
                                        worker_params)
from megaserve.runtime.layout import (comm_world, ready_messages, runs_device_roles,
                                      transport_refusal, worker_specs)
from megaserve.runtime.worker_spec import WorkerSpec
from megaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
# How long a failure that names a lost peer waits to see that peer's process dead: one the
# kernel kills closes its sockets a moment before it can be reaped.
PEER_DEATH_WAIT_S = 1.0


class WorkerError(RuntimeError):
    """A worker failed or disappeared; the engine cannot continue."""


def exit_note(handle) -> str | None:
    """How a worker's process ended ("killed by SIGKILL ...", "exit code 1"), or None while
    it runs or where the launcher does not say (threads, Ray actors)."""
    code = getattr(handle, "exitcode", None)
    if code is None:
        return None
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (out of memory? the kernel's OOM killer sends it: see dmesg)" if -code == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


def _killed(handles) -> list[str]:
    """'NAME was killed by SIG...' for every worker process a signal ended."""
    return [f"{h.name} was {note}" for h in handles
            if (note := exit_note(h)) is not None and note.startswith("killed")]


def _check_host_kv_memory(config: EngineConfig) -> None:
    """Raise ``ValueError`` where the KV pools of the CPU workers this host would start
    (one per attention replica or whole engine) do not fit in its memory together: each
    worker checks its own pool, but workers starting at once each see the host free
    (megaserve.engine.memory.check_host_kv_memory). Pools sized by
    ``kv_cache_memory_bytes`` are checked here; the others by each worker alone."""
    if (config.device != "cpu" or config.launcher != "local"
            or config.kv_cache_memory_bytes is None):
        return
    check_host_kv_memory(config.kv_cache_memory_bytes, config.attention_replicas,
                         "kv_cache_memory_bytes")


def _locked(method):
    """Run ``method`` holding the engine lock (the liveness watch restarts workers from
    its own thread)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class DisaggregatedEngine(EngineClient):
    """Front-end engine over the workers of any layout of :mod:`megaserve.runtime.layout`
    (disaggregated, co-located expert parallelism, data parallelism); see the module
    docstring. Raises ``ValueError`` for bad config."""

    def __init__(self, config: EngineConfig, placement: ExpertPlacement | None = None,
                 launcher: WorkerLauncher | None = None,
                 restart_policy: RestartPolicy | None = None,
                 model: ResolvedModel | None = None) -> None:
        if config.transport == "rdma":
            from megaserve.comm.rdma import rdma_unavailable

            reason = rdma_unavailable()
            if reason is not None:
                raise ValueError(f"transport 'rdma': {reason}; use tcp")
        refusal = transport_refusal(config)
        if refusal is not None:
            raise ValueError(refusal)
        _check_host_kv_memory(config)
        self.resolved_model = model or ResolvedModel.resolve(config.model)
        path = self.resolved_model.path
        self.model_config = self.resolved_model.config
        num_experts = self.model_config.num_experts
        if placement is None and config.expert_placement is not None:
            placement = ExpertPlacement(num_experts, config.expert_placement)
        self.placement = placement or ExpertPlacement.even(num_experts, config.expert_workers)
        self.model_path = path
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.config = replace(config, model=str(path), max_model_len=self.max_model_len)
        self.tokenizer = load_tokenizer(path)
        self.model_name = config.model
        self.vocab_size = self.model_config.vocab_size
        self._arrivals = itertools.count()
        self._router = replica_router(config, self.resolved_model)
        self._prompts: dict[str, str | None] = {}  # text prompts (replicas only see ids)
        self._stats: list[EngineStats | None] = [None] * config.attention_replicas
        self.expert_stats: dict[int, object] = {}
        self._closed = False
        self._launcher = launcher  # where workers run (default: from config.launcher)
        # Recovery from a lost worker (megaserve.runtime.recovery).
        self.eos_token_ids = resolve_eos_token_ids(self.tokenizer, self.model_config)
        self._in_flight = InFlightTable(OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                        self.max_model_len))
        self._budget = RestartBudget(restart_policy or RestartPolicy())
        self._health = WorkerHealth("serving")
        self._lock = threading.RLock()
        self._starting = True  # worker failures while (re)starting raise instead of recovering
        self._generation = 0  # bumped by every group restart
        self._ended: list[RequestOutput] = []  # final outputs produced by a recovery
        self._retired: EngineStats | None = None  # counters of replaced worker groups
        self._watch = None
        # Device-plane roles (megaserve.runtime.device_workers) always step in lockstep:
        # their expert graphs serve every participant of a global step at once.
        self.device_roles = runs_device_roles(config)
        self._lockstep = config.aggregation == "lockstep" or self.device_roles
        self._steps = itertools.count()
        # torch.cuda.set_sync_debug_mode the device roles run their steps under (None:
        # theirs; tests set "error" for steady decode steps).
        self.step_sync_debug: str | None = None
        self._start_workers()
        self._watch = LivenessWatch(self._lost_workers, self._on_loss)

    # -- lifecycle --------------------------------------------------------------------

    def _channel(self) -> ChannelConfig:
        cfg = self.model_config
        itemsize = self.resolved_model.dtype(self.config.dtype).itemsize
        tokens = self.config.max_num_batched_tokens
        size = frame_bytes(tokens, tokens * cfg.top_k, cfg.hidden_size, itemsize)
        return ChannelConfig(slot_bytes=size, slots_per_peer=self.config.microbatches + 1,
                             timeout_s=120.0, connect_timeout_s=STARTUP_TIMEOUT_S)

    def _worker_specs(self) -> list[WorkerSpec]:
        """A fresh rendezvous round, and one WorkerSpec per worker to meet there."""
        world = comm_world(self.config)
        if self._rendezvous is not None:
            self._rendezvous.close()
        # The round stays open as long as workers may take to start (STARTUP_TIMEOUT_S):
        # its 60 s default closed it under a late Ray actor on a loaded host.
        self._rendezvous = (RendezvousServer(world, host=self._launcher.rendezvous_host,
                                             timeout_s=STARTUP_TIMEOUT_S)
                            if world else None)
        address = self._rendezvous.address if world else ""
        return worker_specs(self.config, self.resolved_model, self.placement, address,
                            self._channel())

    def _start_workers(self) -> None:
        self._launcher = self._launcher or make_launcher(
            self.config.launcher, use_processes=self.config.transport != "inproc",
            ray_address=self.config.ray_address)
        self._rendezvous = None
        self._group = None
        try:
            self._group = self._launcher.start(self._worker_specs())
            self._await_ready(ready_messages(self.config))
        except BaseException:
            self.shutdown()
            raise
        self._starting = False

    def health(self) -> WorkerHealth:
        """Whether every worker is up ("serving"), a lost one is being replaced
        ("recovering"), or the engine gave up ("failed"); thread-safe, never blocks."""
        return self._health

    def _lost_workers(self) -> list[str]:
        """The liveness watch's poll: names of dead workers of the current group."""
        if self._closed or self._starting or self._health.state == "failed":
            return []
        return self._group.dead()

    def _on_loss(self, names: list[str]) -> None:
        """The liveness watch found dead workers: report it at once, then recover."""
        self._health = WorkerHealth("recovering", f"{', '.join(names)} exited unexpectedly",
                                    self._budget.total)
        with self._lock:
            if self._closed:
                return
            dead = self._group.dead()
            if not dead:  # the engine thread recovered first
                if self._health.state == "recovering":
                    self._health = WorkerHealth("serving", None, self._budget.total)
                return
            try:
                self._recover(self._exit_reason(dead))
            except WorkerError:
                pass  # health says why; the next step() raises it

    def _recover(self, reason: str) -> None:
        """Replace the worker group and re-run every in-flight request (see
        megaserve.runtime.recovery). Raises WorkerError once the restart budget is spent."""
        if self.config.transport == "inproc":
            # Worker threads cannot be killed and replaced: a failed one is a bug to report.
            self._health = WorkerHealth("failed", reason, self._budget.total)
            raise WorkerError(reason)
        while True:
            if not self._budget.take():
                policy = self._budget.policy
                self._health = WorkerHealth(
                    "failed", f"{reason}; gave up after {policy.max_restarts} restarts within "
                    f"{policy.window_s:.0f}s", self._budget.total)
                logger.error("workers: %s", self._health.reason)
                raise WorkerError(self._health.reason)
            self._health = WorkerHealth("recovering", reason, self._budget.total)
            logger.warning("workers: %s; restarting the worker group (restart %d)",
                           reason, self._budget.total)
            try:
                self._restart_group()
                break
            except (WorkerError, RuntimeError) as e:
                reason = f"restart failed: {e}"
        self._generation += 1
        reruns, ended = self._in_flight.resume()
        for out in ended:
            self._forget(out.request_id)
        self._ended += ended
        for request_id, ids, params, seed in reruns:
            self._group.handles[self._router.owner(request_id)].send(
                AddRequest(request_id, ids, worker_params(params), seed))
        logger.warning("workers: back, re-running %d request(s)", len(reruns))
        self._health = WorkerHealth("serving", None, self._budget.total)

    def _restart_group(self) -> None:
        for stats in filter(None, self._stats):
            self._retired = add_counters(stats, self._retired)
        self._stats = [restarted(s) if s is not None else None for s in self._stats]
        self._starting = True
        try:
            self._group = self._launcher.restart(self._group, self._worker_specs())
            self._await_ready(ready_messages(self.config))
        finally:
            self._starting = False

    def _await_ready(self, world: int) -> None:
        ready = 0
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while ready < world:
            message = self._next_message(max(0.1, deadline - time.monotonic()))
            if message is None:
                raise WorkerError(f"workers did not start within {STARTUP_TIMEOUT_S:.0f}s")
            if isinstance(message, WorkerReady):
                ready += 1
                if message.role == "attention" and message.stats is not None:
                    self._stats[message.index] = message.stats

    def shutdown(self) -> None:
        """Stop every worker (idempotent); kills processes that do not exit in time."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_watch", None) is not None:
            self._watch.stop()
        with self._lock:  # after a restart in progress, so its workers are stopped too
            if self._group is not None:
                self._group.stop(STOP_GRACE_S)
                self._drain_stats()
            if self._rendezvous is not None:
                self._rendezvous.close()
            if self._launcher is not None:
                self._launcher.close()

    @property
    def _workers(self) -> list:
        """The running workers' handles (``name``; ``pid`` for local processes)."""
        return self._group.handles if self._group is not None else []

    def _drain_stats(self) -> None:
        while True:
            message = self._group.receive(0)
            if message is None:
                return
            if isinstance(message, WorkerStats):
                self.expert_stats[message.index] = message.stats

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass

    # -- requests ---------------------------------------------------------------------

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        return validate_prompt(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len)

    @_locked
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    seed: int | None = None) -> None:
        if request_id in self._router:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids = self.validate(prompt, params)
        arrival = next(self._arrivals)
        if seed is None:
            seed = derive_seed(self.config.seed, arrival)
        replica = self._router.place(request_id, ids, params.max_tokens)
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        self._in_flight.added(request_id, self._prompts[request_id], ids, params, seed)
        self._group.handles[replica].send(AddRequest(request_id, ids, worker_params(params),
                                                     seed))

    @_locked
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ask the owning replica to abort; its "abort" output arrives through step()."""
        replica = self._router.owner(request_id)
        if replica is not None:
            self._in_flight.aborting(request_id)
            self._group.handles[replica].send(AbortRequest(request_id))
        return None

    def has_unfinished_requests(self) -> bool:
        return len(self._router) > 0

    @_locked
    def step(self, timeout: float = 0.05) -> list[RequestOutput]:
        """Outputs that replicas produced since the last call. Per-layer aggregation:
        whatever arrived, waiting up to ``timeout`` for the first. Lockstep: one global
        step of every replica with work. A lost worker is replaced (in-flight requests
        continue); raises :class:`WorkerError` once that is impossible."""
        if self._health.state == "failed":
            raise WorkerError(self._health.reason)
        outputs, self._ended = self._ended, []
        if self._lockstep:
            return outputs + self._lockstep_step()
        message = self._next_message(timeout)
        while message is not None:
            outputs += self._accept(message)
            message = self._next_message(0)
        return outputs

    def _lockstep_step(self) -> list[RequestOutput]:
        """Announce a step to every replica with requests; wait until all have run it."""
        participants = self._router.busy_replicas()
        step = next(self._steps)
        for replica in participants:
            self._group.handles[replica].send(
                RunStep(len(participants), tuple(participants), step, self.step_sync_debug))
        outputs: list[RequestOutput] = []
        pending = len(participants)
        generation = self._generation
        while pending and generation == self._generation:
            message = self._next_message(1.0)
            if message is None:
                continue
            pending -= isinstance(message, StepOutputs) and message.stepped
            outputs += self._accept(message)
        return outputs

    def _accept(self, message) -> list[RequestOutput]:
        """Bookkeeping for a worker's StepOutputs; returns its outputs."""
        if not isinstance(message, StepOutputs):
            return []
        replica, outs, stats = message.replica, message.outputs, message.stats
        self._stats[replica] = stats
        delivered = []
        for packed in outs:
            request_id = packed[0]
            if request_id not in self._router:
                continue  # the tail of a re-run the front-end already finished
            prompt = self._prompts.get(request_id)
            out = unpack_output(packed, prompt, self._in_flight.prompt_ids(request_id))
            out, must_abort = self._in_flight.translate(out)
            out.prompt = prompt
            if must_abort:
                self._group.handles[replica].send(AbortRequest(out.request_id))
            if out.finished:
                self._forget(out.request_id)
            delivered.append(out)
        return delivered

    def _forget(self, request_id: str) -> None:
        if self._router.forget(request_id) is not None:
            self._prompts.pop(request_id, None)
            self._in_flight.forget(request_id)

    def _next_message(self, timeout: float):
        message = self._group.receive(timeout)
        if message is None:
            self._check_alive()
            return None
        if isinstance(message, WorkerFailure):
            if self._starting or self._closed:
                raise WorkerError(self._failure_reason(message, full=True))
            self._recover(self._failure_reason(message, full=False))
            return None
        if isinstance(message, WorkerStats):
            self.expert_stats[message.index] = message.stats
        return message

    def _check_alive(self) -> None:
        dead = self._group.dead()
        if dead and not self._closed:
            # A worker that failed reported why just before exiting: surface that first.
            message = self._group.receive(1.0)
            if isinstance(message, WorkerFailure):
                if self._starting:
                    raise WorkerError(self._failure_reason(message, full=True))
                self._recover(self._failure_reason(message, full=False))
                return
            if self._starting:
                raise WorkerError(self._exit_reason(dead))
            self._recover(self._exit_reason(dead))

    def _exit_reason(self, dead: list[str]) -> str:
        """Why the workers named ``dead`` are gone, with how each process ended."""
        notes = {h.name: exit_note(h) for h in self._group.handles}
        return ", ".join(f"{name} ({notes[name]})" if notes.get(name) else name
                         for name in dead) + " exited unexpectedly"

    def _failure_reason(self, message: WorkerFailure, full: bool) -> str:
        """A worker's WorkerFailure as a reason (``full``: its whole traceback, else its
        first line), after the workers a signal killed: a worker the kernel kills (the OOM
        killer's SIGKILL) reports nothing itself, and its peers then fail with a lost
        connection, which names only the symptom."""
        detail = message.detail if full else message.detail.splitlines()[0]
        reason = f"{message.role} worker {message.index} failed: {detail}"
        deadline = time.monotonic() + (PEER_DEATH_WAIT_S if "PeerLostError" in message.detail else 0)
        killed = _killed(self._group.handles)
        while not killed and time.monotonic() < deadline:
            time.sleep(0.05)
            killed = _killed(self._group.handles)
        return f"{'; '.join(killed)}; then {reason}" if killed else reason

    def stats(self) -> EngineStats:
        """Every replica's latest stats, summed, plus the counters of replaced groups."""
        known = [s for s in self._stats if s is not None]
        summed = EngineStats(**{f.name: sum(getattr(s, f.name) for s in known)
                                for f in fields(EngineStats)})
        return add_counters(summed, self._retired)
