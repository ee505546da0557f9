"""AsyncLLMEngine: the engine behind asyncio servers, streaming each request's outputs.

The synchronous :class:`LLMEngine` runs on one background thread. The event loop talks to
it through a command list (add / abort) guarded by a condition variable; outputs come
back with ``loop.call_soon_threadsafe`` into one asyncio queue per request. When nothing
is queued or running, the thread sleeps on the condition: an idle engine does not spin.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import EngineStats, Prompt
from megaserve.runtime.factory import make_engine
from megaserve.outputs import RequestOutput
from megaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; every request in flight gets this error."""


class AsyncLLMEngine:
    """Streams cumulative RequestOutputs per request; see ``generate`` and ``abort``.

    The constructor loads the model synchronously. Use the object from one event loop.
    """

    def __init__(self, **config: Any) -> None:
        self.engine = make_engine(EngineConfig(**config))
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self._cond = threading.Condition()
        self._commands: list[tuple[str, str, Any]] = []  # (kind, request_id, payload)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = self.engine.stats()

    # -- public API -------------------------------------------------------------------

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Prompt token ids; ``ValueError`` starting with the offending field."""
        return self.engine.validate(prompt, params)

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every step it advances.

        Raises ``ValueError`` before the first yield for bad input or a duplicate id.
        If the consumer stops early (cancellation, ``aclose``), the request is aborted
        and its KV blocks are freed.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}")
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.validate(prompt, params)
        self._ensure_thread()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._send("add", request_id, (prompt, params))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._send("abort", request_id, None)

    async def abort(self, request_id: str) -> None:
        """Finish the request with reason "abort" (its stream gets that last output)."""
        self._send("abort", request_id, None)

    def stats(self) -> EngineStats:
        """Counters as of the last engine step (read without blocking the engine)."""
        return self._stats

    async def shutdown(self) -> None:
        """Stop the engine thread (requests in flight are abandoned) and release workers."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.shutdown()

    # -- engine thread ----------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="megaserve-engine", daemon=True)
            self._thread.start()

    def _send(self, kind: str, request_id: str, payload: Any) -> None:
        with self._cond:
            self._commands.append((kind, request_id, payload))
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                outputs = self._apply(commands)
                outputs += self.engine.step()
                self._stats = self.engine.stats()
                for out in outputs:
                    self._loop.call_soon_threadsafe(self._deliver, out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            logger.exception("engine thread failed")
            self._error = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, e)

    def _apply(self, commands: list[tuple[str, str, Any]]) -> list[RequestOutput]:
        outputs = []
        for kind, request_id, payload in commands:
            if kind == "add":
                prompt, params = payload
                try:
                    self.engine.add_request(request_id, prompt, params)
                except ValueError as e:
                    self._loop.call_soon_threadsafe(self._deliver, request_id, e)
            else:
                out = self.engine.abort_request(request_id)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(f"engine failed: {error}"))
