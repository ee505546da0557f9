"""Appending generated tokens: detokenization, stop conditions, RequestOutput snapshots."""

from __future__ import annotations

from megaserve.engine.sequence import Sequence
from megaserve.outputs import CompletionOutput, RequestOutput
from megaserve.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    """Applies one step's tokens to sequences and decides when they finish.

    Stop conditions, in order: EOS (unless ``ignore_eos``), ``stop_token_ids``, stop
    strings (the text is cut before the match unless ``include_stop_str_in_output``),
    ``max_tokens``, ``max_model_len``. While a request with stop strings runs, its visible
    text holds back the last ``len(longest stop) - 1`` characters, so streamed text never
    shows the start of a stop string that is later cut off.
    """

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._detok: dict[Sequence, IncrementalDetokenizer] = {}

    def append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        """Add a sampled token to ``seq``; sets ``seq.finish_reason`` when it must stop."""
        seq.output_token_ids.append(token)
        if logprobs is not None:
            if seq.output_logprobs is None:
                seq.output_logprobs = []
            seq.output_logprobs.append(logprobs)
        delta = self._detokenize(seq, token)
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and self._match_stop(seq, delta):
            return
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._flush(seq)

    def _detokenize(self, seq: Sequence, token: int) -> str:
        if self.tokenizer is None:
            return ""
        detok = self._detok.get(seq)
        if detok is None:
            detok = self._detok[seq] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        delta = detok.add(token)
        seq.text += delta
        return delta

    def _match_stop(self, seq: Sequence, delta: str) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(seq.text) - len(delta) - longest + 1)
        hits = [(seq.text.find(s, search_from), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.text = seq.text[:end]
        seq.finish_reason, seq.stop_reason = "stop", stop
        self._detok.pop(seq, None)
        return True

    def _flush(self, seq: Sequence) -> None:
        detok = self._detok.pop(seq, None)
        if detok is not None:
            seq.text += detok.flush()

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence."""
        self._detok.pop(seq, None)

    def make_output(self, seq: Sequence) -> RequestOutput:
        """A snapshot of the request (lists copied, so later steps do not mutate it)."""
        text = seq.text
        if seq.finish_reason is None and seq.params.stop:
            hold = max(len(s) for s in seq.params.stop) - 1
            text = text[: max(0, len(text) - hold)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(seq.output_token_ids),
            logprobs=list(seq.output_logprobs) if seq.output_logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.finish_reason is not None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )
