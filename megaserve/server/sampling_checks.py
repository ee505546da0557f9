"""What a request's sampling parameters need checked against the model they run on, for
both front ends (gRPC and HTTP): token ids inside the vocabulary, grammars xgrammar can
compile, bad words as token sequences."""

from __future__ import annotations

from dataclasses import replace

from megaserve.sampling_params import SamplingParams
from megaserve.server.errors import RequestError


def check_for_model(engine, params: SamplingParams,
                    grammar_field: str = "structured_output") -> SamplingParams:
    """``params`` checked against ``engine``'s model (``vocab_size``, ``tokenizer``), with
    ``bad_words`` tokenized into ``bad_words_token_ids`` (vLLM's two forms of each word: at
    the start of a text and after a space). Raises RequestError(INVALID_ARGUMENT) naming
    ``logit_bias`` (an id outside the vocabulary), ``grammar_field`` (a grammar xgrammar
    cannot compile) or ``bad_words``; a model without a tokenizer refuses grammars and
    bad words."""
    for token in params.logit_bias or ():
        if token >= engine.vocab_size:
            raise RequestError.invalid("logit_bias", f"token id {token} is outside the "
                                       f"vocabulary [0, {engine.vocab_size})")
    if params.structured_output is not None:
        from megaserve.engine.structured_output import grammar_of

        if engine.tokenizer is None:
            raise RequestError.invalid(grammar_field, "this model has no tokenizer")
        try:
            grammar_of(params.structured_output)
        except ValueError as e:
            raise RequestError.invalid(grammar_field, str(e)) from None
    if params.bad_words and not params.bad_words_token_ids:
        if engine.tokenizer is None:
            raise RequestError.invalid("bad_words", "this model has no tokenizer")
        found: dict[tuple[int, ...], None] = {}
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(engine.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    found[ids] = None
        params = replace(params, bad_words_token_ids=tuple(found))
    return params
