"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and verification.

A step that samples sequence ``s`` (``n`` tokens, K/V of the first ``n - 1`` computed)
runs its last token and its ``j`` drafts in one target forward:

    step rows     t[n-1]   d_1     d_2    ...  d_j
    position      n-1      n       n+1         n+j-1
    row gives p   p_0      p_1     p_2         p_j        (p_r: distribution of token n+r)
    verifies      d_1      d_2     d_3         (bonus)

Verification walks the drafts in order. Greedy: ``d_{r+1}`` is accepted iff it equals the
target's argmax of ``p_r``; the first mismatch is replaced by that argmax, and if all
match the bonus is the argmax of ``p_j`` -- exactly the tokens decoding without
speculation produces, and their logprobs are the same rows' bits (batch-invariant
kernels: a row's result does not depend on how many rows run with it). Sampling: the
speculative sampling rule (Leviathan et al.; Chen et al.): accept ``d`` with probability
``min(1, p(d) / q(d))``, on rejection draw from ``norm(max(0, p - q))``, and when all are
accepted draw the bonus from ``p_j``. ``q`` is the draft model's distribution, or a
one-hot at ``d`` for an n-gram proposal. The output distribution is the target's.

Every random number is a pure function of (seed, position, vocabulary index): the
acceptance uniform and the residual draw use ``kernels.counter_uniform`` under seeds
derived from the request's seed (one stream per purpose, so the draws are independent),
and the bonus draw is the ordinary sampler's. Which drafts a step carries depends only on
the sequence (the scheduler never cuts them to fit the batch), so a seeded request's
output does not depend on the other requests, chunk sizes, cache hits or preemption.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

import kernels
from kernels.filters import filter_row
from megaserve.engine.config import SpeculativeConfig
from megaserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from megaserve.engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

_M64 = (1 << 64) - 1
STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_DRAFT = 1, 2, 3


def stream_seed(seed: int, stream: int) -> int:
    """An independent seed for one purpose (splitmix64 of seed and stream), < 2**63."""
    z = (seed + stream * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


def sampling_probs(logprobs: torch.Tensor, params) -> torch.Tensor:
    """The distribution ``kernels.sample`` draws from for one `[V]` fp32 logprob row:
    tempered, then top-k / top-p / min-p filtered. Returns `[V]` float64 (not
    renormalised after filtering; callers only compare and draw proportionally)."""
    tempered = kernels.log_softmax((logprobs / params.temperature)[None])[0]
    return torch.exp(filter_row(tempered, params.top_k, params.top_p, params.min_p).double())


def _uniform(seed: int, stream: int, position: int, vocab_size: int, device) -> torch.Tensor:
    """`[V]` float64 uniforms in (0, 1) for (stream seed, position, vocabulary index)."""
    seeds = torch.tensor([stream_seed(seed, stream)], dtype=torch.int64, device=device)
    positions = torch.tensor([position], dtype=torch.int64, device=device)
    return kernels.counter_uniform(seeds, positions, vocab_size)[0]


def draw(probs: torch.Tensor, seed: int, stream: int, position: int) -> int:
    """Gumbel-max draw from unnormalised `[V]` probabilities (lowest id on ties)."""
    u = _uniform(seed, stream, position, probs.shape[0], probs.device)
    return int(torch.argmax(torch.log(probs) - torch.log(-torch.log(u))))


def verify(item: "ScheduledSeq", logprobs: torch.Tensor, target_tokens: list[int]) -> tuple[list[int], int]:
    """The tokens a step produces for a sequence with drafts, and how many drafts it kept.

    logprobs: `[j + 1, V]` float32, the target's rows ``p_0 .. p_j`` (module docstring);
    target_tokens: ``kernels.sample`` of each row at its position (the ordinary draw).
    Returns (accepted drafts + one target token, number accepted).
    """
    seq, drafts = item.seq, list(item.draft_token_ids)
    params, n = seq.params, seq.num_tokens
    if params.greedy:
        for r, d in enumerate(drafts):
            if d != target_tokens[r]:
                return drafts[:r] + [target_tokens[r]], r
        return drafts + [target_tokens[-1]], len(drafts)
    for r, d in enumerate(drafts):
        p = sampling_probs(logprobs[r], params)  # [V] float64
        if item.draft_probs is not None:
            q = item.draft_probs[r].to(p.device)  # [V] float64
        else:
            q = torch.zeros_like(p)
            q[d] = 1.0
        u = float(_uniform(seq.seed, STREAM_ACCEPT, n + r, p.shape[0], p.device)[d])
        if u * float(q[d]) < float(p[d]):
            continue
        residual = torch.clamp(p - q, min=0.0)
        return drafts[:r] + [draw(residual, seq.seed, STREAM_RESIDUAL, n + r)], r
    return drafts + [target_tokens[-1]], len(drafts)


class Proposer:
    """Proposes draft tokens. ``num_proposals(seq)`` is how many a sampling step of
    ``seq`` carries (a pure function of the sequence); ``propose`` returns exactly that
    many per sequence, with their draft probabilities (None for certain proposals)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def limit(self, seq: Sequence) -> int:
        """At most k, and never past ``max_tokens`` or ``max_model_len`` (the step adds
        the accepted drafts plus one token)."""
        room_tokens = seq.params.max_tokens - len(seq.output_token_ids) - 1
        room_len = self.max_model_len - seq.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, room_tokens, room_len))

    def attach(self, engine) -> None:
        """Called once the engine (its pool, device, block size) exists."""

    def num_proposals(self, seq: Sequence) -> int:
        raise NotImplementedError

    def propose(self, items: list["ScheduledSeq"]) -> list[tuple[tuple[int, ...], torch.Tensor | None]]:
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, find
    the latest earlier occurrence of the last n tokens and propose the tokens after it."""

    def num_proposals(self, seq: Sequence) -> int:
        return len(self.lookup(seq))

    def lookup(self, seq: Sequence) -> tuple[int, ...]:
        limit = self.limit(seq)
        if limit == 0:
            return ()
        tokens = seq.prompt_token_ids + seq.output_token_ids
        total = len(tokens)
        for n in range(self.config.prompt_lookup_max, self.config.prompt_lookup_min - 1, -1):
            if n >= total:
                continue
            suffix = tokens[total - n:]
            for start in range(total - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + limit]
                    return tuple(follow)
        return ()

    def propose(self, items):
        out = []
        for item in items:
            drafts = self.lookup(item.seq)
            assert len(drafts) == item.num_draft_tokens
            out.append((drafts, None))
        return out
