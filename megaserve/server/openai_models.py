"""The OpenAI-compatible request bodies as pydantic models, and the OpenAPI document.

The models are strict (no coercion: ``"5"`` is not an integer), forbid unknown fields,
refuse non-finite numbers and bound every integer to int64, so that what passes them can
reach the engine without a type or overflow error. OpenAI fields megaserve does not
implement are accepted only at the value that turns the feature off. Extensions, as in
vLLM: ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``.

The responses are described by models too (not used to build them: the tests check real
responses against them). ``openapi_document()`` describes the HTTP API from these models
(OpenAPI 3.1); the server serves it at ``GET /openapi.json`` and the fuzz test generates
requests from it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic.json_schema import models_json_schema

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 64  # stop strings per request (each is looked for after every token)
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS = 4096  # prompts in one completion request (the server's own limit is lower)
MAX_MESSAGES = 4096

_INT64_MAX = 2**63 - 1
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]
PositiveInt = Annotated[int, Field(ge=1, le=_INT64_MAX)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]

# Chat roles a chat template can render ("tool": a tool's result, see tool calling).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call an assistant message made (sent back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: ChatRole
    # None only for an assistant message that made tool calls
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES,
                                                   fail_fast=True)] | None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None  # role "tool": the call this is the result of

    @model_validator(mode="after")
    def _check_message(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: is required (null only for an assistant message "
                             "with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages make tool calls")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined; "" for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"]
    function: _Name


def _prompt_kind(value: Any) -> str | None:
    """Which member of ``Prompt`` a value is meant to be, from its first element (so a
    long list is validated once, not against every member)."""
    if isinstance(value, str):
        return "prompt:text"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return "prompt:token_ids"
        if isinstance(first, str):
            return "prompt:texts"
        if isinstance(first, list):
            return "prompt:token_id_lists"
    return None


_TokenIds = Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]
Prompt = Annotated[
    Annotated[Annotated[str, Field(min_length=1)], Tag("prompt:text")]
    | Annotated[_TokenIds, Tag("prompt:token_ids")]
    | Annotated[Annotated[list[Annotated[str, Field(min_length=1)]],
                          Field(min_length=1, max_length=MAX_PROMPTS, fail_fast=True)],
                Tag("prompt:texts")]
    | Annotated[Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_PROMPTS,
                                                 fail_fast=True)], Tag("prompt:token_id_lists")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="must be a non-empty string, a list of token ids, "
                                       "or a non-empty list of either")]


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=4096)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


def _must_be_off(name: str, value: Any, off: tuple) -> None:
    if value not in off:
        raise ValueError(f"{name}: is not supported by megaserve (got {value!r})")


class _CommonRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=0, le=_INT64_MAX)] | None = None
    # OpenAI fields clients send by default that megaserve accepts and ignores (vLLM's
    # behaviour; the server logs a line naming them): IGNORED_FIELDS.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=0, le=_INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS,
                                                   fail_fast=True)] | None = None
    return_token_ids: bool = False
    repetition_penalty: Annotated[float, Field(gt=0, le=1e6)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=_INT64_MAX)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(max_length=MAX_STOP, fail_fast=True)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _CommonRequest:
        for token in self.logit_bias or ():
            if not token.isdigit() or len(token) > 18:
                raise ValueError(f"logit_bias: keys must be token ids (decimal strings), "
                                 f"got {token[:20]!r}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: is only allowed with stream=true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if self.stop is not None and (not stops or not all(stops)):
            raise ValueError("stop: must be a non-empty string or a list of them")
        return self


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: PositiveInt | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        _must_be_off("suffix", self.suffix, (None, ""))
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: with logprobs is not supported by megaserve (the prompt's "
                             "logprobs are not returned); drop one of them")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: is not supported by megaserve (must equal n)")
        return self


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions`` (``max_tokens`` unset: fill the context)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES,
                                                 fail_fast=True)]
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    max_completion_tokens: PositiveInt | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        names = [t.function.name for t in self.tools or ()]
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice: needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: function {self.tool_choice.function.name!r} is "
                             f"not among the tools {names}")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("tool_choice: a forced tool call cannot be combined with "
                             "response_format / structured_outputs")
        return self


class TokenizeCompletion(_Strict):
    """``POST /tokenize`` of a text (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    """``POST /tokenize`` of chat messages, rendered with the chat template."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES,
                                                 fail_fast=True)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


MAX_DETOKENIZE_TOKENS = 1 << 20


class Detokenize(_Strict):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS, fail_fast=True)]


# -- responses (documented in the OpenAPI document; tests check real responses against them)
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")  # every field a response carries is documented


class PromptTokensDetails(_Response):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """The legacy format; ``top_logprobs`` keys are token texts (``"bytes:\\xNN"`` for a
    piece of a character, ``"token_id:<id>"`` where two alternatives share a text)."""

    tokens: list[str]
    token_ids: list[int]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    """A completion, or (``stream=true``) one SSE chunk of it: ``usage`` is then null, or
    set in a last chunk with no choices (``stream_options.include_usage``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    token_id: int
    logprob: float
    bytes: list[int]  # the token's own bytes


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatLogprob]


class ToolCallOut(_Response):
    id: str
    type: Literal["function"]
    function: dict[str, str]  # {"name", "arguments"}


class AssistantMessage(_Response):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]  # "name" in the first delta of a call, "arguments" pieces


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    """One SSE chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None  # the model served (path or built-in name)
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {"message": "<param>: <problem>", "type", "param", "code"}}``."""

    error: ErrorDetail


_ERROR_STATUSES = {"400": "invalid request (the message names the field)",
                   "401": "missing or wrong API key (--api-key)",
                   "404": "unknown model or path", "405": "method not allowed",
                   "413": "body over the size limit", "429": "server busy: retry later",
                   "503": "loading, draining or failed"}


def openapi_document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 description of the HTTP API."""
    _, schemas = models_json_schema(
        [(m, "validation") for m in (
            CompletionRequest, ChatCompletionRequest, CompletionResponse,
            ChatCompletionResponse, ChatCompletionChunk, ModelList, ModelCard, ErrorResponse,
            TokenizeCompletion, TokenizeChat, Detokenize, TokenizeResponse,
            DetokenizeResponse, VersionResponse)],
        ref_template="#/components/schemas/{model}")
    errors = {code: {"description": text, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for code, text in _ERROR_STATUSES.items()}

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def post(model: str, response: str, chunk: str, summary: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary, "operationId": model,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref(model)}}},
            "responses": {"200": {
                "description": f"the completion; with stream=true an SSE stream of {chunk} "
                               "objects (`data: <json>` events) ending with `data: [DONE]`",
                "content": {"application/json": {"schema": ref(response)},
                            "text/event-stream": {"schema": {"type": "string"}}}},
                **errors}}}

    def get(summary: str, media: str = "application/json", open_: bool = False,
            schema: dict[str, Any] | None = None) -> dict[str, Any]:
        op: dict[str, Any] = {"summary": summary, "responses": {
            "200": {"description": summary, "content": {media: {"schema": schema} if schema
                                                        else {}}}}}
        if open_:  # no API key needed, as in vLLM
            op["security"] = []
        return {"get": op}

    return {
        "openapi": "3.1.0",
        "info": {"title": "megaserve OpenAI-compatible API", "version": version},
        "components": {"schemas": schemas.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/completions": post("CompletionRequest", "CompletionResponse",
                                    "CompletionResponse", "text completion"),
            "/v1/chat/completions": post("ChatCompletionRequest", "ChatCompletionResponse",
                                         "ChatCompletionChunk", "chat completion"),
            "/v1/models": get("the served model names", schema=ref("ModelList")),
            "/v1/models/{model_id}": get("one served name (404 if not served)",
                                         schema=ref("ModelCard")),
            "/tokenize": {"post": {
                "summary": "token ids of a text or of chat messages (vLLM's shape)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"oneOf": [ref("TokenizeCompletion"), ref("TokenizeChat")]}}}},
                "responses": {"200": {"description": "the tokens", "content": {
                    "application/json": {"schema": ref("TokenizeResponse")}}}, **errors}}},
            "/detokenize": {"post": {
                "summary": "the text of token ids (vLLM's shape)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": ref("Detokenize")}}},
                "responses": {"200": {"description": "the text", "content": {
                    "application/json": {"schema": ref("DetokenizeResponse")}}}, **errors}}},
            "/version": get("the server's version", open_=True, schema=ref("VersionResponse")),
            "/health": get("200 when serving, else 503", open_=True),
            "/metrics": get("Prometheus metrics", "text/plain", open_=True),
            "/openapi.json": get("this document", open_=True),
        },
    }
