"""AsyncLLMEngine: the engine behind asyncio servers, streaming each request's outputs.

The synchronous engine runs beside the event loop in one of two ways:

* **a thread of this process** (the default; any layout): the event loop hands it
  commands (add / abort) through a list guarded by a condition variable; when nothing is
  queued or running the thread sleeps on the condition, so an idle engine does not spin;
* **its own process** (``engine_process=True``; co-located layouts), vLLM's split of the
  API server from the engine core. A front-end thread shares the event loop's
  interpreter lock, and at many streams the two take turns: the server streaming 1,024
  requests ran at 0.23x of ``LLM.generate`` on an H200 with the engine in a thread
  (docs/performance.md, "Serving"). In a process of its own the
  engine schedules, steps and detokenises on its own interpreter; the front-end only
  validates prompts (with its own copy of the tokenizer) and streams. Commands go over
  one pipe, each step's outputs come back over another as plain tuples (one message a
  step), with the engine's stats; both ways the messages are the typed ones of
  :mod:`megaserve.runtime.messages`.

Either way a step's outputs reach the event loop in one callback, which hands each to its
request's collector: a request whose consumer has fallen behind (a saturated front-end)
gets its DELTA outputs merged into one, as vLLM's ``RequestOutputCollector`` does, so a
slow stream costs fewer, larger messages instead of a growing backlog (other kinds keep
one output a step, as before).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import EngineStats, Prompt, load_tokenizer, validate_prompt
from megaserve.outputs import CompletionOutput, RequestOutput
from megaserve.runtime.factory import make_engine, uses_device_plane
from megaserve.runtime.messages import (AbortRequest, AddRequest, EngineFailed, EngineOutputs,
                                        EngineReady, RequestRejected, Stop, unpack_output)
from megaserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed; every request in flight gets this error."""


class AsyncLLMEngine:
    """Streams each request's RequestOutputs (by its ``output_kind``); see ``generate``
    and ``abort``.

    The constructor loads the model synchronously (``engine_process``: in the engine's
    process, and waits for it); a bad config raises ``ValueError``. Use the object from
    one event loop.
    """

    def __init__(self, engine_process: bool = False, **config: Any) -> None:
        engine_config = EngineConfig(**config)
        if engine_process and (uses_device_plane(engine_config)
                               or not engine_config.single_engine):
            # A front-end over workers already runs them in processes (and its health and
            # recovery live in this one).
            logger.info("the engine of a disaggregated layout runs in a thread of this process")
            engine_process = False
        self._driver = (_ProcessDriver(config) if engine_process
                        else _ThreadDriver(make_engine(engine_config)))
        info = self._driver.info
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self._collectors: dict[str, _Collector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the first generate()'s
        self._error: BaseException | None = None
        self._driver.start(self._from_driver)

    @property
    def engine(self):
        """The synchronous engine where it runs in this process (a thread); AttributeError
        where it runs in its own process."""
        engine = getattr(self._driver, "engine", None)
        if engine is None:
            raise AttributeError("engine: it runs in its own process")
        return engine

    # -- public API -------------------------------------------------------------------

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Prompt token ids; ``ValueError`` starting with the offending field."""
        return validate_prompt(prompt, params, self.tokenizer, self.vocab_size,
                               self.max_model_len)

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step it advances (cumulative, a delta
        or only the final one, by ``params.output_kind``).

        Raises ``ValueError`` before the first yield for bad input or a duplicate id.
        If the consumer stops early (cancellation, ``aclose``), the request is aborted
        and its KV blocks are freed.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}")
        if request_id in self._collectors:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt_ids = self.validate(prompt, params)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        collector = _Collector(params.output_kind is RequestOutputKind.DELTA, prompt_ids)
        self._collectors[request_id] = collector
        self._driver.send(AddRequest(request_id, prompt_ids, params,
                                     prompt=prompt if isinstance(prompt, str) else None))
        finished = False
        try:
            while True:
                item = await collector.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self._driver.send(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Finish the request with reason "abort" (its stream gets that last output)."""
        self._driver.send(AbortRequest(request_id))

    def end_stream(self, request_id: str) -> bool:
        """End a DELTA request's stream here and now with finish reason "abort" (no new
        tokens), without waiting for the engine, which may be busy (replacing a lost
        worker group, say); the engine drops the request when it gets to it. For a server
        whose grace period is over. False if the request has no stream or is not DELTA."""
        collector = self._collectors.get(request_id)
        if collector is None or not collector.delta:
            return False
        self._driver.send(AbortRequest(request_id))
        collector.put(RequestOutput(
            request_id, None, collector.prompt_ids,
            [CompletionOutput(0, "", [], None, "abort")],
            finished=True))
        return True

    def stats(self) -> EngineStats:
        """Counters as of the last engine step (read without blocking the engine)."""
        return self._driver.stats

    @property
    def errored(self) -> bool:
        """Whether the engine has failed (vLLM's name): every request gets
        ``EngineDeadError`` from now on."""
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """Why the engine failed (None while it has not)."""
        return self._error

    async def shutdown(self) -> None:
        """Stop the engine (requests in flight are abandoned) and release its workers."""
        await asyncio.get_running_loop().run_in_executor(None, self._driver.shutdown)

    # -- from the driver's thread -------------------------------------------------------

    def _from_driver(self, kind: str, payload: Any) -> None:
        """Hand the driver's news to the event loop: "outputs" (one step's list),
        "rejected" ((request id, ValueError)) or "dead" (the error)."""
        if kind == "dead":
            self._error = payload
        loop = self._loop
        if loop is None or loop.is_closed():  # no request yet
            return
        if kind == "outputs":
            loop.call_soon_threadsafe(self._deliver_all, payload)
        elif kind == "rejected":
            loop.call_soon_threadsafe(self._deliver, *payload)
        else:
            loop.call_soon_threadsafe(self._fail_all, payload)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        collectors = self._collectors
        for out in outputs:
            collector = collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        collector = self._collectors.get(request_id)
        if collector is not None:
            collector.put(item)

    def _fail_all(self, error: BaseException) -> None:
        for collector in self._collectors.values():
            collector.put(EngineDeadError(f"engine failed: {error}"))


class _Collector:
    """One request's outputs on their way to its ``generate`` (module docstring), in
    order: a DELTA output that arrives while the one before it waits joins it (tokens,
    text and logprobs appended, the newer end state); every other item waits its turn."""

    def __init__(self, delta: bool, prompt_ids: list[int]) -> None:
        self._delta = delta
        self.prompt_ids = prompt_ids  # for an end made here (AsyncLLMEngine.end_stream)
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._waiter: asyncio.Future | None = None

    @property
    def delta(self) -> bool:
        return self._delta

    def put(self, item: RequestOutput | BaseException) -> None:
        held = self._items[-1] if self._items else None
        if (self._delta and isinstance(held, RequestOutput)
                and isinstance(item, RequestOutput)):
            _merge_delta(held, item)
        else:
            self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold the DELTA output ``new`` into the earlier ``into`` (the same request's)."""
    for a, b in zip(into.outputs, new.outputs):
        a.token_ids += b.token_ids
        a.text += b.text
        if b.logprobs is not None:
            if a.logprobs is None:
                a.logprobs = []
            a.logprobs += b.logprobs
        a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens


@dataclass(frozen=True)
class _EngineInfo:
    """What the front-end needs of an engine to validate prompts and describe the model."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, engine, tokenizer: Any) -> _EngineInfo:
        return cls(tokenizer, engine.model_name, engine.max_model_len, engine.vocab_size,
                   tuple(engine.eos_token_ids))


Sink = Callable[[str, Any], None]


class _ThreadDriver:
    """The engine on a thread of this process (module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.info = _EngineInfo.of(engine, engine.tokenizer)
        self.stats = engine.stats()
        self._cond = threading.Condition()
        self._commands: list[AddRequest | AbortRequest] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self, sink: Sink) -> None:
        self._thread = threading.Thread(target=self._run, args=(sink,), name="megaserve-engine",
                                        daemon=True)
        self._thread.start()

    def send(self, command: AddRequest | AbortRequest) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.engine.shutdown()

    def _run(self, sink: Sink) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping
                               or engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                outputs = _apply(engine, commands,
                                 lambda request_id, e: sink("rejected", (request_id, e)))
                outputs += engine.step()
                self.stats = engine.stats()
                if outputs:
                    sink("outputs", outputs)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            logger.exception("engine thread failed")
            sink("dead", e)


def _apply(engine, commands: list[AddRequest | AbortRequest],
           rejected: Callable[[str, ValueError], None]) -> list[RequestOutput]:
    """Run add / abort commands on ``engine``; the aborted requests' last outputs. An add
    the engine refuses goes to ``rejected(request_id, error)``."""
    outputs = []
    for command in commands:
        if isinstance(command, AddRequest):
            try:
                engine.add_request(command.request_id, command.engine_prompt(), command.params,
                                   seed=command.seed)
            except ValueError as e:
                rejected(command.request_id, e)
        elif isinstance(command, AbortRequest):
            out = engine.abort_request(command.request_id)
            if out is not None:
                outputs.append(out)
        else:
            raise TypeError(f"engine: unexpected command {command!r}")
    return outputs


class _ProcessDriver:
    """The engine in a process of its own (module docstring): a sender thread writes the
    event loop's commands to one pipe (a burst of requests never blocks the loop on a
    full pipe), a reader thread turns each step's message from the other into outputs.
    The engine process exits when the front-end goes away (its command pipe closes)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from megaserve.runtime.launcher import process_context

        ctx = process_context()
        commands_out, self._commands_in = ctx.Pipe(duplex=False)
        self._results, results_in = ctx.Pipe(duplex=False)
        _widen(self._results)
        self._process = ctx.Process(
            target=engine_process_main, name="megaserve-engine", daemon=True,
            args=(commands_out, results_in, config, logging.getLogger().level))
        self._process.start()
        commands_out.close()
        results_in.close()
        try:
            ready = self._results.recv()
        except EOFError:
            self._process.join(timeout=10)
            ready = EngineFailed(RuntimeError.__name__, "the engine process exited while "
                                 f"loading (exit code {self._process.exitcode})", loading=True)
        if not isinstance(ready, EngineReady):
            self._process.join()
            raise (ValueError if ready.error_type == ValueError.__name__
                   else RuntimeError)(ready.message)
        self.stats = ready.stats
        self.info = replace(ready.info, tokenizer=load_tokenizer(ready.model_path))
        # (text or None, token ids) of each request in the engine: it gets the ids only
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self, sink: Sink) -> None:
        self._threads = [
            threading.Thread(target=self._send_loop, name="megaserve-engine-send", daemon=True),
            threading.Thread(target=self._read_loop, args=(sink,), name="megaserve-engine-read",
                             daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, command: AddRequest | AbortRequest) -> None:
        if isinstance(command, AddRequest):
            self._prompts[command.request_id] = (command.prompt, command.token_ids)
            command = replace(command, prompt=None)  # the engine gets the ids only
        self._outbox.put(command)

    def shutdown(self) -> None:
        self._stopping = True
        self._outbox.put(Stop())
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        for thread in self._threads:
            thread.join(timeout=5)

    def _send_loop(self) -> None:
        """Everything queued so far as one message (a list of commands), until Stop."""
        while True:
            batch = [self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get())
            try:
                self._commands_in.send(batch)
            except OSError:  # the engine process is gone (the reader reports it)
                return
            if any(isinstance(command, Stop) for command in batch):
                return

    def _read_loop(self, sink: Sink) -> None:
        while True:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._process.join(timeout=5)
                    sink("dead", RuntimeError(f"the engine process exited (exit code "
                                              f"{self._process.exitcode})"))
                return
            if isinstance(message, EngineOutputs):
                self.stats = message.stats
                sink("outputs", [self._unpack(t) for t in message.outputs])
            elif isinstance(message, RequestRejected):
                self._prompts.pop(message.request_id, None)
                sink("rejected", (message.request_id, ValueError(message.message)))
            else:  # EngineFailed: the engine process logged the traceback
                sink("dead", RuntimeError(f"{message.error_type}: {message.message}"))
                return

    def _unpack(self, packed: tuple) -> RequestOutput:
        request_id, finished = packed[0], packed[2]
        prompt, prompt_ids = (self._prompts.pop(request_id, (None, [])) if finished
                              else self._prompts.get(request_id, (None, [])))
        return unpack_output(packed, prompt, prompt_ids)


def _widen(pipe) -> None:
    """Give a pipe the largest buffer Linux allows (1 MiB by default, not 64 KiB): a
    step's message at 1,024 sequences is ~100 KB, and an engine whose send waited for the
    front-end's reader (which shares its process's interpreter lock with the event loop)
    would stall between steps."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, int(f.read()))
    except (ImportError, AttributeError, OSError, ValueError):
        pass  # not Linux, or not allowed: the default buffer


def engine_process_main(commands, results, config: dict[str, Any], log_level: int) -> None:
    """Entry point of the engine process: build the engine, report ready (or why not),
    then loop: apply the front-end's commands, step, send the step's outputs."""
    from megaserve.engine.gc_heap import freeze_for_life
    from megaserve.runtime.launcher import set_process_title

    set_process_title("megaserve-core")  # (15 characters at most)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front-end owns shutdown (it drains)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = make_engine(EngineConfig(**config))
    except Exception as e:  # noqa: BLE001 - the front-end raises it
        logger.exception("the engine process could not load the model")
        results.send(EngineFailed(type(e).__name__, str(e), loading=True))
        return
    _capture_graphs(engine)
    # (the front-end loads its own tokenizer from the path)
    results.send(EngineReady(str(engine.model_path), _EngineInfo.of(engine, None),
                             engine.stats()))
    freeze_for_life()  # this process serves until it exits (megaserve/engine/gc_heap.py)
    try:
        _serve(engine, commands, results)
    except (EOFError, BrokenPipeError):  # the front-end is gone
        pass
    except Exception as e:  # noqa: BLE001 - reported to the front-end, which fails
        logger.exception("engine process failed")
        results.send(EngineFailed(type(e).__name__, str(e)))
    finally:
        engine.shutdown()


def _capture_graphs(engine) -> None:
    """Capture the decode graphs of every batch size before serving, as vLLM does: a
    server's batch grows through many sizes, and a size captured on first use stalls
    every stream for its capture (~0.25 s at 48 layers on an H200). Offline engines
    keep capturing on first use (a batch of prompts meets few sizes)."""
    runner = getattr(engine, "runner", None)
    if runner is None:
        return
    started = time.perf_counter()
    try:
        captured = runner.capture_decode_graphs()
    except RuntimeError as e:  # the first decode step tries again, and runs eagerly if it fails
        logger.warning("capturing the decode CUDA graphs failed: %s", e)
        return
    if captured:
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s", captured,
                    runner.decode_graphs.sizes[-1], time.perf_counter() - started)


def _serve(engine, commands, results) -> None:
    """The engine process's loop, until a Stop command."""

    def rejected(request_id: str, error: ValueError) -> None:
        results.send(RequestRejected(request_id, str(error)))

    while True:
        # Wait for commands only when nothing runs; else take what has come and step.
        batch = []
        wait = None if not engine.has_unfinished_requests() else 0
        while commands.poll(wait):
            batch += commands.recv()
            wait = 0
        if any(isinstance(command, Stop) for command in batch):
            return
        outputs = _apply(engine, batch, rejected)
        outputs += engine.step()
        results.send(EngineOutputs.of(outputs, engine.stats()))
