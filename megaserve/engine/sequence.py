"""Per-request state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from megaserve.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens, KV blocks and progress.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. A step computes
    tokens ``[num_computed_tokens, num_tokens)`` (the prompt, possibly in chunks, then one
    token per decode step) and samples the next token once all are computed.
    Preemption frees the blocks and resets it to 0 (recompute); a prefix-cache hit at
    admission starts it at the hit length instead.

    ``block_hashes`` names the sequence's full blocks (megaserve.engine.prefix_cache);
    the first ``num_registered_blocks`` of ``block_ids`` are in the prefix cache.
    ``num_draft_computed`` counts tokens whose K/V are in the draft model's cache
    (speculative decoding with a draft model); it never exceeds ``num_computed_tokens``
    after a step.

    ``num_pending_tokens`` counts tokens sampled by steps still in flight on the
    device (async scheduling, megaserve.engine.engine): they follow ``output_token_ids``
    but the host has not read them yet. Such a step already counted its input token in
    ``num_computed_tokens``, which may therefore exceed ``num_tokens`` by the pending ones.

    NOTE: ``block_ids`` only grows in place (``extend``) while the sequence holds its
    blocks; freeing them (finish, abort, preemption) or taking prefix-cache hits assigns a
    new list. ``DecodeGraphs`` relies on this to keep block tables between steps.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one the engine derived for it
    arrival: int  # FCFS order
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    output_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache at first admission (None until admitted).
    num_cached_tokens: int | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_draft_computed: int = 0
    num_pending_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens including those sampled by steps still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:  # decode: no copy of the whole sequence per step
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    def wants_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are requested and not all computed yet."""
        if self.params.prompt_logprobs is None:
            return False
        done = 0 if self.prompt_logprobs is None else len(self.prompt_logprobs)
        return done < self.num_prompt_tokens
