"""Continuous-batching scheduler: FCFS, chunked prefill, preemption by recompute.

Each step runs in two phases:

1. **running** sequences in arrival order get their next tokens (one for a decode, the
   next chunk for a prefill in progress). If KV blocks run out, the newest running
   sequence is preempted (blocks freed, progress reset, back to the front of the queue).
2. **waiting** sequences are admitted in arrival order while the token budget, the free
   blocks and ``max_num_seqs`` allow; a prompt longer than the remaining budget is
   prefilled in chunks over several steps.

Chunk sizes and preemption never change outputs: the kernels are invariant to them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from megaserve.engine.kv_cache import BlockPool, blocks_for
from megaserve.engine.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens [seq.num_computed_tokens, + num_new_tokens) run this step
    samples: bool  # the step completes the sequence's tokens, so a new one is sampled


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]  # preempted during this step (for metrics and tests)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue, the running list and the block pool's allocations."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.total_preemptions = 0

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
            if budget == 0:
                kept.append(seq)
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_needed(seq, num_new)
            while not self.pool.can_allocate(need) and remaining:
                victim = remaining.pop()
                self._preempt(victim)
                preempted.append(victim)
            if not self.pool.can_allocate(need):
                self._preempt(seq)
                preempted.append(seq)
                continue
            self._take(seq, num_new, need, scheduled)
            kept.append(seq)
            budget -= num_new
        self.running = kept
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_needed(seq, num_new)
            if not self.pool.can_allocate(need):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._take(seq, num_new, need, scheduled)
            budget -= num_new

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = blocks_for(seq.num_computed_tokens + num_new, self.config.block_size)
        return max(0, total - len(seq.block_ids))

    def _take(self, seq: Sequence, num_new: int, need: int, out: list[ScheduledSeq]) -> None:
        seq.block_ids.extend(self.pool.allocate(need))
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        out.append(ScheduledSeq(seq, num_new, samples))

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it (recompute from scratch)."""
        self.pool.free(seq.block_ids)
        seq.block_ids = []
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
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED
