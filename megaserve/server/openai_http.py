"""The OpenAI-compatible HTTP app (aiohttp): completions, chat, models, health, metrics.

A request with several prompts and/or ``n > 1`` becomes one engine request per choice
(choice ``index = prompt_index * n + j``), all admitted together before any is prepared;
with a ``seed``, choice ``j`` uses ``seed + j`` so the choices differ but stay
reproducible. If the client disconnects, the handler is cancelled and every choice is
aborted in the engine.

Every error, aiohttp's own included (404, 405, 413, a body that fails to decompress), is
JSON in OpenAI's shape; an unexpected exception is logged and answered with a 500 that
names no internals. ``/v1/*`` needs ``Authorization: Bearer <key>`` when the server has an
API key; ``/health``, ``/metrics`` and ``/openapi.json`` stay open (as in vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from megaserve import __version__
from megaserve.sampling_params import SamplingParams
from megaserve.server import openai_protocol as oai
from megaserve.server.core import Delta, ServerState, ServingCore
from megaserve.server.errors import ErrorCode, RequestError
from megaserve.server.metrics import CONTENT_TYPE
from megaserve.server.openai_models import openapi_document

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
# A body must arrive within this many seconds of its headers (a slow client cannot hold
# a connection and a handler forever).
BODY_READ_TIMEOUT = 60.0
_CORE = web.AppKey("core", ServingCore)
_API_KEY = web.AppKey("api_key", str)
_OPEN_PATHS = ("/health", "/metrics", "/openapi.json")


@dataclasses.dataclass
class _Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


def build_app(core: ServingCore, api_key: str | None = None) -> web.Application:
    """The aiohttp application serving ``core`` (bodies up to 16 MiB, else HTTP 413).

    With ``api_key``, requests to ``/v1/*`` need ``Authorization: Bearer <api_key>``.
    """
    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[_json_errors, _authenticate])
    app[_CORE] = core
    app[_API_KEY] = api_key or ""
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    return app


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering malformed HTTP (a bad request line, a
    header over 8 KiB, broken framing) in OpenAI's JSON error shape instead of text."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # aiohttp logs it (with its traceback) and checks the state
            super().handle_error(request, status, exc, message)
            text = "internal error (see the server log)"
        else:  # the client's fault: a log line, not a traceback
            if request.writer.output_size > 0:
                raise ConnectionError("response already sent, cannot send an error")
            first = (message or "malformed HTTP").strip().splitlines()[0]
            logger.info("refused malformed HTTP from %s: %s", request.remote, first[:200])
            text = f"request: malformed HTTP ({first[:200]})"
        resp = _error_json(status, text, "internal_error" if status >= 500
                           else "invalid_request_error", None if status >= 500 else "request")
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        try:
            return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)
        except (AttributeError, TypeError):  # another aiohttp's internals: its own errors
            return super().__call__()


def use_json_errors(runner: web.AppRunner) -> None:
    """After ``runner.setup()``: malformed HTTP on the runner's connections gets JSON
    errors too (see ``_JsonErrorHandler``)."""
    if type(runner.server) is web.Server:
        runner.server.__class__ = _JsonErrorServer


def _error_json(status: int, message: str, type_: str, param: str | None = None,
                headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": param,
                                        "code": status}}, status=status, headers=headers)


def _error_response(err: RequestError) -> web.Response:
    return web.json_response(oai.error_body(err), status=err.code.http_status)


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's HTTP errors and unexpected exceptions as OpenAI-shaped JSON."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:  # refuse before reading a byte
        # Answered before a byte of the body is read; the connection then closes after
        # aiohttp's bounded lingering read (so a client still sending sees the 413).
        resp = _error_json(413, f"body: Content-Length {length} is over the limit of "
                           f"{MAX_BODY_BYTES} bytes", "invalid_request_error", "body")
        resp.force_close()
        return resp
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        what = {404: f"{request.path}: no such endpoint",
                405: f"{request.path}: method {request.method} is not allowed"}
        return _error_json(e.status, what.get(e.status, e.reason),
                           "not_found_error" if e.status == 404 else "invalid_request_error",
                           headers=headers)
    except RequestError as e:
        return _error_response(e)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return _error_json(500, "internal error (see the server log)", "internal_error")


@web.middleware
async def _authenticate(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[_API_KEY]
    if key and request.path not in _OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return _error_json(401, "authorization: missing or wrong API key (send the "
                               "header 'Authorization: Bearer <key>')", "authentication_error",
                               "authorization")
    return await handler(request)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _health(request: web.Request) -> web.Response:
    core = request.app[_CORE]
    state = core.state
    worker_health = getattr(getattr(core.engine, "engine", None), "health", None)
    if state is ServerState.SERVING and worker_health is not None and not worker_health().serving:
        # A lost worker is being replaced: requests are accepted and wait for it.
        return web.json_response({"status": "RECOVERING", "reason": worker_health().reason},
                                 status=503)
    status = 200 if state is ServerState.SERVING else 503
    return web.json_response({"status": state.value}, status=status)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_CORE].metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE})


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(__version__))


async def _models(request: web.Request) -> web.Response:
    core = request.app[_CORE]
    card: dict[str, Any] = {"id": core.model_name, "object": "model",
                            "created": int(time.time()), "owned_by": "megaserve"}
    if core.engine is not None:
        card["max_model_len"] = core.engine.max_model_len
    return web.json_response({"object": "list", "data": [card]})


def _close_after(request: web.Request, resp: web.Response) -> web.Response:
    """Answers and closes the connection without reading the rest of a body that could
    not be read (aiohttp would try again and log it as an unhandled exception)."""
    resp.force_close()
    request.content.feed_eof()
    return resp


async def _read_body(request: web.Request) -> bytes:
    """The request body. Raises RequestError (413, 408, 400) naming ``body``."""
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(ErrorCode.TOO_LARGE, f"body: larger than the limit of "
                           f"{MAX_BODY_BYTES} bytes", param="body") from None
    except TimeoutError:
        raise RequestError(ErrorCode.TIMEOUT, f"body: not received within "
                           f"{BODY_READ_TIMEOUT:g} s", param="body") from None
    except web.HTTPException:
        raise
    except Exception:  # a Content-Encoding the body does not match, a broken chunk
        encoding = request.headers.get("Content-Encoding")
        if encoding:
            raise RequestError.invalid("body", f"could not be decoded as Content-Encoding "
                                       f"{encoding!r}") from None
        raise RequestError.invalid("body", "could not be read (broken chunked encoding or "
                                   "connection)") from None


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    core = request.app[_CORE]
    try:
        raw = await _read_body(request)
    except RequestError as e:
        logger.info("refused %s: %s", request.path, e.message)
        return _close_after(request, _error_response(e))
    try:
        req = oai.parse_body(raw, chat)
        if req.model is not None and req.model != core.model_name:
            raise RequestError(ErrorCode.NOT_FOUND, f"model: {req.model!r} is not served "
                               f"here; available: [{core.model_name!r}]", param="model")
        core.check_fits(req.num_choices, "messages" if chat else "prompt",
                        f"{len(req.prompts)} prompt(s) x n={req.n}" if not chat
                        else f"n={req.n}")
        base_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        prompts = req.prompts if not chat else (None,)
        with core.admit_many([f"{base_id}-{i}" for i in range(req.num_choices)]) as ids:
            choices = []
            for p_index, prompt in enumerate(prompts):
                for j in range(req.n):
                    index = p_index * req.n + j
                    choices.append(await _prepare(core, req, prompt, index, j, ids[index]))
            if req.stream:
                return await _stream(request, core, req, base_id, choices)
            return await _unary(core, req, base_id, choices)
    except RequestError as e:
        if e.code is not ErrorCode.UNAVAILABLE and e.code is not ErrorCode.RESOURCE_EXHAUSTED:
            logger.info("refused %s: %s", request.path, e.message)
        return _error_response(e)


async def _prepare(core: ServingCore, req: oai.OpenAIRequest, prompt: Any, index: int,
                   j: int, request_id: str) -> _Choice:
    engine = core.engine
    sampling = dict(req.sampling)
    if "seed" in sampling and j:
        sampling["seed"] = sampling["seed"] + j
    sampling["logprobs"] = req.top_logprobs
    field = "messages" if req.chat else "prompt"
    if req.chat:
        try:
            prompt = engine.tokenizer.apply_chat_template(list(req.messages))
        except Exception as e:  # the template's raise_exception, a missing variable
            raise RequestError.invalid("messages", f"chat template failed: {e}") from None
    elif isinstance(prompt, tuple):
        prompt = list(prompt)
    try:
        params = SamplingParams(
            max_tokens=1 if req.max_tokens is None else req.max_tokens, **sampling)
    except ValueError as e:
        raise RequestError.from_value_error(e) from None
    prompt_ids = await core.prepare(prompt, params, field)
    if req.max_tokens is None:  # chat default: fill the context
        params = dataclasses.replace(params, max_tokens=engine.max_model_len - len(prompt_ids))
    return _Choice(index, request_id, prompt_ids, params)


async def _pump(core: ServingCore, choice: _Choice, queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(
                core.stream(choice.request_id, choice.prompt_ids, choice.params)) as deltas:
            async for delta in deltas:
                await queue.put((choice.index, delta))
    except RequestError as e:
        await queue.put((choice.index, e))
    except Exception as e:  # an engine failure: the consumer reports it to the client
        logger.exception("request %s failed", choice.request_id)
        await queue.put((choice.index, oai.internal_error(
            f"internal error: {type(e).__name__} (see the server log)")))


async def _run_choices(core: ServingCore, choices: list[_Choice]):
    """Yields (index, Delta) from all choices as they come; cancels all on exit."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(core, c, queue)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finish_reason is not None:
                remaining -= 1
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(choices: list[_Choice], finals: dict[int, Delta], n: int) -> dict[str, int]:
    prompt = sum(len(c.prompt_ids) for c in choices if c.index % n == 0)
    completion = sum(len(d.output_ids) for d in finals.values())
    # Prompt tokens served from the prefix cache, once per prompt (OpenAI's field).
    cached = sum(d.cached_tokens for i, d in finals.items() if i % n == 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _logprobs(core: ServingCore, req: oai.OpenAIRequest, ids: list[int], lps, offset: int):
    if req.top_logprobs is None or lps is None:
        return None
    if req.chat:
        return oai.chat_logprobs(ids, lps, core.token_bytes)
    return oai.completion_logprobs(ids, lps, offset, core.token_bytes)


def _choice_body(core, req, choice: _Choice, ids, text, lps, finish, offset) -> dict[str, Any]:
    body: dict[str, Any] = {"index": choice.index}
    if req.chat:
        body["message"] = {"role": "assistant", "content": text}
    else:
        body["text"] = text
    body["logprobs"] = _logprobs(core, req, ids, lps, offset)
    body["finish_reason"] = finish
    if req.return_token_ids:
        body["token_ids"] = list(ids)
        body["prompt_token_ids"] = choice.prompt_ids
    return body


async def _unary(core, req, base_id, choices) -> web.Response:
    finals: dict[int, Delta] = {}
    try:
        async with contextlib.aclosing(_run_choices(core, choices)) as results:
            async for index, delta in results:
                if delta.finish_reason is not None:
                    finals[index] = delta
    except RequestError as e:
        return _error_response(e)
    bodies = [_choice_body(core, req, c, finals[c.index].output_ids, finals[c.index].output_text,
                           finals[c.index].output_logprobs, finals[c.index].finish_reason, 0)
              for c in choices]
    return web.json_response({
        "id": base_id, "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()), "model": core.model_name, "choices": bodies,
        "usage": _usage(choices, finals, req.n)})


async def _stream(request, core, req, base_id, choices) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    head = {"id": base_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": core.model_name}
    by_index = {c.index: c for c in choices}
    offsets = dict.fromkeys(by_index, 0)
    finals: dict[int, Delta] = {}

    def chunk(body: dict[str, Any]) -> bytes:
        payload = {**head, "choices": [body]}
        if req.include_usage:
            payload["usage"] = None
        return oai.sse_event(payload)

    if req.chat:
        for c in choices:
            await resp.write(chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}))
    try:
        async with contextlib.aclosing(_run_choices(core, choices)) as results:
            async for index, d in results:
                body = _choice_body(core, req, by_index[index], d.token_ids, d.text,
                                    d.logprobs, d.finish_reason, offsets[index])
                offsets[index] += len(d.text)
                if req.chat:
                    content = body.pop("message")["content"]
                    body["delta"] = {"content": content} if content else {}
                if d.finish_reason is not None:
                    finals[index] = d
                await resp.write(chunk(body))
        if req.include_usage:
            await resp.write(oai.sse_event({**head, "choices": [],
                                            "usage": _usage(choices, finals, req.n)}))
    except RequestError as e:
        await resp.write(oai.sse_event(oai.error_body(e)))
    await resp.write(oai.SSE_DONE)
    await resp.write_eof()
    return resp
