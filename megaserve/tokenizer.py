"""Tokenizer over an HF ``tokenizer.json`` and an incremental detokenizer for streaming.

Only the ``tokenizers`` library is used at runtime (``transformers`` is a test dependency).
``jinja2`` renders chat templates in a sandbox; it is imported only when a template is used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import tokenizers

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Texts longer than this are encoded without holding the interpreter lock (see encode).
_LONG_TEXT_CHARS = 4096

# Used when a checkpoint has no chat template. For messages [{"role": "user", "content":
# "hi"}] and add_generation_prompt=True it renders "<|user|>\nhi\n<|assistant|>\n".
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    """An ``eos_token_id`` field (int, list of ints or null) as a list."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template_from(config: dict[str, Any]) -> str | None:
    """``chat_template`` as a string, or the ``default`` entry of a list of named templates."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its special tokens and chat template.

    Build it with :meth:`from_dir`. ``eos_token_ids`` holds every id that ends generation:
    the tokenizer config's ``eos_token`` first, then ``generation_config.json``'s
    ``eos_token_id`` (int or list); ``config.json``'s ``eos_token_id`` only when neither
    gives one.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._backend = backend
        self._token_texts: dict[tuple[int, bool], str] = {}  # decode_token's
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        for i in [*eos_token_ids, *([] if bos_token_id is None else [bos_token_id])]:
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"special token id {i} is outside the vocabulary [0, {self._vocab_size})")
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._bos_token_id = bos_token_id
        self._add_bos_token = add_bos_token
        self._chat_template = chat_template
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._max_chars_per_token: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the optional configs next to it from directory ``path``.

        Raises ValueError naming the file when ``tokenizer.json`` is missing or unreadable, or
        when a config file is not a JSON object.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{tok_file}: no tokenizer.json in {path}; a checkpoint needs one")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"{tok_file}: not a valid HF tokenizer.json ({e})") from e

        tok_config = _read_json(path / "tokenizer_config.json") or {}
        gen_config = _read_json(path / "generation_config.json") or {}
        model_config = _read_json(path / "config.json") or {}

        bos_token = _token_content(tok_config.get("bos_token"))
        eos_token = _token_content(tok_config.get("eos_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = [] if eos_token is None else [backend.token_to_id(eos_token)]
        eos_ids = [i for i in eos_ids if i is not None] + _id_list(gen_config.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _id_list(model_config.get("eos_token_id"))
        if not eos_ids:
            logger.warning("%s: no EOS token found; generation stops only on length or stop strings", path)

        template_file = path / "chat_template.jinja"  # where transformers>=4.43 saves it
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _chat_template_from(tok_config)
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            add_bos_token=bool(tok_config.get("add_bos_token", False)),
            chat_template=chat_template,
            bos_token=bos_token,
            eos_token=eos_token,
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1, added tokens included (may differ from the model's vocab)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's own template; None when it has none (see DEFAULT_CHAT_TEMPLATE)."""
        return self._chat_template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of input text one token stands for, so that
        ``len(text) > max_len * max_chars_per_token`` proves, without tokenizing, that
        ``text`` has more than ``max_len`` tokens.

        It is the longest token's text in UTF-8 bytes (a character is at least one byte;
        a piece of a character decodes to U+FFFD, three bytes, which only loosens the
        bound) plus one (a word-start marker the decoder drops from a lone token), doubled
        when the tokenizer has a normalizer (one that drops or composes characters makes
        a token stand for more input than its own text). Computed on first use (a pass
        over the vocabulary), then remembered.
        """
        if self._max_chars_per_token is None:
            ids = [[i] for i in range(self._vocab_size)]
            texts = self._backend.decode_batch(ids, skip_special_tokens=False)
            longest = max((len(t.encode("utf-8", "replace")) for t in texts), default=1)
            margin = 2 if self._backend.normalizer is not None else 1
            self._max_chars_per_token = (max(1, longest) + 1) * margin
        return self._max_chars_per_token

    def is_special(self, token_id: int) -> bool:
        """True for the added special tokens, i.e. the ids ``decode(skip_special_tokens=True)`` drops."""
        return token_id in self._special_ids

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the tokenizer's post-processor
        runs, and BOS is prepended when ``add_bos_token`` is set and it is not there yet."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if len(text) > _LONG_TEXT_CHARS:
            # NOTE: encode_batch releases the interpreter lock while it tokenizes (encode
            # holds it): a long text tokenized in a worker thread then leaves the event
            # loop free. Same ids as encode.
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self._add_bos_token
            and self._bos_token_id is not None
            and ids[:1] != [self._bos_token_id]
        ):
            ids = [self._bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD.

        Raises ValueError for an id outside ``[0, vocab_size)``.
        """
        ids = ids if type(ids) is list else list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):  # one pass in C, per token
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, remembered: streams of generated text decode the same
        single tokens over and over (IncrementalDetokenizer). Raises as :meth:`decode`."""
        key = (token_id, skip_special_tokens)
        text = self._token_texts.get(key)
        if text is None:
            text = self._token_texts[key] = self.decode([token_id], skip_special_tokens)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render ``messages`` (dicts with string ``role`` and ``content``, and the other keys
        HF templates read: ``tool_calls``, ``tool_call_id``, ``name``) into a prompt string.

        Uses the checkpoint's template, or DEFAULT_CHAT_TEMPLATE when it has none, in a jinja2
        sandbox; ``tools`` (OpenAI tool definitions) are passed to it as ``tools``. Raises
        ValueError for malformed messages or a template that fails.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for n, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{n}] must be a dict with a string 'role'")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{n}]['content'] must be a string")
        return _render_chat_template(
            self._chat_template or DEFAULT_CHAT_TEMPLATE,
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token or "",
            eos_token=self._eos_token or "",
        )


def _render_chat_template(template: str, **context: Any) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template).render(**context)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed to render: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas that are always valid text.

    NOTE: decoding a suffix of the ids may differ from the suffix of the full decode (a
    SentencePiece word marker at the start of a window loses its space; a character can span
    several byte tokens). So each step decodes a short window that starts a few tokens back
    (the prefix-offset technique of vLLM/TGI) and emits what the new tokens add to it:

        ids:  ... | prefix_offset ... read_offset | new tokens ...
                    <- context, already emitted -> <- delta comes from here ->

    Trailing U+FFFD (an incomplete multi-byte character) is held back until the character
    completes; the window slides forward only when its text has no held-back tail.
    ``flush()`` releases what is still held at the end of the stream. For tokenizers whose
    decode concatenates at character boundaries (byte-level BPE), ``text`` after
    ``flush()`` equals ``tokenizer.decode(generated_ids)``. With a SentencePiece-style
    decoder, ``text`` is what the generated ids add to the decoded prompt (with its leading
    space). Known limit: the ``ByteFallback`` decoder turns a run of byte tokens that is not
    valid UTF-8 into one U+FFFD per byte, even for bytes already emitted as valid text; such
    garbage streams can then differ from the full decode (never for valid UTF-8 output).
    """

    # Prompt tokens kept as context for the first generated token (vLLM uses 5 + 1).
    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        # A prompt that ends inside a character would make the first delta ambiguous: decode
        # the generated tokens without context instead.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._emitted_in_window = len(self._decode(context))
        self._chunks: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        if len(ids) == 1:  # a window's context is mostly the one token before
            return self._tokenizer.decode_token(ids[0], self._skip)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes (possibly "")."""
        self._ids.append(token_id)
        window_text = self._decode(self._ids[self._prefix_offset :])
        end = len(window_text)
        while end > 0 and window_text[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        delta = window_text[self._emitted_in_window : end] if end > self._emitted_in_window else ""
        self._emitted_in_window = max(self._emitted_in_window, end)
        if end == len(window_text):
            # Clean boundary: the window restarts at the previous read offset.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._emitted_in_window = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """End of stream: return the held-back tail (U+FFFD of an unfinished character)."""
        window_text = self._decode(self._ids[self._prefix_offset :])
        delta = window_text[self._emitted_in_window :]
        self._emitted_in_window = len(window_text)
        if delta:
            self._chunks.append(delta)
        return delta
