"""What the gRPC and HTTP front ends share: admission, validation and the streaming loop.

Request life cycle (one asyncio loop, no locks needed)::

    admit(request_id)        # refuse while loading/draining (UNAVAILABLE), over the waiting
        │                    # cap (RESOURCE_EXHAUSTED), or a duplicate id (ALREADY_EXISTS)
    prepare(prompt, params)  # size cap, vocabulary and engine checks → prompt token ids
        │
    stream(request_id, ...)  # engine.generate → Delta per step (new tokens only), metrics;
                             # if the consumer goes away (cancel, deadline, disconnect)
                             # the request is aborted in the engine and its KV blocks freed

NOTE: the waiting cap counts requests the *server* has admitted, so a burst that arrives
before the engine schedules anything is still bounded: at most ``max_num_seqs +
max_waiting`` requests are in flight at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, fields, replace

from megaserve.outputs import Logprobs, RequestOutput
from megaserve.sampling_params import RequestOutputKind, SamplingParams
from megaserve.server.errors import ErrorCode, RequestError
from megaserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Text prompts longer than max_model_len tokens of the tokenizer's longest token
# (Tokenizer.max_chars_per_token) are refused before tokenization: they cannot fit, and
# tokenizing them is the expensive part. Without a tokenizer this bound is used.
MAX_CHARS_PER_TOKEN = 32
# Prompts of more characters than this are tokenized in the tokenizer pool, off the event
# loop (the tokenizer releases the interpreter lock for them, see Tokenizer.encode).
_THREAD_TOKENIZE_CHARS = 4096
# Worker threads tokenizing at once: a storm of long prompts queues here instead of taking
# every core from the engine and the event loop (vLLM's API server uses one).
TOKENIZE_WORKERS = 2


def chars_per_token(tokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` can stand for (its
    ``max_chars_per_token``; ``MAX_CHARS_PER_TOKEN`` without a tokenizer)."""
    if tokenizer is None:
        return MAX_CHARS_PER_TOKEN
    return getattr(tokenizer, "max_chars_per_token", MAX_CHARS_PER_TOKEN)


class ServerState(enum.Enum):
    LOADING = "LOADING"
    SERVING = "SERVING"
    DRAINING = "DRAINING"
    FAILED = "FAILED"  # the engine died: refuse everything, health NOT_SERVING
    STOPPED = "STOPPED"


@dataclass(frozen=True)
class Health:
    """The server's health as every front end reports it."""

    state: str  # a ServerState value, or "RECOVERING"
    serving: bool  # HTTP 200 / gRPC SERVING
    reason: str = ""


@dataclass
class Delta:
    """What one engine step added to a request (new tokens only), plus the end state.

    When ``finish_reason`` is set this is the last delta and ``output_ids`` / ``output_text``
    / ``output_logprobs`` hold the whole output.
    """

    token_ids: list[int]
    text: str
    logprobs: Logprobs | None
    finish_reason: str | None = None
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    output_logprobs: Logprobs | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class _Progress:
    """What a request's stream has sent so far (its final message repeats all of it)."""

    arrival: float
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # the deltas' text, joined at the end
    logprobs: Logprobs | None = None
    last_token_at: float | None = None


class ServingCore:
    """Owns the engine (once loaded), the in-flight table and the metrics."""

    def __init__(self, model_name: str, max_num_seqs: int, max_waiting: int,
                 served_model_names: tuple[str, ...] = ()) -> None:
        """``model_name``: the model as given (path or built-in name); the API serves it
        under ``served_model_names`` (default: ``model_name``), the first of which labels
        the metrics and answers requests that name no model."""
        self.model_path = model_name
        self.served_model_names = tuple(served_model_names) or (model_name,)
        self.model_name = self.served_model_names[0]
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.engine = None  # AsyncLLMEngine once load() is done
        self.state = ServerState.LOADING
        self.started_at = time.monotonic()
        self._in_flight: dict[str, float] = {}  # request id → arrival time (monotonic)
        self._token_bytes = None
        # Tokenizes long prompts off the event loop; threads start on first use.
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_WORKERS,
                                                 thread_name_prefix="megaserve-tokenize")
        self._idle = asyncio.Event()
        self._idle.set()
        self._counted_from = None  # the engine's stats at start_counting()
        self.failed = asyncio.Event()  # set once by mark_failed
        self.metrics = ServerMetrics(self.model_name, self.engine_stats, lambda: len(self._in_flight))

    # -- state ---------------------------------------------------------------------------
    def start_counting(self) -> None:
        """The engine's counters (tokens, prefix-cache queries and hits, preemptions, ...)
        read 0 in ``engine_stats`` from now on: what the server ran before serving (its
        warm-up request) is not a request of the API. Gauges are unaffected."""
        self._counted_from = self.engine.stats()

    def engine_stats(self):
        """The engine's ``EngineStats`` (None while loading), counters since
        ``start_counting``. Once the engine has failed, nothing runs, waits or holds a KV
        block any more: those read 0 (the engine's last report would freeze them at the
        moment it died); the totals stay."""
        if self.engine is None:
            return None
        stats = self.engine.stats()
        if stats is not None and self._counted_from is not None:
            from megaserve.runtime.recovery import GAUGES

            base = self._counted_from
            stats = replace(stats, **{f.name: getattr(stats, f.name) - getattr(base, f.name)
                                      for f in fields(stats) if f.name not in GAUGES})
        if self.state is ServerState.FAILED and stats is not None:
            stats = replace(stats, num_running=0, num_waiting=0,
                            num_free_kv_blocks=stats.num_kv_blocks)
        return stats

    def health(self) -> Health:
        """What ``/health``, gRPC health and ``GetServerInfo`` all report: the server's
        state, or RECOVERING while a lost worker is being replaced (the disaggregated
        runtime; requests are accepted and wait for it)."""
        state = self.state
        worker_health = getattr(getattr(self.engine, "engine", None), "health", None)
        if state is ServerState.SERVING and worker_health is not None:
            now = worker_health()
            if not now.serving:
                return Health("RECOVERING", False, now.reason)
        return Health(state.value, state is ServerState.SERVING)

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (None: the first); NOT_FOUND otherwise."""
        if name is None:
            return self.model_name
        if name not in self.served_model_names:
            raise RequestError(ErrorCode.NOT_FOUND, f"model: {name!r} is not served here; "
                               f"available: {list(self.served_model_names)}", param="model")
        return name

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, long texts in the tokenizer pool (off the event loop)."""
        encode = self.engine.tokenizer.encode
        if len(text) > _THREAD_TOKENIZE_CHARS:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, encode, text, add_special_tokens)
        return encode(text, add_special_tokens)

    # -- admission ---------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def limit(self) -> int:
        """Requests admitted at once, at most: ``max_num_seqs + max_waiting``."""
        return self.max_num_seqs + self.max_waiting

    def check_fits(self, num_requests: int, field_name: str, what: str) -> None:
        """Raises INVALID_ARGUMENT if ``num_requests`` could never be admitted together
        (more than ``limit``): retrying later cannot help, so it is not a 429."""
        if num_requests > self.limit:
            raise RequestError.invalid(
                field_name, f"{what} = {num_requests} requests is more than this server "
                f"admits at once (max_num_seqs + max_waiting = {self.limit}); split it")

    @contextlib.contextmanager
    def admit(self, request_id: str | None, owner: str = "") -> Iterator[str]:
        """Registers a request for the duration of the ``with`` block; yields the id to
        run it under in the engine.

        ``owner`` names the caller (for example a gRPC connection): request ids are
        scoped by owner, so callers cannot collide with, probe or abort each other's
        requests (the engine id is ``"<owner>#<request_id>"``, or ``request_id`` for the
        empty owner). Raises RequestError (UNAVAILABLE, RESOURCE_EXHAUSTED,
        ALREADY_EXISTS).
        """
        with self.admit_many([request_id or uuid.uuid4().hex], owner) as ids:
            yield ids[0]

    @staticmethod
    def engine_id(request_id: str, owner: str = "") -> str:
        """The engine's id for ``owner``'s ``request_id`` (see ``admit``)."""
        return f"{owner}#{request_id}" if owner else request_id

    @contextlib.contextmanager
    def admit_many(self, request_ids: list[str], owner: str = "") -> Iterator[list[str]]:
        """Admits all of ``request_ids`` or none (see ``admit``); yields their engine ids."""
        if self.state is not ServerState.SERVING or \
                len(self._in_flight) + len(request_ids) > self.limit:
            self._refuse(len(request_ids))
        engine_ids = [self.engine_id(r, owner) for r in request_ids]
        for request_id, engine_id in zip(request_ids, engine_ids):
            if engine_id in self._in_flight or request_ids.count(request_id) > 1:
                raise RequestError(ErrorCode.ALREADY_EXISTS,
                                   f"request_id: {request_id!r} is already in flight",
                                   param="request_id")
        now = time.monotonic()
        for engine_id in engine_ids:
            self._in_flight[engine_id] = now
        self._idle.clear()
        try:
            yield engine_ids
        finally:
            for engine_id in engine_ids:
                del self._in_flight[engine_id]
            if not self._in_flight:
                self._idle.set()

    @property
    def token_bytes(self):
        """The engine tokenizer's ``TokenBytes`` (built on first use)."""
        if self._token_bytes is None:
            from megaserve.server.token_bytes import TokenBytes

            self._token_bytes = TokenBytes(self.engine.tokenizer)
        return self._token_bytes

    def mark_failed(self, reason: str) -> None:
        """The engine cannot serve any more: refuse new requests and wake ``failed``."""
        if self.state is not ServerState.FAILED:
            logger.error("megaserve: engine failed, refusing requests: %s", reason)
            self.state = ServerState.FAILED
            self.failed.set()

    def _refuse(self, num_requests: int = 1) -> None:
        """Raises (and counts) UNAVAILABLE or RESOURCE_EXHAUSTED."""
        if self.state is not ServerState.SERVING:
            what = {ServerState.LOADING: "loading the model; retry later",
                    ServerState.FAILED: "unusable: its engine failed (see the server log); "
                                        "restart it"}.get(self.state, "shutting down")
            error = RequestError(ErrorCode.UNAVAILABLE, f"server is {what}")
        else:
            error = RequestError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"too many requests: {len(self._in_flight)} in flight and {num_requests} "
                f"more asked for, the limit is max_num_seqs + max_waiting = {self.limit}; "
                "retry later")
        self.metrics.rejected(error.code.grpc_name)
        raise error

    # -- validation --------------------------------------------------------------------
    async def prepare(self, prompt: str | list[int], params: SamplingParams,
                      field_name: str = "prompt") -> list[int]:
        """Checks a prompt against the model and returns its token ids.

        Raises RequestError(INVALID_ARGUMENT) naming ``field_name`` or the engine's field.
        """
        engine = self.engine
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError.invalid(field_name, "must not be empty")
            per_token = chars_per_token(engine.tokenizer)
            limit = engine.max_model_len * per_token
            if len(prompt) > limit:
                raise RequestError.invalid(
                    field_name, f"{len(prompt)} characters is too long: it cannot fit in "
                    f"max_model_len={engine.max_model_len} tokens (the limit is {limit} "
                    f"characters, {per_token} per token: this tokenizer's longest token)")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError.invalid(field_name, "is not valid UTF-8 (unpaired surrogate)") from None
        else:
            if not prompt:
                raise RequestError.invalid(field_name, "must not be empty")
            if len(prompt) >= engine.max_model_len:  # before looking at each id
                raise RequestError.invalid(
                    field_name, f"{len(prompt)} tokens leave no room for output: "
                    f"max_model_len={engine.max_model_len}")
            vocab = engine.vocab_size
            for pos, token in enumerate(prompt):
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                    raise RequestError.invalid(
                        field_name, f"token id {token!r} at position {pos} is outside the "
                        f"vocabulary [0, {vocab})")
        try:
            if isinstance(prompt, str) and len(prompt) > _THREAD_TOKENIZE_CHARS:
                prompt_ids = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize_pool, engine.validate, prompt, params)
            else:
                prompt_ids = engine.validate(prompt, params)
        except ValueError as e:
            raise RequestError.from_value_error(e, field_name) from None
        if len(prompt_ids) + params.max_tokens > engine.max_model_len:
            raise RequestError.invalid(
                "max_tokens", f"{params.max_tokens} plus the prompt's {len(prompt_ids)} tokens "
                f"exceeds max_model_len={engine.max_model_len}")
        return prompt_ids

    # -- generation --------------------------------------------------------------------
    async def stream(self, request_id: str, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[Delta]:
        """Runs one admitted request and yields a Delta per engine step.

        The last Delta has ``finish_reason`` set. If the consumer stops early (cancelled,
        deadline, client gone, ``aclose()``), the request is aborted in the engine.
        Use with ``contextlib.aclosing`` so that happens promptly.
        """
        progress = _Progress(arrival=self._in_flight.get(request_id, time.monotonic()))
        finished = False
        # The engine's outputs are deltas: no step copies what it sent before.
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        try:
            async with contextlib.aclosing(
                    self.engine.generate(request_id, prompt_ids, params)) as outputs:
                async for out in outputs:
                    delta = self._advance(progress, out)
                    finished = delta.finish_reason is not None
                    if delta.token_ids or delta.text or finished:
                        yield delta
                    if finished:
                        return
        except ValueError as e:
            finished = True  # refused before it ran: nothing to abort
            raise RequestError.from_value_error(e) from None
        except Exception as e:
            from megaserve.runtime.async_engine import EngineDeadError  # loaded by now

            if isinstance(e, EngineDeadError):  # the engine thread is gone for good
                self.mark_failed(str(e))
            raise
        finally:
            if not finished:
                # Cancelled, deadline passed, client gone or an engine failure: free the
                # request's KV blocks. Shielded: we may be inside a cancelled task.
                await asyncio.shield(self._abort_quietly(request_id))

    def _advance(self, progress: _Progress, out: RequestOutput) -> Delta:
        """The Delta of a step's output (a DELTA output: what the step added); records
        latencies and adds it to ``progress``."""
        comp = out.outputs[0]
        new_ids = comp.token_ids
        now = time.monotonic()
        if new_ids:
            if progress.last_token_at is None:
                self.metrics.first_token(now - progress.arrival)
            else:
                gap = (now - progress.last_token_at) / len(new_ids)
                self.metrics.inter_token(gap, len(new_ids))
            progress.last_token_at = now
        delta = Delta(token_ids=new_ids, text=comp.text, logprobs=comp.logprobs)
        progress.token_ids += new_ids
        if comp.text:
            progress.text.append(comp.text)
        if comp.logprobs is not None:
            if progress.logprobs is None:
                progress.logprobs = []
            progress.logprobs += comp.logprobs
        if out.finished:
            reason = comp.finish_reason or "stop"
            self.metrics.request_done(now - progress.arrival)
            self.metrics.finished(reason)
            delta.finish_reason = reason
            delta.output_ids = progress.token_ids
            delta.output_text = "".join(progress.text)
            delta.output_logprobs = progress.logprobs
            delta.prompt_tokens = len(out.prompt_token_ids)
            delta.cached_tokens = out.num_cached_tokens
        return delta

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
            self.metrics.finished("abort")
        except Exception:  # the engine may already have dropped it
            logger.debug("abort of %s failed", request_id, exc_info=True)

    async def abort(self, request_id: str, owner: str = "") -> bool:
        """Aborts ``owner``'s in-flight request ``request_id``; False if ``owner`` has no
        such request in flight (another caller's request is never touched)."""
        engine_id = self.engine_id(request_id, owner)
        if engine_id not in self._in_flight or self.engine is None:
            return False
        await self.engine.abort(engine_id)
        return True

    # -- shutdown ----------------------------------------------------------------------
    def close(self) -> None:
        """Releases the tokenizer pool (prompts still queued there are dropped)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def drain(self, grace_period: float, flush_timeout: float = 1.0) -> int:
        """Stops admitting, waits up to ``grace_period`` s for in-flight requests, then
        aborts what is left (their streams end with finish_reason "abort") and waits up to
        ``flush_timeout`` s for those streams to end: half for the engine's abort outputs,
        the other half for the streams the engine did not end in time, which are ended here
        (``end_stream``, also with "abort").

        Returns the number of requests that had to be aborted.
        """
        self.state = ServerState.DRAINING
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_period)
            return 0
        except asyncio.TimeoutError:
            pass
        left = list(self._in_flight)
        logger.warning("grace period over: aborting %d in-flight request(s)", len(left))
        for request_id in left:
            with contextlib.suppress(Exception):
                await self.engine.abort(request_id)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=flush_timeout / 2)
        # An engine that did not answer in time (one replacing its workers, say): end the
        # streams here, so each still gets its finish reason before the server exits.
        end_stream = getattr(self.engine, "end_stream", None)
        if end_stream is not None and self._in_flight:
            for request_id in list(self._in_flight):
                end_stream(request_id)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=flush_timeout / 2)
        return len(left)
