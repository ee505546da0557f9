"""Launchers: where the workers of a DisaggregatedEngine run, and how the front-end reaches them.

The front-end only needs four things from a worker: send it a message, receive what the
workers send back, know whether it is alive, and stop or kill it. A launcher provides
them for one *group* (every worker of one mesh: attention replicas, then expert workers):

    launcher = LocalLauncher(use_processes=True)      # or make_launcher("ray", ...)
    group = launcher.start(specs)                     # one worker per WorkerSpec, same order
    group.handles[i].send(AddRequest(...))            # front-end → worker i
    group.receive(timeout)                            # any worker → front-end, or None
    group.dead()                                      # names of workers that are gone
    group = launcher.restart(group, new_specs)        # stop the group, start a fresh one
    group.stop(grace_s); launcher.close()

Every worker runs :func:`megaserve.runtime.workers.run_worker` (the one entry point both
launchers share) with an inbox and an outbox; messages are the picklable values that
module documents. NOTE: the comm mesh is connected once, at start (rendezvous), so a
lost worker is replaced by restarting the whole group with a new rendezvous round;
``restart`` is that operation, and a launcher may reuse what it reserved (Ray keeps its
placement groups).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
import time
from typing import Any, Protocol

from megaserve.runtime.messages import Stop
from megaserve.runtime.worker_spec import WorkerSpec
from megaserve.runtime.workers import run_worker

logger = logging.getLogger(__name__)

LAUNCHERS = ("local", "ray")


class WorkerHandle(Protocol):
    """One running worker, as the front-end sees it."""

    name: str  # e.g. "megaserve-expert-1", unique within a group

    def send(self, message: Any) -> None:
        """Queue ``message`` for the worker (never blocks on the worker)."""

    def is_alive(self) -> bool:
        """False once the worker has exited, was killed, or cannot be reached."""

    def kill(self) -> None:
        """Terminate the worker at once (no clean stop); idempotent."""

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the worker to exit."""


class WorkerGroup(Protocol):
    """The workers of one mesh, started together by one launcher."""

    handles: list[WorkerHandle]

    def receive(self, timeout: float) -> Any | None:
        """The next message any worker sent, waiting up to ``timeout`` s (0: do not wait)."""

    def dead(self) -> list[str]:
        """Names of the workers that are no longer alive (cheap; polled continuously)."""

    def stop(self, grace_s: float) -> None:
        """Ask every worker to stop, kill those still running after ``grace_s``, release
        queues. Idempotent."""


class WorkerLauncher(Protocol):
    """Starts worker groups; see the module docstring."""

    @property
    def rendezvous_host(self) -> str:
        """The address workers reach the front-end's rendezvous server at."""

    def start(self, specs: list[WorkerSpec]) -> WorkerGroup:
        """Start one worker per spec (in order). Raises RuntimeError if it cannot place them."""

    def restart(self, group: WorkerGroup, specs: list[WorkerSpec]) -> WorkerGroup:
        """Replace ``group`` (stopped here, killing survivors) by a fresh one for ``specs``."""

    def close(self) -> None:
        """Release everything the launcher reserved (idempotent)."""


# -- local: threads (inproc) or forkserver processes ---------------------------------------


def process_context():
    """Worker processes fork from a server that has already imported torch and the
    runtime (forkserver): each starts in a fraction of a second, and never inherits the
    front-end's threads or locks (which a plain fork would)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["megaserve.runtime.workers", "megaserve.engine.engine"])
    return ctx


def process_title(spec: WorkerSpec) -> str:
    """The short name a worker process shows in ``ps`` / ``/proc/<pid>/comm``:
    ``megaserve-A<i>`` for attention replica i, ``megaserve-E<i>`` for expert worker i,
    ``megaserve-EP<i>`` for co-located worker i (both), ``megaserve-DP<i>`` for
    data-parallel engine i."""
    return f"megaserve-{_TITLES[spec.role]}{spec.index}"


_TITLES = {"attention": "A", "expert": "E", "colocated": "EP", "engine": "DP"}


def set_process_title(title: str) -> None:
    """Name the calling thread for ``ps`` (a local worker process: its main thread, so
    ``ps -o comm`` shows it; a Ray actor: the thread running the worker, ``ps -L``);
    Linux only, silently skipped elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        pr_set_name = 15
        libc.prctl(pr_set_name, title.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def run_local_worker(spec: WorkerSpec, inbox: Any, outbox: Any) -> None:
    """Entry point of a local worker process: names it, then :func:`run_worker`.

    SIGINT is ignored: Ctrl-C in a terminal signals the whole foreground process group,
    workers included, and the front-end owns shutdown (it drains, then sends Stop); a
    worker that died of KeyboardInterrupt would be a lost worker to recover mid-drain."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_process_title(process_title(spec))
    run_worker(spec, inbox, outbox)


class _LocalHandle:
    """A worker thread or process with its inbox."""

    def __init__(self, worker: threading.Thread | multiprocessing.process.BaseProcess,
                 inbox: Any) -> None:
        self.worker = worker
        self.inbox = inbox
        self.name = worker.name

    @property
    def pid(self) -> int | None:
        """The process id (None for a thread)."""
        return getattr(self.worker, "pid", None)

    @property
    def exitcode(self) -> int | None:
        """The process's exit status once it has exited (``-N``: killed by signal N);
        None while it runs, and for a thread."""
        return getattr(self.worker, "exitcode", None)

    def send(self, message: Any) -> None:
        self.inbox.put(message)

    def is_alive(self) -> bool:
        return self.worker.is_alive()

    def kill(self) -> None:
        # NOTE: threads cannot be killed; an inproc worker stops only through Stop().
        if isinstance(self.worker, multiprocessing.process.BaseProcess) and self.worker.is_alive():
            self.worker.kill()

    def join(self, timeout: float) -> None:
        self.worker.join(timeout)


class _LocalGroup:
    """Workers of this host sharing one outbox (a fresh one per group: a worker killed
    while writing may leave a multiprocessing queue unusable)."""

    def __init__(self, handles: list[_LocalHandle], outbox: Any) -> None:
        self.handles = handles
        self._outbox = outbox
        self._stopped = False

    def receive(self, timeout: float) -> Any | None:
        try:
            return self._outbox.get(timeout=timeout) if timeout > 0 else self._outbox.get_nowait()
        except (queue.Empty, OSError, ValueError, EOFError):
            return None

    def dead(self) -> list[str]:
        return [h.name for h in self.handles if not h.is_alive()]

    def stop(self, grace_s: float) -> None:
        if self._stopped:
            return
        self._stopped = True
        for handle in self.handles:
            try:
                handle.send(Stop())
            except (OSError, ValueError):  # a closed queue: the worker is gone anyway
                pass
        deadline = time.monotonic() + grace_s
        for handle in self.handles:
            handle.join(max(0.0, deadline - time.monotonic()))
        for handle in self.handles:
            if handle.is_alive() and handle.pid is not None:
                logger.warning("killing %s after %.0fs", handle.name, grace_s)
                handle.kill()
                handle.join(5)


class LocalLauncher:
    """Workers on this host: threads when ``use_processes`` is False (the ``inproc``
    transport), else forkserver processes that exit by themselves if the front-end dies."""

    rendezvous_host = "127.0.0.1"

    def __init__(self, use_processes: bool) -> None:
        self.use_processes = use_processes

    def start(self, specs: list[WorkerSpec]) -> _LocalGroup:
        ctx = process_context() if self.use_processes else None
        outbox = ctx.Queue() if ctx else queue.Queue()
        handles = []
        for spec in specs:
            inbox = ctx.Queue() if ctx else queue.Queue()
            name = f"megaserve-{spec.role}-{spec.index}"
            if ctx:
                worker = ctx.Process(target=run_local_worker, args=(spec, inbox, outbox),
                                     name=name, daemon=True)
            else:
                worker = threading.Thread(target=run_worker, args=(spec, inbox, outbox),
                                          name=name, daemon=True)
            worker.start()
            handles.append(_LocalHandle(worker, inbox))
        return _LocalGroup(handles, outbox)

    def restart(self, group: _LocalGroup, specs: list[WorkerSpec]) -> _LocalGroup:
        group.stop(grace_s=1.0)
        return self.start(specs)

    def close(self) -> None:
        pass


LAUNCHER_ENTRY_POINTS = "megaserve.launchers"


def registered_launchers() -> dict[str, Any]:
    """Launchers other packages provide: the ``megaserve.launchers`` entry points, name ->
    entry point. Each loads a factory ``(use_processes: bool, address: str | None) ->
    WorkerLauncher`` (megaserve's own ``ray`` is ``megaserve.deploy.ray_launcher``'s)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=LAUNCHER_ENTRY_POINTS)}


def make_launcher(name: str, use_processes: bool, ray_address: str | None = None) -> WorkerLauncher:
    """The launcher called ``name`` (one of :data:`LAUNCHERS`): ``local`` here, the others
    from the package that registers them (:func:`registered_launchers`; the runtime imports
    no launcher beyond one host). Raises ValueError for an unknown name, a launcher that is
    not installed or whose optional dependency is missing."""
    if name == "local":
        return LocalLauncher(use_processes)
    if name not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {list(LAUNCHERS)}, not {name!r}")
    entry = registered_launchers().get(name)
    if entry is None:
        raise ValueError(f"launcher {name!r} is not installed (no {LAUNCHER_ENTRY_POINTS!r} "
                         f"entry point named {name!r}): pip install -e '.[{name}]' from a "
                         "checkout, or reinstall megaserve")
    try:
        factory = entry.load()
    except ImportError as e:
        raise ValueError(f"launcher {name!r}: {e}; install it with pip install "
                         f"'megaserve[{name}]'") from None
    return factory(use_processes, ray_address)
