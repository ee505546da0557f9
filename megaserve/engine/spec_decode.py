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
acceptance uniform and the residual draw use ``megaserve.kernels.counter_uniform`` under seeds
derived from the request's seed (one stream per purpose, so the draws are independent),
and the bonus draw is the ordinary sampler's. Which drafts a step carries depends only on
the sequence (the scheduler never cuts them to fit the batch), so a seeded request's
output does not depend on the other requests, chunk sizes, cache hits or preemption.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from megaserve import kernels
from megaserve.kernels.filters import filter_row
from megaserve.engine.config import SpeculativeConfig
from megaserve.engine.micro_batch import build_micro_batch
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
    """The distribution ``megaserve.kernels.sample`` draws from for one `[V]` fp32 logprob row:
    tempered, then top-k / top-p / min-p filtered, renormalised (the rule's ratio
    ``p / q`` needs both normalised). Returns `[V]` float64."""
    tempered = kernels.log_softmax((logprobs / params.temperature)[None])[0]
    probs = torch.exp(filter_row(tempered, params.top_k, params.top_p, params.min_p).double())
    return probs / probs.sum()


def _uniform(seed: int, stream: int, position: int, vocab_size: int, device) -> torch.Tensor:
    """`[V]` float64 uniforms in (0, 1) for (stream seed, position, vocabulary index)."""
    seeds = torch.tensor([stream_seed(seed, stream)], dtype=torch.int64, device=device)
    positions = torch.tensor([position], dtype=torch.int64, device=device)
    return kernels.counter_uniform(seeds, positions, vocab_size)[0]


def draw(probs: torch.Tensor, seed: int, stream: int, position: int) -> int:
    """Gumbel-max draw from unnormalised `[V]` probabilities (lowest id on ties)."""
    u = _uniform(seed, stream, position, probs.shape[0], probs.device)
    return int(torch.argmax(torch.log(probs) - torch.log(-torch.log(u))))


def verify(item: "ScheduledSeq", logprobs: torch.Tensor | None,
           target_tokens: list[int]) -> tuple[list[int], int]:
    """The tokens a step produces for a sequence with drafts, and how many drafts it kept.

    logprobs: `[j + 1, V]` float32, the target's rows ``p_0 .. p_j`` (module docstring;
    unused, and may be None, for a greedy request); target_tokens:
    ``megaserve.kernels.sample`` of each row at its position (the ordinary draw).
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
        if not float(residual.sum()) > 0:  # p == q up to rounding: p itself is the residual
            residual = p
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

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K/V the proposer keeps per pool block (sizes the pool)."""
        return 0

    def attach(self, engine) -> None:
        """Called once the engine (its pool, device, block size) exists."""

    def num_proposals(self, seq: Sequence) -> int:
        raise NotImplementedError

    def propose(self, items: list["ScheduledSeq"]) -> list[tuple[tuple[int, ...], torch.Tensor | None]]:
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, find
    the latest earlier occurrence of the last n tokens and propose the tokens after it.

    Where those run out before :meth:`limit` (the occurrence is less than ``limit``
    tokens back), the proposal continues periodically: a match ``p`` tokens back says
    the text repeats with period ``p``, so draft ``i`` is the token ``p`` before it.
    A verification step costs the same with fewer drafts (the graphs pad to k), so
    proposing all ``limit`` is free and accepts more in a loop."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        # Lookups of this step (the scheduler's num_proposals, then propose): id(seq) ->
        # (seq, num_tokens, proposal); cleared by propose.
        self._looked_up: dict[int, tuple[Sequence, int, tuple[int, ...]]] = {}

    def num_proposals(self, seq: Sequence) -> int:
        drafts = self.lookup(seq)
        if drafts:  # a step with drafts calls propose, which clears the entries
            self._looked_up[id(seq)] = (seq, seq.num_tokens, drafts)
        return len(drafts)

    def _proposal(self, seq: Sequence) -> tuple[int, ...]:
        """:meth:`lookup`, reusing the scheduler's lookup of this step."""
        entry = self._looked_up.get(id(seq))
        if entry is not None and entry[0] is seq and entry[1] == seq.num_tokens:
            return entry[2]
        return self.lookup(seq)

    def lookup(self, seq: Sequence) -> tuple[int, ...]:
        """The proposal for ``seq`` (at most :meth:`limit` tokens, possibly none)."""
        limit = self.limit(seq)
        if limit == 0:
            return ()
        tokens = np.asarray(seq.prompt_token_ids + seq.output_token_ids, dtype=np.int64)  # [L]
        total = tokens.shape[0]
        for n in range(self.config.prompt_lookup_max, self.config.prompt_lookup_min - 1, -1):
            if n >= total:
                continue
            # Windows starting at 0 .. L-n-1 (each followed by at least one token): [L-n, n]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                period = total - start  # >= 1: a window is followed by a token
                return tuple(tokens[start + np.arange(limit) % period].tolist())
        return ()

    def propose(self, items):
        out = []
        for item in items:
            drafts = self._proposal(item.seq)
            assert len(drafts) == item.num_draft_tokens
            out.append((drafts, None))
        self._looked_up.clear()
        return out


class DraftModelProposer(Proposer):
    """Proposes with a smaller checkpoint of the same vocabulary, run in this process.

    The draft keeps its own paged K/V cache with the target's block ids (same pool, same
    block tables), so no allocation of its own; ``seq.num_draft_computed`` says how far
    its K/V are valid. A step first catches the draft up on the sequence's tokens, then
    runs it one token at a time: ``d_1`` from the last token's row, ``d_{r+1}`` from
    ``d_r``'s. Drafts are drawn with the request's sampling parameters under a stream of
    its own (``STREAM_DRAFT``); ``q`` is the distribution they were drawn from.

    NOTE: a prefix-cache hit gives a sequence blocks whose draft K/V may never have been
    written; its draft starts at 0 (``num_draft_computed`` is reset at admission) and
    rewrites them with the same bits, which is safe for the sequences sharing them.
    """

    def load(self, config, vocab_size: int) -> None:
        """Load the draft's weights (``config``: the engine's EngineConfig); raises
        ``ValueError`` for a draft of another vocabulary."""
        from megaserve.models.forward import LocalExperts
        from megaserve.models.loader import load_model
        from megaserve.models.resolved import ResolvedModel

        draft = ResolvedModel.resolve(self.config.model)
        self.draft_config = draft.config
        if self.draft_config.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({self.draft_config.vocab_size}) "
                f"differs from the target's ({vocab_size}); use a draft of the same tokenizer")
        model = load_model(draft, config.dtype, config.device,
                           max_positions=self.max_model_len + self.config.num_speculative_tokens)
        self.attention = model.attention
        self.experts = LocalExperts(model.experts)
        self.device = model.attention.device

    def kv_bytes_per_block(self, block_size: int) -> int:
        from megaserve.engine.memory import kv_bytes_per_block

        cfg = self.draft_config
        return kv_bytes_per_block(cfg.num_layers, block_size, cfg.cache_kv_heads, cfg.cache_head_dim,
                                  self.attention.dtype, cfg.cache_shares_kv)

    def attach(self, engine) -> None:
        """Allocate the draft's K/V; on CUDA with ``cuda_graphs``, set up its graphs: the
        catch-up (1 or 2 tokens per sequence after a step) and the one-token rounds."""
        from megaserve.engine.kv_cache import allocate_kv_tensors
        from megaserve.engine.spec_graphs import MultiTokenGraphs

        self.block_size = engine.config.block_size
        cfg = self.draft_config
        self.kv_caches = allocate_kv_tensors(
            cfg.num_layers, engine.pool.num_blocks, self.block_size, cfg.cache_kv_heads,
            cfg.cache_head_dim, self.attention.dtype, self.device, cfg.cache_shares_kv)
        self.graphs = []  # tried in order: the first that fits a forward runs it
        if engine.config.cuda_graphs and self.device.type == "cuda":
            self.graphs = [
                MultiTokenGraphs(self.attention, self.experts.experts, self.kv_caches,
                                 self.block_size, engine.config.max_num_seqs,
                                 int(self.attention.cos.shape[0]), query_len=q)
                for q in (1, 2)]

    def num_proposals(self, seq: Sequence) -> int:
        return self.limit(seq)

    def _forward(self, inputs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """Log-probs `[S, V]` fp32 of each input's last row (writes the inputs' draft K/V):
        from a CUDA graph where one fits (bitwise the same rows), else eagerly."""
        from megaserve.models.forward import run_layers

        for graphs in self.graphs:
            if not graphs.can_run(inputs):
                continue
            try:
                out = graphs.run(inputs)  # [S * Q, V]
            except RuntimeError as e:  # capture failed; the eager forward rewrites the K/V
                logger.warning("draft CUDA graph capture failed, running eagerly: %s", e)
                self.graphs = []
                break
            q = graphs.query_len
            last = [i * q + len(ids) - 1 for i, (ids, _, _) in enumerate(inputs)]
            return out[torch.tensor(last, device=out.device)]  # [S, V] (a copy)
        batch = build_micro_batch(inputs, self.block_size, self.device)
        self.experts.begin_step(1)
        h = run_layers(self.attention, self.experts, [batch], self.kv_caches)[0]  # [T, D]
        last = batch.meta.query_start_loc[1:].long() - 1  # [S]
        return kernels.log_softmax(self.attention.logits(h[last]))  # [S, V]

    def _draw(self, seqs: list[Sequence], logprobs: torch.Tensor, positions: list[int]):
        """Draft tokens of each row and, for sampled requests, their `[V]` q rows."""
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device)

        tokens = kernels.sample(
            logprobs,
            col([s.params.temperature for s in seqs], torch.float32),
            col([s.params.top_k for s in seqs], torch.int64),
            col([s.params.top_p for s in seqs], torch.float32),
            col([s.params.min_p for s in seqs], torch.float32),
            col([stream_seed(s.seed, STREAM_DRAFT) for s in seqs], torch.int64),
            col(positions, torch.int64),
        ).tolist()
        probs = [None if s.params.greedy else sampling_probs(logprobs[i], s.params)
                 for i, s in enumerate(seqs)]
        return tokens, probs

    def propose(self, items):
        seqs = [item.seq for item in items]
        counts = [item.num_draft_tokens for item in items]
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor | None]] = [[] for _ in items]
        # Round 0: catch up on the sequence's tokens, draw d_1 at position n.
        inputs = [(s.token_ids(s.num_draft_computed, s.num_tokens), s.num_draft_computed, s.block_ids)
                  for s in seqs]
        active = list(range(len(items)))
        logprobs = self._forward(inputs)
        for r in range(max(counts)):
            if r > 0:
                active = [i for i in active if counts[i] > r]
                inputs = [([drafts[i][-1]], seqs[i].num_tokens + r - 1, seqs[i].block_ids)
                          for i in active]
                logprobs = self._forward(inputs)
            tokens, qs = self._draw([seqs[i] for i in active], logprobs,
                                    [seqs[i].num_tokens + r for i in active])
            for i, token, q in zip(active, tokens, qs):
                drafts[i].append(token)
                probs[i].append(q)
        for s, count in zip(seqs, counts):
            s.num_draft_computed = s.num_tokens + count - 1  # d_1 .. d_{j-1} ran
        return [(tuple(d), None if s.params.greedy else torch.stack(p))
                for d, p, s in zip(drafts, probs, seqs)]
