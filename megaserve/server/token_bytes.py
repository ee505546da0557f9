"""A token's own bytes and a unique display string, for logprob entries.

``Tokenizer.decode([t])`` turns bytes that are not valid UTF-8 on their own (one token of a
multi-byte character) into U+FFFD, so two such tokens would show the same text. OpenAI
writes such a token as ``"bytes:\\xe2\\x80"`` and gives its real bytes; so do we:

* byte-level BPE (GPT-2, Qwen, Llama 3): the token string maps back to bytes through the
  inverse of GPT-2's byte→character table;
* SentencePiece with byte fallback: ``<0xE2>`` is the byte 0xE2 and ``▁`` a space;
* anything else: the UTF-8 of the decoded text.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + n)] = b
            n += 1
    return mapping


def _decoder_types(tokenizer) -> set[str]:
    """The ``type`` of the backend's decoder and of its sub-decoders (a Sequence)."""
    try:
        decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return set()
    parts = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
    return {p.get("type") for p in parts if isinstance(p, dict)}


class TokenBytes:
    """Per-token bytes and display strings of one tokenizer (memoized per id)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes this token contributes to the output text."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        tok = self._tokenizer
        piece = tok.backend.id_to_token(token_id) if not tok.is_special(token_id) else None
        raw: bytes | None = None
        if piece is not None and self._byte_level:
            inverse = _byte_level_inverse()
            if all(ch in inverse for ch in piece):
                raw = bytes(inverse[ch] for ch in piece)
        elif piece is not None and self._byte_fallback:
            m = _BYTE_FALLBACK.match(piece)
            raw = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        if raw is None:
            raw = tok.decode([token_id]).encode("utf-8")
        self._bytes[token_id] = raw
        return raw

    def text_of(self, token_id: int) -> str:
        """The token's text, or ``"bytes:\\xNN..."`` when its bytes are not valid UTF-8."""
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
