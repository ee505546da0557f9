"""Appending generated tokens: detokenization, stop conditions, RequestOutputs."""

from __future__ import annotations

from megaserve.engine.sequence import Sequence
from megaserve.outputs import CompletionOutput, RequestOutput
from megaserve.sampling_params import RequestOutputKind
from megaserve.tokenizer import IncrementalDetokenizer, Tokenizer


class _Text:
    """A sequence's incremental detokenizer, the tokens fed to it so far, and what its
    DELTA outputs have emitted."""

    __slots__ = ("detok", "num_fed", "num_emitted_tokens", "num_emitted_chars")

    def __init__(self, detok: IncrementalDetokenizer | None) -> None:
        self.detok = detok
        self.num_fed = 0
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0


class OutputProcessor:
    """Applies one step's tokens to sequences and decides when they finish.

    Stop conditions, in order: EOS (unless ``ignore_eos``), ``stop_token_ids``, stop
    strings (the text is cut before the match unless ``include_stop_str_in_output``),
    ``max_tokens``, ``max_model_len``. While a request with stop strings runs, its visible
    text holds back the last ``len(longest stop) - 1`` characters, so streamed text never
    shows the start of a stop string that is later cut off.

    Text is detokenized token by token only for requests with stop strings (the match
    needs it); for the others the same incremental detokenizer catches up when an output
    needs the text, so the text is the same whenever it is read.
    """

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._text: dict[Sequence, _Text] = {}

    def append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        """Add a sampled token to ``seq``; sets ``seq.finish_reason`` when it must stop."""
        seq.output_token_ids.append(token)
        if logprobs is not None:
            if seq.output_logprobs is None:
                seq.output_logprobs = []
            seq.output_logprobs.append(logprobs)
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and self._match_stop(seq, self._detokenize(seq)):
            return
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._flush(seq)

    def _state(self, seq: Sequence) -> _Text:
        state = self._text.get(seq)
        if state is None:
            detok = (IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
                     if self.tokenizer is not None else None)
            state = self._text[seq] = _Text(detok)
        return state

    def _detokenize(self, seq: Sequence) -> str:
        """Feed the detokenizer the tokens it has not seen; returns the text they add."""
        state = self._state(seq)
        ids = seq.output_token_ids
        fed = state.num_fed
        if fed == len(ids):
            return ""
        state.num_fed = len(ids)
        detok = state.detok
        if detok is None:
            return ""
        if fed + 1 == len(ids):
            delta = detok.add(ids[fed])
        else:
            delta = "".join([detok.add(token) for token in ids[fed:]])
        if delta:
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
        state = self._text.get(seq)
        if state is not None:
            state.detok = None  # the text is final
        return True

    def _flush(self, seq: Sequence) -> None:
        """End of the stream: the rest of the text, and the detokenizer's held tail."""
        self._detokenize(seq)
        state = self._text[seq]
        if state.detok is not None:
            seq.text += state.detok.flush()
            state.detok = None

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence."""
        self._text.pop(seq, None)

    def abort(self, seq: Sequence) -> None:
        """End ``seq`` with reason "abort": its text holds every token (no held tail).
        Call :meth:`step_output` for its last output (which forgets it)."""
        if seq.finish_reason is None:
            self._detokenize(seq)
        seq.finish_reason = "abort"

    def step_output(self, seq: Sequence) -> RequestOutput | None:
        """What a step that advanced ``seq`` returns for it, by its ``output_kind``: the
        cumulative snapshot, the delta since its last output, or (FINAL_ONLY) the
        snapshot once it finished and None before. Forgets a finished sequence."""
        kind = seq.params.output_kind
        finished = seq.finish_reason is not None
        if kind is RequestOutputKind.CUMULATIVE:
            out = self._snapshot(seq, 0, 0, True)
        elif kind is RequestOutputKind.FINAL_ONLY:
            out = self._snapshot(seq, 0, 0, True) if finished else None
        else:
            state = self._state(seq)
            start, chars = state.num_emitted_tokens, state.num_emitted_chars
            out = self._snapshot(seq, start, chars, start == 0)
            state.num_emitted_tokens = len(seq.output_token_ids)
            state.num_emitted_chars = chars + len(out.outputs[0].text)
        if finished:
            self._text.pop(seq, None)
        return out

    def mark_sent(self, seq: Sequence, num_tokens: int, num_chars: int) -> None:
        """``seq``'s caller has been sent its first ``num_tokens`` tokens and ``num_chars``
        characters of text (a re-run's replay of them): its next DELTA output starts
        there."""
        state = self._state(seq)
        state.num_emitted_tokens, state.num_emitted_chars = num_tokens, num_chars

    def make_output(self, seq: Sequence) -> RequestOutput:
        """A cumulative snapshot of the request (lists copied, so later steps do not
        mutate it)."""
        return self._snapshot(seq, 0, 0, True)

    def _snapshot(self, seq: Sequence, start: int, chars: int,
                  with_prompt_logprobs: bool) -> RequestOutput:
        """The request's output from generated token ``start`` and visible character
        ``chars`` on."""
        text = seq.text
        if seq.finish_reason is None:
            if self._detokenize(seq):
                text = seq.text
            if seq.params.stop:
                hold = max(len(s) for s in seq.params.stop) - 1
                text = text[: max(0, len(text) - hold)]
        completion = CompletionOutput(
            index=0,
            text=text[chars:] if chars else text,
            token_ids=seq.output_token_ids[start:],
            logprobs=seq.output_logprobs[start:] if seq.output_logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        prompt_logprobs = seq.prompt_logprobs
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.finish_reason is not None,
            prompt_logprobs=(list(prompt_logprobs) if with_prompt_logprobs
                             and prompt_logprobs is not None else None),
            num_cached_tokens=seq.num_cached_tokens or 0,
        )
