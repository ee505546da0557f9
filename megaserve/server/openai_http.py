"""The OpenAI-compatible HTTP app (aiohttp): completions, chat, models, health, metrics.

A request with several prompts and/or ``n > 1`` becomes one engine request per choice
(choice ``index = prompt_index * n + j``), all admitted together before any is prepared;
with a ``seed``, choice ``j`` uses ``seed + j`` so the choices differ but stay
reproducible. If the client disconnects, the handler is cancelled and every choice is
aborted in the engine.

Every error is JSON in OpenAI's shape and ``/v1/*`` needs the API key when the server has
one (``/health``, ``/metrics`` and ``/openapi.json`` stay open, as in vLLM): see
``http_errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from megaserve import __version__
from megaserve.sampling_params import SamplingParams
from megaserve.server import openai_extras as extras
from megaserve.server import openai_protocol as oai
from megaserve.server import tool_calls as tools
from megaserve.server.auth import normalize_keys
from megaserve.server.core import Delta, ServerState, ServingCore
from megaserve.server.errors import ErrorCode, RequestError
from megaserve.server.http_errors import (
    API_KEY, MAX_BODY_BYTES, authenticate, close_after, error_response, json_errors, read_body)
from megaserve.server.metrics import CONTENT_TYPE
from megaserve.server.openai_models import openapi_document
from megaserve.server.sampling_checks import check_for_model

logger = logging.getLogger(__name__)

_CORE = web.AppKey("core", ServingCore)
TOOL_PARSER = web.AppKey("tool_parser", object)  # "hermes" or None: "auto" tool choice refused


@dataclasses.dataclass
class _Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""  # with echo: the prompt's text, sent before the completion


def build_app(core: ServingCore, api_key: str | tuple[str, ...] | None = None, *,
              allowed_origins: tuple[str, ...] = (),
              request_id_headers: bool = False,
              tool_parser: str | None = None) -> web.Application:
    """The aiohttp application serving ``core`` (bodies up to 16 MiB, else HTTP 413).

    With ``api_key`` (one key or several), requests to every path but ``OPEN_PATHS``
    need ``Authorization: Bearer <key>`` with one of them. ``allowed_origins``: CORS
    origins (``"*"``: any); ``request_id_headers``: ``X-Request-Id`` on every response
    (``megaserve.server.openai_extras``). ``tool_parser``: the parser of ``"auto"`` tool
    choice (``megaserve.server.tool_calls.PARSERS``); None refuses it.
    """
    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[extras.cors_and_request_id, json_errors, authenticate])
    app[_CORE] = core
    app[extras.CORE] = core
    app[extras.ALLOWED_ORIGINS] = tuple(allowed_origins)
    app[extras.REQUEST_ID_HEADERS] = request_id_headers
    app[TOOL_PARSER] = tool_parser
    app[API_KEY] = normalize_keys(api_key)
    extras.add_routes(app)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    return app


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _health(request: web.Request) -> web.Response:
    health = request.app[_CORE].health()
    body = {"status": health.state}
    if health.reason:
        body["reason"] = health.reason
    return web.json_response(body, status=200 if health.serving else 503)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_CORE].metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE})


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(__version__))


async def _models(request: web.Request) -> web.Response:
    core = request.app[_CORE]
    return web.json_response({"object": "list", "data": [
        extras.model_card(core, name) for name in core.served_model_names]})


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    core = request.app[_CORE]
    try:
        raw = await read_body(request)
    except RequestError as e:
        logger.info("refused %s: %s", request.path, e.message)
        return close_after(request, error_response(e))
    try:
        req = oai.parse_body(raw, chat)
        req = dataclasses.replace(req, model=core.check_model(req.model))
        if req.tool_choice == "auto" and request.app[TOOL_PARSER] is None:
            raise RequestError.invalid("tool_choice", '"auto" tool choice (the default with '
                                       "tools) needs the server started with "
                                       "--enable-auto-tool-choice --tool-call-parser")
        if req.ignored:
            logger.info("%s: ignored the OpenAI field(s) %s (megaserve has no use for them)",
                        request.path, ", ".join(req.ignored))
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
        return error_response(e)


async def _prepare(core: ServingCore, req: oai.OpenAIRequest, prompt: Any, index: int,
                   j: int, request_id: str) -> _Choice:
    engine = core.engine
    sampling = dict(req.sampling)
    if "seed" in sampling and j:
        sampling["seed"] = sampling["seed"] + j
    sampling["logprobs"] = req.top_logprobs
    field = "messages" if req.chat else "prompt"
    if req.chat:
        if engine.tokenizer is None:
            raise RequestError.invalid("messages", "this model has no tokenizer (no "
                                       "tokenizer.json): chat needs one; send token ids "
                                       "to /v1/completions")
        try:
            prompt = engine.tokenizer.apply_chat_template(
                _messages_for(engine.tokenizer, req.messages), tools=list(req.tools) or None)
        except Exception as e:  # the template's raise_exception, a missing variable
            raise RequestError.invalid("messages", f"chat template failed: {e}") from None
    elif isinstance(prompt, tuple):
        prompt = list(prompt)
    forced = tools.grammar_for(list(req.tools), req.tool_choice) if req.chat else None
    grammar_field = "structured_outputs" if req.structured_outputs_given else "response_format"
    if forced is not None:
        sampling["structured_output"], grammar_field = forced, "tools"
    elif req.structured_output is not None:
        sampling["structured_output"] = req.structured_output
    try:
        params = SamplingParams(
            max_tokens=1 if req.max_tokens is None else req.max_tokens, **sampling)
    except ValueError as e:
        raise RequestError.from_value_error(e) from None
    params = check_for_model(engine, params, grammar_field)
    prompt_ids = await core.prepare(prompt, params, field)
    if req.max_tokens is None:  # chat default: fill the context
        params = dataclasses.replace(params, max_tokens=engine.max_model_len - len(prompt_ids))
    echo = ""
    if req.echo:
        echo = prompt if isinstance(prompt, str) else _decode(engine, prompt_ids)
    return _Choice(index, request_id, prompt_ids, params, echo)


def _decode(engine, token_ids: list[int]) -> str:
    if engine.tokenizer is None:
        raise RequestError.invalid("echo", "this model has no tokenizer to show the prompt")
    return engine.tokenizer.decode(token_ids)


def _messages_for(tokenizer, messages: tuple[dict, ...]) -> list[dict]:
    """``messages`` for the chat template; for a template that does not render tool calls,
    an assistant message's calls are appended to its content as Hermes blocks (the format
    the Hermes parser reads back)."""
    template = tokenizer.chat_template or ""
    if "tool_calls" in template:
        return list(messages)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = "".join(
                '<tool_call>\n{"name": ' + json.dumps(c["function"]["name"])
                + ', "arguments": ' + c["function"]["arguments"] + "}\n</tool_call>"
                for c in m["tool_calls"])
            m = {**m, "content": m["content"] + blocks}
        out.append(m)
    return out


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
        return oai.chat_logprobs(ids, lps, core.token_bytes, req.top_logprobs)
    return oai.completion_logprobs(ids, lps, offset, core.token_bytes)


def _choice_body(core, req, choice: _Choice, ids, text, lps, finish, offset) -> dict[str, Any]:
    body: dict[str, Any] = {"index": choice.index}
    if req.chat:
        body["message"] = {"role": "assistant", "content": text}
        if finish is not None and tools.uses_tools(req.tool_choice):  # a whole output
            body["message"], called = tools.message(text, req.tool_choice)
            if called and finish == "stop":
                finish = "tool_calls"
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
        return error_response(e)
    bodies = [_choice_body(core, req, c, finals[c.index].output_ids,
                           c.prompt_text + finals[c.index].output_text,
                           finals[c.index].output_logprobs, finals[c.index].finish_reason, 0)
              for c in choices]
    return web.json_response({
        "id": base_id, "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()), "model": req.model, "choices": bodies,
        "usage": _usage(choices, finals, req.n)})


async def _stream(request, core, req, base_id, choices) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    extras.prepare_headers(request, resp)
    await resp.prepare(request)
    head = {"id": base_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": req.model}
    by_index = {c.index: c for c in choices}
    offsets = dict.fromkeys(by_index, 0)
    tool_streams = {c.index: tools.ToolStream(req.tool_choice) for c in choices} \
        if req.chat and tools.uses_tools(req.tool_choice) else None
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
    for c in choices:
        if c.prompt_text:  # echo
            await resp.write(chunk({"index": c.index, "text": c.prompt_text, "logprobs": None,
                                    "finish_reason": None}))
    try:
        async with contextlib.aclosing(_run_choices(core, choices)) as results:
            async for index, d in results:
                body = _choice_body(core, req, by_index[index], d.token_ids, d.text,
                                    d.logprobs, None, offsets[index])
                body["finish_reason"] = d.finish_reason
                offsets[index] += len(d.text)
                if req.chat:
                    content = body.pop("message")["content"]
                    body["delta"] = {"content": content} if content else {}
                if tool_streams is not None:
                    stream = tool_streams[index]
                    body["delta"] = stream.delta(d.text, d.finish_reason is not None)
                    if stream.called and d.finish_reason == "stop":
                        body["finish_reason"] = "tool_calls"
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
