"""OpenAI-compatible request parsing and response/SSE building (pure, no I/O).

Requests are checked strictly: unknown fields, wrong types and OpenAI features megaserve
does not implement are refused with a RequestError naming the field, never ignored.
Extensions over OpenAI (as in vLLM): ``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids`` and ``return_token_ids`` (adds ``token_ids`` / ``prompt_token_ids`` to
each choice).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megaserve.outputs import Logprobs
from megaserve.server.errors import ErrorCode, RequestError

MAX_N = 16
MAX_TOP_LOGPROBS = 20

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "stop", "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias",
           "top_k", "min_p", "ignore_eos", "stop_token_ids", "return_token_ids"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
# OpenAI fields accepted only at the value that means "feature off".
_OFF_VALUES: dict[str, Callable[[Any], bool]] = {
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
                    "stop_token_ids")


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked /v1/completions or /v1/chat/completions body.

    ``prompts`` holds the completion prompts (str or token ids); for chat it is empty and
    ``messages`` is set (rendered with the tokenizer's chat template by the caller).
    ``sampling`` are SamplingParams keyword arguments without ``max_tokens``, which is
    ``max_tokens`` when the client gave one (chat default: fill the context).
    """

    chat: bool
    prompts: tuple[str | tuple[int, ...], ...]
    messages: tuple[dict, ...] | None
    sampling: dict[str, Any]
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs
    return_token_ids: bool
    model: str | None


def decode_body(raw: bytes) -> dict[str, Any]:
    """Bytes of an HTTP body → a JSON object. Raises RequestError naming the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError.invalid("body", f"is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError.invalid("body", f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError.invalid("body", f"must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError.invalid(key, "is not valid UTF-8 (unpaired surrogate escape)") from None
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise RequestError.invalid(key, "unknown field")
    for key, is_off in _OFF_VALUES.items():
        if key in body and not is_off(body[key]):
            raise RequestError.invalid(key, f"is not supported by megaserve (got {body[key]!r})")


def _parse_prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return (tuple(prompt),)
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return tuple(tuple(p) for p in prompt)
    if prompt is None:
        raise RequestError.invalid("prompt", "is required")
    if isinstance(prompt, list) and not prompt:
        raise RequestError.invalid("prompt", "must not be empty")
    raise RequestError.invalid(
        "prompt", "must be a string, a list of token ids, or a list of either")


def _parse_messages(messages: Any) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise RequestError.invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError.invalid(f"messages[{i}]", "must be an object with a string 'role'")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError.invalid(f"messages[{i}].{sorted(extra)[0]}", "unknown field")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise RequestError.invalid(f"messages[{i}].content",
                                               "only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError.invalid(f"messages[{i}].content", "must be a string")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def parse_request(body: dict[str, Any], chat: bool) -> OpenAIRequest:
    """Checks a request body. Raises RequestError(INVALID_ARGUMENT) naming the field."""
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise RequestError.invalid("n", f"must be an integer in [1, {MAX_N}], got {n!r}")
    if "best_of" in body and body["best_of"] not in (None, n):
        raise RequestError.invalid("best_of", "is not supported by megaserve (must equal n)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError.invalid("stream", f"must be a boolean, got {stream!r}")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError.invalid("stream_options", "is only allowed with stream=true")
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise RequestError.invalid("stream_options",
                                       "must be {\"include_usage\": true|false}")
        include_usage = options.get("include_usage", False)
    sampling: dict[str, Any] = {}
    for key in _SAMPLING_FIELDS:
        if body.get(key) is not None:
            value = body[key]
            if key in ("temperature", "top_p", "min_p") and not _is_num(value):
                raise RequestError.invalid(key, f"must be a number, got {value!r}")
            if key == "ignore_eos" and not isinstance(value, bool):
                raise RequestError.invalid(key, f"must be a boolean, got {value!r}")
            sampling[key] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError.invalid("stop", "must be a non-empty string or a list of them")
        sampling["stop"] = tuple(stop)
    if "stop_token_ids" in sampling and not isinstance(sampling["stop_token_ids"], list):
        raise RequestError.invalid("stop_token_ids", "must be a list of token ids")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat \
        else body.get("max_tokens", 16)
    if max_tokens is not None and not _is_int(max_tokens):
        raise RequestError.invalid("max_tokens", f"must be an integer, got {max_tokens!r}")
    top_logprobs = _parse_logprobs(body, chat)
    return_token_ids = body.get("return_token_ids", False)
    if not isinstance(return_token_ids, bool):
        raise RequestError.invalid("return_token_ids", "must be a boolean")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError.invalid("model", "must be a string")
    return OpenAIRequest(
        chat=chat, prompts=() if chat else _parse_prompts(body.get("prompt")),
        messages=_parse_messages(body.get("messages")) if chat else None,
        sampling=sampling, max_tokens=max_tokens, n=n, stream=stream,
        include_usage=include_usage, top_logprobs=top_logprobs,
        return_token_ids=return_token_ids, model=model)


def _parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        want = body.get("logprobs", False)
        if not isinstance(want, bool):
            raise RequestError.invalid("logprobs", "must be a boolean for chat completions")
        top = body.get("top_logprobs")
        if top is not None and not want:
            raise RequestError.invalid("top_logprobs", "requires logprobs=true")
        value = (top or 0) if want else None
        name = "top_logprobs"
    else:
        value, name = body.get("logprobs"), "logprobs"
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise RequestError.invalid(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    return value


def error_body(err: RequestError) -> dict[str, Any]:
    """The OpenAI error object for a RequestError."""
    return {"error": {"message": err.message, "type": err.code.openai_type,
                      "param": err.param, "code": err.code.http_status}}


def internal_error(message: str) -> RequestError:
    return RequestError(ErrorCode.INTERNAL, message)


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    data = payload if isinstance(payload, str) else json.dumps(
        payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


SSE_DONE = sse_event("[DONE]")


def completion_logprobs(token_ids: list[int], logprobs: Logprobs, offset: int,
                        token_text: Callable[[int], str]) -> dict[str, Any]:
    """The legacy /v1/completions ``logprobs`` object (plus ``token_ids``)."""
    tokens = [token_text(t) for t in token_ids]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_ids": list(token_ids),
            "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [{token_text(k): v for k, v in lp.items()} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: Logprobs,
                  token_text: Callable[[int], str]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "token_id": t, "logprob": lp,
                "bytes": list(text.encode("utf-8", "replace"))}
    content = []
    for t, lp in zip(token_ids, logprobs):
        item = entry(t, lp.get(t))
        item["top_logprobs"] = [entry(k, v) for k, v in lp.items() if k != t]
        content.append(item)
    return {"content": content}
