"""``megaserve.v1`` messages ↔ engine types: request parsing, validation and responses.

Parsing is done here rather than by grpc's default deserializer so that malformed input
gets INVALID_ARGUMENT naming the field instead of grpc's generic INTERNAL: a message whose
``text`` is not valid UTF-8, or one that carries both ``text`` and ``token_ids`` on the
wire (protobuf would silently keep the last one of a oneof).

NOTE: every step runs in protobuf's C parser (upb), in time linear in the message: the
bytes are first parsed as a *wire-check* twin of GenerateRequest (built at run time from
the same descriptor: proto2, no oneof, strings as bytes), which keeps both members of the
oneof and accepts any bytes in strings; then checked; then parsed for real. No Python loop
runs over the message's bytes, so a hostile 16 MiB message costs milliseconds, not the
event loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from megaserve.outputs import Logprobs
from megaserve.sampling_params import SamplingParams, StructuredOutput
from megaserve.server import generation_pb2 as pb
from megaserve.server.errors import RequestError
from megaserve.server.openai_models import MAX_STOP, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS
from megaserve.service import SERVICE_NAME  # noqa: F401 (the service this module speaks)


@dataclass(frozen=True)
class ParsedGenerate:
    """A GenerateRequest turned into engine inputs (not yet checked against the model)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: bool


class BadMessage:
    """What ``deserialize_generate`` returns for bytes it cannot accept (never raises:
    grpc would turn an exception into INTERNAL)."""

    def __init__(self, error: RequestError) -> None:
        self.error = error


_WIRE_PACKAGE = "megaserve.wirecheck"
_WIRE_MESSAGES = ("GenerateRequest", "TokenIds", "SamplingParams", "StructuredOutput", "Choices")
_STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@lru_cache(maxsize=1)
def _wire_check_class():
    """GenerateRequest's twin for the checks: proto2 (every field has presence), no
    oneof (both inputs kept), ``string`` → ``bytes`` (no UTF-8 check while parsing)."""
    source = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(source)
    twin = descriptor_pb2.FileDescriptorProto(
        name="megaserve_wirecheck.proto", package=_WIRE_PACKAGE, syntax="proto2")
    for message in source.message_type:
        if message.name not in _WIRE_MESSAGES:
            continue
        copy = twin.message_type.add()
        copy.CopyFrom(message)
        del copy.oneof_decl[:]
        for f in copy.field:
            f.ClearField("oneof_index")
            f.ClearField("proto3_optional")
            if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            if f.type_name:
                f.type_name = f.type_name.replace(".megaserve.v1.", f".{_WIRE_PACKAGE}.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(twin)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"{_WIRE_PACKAGE}.GenerateRequest"))


def _utf8_problem(data: bytes) -> str | None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"is not valid UTF-8 (byte {e.start}: {e.reason})"
    return None


def deserialize_generate(data: bytes) -> pb.GenerateRequest | BadMessage:
    """Parses a GenerateRequest, or returns a BadMessage naming the problem.

    Linear time in ``len(data)``, all in protobuf's C parser (see the module's NOTE).
    """
    try:
        wire = _wire_check_class().FromString(data)
    except DecodeError:
        return BadMessage(RequestError.invalid(
            "request", f"{len(data)} bytes that are not a valid megaserve.v1.GenerateRequest"))
    if wire.HasField("text") and wire.HasField("token_ids"):
        return BadMessage(RequestError.invalid(
            "input", "set exactly one of text or token_ids, got both"))
    for name in ("request_id", "text"):
        problem = _utf8_problem(getattr(wire, name))
        if problem:
            return BadMessage(RequestError.invalid(name, problem))
    sp = wire.sampling_params
    kinds = [k for k in _STRUCTURED_KINDS if sp.structured_output.HasField(k)]
    if len(kinds) > 1:
        return BadMessage(RequestError.invalid(
            "sampling_params.structured_output", f"set exactly one kind, got {kinds}"))
    texts = [(f"sampling_params.{name}[{i}]", text) for name in ("stop", "bad_words")
             for i, text in enumerate(getattr(sp, name))]
    texts += [(f"sampling_params.structured_output.{k}", getattr(sp.structured_output, k))
              for k in ("json_schema", "regex", "grammar")]
    texts += [(f"sampling_params.structured_output.choice.choices[{i}]", text)
              for i, text in enumerate(sp.structured_output.choice.choices)]
    for name, text in texts:
        problem = _utf8_problem(text)
        if problem:
            return BadMessage(RequestError.invalid(name, problem))
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return BadMessage(RequestError.invalid(
            "request", f"could not be parsed as megaserve.v1.GenerateRequest ({e})"))


def safe_deserializer(message_class):
    """``message_class.FromString`` that returns a BadMessage instead of raising for bytes
    that are not a ``message_class`` (grpc would answer UNKNOWN with a traceback)."""
    name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return BadMessage(RequestError.invalid(
                "request", f"{len(data)} bytes that are not a valid {name}"))
    return deserialize


def parse_generate(req: pb.GenerateRequest) -> ParsedGenerate:
    """Maps a GenerateRequest to engine inputs. Raises RequestError naming the field."""
    which = req.WhichOneof("input")
    if which is None:
        raise RequestError.invalid("input", "set one of text or token_ids")
    if which == "text":
        if not req.text:
            raise RequestError.invalid("text", "must not be empty")
        prompt: str | list[int] = req.text
    else:
        if not req.token_ids.ids:
            raise RequestError.invalid("token_ids", "must not be empty")
        prompt = list(req.token_ids.ids)
    sp = req.sampling_params
    if sp.HasField("logprobs") and not 0 <= sp.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError.invalid("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], "
                                   f"got {sp.logprobs}")
    if len(sp.stop) > MAX_STOP:
        raise RequestError.invalid("stop", f"{len(sp.stop)} stop strings: at most {MAX_STOP}")
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError.invalid("stop_token_ids", f"{len(sp.stop_token_ids)} ids: at most "
                                   f"{MAX_STOP_TOKEN_IDS}")
    if len(sp.bad_words) > MAX_STOP:
        raise RequestError.invalid("bad_words", f"{len(sp.bad_words)} words: at most {MAX_STOP}")
    if len(sp.logit_bias) > MAX_STOP_TOKEN_IDS:
        raise RequestError.invalid("logit_bias", f"{len(sp.logit_bias)} entries: at most "
                                   f"{MAX_STOP_TOKEN_IDS}")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if sp.HasField(name) and not math.isfinite(getattr(sp, name)):
            raise RequestError.invalid(name, f"must be a finite number, got {getattr(sp, name)}")
    for token, bias in sp.logit_bias.items():
        if token < 0 or not -100 <= bias <= 100:  # (NaN fails the range too)
            raise RequestError.invalid("logit_bias", f"token id {token}: bias {bias}; ids "
                                       "must be >= 0 and biases in [-100, 100]")
    kwargs: dict = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if sp.HasField(name):
            kwargs[name] = getattr(sp, name)
    if sp.logit_bias:
        kwargs["logit_bias"] = dict(sp.logit_bias)
    if sp.HasField("structured_output"):
        kwargs["structured_output"] = _structured_output(sp.structured_output)
    try:
        params = SamplingParams(stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids),
                                ignore_eos=sp.ignore_eos, bad_words=tuple(sp.bad_words),
                                **kwargs)
    except ValueError as e:
        raise RequestError.from_value_error(e, "sampling_params") from None
    return ParsedGenerate(req.request_id, prompt, params, req.stream)


def _structured_output(so: pb.StructuredOutput) -> StructuredOutput:
    """The engine's StructuredOutput of a ``StructuredOutput`` message (its grammar is
    compiled later, against the model's tokenizer). Raises RequestError naming the field."""
    field = "structured_output"
    kind = so.WhichOneof("kind")
    if kind is None:
        raise RequestError.invalid(field, f"set one of {', '.join(_STRUCTURED_KINDS)}")
    if kind == "json_object":
        if not so.json_object:
            raise RequestError.invalid(f"{field}.json_object", "must be true when set "
                                       "(leave structured_output unset for free text)")
        return StructuredOutput("json_object")
    if kind == "choice":
        choices = list(so.choice.choices)
        if not choices or not all(choices):
            raise RequestError.invalid(f"{field}.choice.choices",
                                       "must hold at least one non-empty string")
        return StructuredOutput("choice", json.dumps(choices))
    spec = getattr(so, kind)
    if not spec:
        raise RequestError.invalid(f"{field}.{kind}", "must not be empty")
    return StructuredOutput({"json_schema": "json"}.get(kind, kind), spec)


def logprobs_to_proto(token_ids: list[int], logprobs: Logprobs | None) -> list[pb.PositionLogprobs]:
    """One PositionLogprobs per generated token: the sampled token, then the others."""
    if not logprobs:
        return []
    out = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = pb.TokenLogprob(token_id=token_id, logprob=entry.get(token_id, float("nan")))
        top = [pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in entry.items() if t != token_id]
        out.append(pb.PositionLogprobs(sampled=sampled, top=top))
    return out


def logprobs_from_proto(positions) -> Logprobs:
    """Inverse of ``logprobs_to_proto`` (sampled token first in each dict)."""
    out = []
    for p in positions:
        entry = {p.sampled.token_id: p.sampled.logprob}
        entry.update({t.token_id: t.logprob for t in p.top})
        out.append(entry)
    return out
