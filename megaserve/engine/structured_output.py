"""Structured outputs: a grammar (JSON schema, any JSON, regex, a choice of strings, EBNF)
masks the tokens a request may sample next, through xgrammar.

Why xgrammar: it is vLLM's and SGLang's default backend, maintained, installs as a wheel
with the CPU torch build, and works from a ``tokenizers`` vocabulary (no transformers at
run time); its masks are bitmasks computed per request on the CPU, which is where the
engine applies them.

NOTE (batch invariance): a request's mask is a function of its own grammar and the tokens
it generated, and it is applied to its own row only (``logits_processing``), so neither
its neighbours' grammars nor their presence change its tokens.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from megaserve.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)


def grammar_of(spec: StructuredOutput):
    """The xgrammar ``Grammar`` of ``spec``; ``ValueError`` naming the problem for an
    invalid schema, regex or grammar (or a missing xgrammar)."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError("structured outputs need the xgrammar package (pip install "
                         "xgrammar)") from None
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "json_object":  # an object, as OpenAI's name says (xgrammar's
            # builtin JSON grammar, which vLLM uses, also allows a top-level array)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=True)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in choices))
        return xgr.Grammar.from_ebnf(spec.spec)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with a message
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise ValueError(f"{spec.kind}: not a valid {_WHAT[spec.kind]} ({first[:300]})") from None


_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
         "choice": "list of choices", "grammar": "EBNF grammar"}


@dataclass
class _State:
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: list[int]  # the tokens the matcher has accepted, in order
    broken: bool = False  # a token the grammar refused: no mask from then on


class GrammarMasks:
    """Per-request grammar matchers of one engine and the masks they give.

    ``tokenizer``: the engine's Tokenizer; ``vocab_size``: the width of the model's
    logits; ``eos_token_ids``: the tokens that end a request (allowed once the grammar is
    complete). Compiled grammars are cached by spec; a request's matcher lives as long as
    its Sequence object.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._compiled: dict[StructuredOutput, Any] = {}
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _compile(self, spec: StructuredOutput):
        import xgrammar as xgr

        if self._compiler is None:
            backend = self._tokenizer.backend
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            vocab = [""] * max(self._vocab_size, self._tokenizer.vocab_size)
            for text, token_id in backend.get_vocab(with_added_tokens=True).items():
                vocab[token_id] = text
            info = xgr.TokenizerInfo(vocab[:self._vocab_size], meta["vocab_type"],
                                     vocab_size=self._vocab_size,
                                     stop_token_ids=self._eos_token_ids,
                                     add_prefix_space=meta["add_prefix_space"])
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiled[spec] = self._compiler.compile_grammar(grammar_of(spec))
        return compiled

    def apply(self, key: object, spec: StructuredOutput, generated: list[int],
              row: torch.Tensor) -> None:
        """Sets to -inf, in place, the entries of ``row`` (`[V]` float32) that the grammar
        forbids after ``generated`` (the request's tokens so far). ``key``: the request's
        Sequence (its matcher is kept while it lives)."""
        import xgrammar as xgr

        state = self._states.get(key)
        if state is None or state.consumed != generated[:len(state.consumed)]:
            # first use, or the request's tokens changed (drafts rejected): start over
            state = self._states[key] = _State(xgr.GrammarMatcher(self._compile(spec)), [])
        if state.broken:
            return
        for token in generated[len(state.consumed):]:
            if not state.matcher.accept_token(token):
                logger.warning("a token the grammar forbids was generated; the rest of "
                               "the request runs unconstrained")
                state.broken = True
                return
            state.consumed.append(token)
        if state.matcher.is_terminated():
            return
        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        state.matcher.fill_next_token_bitmask(bitmask)
        masked = row.unsqueeze(0)
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(row.device), vocab_size=self._vocab_size)
