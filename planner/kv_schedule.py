"""The steps of a whole ``generate`` run whose KV pool cannot hold every sequence at once.

The engine's scheduler (megaserve/engine/scheduler.py) admits waiting prompts in arrival
order while the token budget, free KV blocks and ``max_num_seqs`` allow, prefills them in
chunks, and when a running sequence needs a block and none is free it preempts the newest
running sequence (its blocks freed, its prompt and generated tokens prefilled again later).
A run of ``num_prompts`` identical requests therefore decodes in batches that shrink as the
pool fills and recomputes the preempted sequences' tokens: :func:`schedule` replays that,
at the granularity of KV blocks, and returns how many steps decode how many sequences and
how many prompt tokens are prefilled (recomputation included). Used by
planner/measurements.py to predict measured runs; the search does not model preemption
(its batches are sized so that every sequence's KV fits).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Schedule:
    """Steps of one run: ``decode[b]`` steps decode b sequences; ``prefill[t]`` steps
    prefill t prompt tokens (a step may do both: it is counted in each)."""

    decode: tuple[tuple[int, int], ...]  # (sequences, steps)
    prefill: tuple[tuple[int, int], ...]  # (tokens, steps)
    preemptions: int


@lru_cache(maxsize=64)
def schedule(num_prompts: int, max_num_seqs: int, input_len: int, output_len: int, max_num_batched_tokens: int,
             pool_tokens: int, block_size: int = 16) -> Schedule:
    """Replay the scheduler for ``num_prompts`` requests of ``input_len`` prompt tokens and
    ``output_len`` generated ones with a pool of ``pool_tokens`` KV slots. Raises ValueError
    if the pool cannot hold one whole sequence (the engine refuses such a request)."""
    if pool_tokens < input_len + output_len:
        raise ValueError(f"a KV pool of {pool_tokens} tokens cannot hold one {input_len + output_len}-token sequence")
    free = pool_tokens // block_size
    tokens = [input_len] * num_prompts  # prompt + generated so far
    computed = [0] * num_prompts  # tokens whose KV is in the pool
    generated = [0] * num_prompts
    held = [0] * num_prompts  # blocks held
    waiting, running = deque(range(num_prompts)), []
    decode, prefill, preemptions = Counter(), Counter(), 0

    def blocks_needed(s: int, n: int) -> int:
        return math.ceil((computed[s] + n) / block_size) - held[s]

    def preempt(s: int) -> None:
        nonlocal free, preemptions
        free, held[s], computed[s] = free + held[s], 0, 0
        waiting.appendleft(s)
        preemptions += 1

    while waiting or running:
        budget, step = max_num_batched_tokens, []
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            n = min(tokens[s] - computed[s], budget)
            while blocks_needed(s, n) > free and running[-1] != s:
                preempt(running.pop())
            if blocks_needed(s, n) > free:
                preempt(running.pop())
                break
            free -= blocks_needed(s, n)
            held[s] += blocks_needed(s, n)
            budget -= n
            step.append((s, n))
            i += 1
        while waiting and budget > 0 and len(running) < max_num_seqs:
            s = waiting[0]
            n = min(tokens[s] - computed[s], budget)
            if blocks_needed(s, n) > free:
                break
            waiting.popleft()
            running.append(s)
            free -= blocks_needed(s, n)
            held[s] += blocks_needed(s, n)
            budget -= n
            step.append((s, n))
        num_decode = sum(1 for s, n in step if generated[s] > 0 and n == 1 and computed[s] + 1 == tokens[s])
        num_prefill = sum(n for s, n in step) - num_decode
        for s, n in step:
            computed[s] += n
            if computed[s] == tokens[s]:  # the step reached the sequence's end: it samples
                tokens[s] += 1
                generated[s] += 1
                if generated[s] == output_len:
                    running.remove(s)
                    free, held[s] = free + held[s], 0
        if num_decode:
            decode[num_decode] += 1
        if num_prefill:
            prefill[num_prefill] += 1
    return Schedule(tuple(sorted(decode.items())), tuple(sorted(prefill.items())), preemptions)
