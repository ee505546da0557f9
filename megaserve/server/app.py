"""Wiring of one serving process: gRPC + HTTP on one loop, model load, SIGTERM drain.

The HTTP port is owned by ``HttpListener``: a small process of its own answers ``/health``
(from the health the loop publishes every 0.1 s) and hands every other connection to the
aiohttp app on the loop, so a probe never waits behind the loop's work.

Timeline::

    bind gRPC and HTTP ──▶ health NOT_SERVING, requests get UNAVAILABLE / 503
    load the engine in a worker thread (seconds) ──▶ health SERVING
    SIGTERM / SIGINT ──▶ health NOT_SERVING, listeners closed (no new connections or RPCs)
        ──▶ in-flight requests finish, for at most grace_period - reserve seconds
        ──▶ the rest are aborted (their streams end with finish_reason "abort")
        ──▶ servers stopped, engine shut down, exit 0, all within grace_period
            (reserve = min(1 s, grace_period / 4))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from megaserve.engine.config import EngineConfig
from megaserve.server.core import ServerState, ServingCore, chars_per_token
from megaserve.server.http_listener import HttpListener, publish_health

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """What ``megaserve serve`` runs.

    ``engine`` holds the AsyncLLMEngine / EngineConfig keyword arguments (model, dtype,
    device, max_num_seqs, max_model_len, seed, placement, ...), passed on unchanged; the
    other fields are the server's own.
    """

    engine: dict[str, Any] = field(default_factory=lambda: {"model": "builtin:tiny-moe"})
    host: str = "0.0.0.0"
    grpc_port: int = 50051
    http_port: int = 8000
    max_waiting: int = 256
    grace_period: float = 30.0
    # vLLM's --api-key: HTTP /v1/* and gRPC Generation calls need one of these keys, each
    # a caller identity (megaserve.server.auth); None: no auth.
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    # Names the API serves the model under (vLLM's --served-model-name); empty: the model.
    served_model_names: tuple[str, ...] = ()
    # CORS origins allowed to call the HTTP API ("*": any); empty: no CORS headers.
    allowed_origins: tuple[str, ...] = ()
    # vLLM's --enable-request-id-headers: X-Request-Id on every HTTP response.
    enable_request_id_headers: bool = False
    # vLLM's --enable-auto-tool-choice --tool-call-parser: the parser of "auto" tool choice
    # (megaserve.server.tool_calls.PARSERS); None: "auto" is refused.
    tool_call_parser: str | None = None
    # Seconds a connection may stay without a complete request head (idle keep-alive
    # included) before it is closed: uvicorn's --timeout-keep-alive, which vLLM uses.
    timeout_keep_alive: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.engine.get("model"), str):
            raise ValueError(f"engine['model'] must be a model name or path, got {self.engine}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) \
                or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        for name in ("grpc_port", "http_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 65536:
                raise ValueError(f"{name} must be in [1, 65535], got {value!r}")
        if self.grpc_port == self.http_port:
            raise ValueError(f"grpc_port and http_port must differ, both are {self.grpc_port}")
        if not self.grace_period >= 0:
            raise ValueError(f"grace_period must be >= 0 seconds, got {self.grace_period!r}")
        if not 0 < self.timeout_keep_alive < float("inf"):
            raise ValueError("timeout_keep_alive must be > 0 seconds, got "
                             f"{self.timeout_keep_alive!r}")
        if self.tool_call_parser is not None:
            from megaserve.server.tool_calls import PARSERS

            if self.tool_call_parser not in PARSERS:
                raise ValueError(f"tool_call_parser must be one of {PARSERS}, got "
                                 f"{self.tool_call_parser!r}")
        for name in ("served_model_names", "allowed_origins"):
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value or ()))
            if any(not isinstance(v, str) or not v.strip() for v in getattr(self, name)):
                raise ValueError(f"{name} must be non-empty strings, got {value!r}")
        if isinstance(self.api_key, list):
            object.__setattr__(self, "api_key", tuple(self.api_key))
        if self.api_key is not None:
            keys = (self.api_key,) if isinstance(self.api_key, str) else self.api_key
            if not keys or any(not isinstance(k, str) or not k or k != k.strip()
                               or " " in k for k in keys):
                raise ValueError("api_key must be non-empty strings without spaces")

    @property
    def model(self) -> str:
        return self.engine["model"]

    @property
    def max_num_seqs(self) -> int:
        value = self.engine.get("max_num_seqs")
        return int(value) if value is not None else EngineConfig(**self.engine).max_num_seqs


def _default_engine_factory(config: ServeConfig) -> Any:
    from megaserve.runtime.async_engine import AsyncLLMEngine

    # The engine in its own process: at many streams a thread of this one competes with
    # the event loop for the interpreter (megaserve.runtime.async_engine).
    return AsyncLLMEngine(engine_process=True, **config.engine)


async def serve(config: ServeConfig,
                engine_factory: Callable[[ServeConfig], Any] = _default_engine_factory) -> int:
    """Serves until SIGTERM/SIGINT, then drains. Returns the process exit code.

    Raises OSError if a port cannot be bound. A model that fails to load is logged and
    gives exit code 1.
    """
    from megaserve.engine.gc_heap import frozen_heap
    from megaserve.server.grpc_service import GenerationService, build_grpc_server, set_health
    from megaserve.server.http_errors import use_json_errors
    from megaserve.server.openai_http import build_app

    core = ServingCore(config.model, config.max_num_seqs, config.max_waiting,
                       config.served_model_names)
    dtype = {"name": str(config.engine.get("dtype", "auto"))}  # resolved once loaded
    grpc_server, health = build_grpc_server(
        GenerationService(core, lambda: dtype["name"], str(config.engine.get("device", "cpu"))),
        f"{_grpc_host(config.host)}:{config.grpc_port}", api_key=config.api_key)
    await set_health(health, serving=False)
    await grpc_server.start()
    app = build_app(core, config.api_key, allowed_origins=config.allowed_origins,
                    request_id_headers=config.enable_request_id_headers,
                    tool_parser=config.tool_call_parser)
    runner = web.AppRunner(app, handler_cancellation=True,
                           access_log=None, keepalive_timeout=config.timeout_keep_alive)
    await runner.setup()
    use_json_errors(runner)
    loop = asyncio.get_running_loop()
    try:
        listener = HttpListener(config.host, config.http_port, loop, _adopter(runner),
                                idle_timeout=config.timeout_keep_alive,
                                request_id_headers=config.enable_request_id_headers,
                                cors=bool(config.allowed_origins),
                                on_exit=core.mark_failed)  # no HTTP port: restart us
    except OSError:
        await grpc_server.stop(0)
        await runner.cleanup()
        raise
    listener.publish(core.health())
    listener.start()
    publisher = asyncio.create_task(publish_health(listener, core.health))
    logger.info("megaserve: gRPC on %s:%d, HTTP on %s:%d; loading %s",
                config.host, config.grpc_port, config.host, config.http_port, config.model)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    exit_code = 0
    load = asyncio.create_task(asyncio.to_thread(_load, engine_factory, config, dtype))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if load.done():
        try:
            core.engine = load.result()
            await _warm_up(core.engine)
            core.start_counting()  # the warm-up is not counted in the metrics
        except Exception:  # a bad model path, a corrupt checkpoint, a model that cannot run
            logger.exception("megaserve: loading %s failed", config.model)
            exit_code = 1
            stop.set()
        else:
            core.state = ServerState.SERVING
            listener.publish(core.health())
            await set_health(health, serving=True)
            logger.info("megaserve: serving %s (max_model_len=%d)", config.model,
                        core.engine.max_model_len)
    failure_watch = asyncio.create_task(_watch_failure(core, health))
    engine_watch = asyncio.create_task(_watch_engine(core, health))
    with frozen_heap():  # the start-up heap out of every collection while serving
        await stop.wait()
    failure_watch.cancel()
    engine_watch.cancel()

    # Drain: refuse new work first, then give in-flight work the grace period.
    deadline = loop.time() + config.grace_period
    logger.info("megaserve: shutting down (grace period %.1f s)", config.grace_period)
    core.state = ServerState.DRAINING
    listener.publish(core.health())
    await set_health(health, serving=False)
    listener.stop_accepting()  # no new connections; open ones finish their requests
    # The whole shutdown fits in the grace period (an orchestrator kills us after it):
    # in-flight work gets all of it but a reserve for aborting what is left, flushing
    # those streams' final messages and stopping the engine. grpc refuses new RPCs at once
    # and cancels whatever is still open at the end of the grace period.
    reserve = min(1.0, 0.25 * config.grace_period)
    grpc_stopped = asyncio.create_task(grpc_server.stop(config.grace_period))
    if core.engine is not None:
        aborted = await core.drain(deadline - reserve - loop.time(), flush_timeout=reserve / 3)
        if aborted:
            logger.warning("megaserve: aborted %d request(s) at the end of the grace period",
                           aborted)
    await _within(grpc_stopped, deadline - loop.time(), "stopping gRPC")
    await _within(runner.cleanup(), deadline - loop.time(), "closing HTTP connections")
    publisher.cancel()
    listener.close()
    core.close()
    core.state = ServerState.STOPPED
    if core.engine is not None:
        # (an engine process still running when we exit ends when its pipe closes)
        await _within(core.engine.shutdown(), deadline - loop.time(), "stopping the engine")
    elif not load.done():
        load.cancel()
    logger.info("megaserve: stopped")
    return exit_code


async def _within(work: Any, seconds: float, what: str) -> None:
    """Awaits ``work`` for at most ``seconds`` (it is cancelled after), logging a miss."""
    try:
        await asyncio.wait_for(work, timeout=max(0.0, seconds))
    except asyncio.TimeoutError:
        logger.warning("megaserve: %s did not finish within the grace period", what)


def _adopter(runner: web.AppRunner) -> Callable[[socket.socket], None]:
    """What ``HttpListener`` calls (on the loop) with a connection for the app: serves it
    with aiohttp's connection handler, as its own listener would have."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    async def serve_connection(sock: socket.socket) -> None:
        if runner.server is None:  # shutting down
            sock.close()
            return
        try:
            await loop.connect_accepted_socket(runner.server, sock)
        except OSError:
            sock.close()

    def adopt(sock: socket.socket) -> None:
        task = loop.create_task(serve_connection(sock))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return adopt


def _load(engine_factory: Callable[[ServeConfig], Any], config: ServeConfig,
          dtype: dict[str, str]) -> Any:
    """Builds the engine (in a worker thread) and resolves ``dtype["name"]``."""
    engine = engine_factory(config)
    # The size bound on text prompts (a pass over the vocabulary): here, not on the loop.
    chars_per_token(getattr(engine, "tokenizer", None))
    if dtype["name"] == "auto":
        try:
            from megaserve.models.resolved import ResolvedModel

            dtype["name"] = str(ResolvedModel.resolve(config.model).dtype("auto")).removeprefix(
                "torch.")
        except Exception:  # an engine that is not a checkpoint: report what was asked
            logger.debug("could not resolve dtype auto", exc_info=True)
    return engine


async def _warm_up(engine: Any) -> None:
    """Runs one tiny request (one prompt token, one greedy token) through the engine, so a
    model that loads but cannot run (no kernel for its dtype on this device, say) fails
    start-up instead of its first request. Raises what the engine raised.

    Its seed is fixed, so it leaves no trace in the sampling of later requests except the
    engine's arrival count (unseeded requests' seeds derive from it); the server's metrics
    count from after it (``ServingCore.start_counting``)."""
    from megaserve.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, seed=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    token = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    started = time.perf_counter()
    async with contextlib.aclosing(engine.generate("megaserve-warm-up", [token], params)) as outs:
        async for _ in outs:
            pass
    logger.info("megaserve: warm-up request done in %.2f s", time.perf_counter() - started)


async def _watch_failure(core: ServingCore, health: Any) -> None:
    """Health NOT_SERVING once the engine has failed, so an orchestrator replaces us."""
    from megaserve.server.grpc_service import set_health

    await core.failed.wait()
    await set_health(health, serving=False)


async def _watch_engine(core: ServingCore, health: Any, poll_s: float = 0.25) -> None:
    """The server FAILED once its engine has (an engine process that died, say, with no
    request in flight to notice it). Health follows the engine's workers (engines with
    ``health()``: the disaggregated runtime): NOT_SERVING while a lost worker is being
    replaced (in-flight requests pause, then continue), and FAILED once the engine gives
    up."""
    from megaserve.server.grpc_service import set_health

    worker_health = getattr(getattr(core.engine, "engine", None), "health", None)
    serving = True
    while core.state is ServerState.SERVING:
        await asyncio.sleep(poll_s)
        if getattr(core.engine, "errored", False):
            core.mark_failed(str(core.engine.error))
            return
        if worker_health is None:
            continue
        now = worker_health()
        if now.state == "failed":
            core.mark_failed(now.reason)
            return
        if now.serving != serving and core.state is ServerState.SERVING:
            serving = now.serving
            if not serving:
                logger.warning("megaserve: health NOT_SERVING: %s", now.reason)
            else:
                logger.info("megaserve: workers back, health SERVING")
            await set_health(health, serving=serving)


def _grpc_host(host: str) -> str:
    """grpc wants IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
