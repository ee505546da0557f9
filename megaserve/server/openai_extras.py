"""The HTTP routes and middlewares around the OpenAI API that vLLM users reach for:
``/tokenize``, ``/detokenize``, ``/version``, ``/v1/models/{id}``, CORS and
``X-Request-Id``.

Request and response shapes are vLLM's:

* ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages":
  [...], "add_generation_prompt": true}`` (the chat template applied) →
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
  ``"return_token_strs": true``, else null);
* ``POST /detokenize`` ``{"tokens": [int]}`` → ``{"prompt": str}``;
* ``GET /version`` → ``{"version": str}``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from megaserve import __version__
from megaserve.server.core import ServingCore
from megaserve.server.errors import ErrorCode, RequestError
from megaserve.server.openai_models import Detokenize, TokenizeChat, TokenizeCompletion
from megaserve.server.openai_protocol import parse_json_object, request_error

logger = logging.getLogger(__name__)

CORE = web.AppKey("core", ServingCore)
ALLOWED_ORIGINS = web.AppKey("allowed_origins", tuple)
REQUEST_ID_HEADERS = web.AppKey("request_id_headers", bool)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models/{model_id:.+}", _model)


def model_card(core: ServingCore, name: str) -> dict[str, Any]:
    """The ``/v1/models`` entry of one served name."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": int(time.time()),
                            "owned_by": "megaserve", "root": core.model_path}
    if core.engine is not None:
        card["max_model_len"] = core.engine.max_model_len
    return card


async def _model(request: web.Request) -> web.Response:
    core = request.app[CORE]
    name = request.match_info["model_id"]
    if name not in core.served_model_names:
        raise RequestError(ErrorCode.NOT_FOUND, f"model: {name!r} is not served here; "
                           f"available: {list(core.served_model_names)}", param="model")
    return web.json_response(model_card(core, name))


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def _body(request: web.Request, *models):
    """The body checked against the first model it fits (by its keys)."""
    from megaserve.server.http_errors import read_body

    body = parse_json_object(await read_body(request))
    model = models[0] if len(models) == 1 or "messages" not in body else models[1]
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise request_error(e) from None
    core = request.app[CORE]
    core.check_model(parsed.model)
    if core.engine is None:
        raise RequestError(ErrorCode.UNAVAILABLE, "server is loading the model; retry later")
    if core.engine.tokenizer is None:
        raise RequestError.invalid("model", "this model has no tokenizer (no tokenizer.json)")
    return core, parsed


async def _tokenize(request: web.Request) -> web.Response:
    core, req = await _body(request, TokenizeCompletion, TokenizeChat)
    tokenizer = core.engine.tokenizer
    if isinstance(req, TokenizeChat):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in req.messages],
                add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # the template's raise_exception, a missing variable
            raise RequestError.invalid("messages", f"chat template failed: {e}") from None
    else:
        text = req.prompt
    ids = await core.tokenize(text, req.add_special_tokens)
    strs = [tokenizer.backend.id_to_token(t) for t in ids] if req.return_token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": core.engine.max_model_len,
                              "tokens": ids, "token_strs": strs})


async def _detokenize(request: web.Request) -> web.Response:
    core, req = await _body(request, Detokenize)
    try:
        text = core.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
    except ValueError as e:
        raise RequestError.invalid("tokens", str(e)) from None
    return web.json_response({"prompt": text})


def cors(request: web.Request, response: web.StreamResponse) -> None:
    """Adds the CORS headers for an allowed ``Origin`` (``--allowed-origins``)."""
    origin = request.headers.get("Origin")
    allowed = request.app[ALLOWED_ORIGINS]
    if origin is None or not allowed or (origin not in allowed and "*" not in allowed):
        return
    response.headers["Access-Control-Allow-Origin"] = "*" if "*" in allowed else origin
    if "*" not in allowed:
        response.headers["Vary"] = "Origin"


@web.middleware
async def cors_and_request_id(request: web.Request, handler) -> web.StreamResponse:
    """CORS (answers preflight ``OPTIONS`` itself, before authentication) and, with
    ``--enable-request-id-headers``, ``X-Request-Id`` on every response: the client's,
    or one the server made up."""
    if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method"):
        response: web.StreamResponse = web.Response(status=204)
        if request.app[ALLOWED_ORIGINS]:
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "Authorization, Content-Type")
            response.headers["Access-Control-Max-Age"] = "600"
        cors(request, response)
        return response
    if request.app[REQUEST_ID_HEADERS]:
        request_id = request.headers.get("X-Request-Id", "")[:256] or uuid.uuid4().hex
        request["request_id"] = request_id
    response = await handler(request)
    if not response.prepared:  # a stream set its headers when it started (see prepare)
        prepare_headers(request, response)
    return response


def prepare_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The CORS and request-id headers of ``response``; call before ``prepare`` for a
    streamed response (the middleware does it for the others)."""
    cors(request, response)
    if "request_id" in request:
        response.headers["X-Request-Id"] = request["request_id"]
