"""Tool calling for chat completions: which calls a model's output makes.

* ``tool_choice`` a named function or ``"required"``: the output is constrained by a JSON
  schema (a structured output, ``megaserve.engine.structured_output``): the function's
  parameters, or vLLM's array of ``{"name", "parameters"}`` objects; it parses into
  calls by construction.
* ``"auto"`` (with ``--enable-auto-tool-choice --tool-call-parser hermes``): the model
  writes calls as Hermes-style blocks, ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` (Qwen2.5/Qwen3, Hermes; DeepSeek-V3.1 chat templates are rendered with
  their own markers and are not parsed here); text outside the blocks is the content.
  ``HermesStream`` does the same on a stream of text deltas.
* ``"none"``: tools are given to the chat template, the output is plain content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from megaserve.sampling_params import StructuredOutput

PARSERS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's ``tool_calls`` (OpenAI's shape)."""
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def grammar_for(tools: list[dict[str, Any]], tool_choice: Any) -> StructuredOutput | None:
    """The structured output that forces ``tool_choice`` (a named function or
    ``"required"``); None for ``"auto"`` / ``"none"``."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        params = next(t["function"].get("parameters") or {"type": "object"}
                      for t in tools if t["function"]["name"] == name)
        return StructuredOutput("json", json.dumps(params))
    if tool_choice == "required":
        return StructuredOutput("json", json.dumps({
            "type": "array", "minItems": 1,
            "items": {"anyOf": [{
                "type": "object",
                "properties": {"name": {"enum": [t["function"]["name"]]},
                               "parameters": t["function"].get("parameters")
                               or {"type": "object"}},
                "required": ["name", "parameters"], "additionalProperties": False}
                for t in tools]}}))
    return None


def forced_calls(text: str, tool_choice: Any) -> list[dict[str, Any]]:
    """The calls of an output constrained by ``grammar_for`` (empty if it was cut short
    and is not JSON)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(tool_choice, dict):
        return [call(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    return [call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in value]


def _parse_block(block: str) -> dict[str, Any] | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return call(value["name"], arguments if isinstance(arguments, str)
                else json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole output. A block that is not a JSON call stays content."""
    stream = HermesStream()
    content = stream.feed(text) + stream.finish()
    return (content or None) if stream.calls else content, stream.calls


@dataclass
class HermesStream:
    """Hermes tool calls in a stream of text deltas: ``feed`` returns the content that can
    be sent now (text that might still start a ``<tool_call>`` is held back), and appends
    each completed block to ``calls`` (``new_calls`` since the last look)."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    _buffer: str = ""
    _in_call: bool = False
    _reported: int = 0

    def feed(self, text: str) -> str:
        self._buffer += text
        out = []
        while True:
            if not self._in_call:
                start = self._buffer.find(_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, _OPEN)
                    out.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return "".join(out)
                out.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(_OPEN):]
                self._in_call = True
            end = self._buffer.find(_CLOSE)
            if end < 0:
                return "".join(out)
            block = self._buffer[:end]
            self._buffer = self._buffer[end + len(_CLOSE):]
            self._in_call = False
            parsed = _parse_block(block)
            if parsed is None:
                out.append(_OPEN + block + _CLOSE)
            else:
                self.calls.append(parsed)

    def finish(self) -> str:
        """The text still held back (an unfinished block stays content)."""
        rest = (_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return rest

    def new_calls(self) -> list[tuple[int, dict[str, Any]]]:
        """(index, call) of the calls completed since the last call of this method."""
        fresh = list(enumerate(self.calls))[self._reported:]
        self._reported = len(self.calls)
        return fresh


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def uses_tools(tool_choice: Any) -> bool:
    """Whether the output is read for tool calls (any choice but None / "none")."""
    return tool_choice not in (None, "none")


def message(text: str, tool_choice: Any) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole output, and whether it made tool calls."""
    if tool_choice == "auto":
        content, calls = parse_hermes(text)
    else:
        content, calls = None, forced_calls(text, tool_choice)
        if not calls:  # cut short: what was generated stays visible
            content = text
    body: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        body["tool_calls"] = calls
    return body, bool(calls)


@dataclass
class ToolStream:
    """The chat deltas of one streamed choice whose output is read for tool calls, as
    OpenAI streams them: ``{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments"}}]}`` for a call's first delta, ``{"index", "function": {"arguments"}}``
    for more of its arguments."""

    tool_choice: Any
    called: bool = False
    _text: list[str] = field(default_factory=list)
    _hermes: HermesStream = field(default_factory=HermesStream)
    _call_id: str = ""

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta for ``text`` (the step's new text); ``finished``: the last one."""
        out: dict[str, Any] = {}
        calls: list[dict[str, Any]] = []
        if isinstance(self.tool_choice, dict):  # the text is the arguments, as they come
            if not self._call_id:
                self._call_id = new_call_id()
                calls.append({"index": 0, "id": self._call_id, "type": "function",
                              "function": {"name": self.tool_choice["function"]["name"],
                                           "arguments": text}})
            elif text:
                calls.append({"index": 0, "function": {"arguments": text}})
        elif self.tool_choice == "required":  # one JSON array: parsed at the end
            self._text.append(text)
            if finished:
                parsed = forced_calls("".join(self._text), self.tool_choice)
                calls = [{"index": i, **c} for i, c in enumerate(parsed)]
                if not parsed:
                    out["content"] = "".join(self._text)
        else:  # auto: Hermes blocks
            content = self._hermes.feed(text) + (self._hermes.finish() if finished else "")
            if content:
                out["content"] = content
            calls = [{"index": i, **c} for i, c in self._hermes.new_calls()]
        if calls:
            out["tool_calls"] = calls
            self.called = True
        return out
