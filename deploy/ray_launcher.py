"""The Ray launcher: every attention replica and expert worker of a plan unit as a Ray actor.

Placement (vLLM's Ray executor and Ray Serve LLM conventions)::

    one placement group per plan unit, strategy PACK, one bundle per worker (rank order):
        attention replica i → {"CPU": 1, "GPU": g, "accelerator_type:<attention GPU>": 0.001}
        expert worker j     → {"CPU": 1, "GPU": g, "accelerator_type:<expert GPU>": 0.001}
    g = 1 on CUDA (the runtime runs every worker at tp=1), 0 on CPU. Ray gives each node
    with GPUs of type T the resource ``accelerator_type:T``; KubeRay worker groups get it from
    ``ray.io/accelerator-type`` / rayStartParams (see deploy/k8s.py).

Messaging: the front-end (the driver, where ``megaserve serve`` runs) sends a worker its
messages through an actor method (``send``, queued inside the actor, so the worker's own
``inbox.get_nowait()`` stays local); workers send theirs to one mailbox actor per group,
fire-and-forget. Both directions number their messages: Ray may run one caller's calls to
a threaded or async actor out of order, and the receiving side restores the order. Workers find each
other through the driver's rendezvous server (its node IP, an ephemeral port), not through
fixed ports. A worker is dead when its ``run`` call has returned (it stopped or failed) or
its actor died; the driver polls that with ``ray.wait(timeout=0)``.

Recovery replaces the group's actors (new actors in the same placement-group bundles, which
Ray re-places if a node was lost); the placement group lives until ``close()``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import itertools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megaserve.runtime.launcher import process_title, set_process_title
from megaserve.runtime.messages import Stop
from megaserve.runtime.worker_spec import WorkerSpec
from megaserve.runtime.workers import run_worker

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
ACCELERATOR_SHARE = 0.001  # what a bundle asks of accelerator_type:<T> (as Ray's own option)
ENV_PREFIXES = ("MEGASERVE_",)  # environment forwarded to the worker actors


@ray.remote(num_cpus=0)
class Mailbox:
    """Worker → front-end messages of one group (an async actor)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue | None = None
        self._order = _Reorder()

    def _q(self) -> asyncio.Queue:
        if self._queue is None:
            self._queue = asyncio.Queue()
        return self._queue

    async def put(self, sender: int, seq: int, message: Any) -> None:
        for ready in self._order.accept(sender, seq, message):
            self._q().put_nowait(ready)

    async def take(self, timeout: float) -> list[Any]:
        """Everything queued, waiting up to ``timeout`` s for the first message."""
        q = self._q()
        items = []
        if q.empty() and timeout > 0:
            try:
                items.append(await asyncio.wait_for(q.get(), timeout))
            except asyncio.TimeoutError:
                return []
        while not q.empty():
            items.append(q.get_nowait())
        return items


class _Reorder:
    """Puts numbered messages back in order. NOTE: Ray runs the calls of one caller to an
    async or threaded actor concurrently, so they may execute out of order; every message
    carries its sender's sequence number and is released only after its predecessors."""

    def __init__(self) -> None:
        self._next: dict[int, int] = collections.defaultdict(int)
        self._held: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()

    def accept(self, sender: int, seq: int, message: Any) -> list[Any]:
        """The messages now in order (possibly none, possibly several)."""
        with self._lock:
            self._held[(sender, seq)] = message
            ready = []
            while (sender, self._next[sender]) in self._held:
                ready.append(self._held.pop((sender, self._next[sender])))
                self._next[sender] += 1
            return ready


class _Outbox:
    """What run_worker sees as its outbox: ``put`` sends to the mailbox without waiting."""

    def __init__(self, mailbox: Any, rank: int) -> None:
        self._mailbox = mailbox
        self._rank = rank
        self._seq = itertools.count()

    def put(self, message: Any) -> None:
        self._mailbox.put.remote(self._rank, next(self._seq), message)


@ray.remote(max_concurrency=4)
class RayWorker:
    """One worker (megaserve.runtime.workers.run_worker) in a threaded actor: ``run``
    blocks for the worker's life; ``send`` and ``info`` answer meanwhile."""

    def __init__(self, spec: WorkerSpec, mailbox: Any) -> None:
        self._spec = spec
        self._inbox: queue.Queue = queue.Queue()
        self._outbox = _Outbox(mailbox, spec.rank)
        self._order = _Reorder()

    def run(self) -> None:
        # The actor's own pid stands for the front-end: Ray ends a (non-detached) actor when
        # its driver dies, so the worker's parent check follows the actor's life. Ray sets
        # CUDA_VISIBLE_DEVICES to the bundle's GPU, which is cuda:0 in here. The endpoint
        # listens on this node's IP, so workers on other nodes can reach it.
        device = "cuda:0" if self._spec.device.startswith("cuda") else self._spec.device
        spec = replace(self._spec, parent_pid=os.getpid(), device=device,
                       host=ray.util.get_node_ip_address())
        set_process_title(process_title(spec))
        run_worker(spec, self._inbox, self._outbox)

    def send(self, seq: int, message: Any) -> None:
        for ready in self._order.accept(0, seq, message):
            self._inbox.put(ready)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


class RayHandle:
    """The front-end's view of one worker actor."""

    def __init__(self, name: str, actor: Any, run_ref: Any) -> None:
        self.name = name
        self.actor = actor
        self.run_ref = run_ref
        self._seq = itertools.count()
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._send_lock:  # numbering and submission in one order
            self.actor.send.remote(next(self._seq), message)

    def is_alive(self) -> bool:
        ready, _ = ray.wait([self.run_ref], timeout=0, fetch_local=False)
        return not ready

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float) -> None:
        ray.wait([self.run_ref], timeout=timeout, fetch_local=False)


class RayGroup:
    """The worker actors of one mesh and their mailbox."""

    def __init__(self, handles: list[RayHandle], mailbox: Any) -> None:
        self.handles = handles
        self._mailbox = mailbox
        self._received: collections.deque = collections.deque()
        self._stopped = False

    def receive(self, timeout: float) -> Any | None:
        if not self._received and not self._stopped:
            try:
                self._received.extend(ray.get(self._mailbox.take.remote(timeout),
                                              timeout=timeout + 30))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                return None
        return self._received.popleft() if self._received else None

    def dead(self) -> list[str]:
        refs = [h.run_ref for h in self.handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        ready = set(ready)
        return [h.name for h in self.handles if h.run_ref in ready]

    def stop(self, grace_s: float) -> None:
        if self._stopped:
            return
        for handle in self.handles:
            handle.send(Stop())
        refs = [h.run_ref for h in self.handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s, fetch_local=False)
        if len(ready) < len(refs):
            logger.warning("killing %d worker actor(s) after %.0fs", len(refs) - len(ready), grace_s)
        # Drain what the workers sent on their way out (expert stats) before the mailbox goes.
        try:
            self._received.extend(ray.get(self._mailbox.take.remote(0), timeout=10))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass
        self._stopped = True
        for handle in self.handles:  # a stopped worker's actor still holds its bundle
            handle.kill()
        ray.kill(self._mailbox, no_restart=True)


SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SIGACTION_BYTES = 512  # more than any libc's struct sigaction (152 bytes on x86-64 glibc)


@contextlib.contextmanager
def keep_signal_handlers(signals: tuple[int, ...]) -> Iterator[None]:
    """Restores the process's handlers of ``signals`` as they were before the block, at the
    C level (``sigaction``), from whichever thread runs it.

    NOTE: why ``ray.init`` needs this. A driver's Ray core worker installs Abseil's failure
    signal handler for SIGTERM (among crash signals). On SIGTERM it prints ``*** SIGTERM
    received``, arms ``alarm(3)`` with an abort handler, then calls the previous handler
    (the server's, which starts the drain) — so any shutdown that takes more than 3 s
    (a drain with streams in flight, stopping workers after a recovery) ends in SIGABRT
    (exit code -6). The server owns SIGTERM/SIGINT: it drains in its grace period and
    releases the actors and placement group itself. Crash signals keep Ray's handler
    (its stack traces are useful). ``struct sigaction`` is kept as opaque bytes, so no
    libc layout is assumed. Where libc has no ``sigaction`` (not POSIX), a no-op.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sigaction = libc.sigaction
    except (OSError, AttributeError):
        yield
        return
    sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    # Python's own table too (ray.init sets a SIGTERM handler when run in the main thread).
    main = threading.current_thread() is threading.main_thread()
    python_handlers = {signum: signal.getsignal(signum) for signum in signals} if main else {}
    saved = {}
    for signum in signals:
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if sigaction(int(signum), None, buf) == 0:
            saved[signum] = buf
    try:
        yield
    finally:
        for signum, handler in python_handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        for signum, buf in saved.items():
            if sigaction(int(signum), buf, None) != 0:
                logger.warning("could not restore the handler of signal %d (errno %d)",
                               signum, ctypes.get_errno())


def _bundle(spec: WorkerSpec) -> dict[str, float]:
    bundle = {"CPU": 1.0}
    if spec.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    gpu_type = (spec.engine.attention_gpu_type if spec.runs_attention
                else spec.engine.expert_gpu_type)
    if gpu_type:
        bundle[f"accelerator_type:{gpu_type}"] = ACCELERATOR_SHARE
    return bundle


def make_ray_launcher(use_processes: bool, address: str | None = None) -> "RayLauncher":
    """The ``ray`` entry of the runtime's launchers (pyproject's ``megaserve.launchers``
    entry points; ``runtime.launcher.make_launcher`` loads it). Raises ValueError for
    thread workers: Ray runs every worker as an actor, a process of its own."""
    if not use_processes:
        raise ValueError("launcher 'ray' runs workers as Ray actors (processes): choose a "
                         "process transport, e.g. transport='tcp'")
    return RayLauncher(address=address)


class RayLauncher:
    """Launches worker groups on a Ray cluster (see the module docstring).

    ``address``: the cluster to join (``"auto"``, ``"ray://host:10001"``, a GCS address);
    None joins the one this process is already connected to, or starts a local one.
    Raises RuntimeError where the plan's GPUs cannot be placed within PLACEMENT_TIMEOUT_S.
    """

    def __init__(self, address: str | None = None,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            with keep_signal_handlers(SHUTDOWN_SIGNALS):
                try:
                    ray.init(address=address, include_dashboard=False, log_to_driver=True,
                             runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                                       if k.startswith(ENV_PREFIXES)}})
                except (ray.exceptions.AuthenticationError, ConnectionError) as e:
                    raise RuntimeError(
                        f"cannot join the Ray cluster at {address or 'auto'}: {e}. If the "
                        "cluster uses token authentication (Ray's `ray start` turns it on "
                        "when ~/.ray/auth_token exists), this process needs "
                        f"RAY_AUTH_MODE=token and the token (RAY_AUTH_MODE is "
                        f"{os.environ.get('RAY_AUTH_MODE', 'unset')} here); see "
                        "docs/deploy.md, 'Walk-through on one machine'") from e
        self._placement_timeout_s = placement_timeout_s
        self._pg = None
        self._bundles: list[dict[str, float]] = []
        self.rendezvous_host = ray.util.get_node_ip_address()

    @property
    def placement_group(self) -> Any:
        return self._pg

    def _reserve(self, specs: list[WorkerSpec]) -> None:
        bundles = [_bundle(spec) for spec in specs]
        if self._pg is not None and bundles == self._bundles:
            return
        self._pg = placement_group(bundles, strategy="PACK", name=f"megaserve-{os.getpid()}")
        self._bundles = bundles
        ready, _ = ray.wait([self._pg.ready()], timeout=self._placement_timeout_s)
        if not ready:
            needed = collections.Counter()
            for bundle in bundles:
                needed.update(bundle)
            available = ray.cluster_resources()
            remove_placement_group(self._pg)
            self._pg = None
            raise RuntimeError(
                f"cannot place the workers within {self._placement_timeout_s:.0f}s: they need "
                f"{dict(needed)} (one bundle per worker: {bundles}); the cluster has "
                f"{available}. Add nodes of the planned GPU types or change the plan.")

    def start(self, specs: list[WorkerSpec]) -> RayGroup:
        self._reserve(specs)
        mailbox = Mailbox.remote()
        handles = []
        for rank, spec in enumerate(specs):
            bundle = self._bundles[rank]
            actor = RayWorker.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                name=f"megaserve-{os.getpid()}-{spec.role}-{spec.index}-{time.monotonic_ns()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank),
            ).remote(spec, mailbox)
            handles.append(RayHandle(f"megaserve-{spec.role}-{spec.index}", actor,
                                     actor.run.remote()))
        return RayGroup(handles, mailbox)

    def restart(self, group: RayGroup, specs: list[WorkerSpec]) -> RayGroup:
        group.stop(grace_s=1.0)
        ready, _ = ray.wait([self._pg.ready()], timeout=self._placement_timeout_s)
        if not ready:
            raise RuntimeError("the placement group lost nodes and Ray could not re-place "
                               f"it within {self._placement_timeout_s:.0f}s")
        return self.start(specs)

    def close(self) -> None:
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
