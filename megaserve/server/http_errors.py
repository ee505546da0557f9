"""HTTP hygiene for the OpenAI app: every error as OpenAI-shaped JSON, the API key, and
reading a body within bounds.

* ``json_errors`` (middleware): aiohttp's own HTTP errors (404, 405, 413, ...) and
  RequestErrors become ``{"error": {message, type, param, code}}``; an unexpected exception
  is logged and answered with a 500 naming no internals.
* ``use_json_errors(runner)``: the same for malformed HTTP that never reaches the app (a
  bad request line, a header over 8 KiB), answered by aiohttp's connection handler.
* ``authenticate`` (middleware): ``Authorization: Bearer <key>`` on everything but
  ``OPEN_PATHS``, compared in constant time.
* ``read_body``: at most ``MAX_BODY_BYTES`` (refused from ``Content-Length`` before a byte
  is read), within ``BODY_READ_TIMEOUT`` seconds.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from megaserve.server import openai_protocol as oai
from megaserve.server.auth import matching_key
from megaserve.server.errors import ErrorCode, RequestError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
# A body must arrive within this many seconds of its headers (a slow client cannot hold
# a connection and a handler forever).
BODY_READ_TIMEOUT = 60.0
API_KEY = web.AppKey("api_keys", tuple)  # the server's API keys; empty: no authentication
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/version")


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
            first = ((message or "").strip().splitlines() or ["malformed HTTP"])[0]
            logger.info("refused malformed HTTP from %s: %s", request.remote, first[:200])
            text = f"request: malformed HTTP ({first[:200]})"
        resp = error_json(status, text, "internal_error" if status >= 500
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


def error_json(status: int, message: str, type_: str, param: str | None = None,
                headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": param,
                                        "code": status}}, status=status, headers=headers)


def error_response(err: RequestError) -> web.Response:
    return web.json_response(oai.error_body(err), status=err.code.http_status)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's HTTP errors and unexpected exceptions as OpenAI-shaped JSON."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:  # refuse before reading a byte
        # Answered before a byte of the body is read; the connection then closes after
        # aiohttp's bounded lingering read (so a client still sending sees the 413).
        resp = error_json(413, f"body: Content-Length {length} is over the limit of "
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
        return error_json(e.status, what.get(e.status, e.reason),
                           "not_found_error" if e.status == 404 else "invalid_request_error",
                           headers=headers)
    except RequestError as e:
        return error_response(e)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return error_json(500, "internal error (see the server log)", "internal_error")


@web.middleware
async def authenticate(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[API_KEY]
    if key and request.path not in OPEN_PATHS:
        if matching_key(request.headers.get("Authorization", ""), key) is None:
            return error_json(401, "authorization: missing or wrong API key (send the "
                               "header 'Authorization: Bearer <key>')", "authentication_error",
                               "authorization")
    return await handler(request)


def close_after(request: web.Request, resp: web.Response) -> web.Response:
    """Answers and closes the connection without reading the rest of a body that could
    not be read (aiohttp would try again and log it as an unhandled exception)."""
    resp.force_close()
    request.content.feed_eof()
    return resp


async def read_body(request: web.Request) -> bytes:
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
