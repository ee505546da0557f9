"""``megaserve.v1`` messages ↔ engine types: request parsing, validation and responses.

Parsing is done here rather than by grpc's default deserializer so that malformed input
gets INVALID_ARGUMENT naming the field instead of grpc's generic INTERNAL: a message whose
``text`` is not valid UTF-8, or one that carries both ``text`` and ``token_ids`` on the
wire (protobuf would silently keep the last one of a oneof).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from megaserve.outputs import Logprobs
from megaserve.sampling_params import SamplingParams
from megaserve.server import generation_pb2 as pb
from megaserve.server.errors import RequestError

SERVICE_NAME = "megaserve.v1.Generation"

# GenerateRequest field numbers (see generation.proto).
_FIELD_TEXT = 2
_FIELD_TOKEN_IDS = 3


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


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise DecodeError("truncated varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _top_level_fields(data: bytes) -> list[tuple[int, bytes | None]]:
    """(field number, payload for length-delimited fields) of each top-level field."""
    fields, pos = [], 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        payload = None
        if wire_type == 0:
            _, pos = _read_varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            payload = data[pos:pos + length]
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            raise DecodeError(f"unsupported wire type {wire_type}")
        fields.append((number, payload))
    return fields


def deserialize_generate(data: bytes) -> pb.GenerateRequest | BadMessage:
    """Parses a GenerateRequest, or returns a BadMessage naming the problem."""
    try:
        numbers = _top_level_fields(data)
    except DecodeError as e:
        return BadMessage(RequestError.invalid("request", f"not a GenerateRequest ({e})"))
    present = {n for n, _ in numbers}
    if _FIELD_TEXT in present and _FIELD_TOKEN_IDS in present:
        return BadMessage(RequestError.invalid(
            "input", "set exactly one of text or token_ids, got both"))
    for number, payload in numbers:
        if number == _FIELD_TEXT and payload is not None:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError as e:
                return BadMessage(RequestError.invalid(
                    "text", f"is not valid UTF-8 (byte {e.start}: {e.reason})"))
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return BadMessage(RequestError.invalid(
            "request", f"could not be parsed as megaserve.v1.GenerateRequest ({e}); "
                       "stop strings must be valid UTF-8"))


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
    kwargs: dict = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs"):
        if sp.HasField(name):
            kwargs[name] = getattr(sp, name)
    try:
        params = SamplingParams(stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids),
                                ignore_eos=sp.ignore_eos, **kwargs)
    except ValueError as e:
        raise RequestError.from_value_error(e, "sampling_params") from None
    return ParsedGenerate(req.request_id, prompt, params, req.stream)


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
