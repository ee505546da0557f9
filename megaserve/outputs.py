"""What the engine returns for a request (vLLM-compatible field names)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One dict per position: token id → logprob. Always holds the sampled (or prompt) token.
Logprobs = list[dict[int, float]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    ``token_ids`` and ``text`` are cumulative (everything generated so far); ``text`` only
    ever grows by whole UTF-8 characters. ``finish_reason`` is None while running, then
    "stop" (EOS, stop string or stop token), "length" (max_tokens / max_model_len) or
    "abort"; ``stop_reason`` is the matched stop string or token id, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (cumulative, not a delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # Entry 0 is None (the first prompt token has no context), as in vLLM.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Prompt tokens whose K/V came from the prefix cache (vLLM's name).
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
