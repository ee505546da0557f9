"""Per-request adjustments of the next-token distribution before sampling: penalties,
logit bias, ``min_tokens`` and bad words (vLLM's sampling parameters of those names).

Shape legend: n = rows that sample, V = vocab.

NOTE: every adjustment reads only its own row and its own request's tokens, and the
adjusted row is renormalised with the batch-invariant ``kernels.log_softmax``, so a
request's tokens are the same bits whatever else is batched with it (the determinism
contract). They change what is sampled, not the logprobs reported (vLLM's default,
``raw_logprobs``).

They act on log-probabilities, which differ from logits by a per-row constant: additive
adjustments (presence, frequency, bias, bans) are therefore exactly vLLM's. The
repetition penalty multiplies a seen token's log-probability by the penalty (always <= 0,
so a penalty > 1 makes it less likely); vLLM divides positive logits and multiplies
negative ones, which depends on the logits' arbitrary offset.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from megaserve import kernels
from megaserve.engine.structured_output import GrammarMasks
from megaserve.sampling_params import SamplingParams


def adjust(rows: torch.Tensor,
           requests: Seq[tuple[SamplingParams, list[int], list[int], object]],
           eos_token_ids: Seq[int], grammars: GrammarMasks | None = None) -> torch.Tensor:
    """The adjusted, renormalised log-probabilities of the rows whose request asks for it.

    rows: `[n, V]` float32 log-probabilities (not modified); requests: per row, (its
    params, its prompt token ids, the tokens it generated so far, in order, the request's
    Sequence: it keys its grammar matcher). ``grammars``: the engine's grammar masks
    (structured outputs; ValueError if a request has a grammar and there are none).
    ``eos_token_ids``: the model's EOS ids (banned with ``stop_token_ids`` until
    ``min_tokens`` tokens were generated, unless ``ignore_eos``). Returns a new tensor.
    """
    out = rows.clone()
    vocab = rows.shape[1]
    for j, (params, prompt_ids, output_ids, key) in enumerate(requests):
        if not params.adjusts_logits:
            continue
        row = out[j]  # [V], a view
        if params.repetition_penalty != 1.0:  # first: on log-probabilities, all <= 0
            seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64,
                                device=row.device)
            row[seen] *= params.repetition_penalty
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab]
            row[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=row.dtype,
                                     device=row.device)
        if (params.presence_penalty or params.frequency_penalty) and output_ids:
            counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64,
                                                 device=row.device), minlength=vocab)[:vocab]
            row -= (params.frequency_penalty * counts.to(row.dtype)
                    + params.presence_penalty * (counts > 0).to(row.dtype))
        if len(output_ids) < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            row[[t for t in banned if t < vocab]] = float("-inf")
        for word in params.bad_words_token_ids:
            prefix = list(word[:-1])
            if word[-1] < vocab and (not prefix or output_ids[-len(prefix):] == prefix):
                row[word[-1]] = float("-inf")
        if params.structured_output is not None:  # last: the grammar has the final word
            if grammars is None:
                raise ValueError("structured_output: this engine has no tokenizer")
            grammars.apply(key, params.structured_output, output_ids, row)
        if torch.isneginf(row).all():  # everything banned: fall back to the model's row
            row.copy_(rows[j])
        out[j] = kernels.log_softmax(row.unsqueeze(0))[0]
    return out
