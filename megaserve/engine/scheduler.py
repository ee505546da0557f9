"""Continuous-batching scheduler: FCFS, chunked prefill, prefix caching, preemption by
recompute, room for speculative proposals.

Each step runs in two phases:

1. **running** sequences in arrival order get their next tokens (one for a decode, the
   next chunk for a prefill in progress). If KV blocks run out, the newest running
   sequence is preempted (blocks freed, progress reset, back to the front of the queue).
2. **waiting** sequences are admitted in arrival order while the token budget, the free
   blocks and ``max_num_seqs`` allow; a prompt longer than the remaining budget is
   prefilled in chunks over several steps. With prefix caching, an admitted sequence
   first takes the longest run of cached full blocks of its tokens (at most all but its
   last token, which must run to give logits) and starts computing after them.

With async scheduling a running sequence may have a token sampled by a step still in
flight (``Sequence.num_pending_tokens``): it counts as one of the sequence's tokens (its
input comes from the device), and a sequence whose pending tokens already reach its
length limit (``max_tokens``, ``max_model_len``) is not scheduled again. Such steps are
counted at launch (:meth:`Scheduler.launched`), before their tokens are read.

A step that reaches the end of a sequence's tokens samples; with speculative decoding it
also carries the sequence's draft tokens (``num_draft_tokens``, a pure function of the
sequence, never cut to fit the budget: where they do not fit, the chunk stops one token
short instead and the sequence samples in a later step).

Chunk sizes, prefix-cache hits and preemption never change outputs: the kernels are
invariant to them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from megaserve.engine.kv_cache import BlockPool, blocks_for
from megaserve.engine.prefix_cache import PrefixCacheStats, extend_block_hashes
from megaserve.engine.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool = False
    # Start of every block-hash chain: names the model, dtype and block size.
    cache_root: bytes = b""
    # Tokens per sequence (prompt + output): a sequence whose pending tokens reach it is
    # done once they are read, so it is not scheduled again. None: no limit known here.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class ScheduledSeq(NamedTuple):
    """One sequence's part of a step (immutable; a NamedTuple because one is built per
    sequence per step, and a frozen dataclass costs three times as much to create)."""

    seq: Sequence
    num_new_tokens: int  # tokens [seq.num_computed_tokens, + num_new_tokens) run this step
    samples: bool  # the step completes the sequence's tokens, so a new one is sampled
    # Speculative decoding: draft tokens run after the new tokens, at the next positions,
    # so one forward verifies them (the scheduler plans the count, the proposer fills ids).
    num_draft_tokens: int = 0
    draft_token_ids: tuple[int, ...] = ()
    # `[num_draft_tokens, V]` float64 draft probabilities (a draft model), or None where
    # each draft is certain (n-gram lookup: a one-hot proposal).
    draft_probs: Any = None

    @property
    def num_step_tokens(self) -> int:
        """Rows this sequence contributes to the step's forward."""
        return self.num_new_tokens + self.num_draft_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]  # preempted during this step (for metrics and tests)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_step_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue, the running list and the block pool's allocations.

    ``num_drafts(seq)``: how many draft tokens a sampling step of ``seq`` carries
    (speculative decoding; None = never any).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        num_drafts: Callable[[Sequence], int] | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.num_drafts = num_drafts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.total_preemptions = 0
        self.prefix_stats = PrefixCacheStats()

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, preempted)

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledSeq], preempted: list[Sequence]
    ) -> int:
        remaining = deque(sorted(self.running, key=lambda s: s.arrival))
        kept: list[Sequence] = []
        while remaining:
            seq = remaining.popleft()
            if seq.num_pending_tokens and self._ends_by_length(seq):
                kept.append(seq)  # done once its pending tokens are read
                continue
            plan = self._plan(seq, budget)
            if plan is None:
                kept.append(seq)
                continue
            num_new, num_draft = plan
            need = self._blocks_needed(seq, num_new + num_draft)
            while not self.pool.can_allocate(need) and remaining:
                victim = remaining.pop()
                self._preempt(victim)
                preempted.append(victim)
            if not self.pool.can_allocate(need):
                self._preempt(seq)
                preempted.append(seq)
                continue
            self._take(seq, num_new, num_draft, need, scheduled)
            kept.append(seq)
            budget -= num_new + num_draft
        self.running = kept
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            num_hit = len(hits) * self.config.block_size
            plan = self._plan(seq, budget, num_computed=num_hit)
            if plan is None:
                break
            num_new, num_draft = plan
            total = blocks_for(num_hit + num_new + num_draft, self.config.block_size)
            need = total - len(hits)
            # Hits sitting in the free queue leave it when shared.
            if not self.pool.can_allocate(need + self.pool.num_evictable(hits)):
                break
            self.waiting.popleft()
            self._admit(seq, hits)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._take(seq, num_new, num_draft, need, scheduled)
            budget -= num_new + num_draft

    def _plan(self, seq: Sequence, budget: int, num_computed: int | None = None) -> tuple[int, int] | None:
        """(new tokens, draft tokens) for ``seq`` within ``budget``; None if it cannot run.

        A chunk reaching the end of the tokens carries all of the sequence's drafts; where
        they do not fit it stops one token short (no sampling this step)."""
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        remaining = seq.num_tokens_with_pending - computed
        num_new = min(remaining, budget)
        if num_new <= 0:
            return None
        if num_new < remaining or self.num_drafts is None:
            return num_new, 0
        num_draft = self.num_drafts(seq)
        if remaining + num_draft <= budget:
            return remaining, num_draft
        if remaining > 1:
            return remaining - 1, 0
        return None

    def _ends_by_length(self, seq: Sequence) -> bool:
        """True when the tokens sampled so far (pending ones included) reach the
        sequence's ``max_tokens`` or ``max_model_len``: it needs no further step."""
        num_output = len(seq.output_token_ids) + seq.num_pending_tokens
        limit = self.config.max_model_len
        return (num_output >= seq.params.max_tokens
                or (limit is not None and seq.num_tokens_with_pending >= limit))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of ``seq``'s longest cached prefix (no changes). Never all of its
        tokens (the last one must run for logits), none for a sequence in progress, and
        none where prompt logprobs are wanted (they need the prompt's rows)."""
        if (not self.config.enable_prefix_caching or seq.num_computed_tokens > 0
                or seq.params.prompt_logprobs is not None):
            return []
        bs = self.config.block_size
        num_blocks = (seq.num_tokens - 1) // bs
        extend_block_hashes(seq.block_hashes, seq.token_ids, num_blocks, bs, self.config.cache_root)
        return self.pool.lookup(seq.block_hashes[:num_blocks])

    def _admit(self, seq: Sequence, hits: list[int]) -> None:
        """Take the prefix-cache hits: their blocks become the sequence's first blocks."""
        num_hit = len(hits) * self.config.block_size
        if self.config.enable_prefix_caching and seq.num_computed_tokens == 0:
            self.prefix_stats.queries += seq.num_tokens
            self.prefix_stats.hits += num_hit
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(num_hit, seq.num_prompt_tokens)
        if hits:
            self.pool.share(hits)
            seq.block_ids = list(hits)
            seq.num_computed_tokens = num_hit
            seq.num_registered_blocks = len(hits)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = blocks_for(seq.num_computed_tokens + num_tokens, self.config.block_size)
        return max(0, total - len(seq.block_ids))

    def _take(self, seq: Sequence, num_new: int, num_draft: int, need: int,
              out: list[ScheduledSeq]) -> None:
        if need:
            seq.block_ids.extend(self.pool.allocate(need))
        samples = seq.num_computed_tokens + num_new == seq.num_tokens_with_pending
        out.append(ScheduledSeq(seq, num_new, samples, num_draft))

    def postprocess(self, item: ScheduledSeq, num_accepted: int) -> None:
        """After a step: ``item``'s new tokens and ``num_accepted`` of its drafts have
        their K/V in the cache (:meth:`advance`), and full blocks are registered
        (:meth:`register_blocks`). Call after the step's tokens were appended."""
        self.advance(item, num_accepted)
        self.register_blocks(item.seq)

    def advance(self, item: ScheduledSeq, num_accepted: int) -> None:
        """Count ``item``'s new tokens and ``num_accepted`` of its drafts as computed.
        A decode step launched ahead of its predecessor's results (async scheduling)
        calls it at launch: the step's K/V writes are ordered on the device stream
        before anything a later step reads, so the host may count them early."""
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens + num_accepted
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)

    def launched(self, scheduled: list[ScheduledSeq]) -> int:
        """A step of ``scheduled`` (no drafts) was launched ahead of reading its tokens:
        each input token counts as computed (see :meth:`advance`), full blocks of known
        tokens are registered (:meth:`register_blocks`), and each sampling sequence's
        next token is pending until the host reads it. Returns how many of the input
        tokens were prompt tokens."""
        num_prompt = 0
        for item in scheduled:
            seq = item.seq
            if seq.num_computed_tokens < len(seq.prompt_token_ids):
                num_prompt += min(item.num_new_tokens,
                                  len(seq.prompt_token_ids) - seq.num_computed_tokens)
            seq.num_computed_tokens += item.num_new_tokens  # advance(item, 0), inlined
            if item.num_new_tokens > 1:  # a decode row's block: when its token is read
                self.register_blocks(seq)
            seq.num_pending_tokens += item.samples
        return num_prompt

    def register_blocks(self, seq: Sequence) -> None:
        """Put ``seq``'s blocks that are full of computed, known tokens in the prefix
        cache (none without prefix caching)."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        if num_full <= seq.num_registered_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, num_full, bs, self.config.cache_root)
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.cache(seq.block_ids[i], seq.block_hashes[i])
        seq.num_registered_blocks = num_full

    def _release(self, seq: Sequence) -> None:
        """Free the sequence's blocks, last first (prefix ends are evicted first)."""
        self.pool.free(seq.block_ids[::-1])
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.num_draft_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it (recompute from scratch)."""
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.total_preemptions += 1
        # Back in arrival order, ahead of later arrivals.
        self.waiting.append(seq)
        self.waiting = deque(sorted(self.waiting, key=lambda s: s.arrival))

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
