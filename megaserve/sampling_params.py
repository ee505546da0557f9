"""SamplingParams: how one request is decoded (a vLLM-compatible subset)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """Which ``RequestOutput``s a request gets (vLLM's ``RequestOutputKind``).

    CUMULATIVE: one after every step that advanced it, with everything generated so far.
    DELTA: one after every step that advanced it, with only what that step added (the
    prompt logprobs in the first one). FINAL_ONLY: one when it finishes (``LLM.generate``).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


StructuredOutputKind = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow (megaserve.engine.structured_output).

    ``kind``: "json" (``spec`` a JSON schema, as JSON text), "json_object" (any JSON
    object; ``spec`` unused), "regex", "choice" (``spec`` a JSON list of the strings
    allowed) or "grammar" (EBNF, xgrammar's / GBNF dialect).
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in StructuredOutputKind:
            raise ValueError(f"structured_output kind must be one of {StructuredOutputKind}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError("structured_output spec must be a string")


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters of one request, validated on construction.

    ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible: the draw for a
    token is a pure function of (seed, position, vocabulary index), so the same request
    gives the same tokens whatever else is batched with it. Without a seed the engine
    assigns one (from ``LLM(seed=...)``) when the request is added.

    Raises ``ValueError`` naming the field for out-of-range values.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Adjustments of the distribution sampled from (megaserve.engine.logits_processing),
    # vLLM's: penalties on tokens already generated (presence, frequency: additive; 2.0
    # at most in magnitude) and on prompt + generated tokens (repetition: > 1 penalises),
    # a bias per token id, EOS and stop_token_ids banned until min_tokens, and token
    # sequences never to complete (bad_words as the front end tokenized them).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, minimum=0)
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self._check_processing()

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if isinstance(rep, bool) or not isinstance(rep, (int, float)) or not 0 < rep <= 1e6:
            raise ValueError(f"repetition_penalty must be in (0, 1e6], got {rep!r}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias", token, minimum=0)
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                        or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        if self.structured_output is not None and \
                not isinstance(self.structured_output, StructuredOutput):
            raise ValueError("structured_output must be a StructuredOutput, got "
                             f"{type(self.structured_output).__name__}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        for word in self.bad_words:
            if not isinstance(word, str) or not word:
                raise ValueError(f"bad_words must hold non-empty strings, got {word!r}")
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(w) for w in self.bad_words_token_ids or ()))
        for word in self.bad_words_token_ids:
            if not word:
                raise ValueError("bad_words_token_ids must hold non-empty token sequences")
            for t in word:
                _check_int("bad_words_token_ids", t, minimum=0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling goes through megaserve.engine.logits_processing."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens
                    or self.bad_words_token_ids or self.structured_output is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
