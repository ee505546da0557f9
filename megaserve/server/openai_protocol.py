"""OpenAI-compatible request parsing and response/SSE building (pure, no I/O).

Bodies are checked by the pydantic models of ``openai_models`` (strict: unknown fields,
wrong types, non-finite numbers, unknown chat roles and OpenAI features megaserve does not
implement are refused); the first problem becomes a RequestError whose message starts
with the field's path (``"messages[0].role: ..."``) and whose ``param`` is that path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pydantic_core
from pydantic import ValidationError

from megaserve.outputs import Logprobs
from megaserve.sampling_params import StructuredOutput
from megaserve.server.errors import ErrorCode, RequestError
from megaserve.server.openai_models import (
    IGNORED_FIELDS, MAX_STOP, ChatCompletionRequest, CompletionRequest)
from megaserve.server.token_bytes import TokenBytes


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
    echo: bool = False  # completions: the prompt's text before each choice's
    structured_output: StructuredOutput | None = None  # from response_format / structured_outputs
    structured_outputs_given: bool = False  # the grammar came from structured_outputs
    tools: tuple[dict[str, Any], ...] = ()  # chat: the tools' definitions, as given
    # chat: "none", "auto", "required" or {"type": "function", "function": {"name"}};
    # None without tools
    tool_choice: Any = None
    ignored: tuple[str, ...] = ()  # OpenAI fields given that megaserve ignores

    @property
    def num_choices(self) -> int:
        """Engine requests this body becomes: one per prompt and choice."""
        return (1 if self.chat else len(self.prompts)) * self.n


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
# What a union-typed field accepts, said once instead of one error per union member.
_UNION_HELP = {
    "prompt": "must be a non-empty string, a list of token ids, or a non-empty list of either",
    "content": "must be a string or a list of text parts",
    "stop": f"must be a non-empty string or a list of at most {MAX_STOP} of them",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


# JSON values in one body, at most (bounded by counting commas, an upper bound). Decoding
# holds the GIL, so this bounds how long one body can hold the event loop (~50 ms); a
# batch of the largest prompts is better sent as several requests anyway.
MAX_JSON_VALUES = 1 << 18
_MAX_KEYS = 64  # top-level fields; the models have fewer


def parse_body(raw: bytes, chat: bool) -> OpenAIRequest:
    """Bytes of an HTTP body → a checked request. Raises RequestError naming the field.

    Cost is bounded before any decoding: at most MAX_JSON_VALUES values, nesting depth
    at most pydantic-core's limit, integers of at most 4300 digits.
    """
    body = parse_json_object(raw)
    if len(body) > _MAX_KEYS:
        allowed = (ChatCompletionRequest if chat else CompletionRequest).model_fields
        unknown = next((k for k in body if k not in allowed), "body")
        raise RequestError.invalid(unknown, "unknown field")
    return parse_request(body, chat)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Bytes of an HTTP body → a JSON object, its cost bounded as ``parse_body`` says.
    Raises RequestError naming ``body``."""
    if raw.count(b",") >= MAX_JSON_VALUES:
        raise RequestError(ErrorCode.TOO_LARGE, f"body: more than {MAX_JSON_VALUES} JSON "
                           "values; split the request", param="body")
    try:
        body = pydantic_core.from_json(raw)
    except ValueError as e:
        raise RequestError.invalid("body", f"malformed JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError.invalid("body", f"must be a JSON object, got {_json_type(body)}")
    return body


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def parse_request(body: dict[str, Any], chat: bool) -> OpenAIRequest:
    """A decoded JSON object → a checked request. Raises RequestError naming the field."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return _to_request(model.model_validate(body), chat)
    except ValidationError as e:
        raise request_error(e) from None


def request_error(e: ValidationError) -> RequestError:
    """The first problem of a ValidationError as ``"<path>: <problem>"``."""
    err = e.errors(include_url=False)[0]
    kind, msg = err["type"], err["msg"]
    path, union_path = "", None  # union_path: the path up to a union member's tag
    for part in err["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith("prompt:"):  # the prompt's kind (a tag we chose): no help
            continue
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        elif union_path is None:  # a union member's tag, e.g. "list[int]"
            union_path = path
    if kind == "prompt_type":
        return RequestError.invalid(path, msg)
    if kind == "json_invalid":
        return RequestError.invalid("body", f"malformed JSON ({msg.removeprefix('Invalid JSON: ')})")
    if kind == "model_type" and not path:
        return RequestError.invalid("body", "must be a JSON object")
    if kind == "value_error":  # our validators say "<field>: <problem>"
        text = str(err.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
        field, _, problem = text.partition(": ")
        return RequestError.invalid(field, problem)
    if kind == "extra_forbidden":
        return RequestError.invalid(path, "unknown field")
    if kind == "missing":
        return RequestError.invalid(path, "is required")
    if union_path is not None and kind.endswith("_type"):
        leaf = union_path.rsplit(".", 1)[-1].split("[", 1)[0]
        if leaf in _UNION_HELP:
            return RequestError.invalid(union_path, _UNION_HELP[leaf])
    got = err.get("input")
    shown = repr(got) if isinstance(got, (int, float, str, bool)) or got is None else type(got).__name__
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return RequestError.invalid(path or "body", f"{msg[:1].lower()}{msg[1:]} (got {shown})")


def _to_request(m: CompletionRequest | ChatCompletionRequest, chat: bool) -> OpenAIRequest:
    sampling = {k: getattr(m, k) for k in _SAMPLING_FIELDS if getattr(m, k) is not None}
    if m.stop_token_ids is not None:
        sampling["stop_token_ids"] = tuple(m.stop_token_ids)
    if m.stop is not None:
        sampling["stop"] = (m.stop,) if isinstance(m.stop, str) else tuple(m.stop)
    if m.logit_bias:
        sampling["logit_bias"] = {int(k): v for k, v in m.logit_bias.items()}
    if m.bad_words:
        sampling["bad_words"] = tuple(m.bad_words)
    if chat:
        top = (m.top_logprobs or 0) if m.logprobs else None
        max_tokens = m.max_completion_tokens if m.max_completion_tokens is not None \
            else m.max_tokens
        prompts: tuple = ()
        messages = tuple(_template_message(msg) for msg in m.messages)
    else:
        top, max_tokens, messages = m.logprobs, m.max_tokens, None
        p = m.prompt
        if isinstance(p, str):
            prompts = (p,)
        elif isinstance(p[0], int):
            prompts = (tuple(p),)
        else:
            prompts = tuple(x if isinstance(x, str) else tuple(x) for x in p)
    options = m.stream_options
    return OpenAIRequest(
        chat=chat, prompts=prompts, messages=messages, sampling=sampling,
        max_tokens=max_tokens, n=m.n, stream=m.stream,
        include_usage=bool(options and options.include_usage), top_logprobs=top,
        return_token_ids=m.return_token_ids, model=m.model,
        echo=bool(getattr(m, "echo", False)), structured_output=_structured_output(m),
        structured_outputs_given=m.structured_outputs is not None,
        tools=tuple(t.model_dump(exclude_none=True) for t in m.tools or ()) if chat else (),
        tool_choice=_tool_choice(m) if chat else None,
        ignored=tuple(f for f in IGNORED_FIELDS if getattr(m, f) is not None))


def _template_message(msg) -> dict[str, Any]:
    """A chat message as chat templates read it (HF's convention)."""
    out: dict[str, Any] = {"role": msg.role, "content": msg.text()}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
    return out


def _tool_choice(m) -> Any:
    if not m.tools:
        return None
    if m.tool_choice is None:
        return "auto"  # OpenAI's default when tools are given
    return m.tool_choice if isinstance(m.tool_choice, str) else m.tool_choice.model_dump()


def _structured_output(m) -> StructuredOutput | None:
    """The grammar of ``response_format`` or vLLM's ``structured_outputs`` (one of them,
    one constraint). Raises RequestError naming the field; the grammar itself is checked
    by ``megaserve.engine.structured_output.grammar_of``."""
    fmt, so = m.response_format, m.structured_outputs
    spec = None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            spec = StructuredOutput("json_object")
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError.invalid("response_format", "json_schema: needs a 'schema'")
        else:
            spec = StructuredOutput("json", json.dumps(fmt.json_schema.schema_))
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex),
                                     ("choice", so.choice), ("grammar", so.grammar),
                                     ("json_object", so.json_object or None)) if v is not None]
        if len(given) != 1 or spec is not None:
            raise RequestError.invalid("structured_outputs", "give exactly one of json, regex, "
                                       "choice, grammar, json_object (and no response_format)")
        kind, value = given[0]
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        spec = StructuredOutput(kind, value)
    return spec


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
                        tokens: TokenBytes) -> dict[str, Any]:
    """The legacy /v1/completions ``logprobs`` object (plus ``token_ids``).

    ``top_logprobs`` maps each alternative's text to its logprob; a token whose bytes are
    not valid UTF-8 on their own is keyed ``"bytes:\\xNN..."`` (as OpenAI does) and one
    whose text another alternative already took ``"token_id:<id>"`` (as vLLM does), so
    every alternative the engine returned is there.
    """
    texts = [tokens.text_of(t) for t in token_ids]
    offsets, pos = [], offset
    for t in token_ids:
        offsets.append(pos)
        pos += len(tokens.bytes_of(t).decode("utf-8", "replace"))
    top = []
    for lp in logprobs:
        entry: dict[str, float] = {}
        for k, v in lp.items():
            key = tokens.text_of(k)
            entry[f"token_id:{k}" if key in entry else key] = v
        top.append(entry)
    return {"tokens": texts, "token_ids": list(token_ids),
            "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: Logprobs, tokens: TokenBytes,
                  top_n: int) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.

    ``bytes`` are the token's own bytes (a piece of a multi-byte character stays that
    piece, not U+FFFD); ``top_logprobs`` are the ``top_n`` most likely tokens, most likely
    first, the sampled one included where it ranks (OpenAI's and vLLM's shape). Each of
    ``logprobs`` holds the engine's top ``top_n`` in rank order, then the sampled token
    when it is not among them.
    """
    def entry(t: int, lp: float) -> dict[str, Any]:
        return {"token": tokens.text_of(t), "token_id": t, "logprob": lp,
                "bytes": list(tokens.bytes_of(t))}
    content = []
    for t, lp in zip(token_ids, logprobs):
        item = entry(t, lp.get(t))
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]  # stable: ties keep rank
        item["top_logprobs"] = [entry(k, v) for k, v in ranked]
        content.append(item)
    return {"content": content}
