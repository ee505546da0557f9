"""Prefix caching: the identity of a full KV block, and hit-rate bookkeeping.

A full block is named by a hash chained over its tokens and everything before it:

    root = H(model, dtype, block size)         (anything else that changes K/V joins here)
    h_0  = H(root, tokens[0:bs])
    h_i  = H(h_{i-1}, tokens[i*bs:(i+1)*bs])

so two sequences share ``h_i`` exactly when their first ``(i+1)*bs`` tokens are equal, and
then (batch-invariant kernels) the block's K/V are the same bits. The block pool
(:class:`megaserve.engine.kv_cache.BlockPool`) maps hashes to block ids; the scheduler
looks hashes up when it admits a sequence and registers blocks once their K/V are
computed. Hashes are 128-bit BLAKE2b digests: a collision would silently serve another
prompt's K/V, so a 64-bit Python ``hash`` is not good enough.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

DIGEST_BYTES = 16


def root_hash(*keys: object) -> bytes:
    """The chain's start: a digest of everything besides the tokens that shapes K/V."""
    return hashlib.blake2b(repr(keys).encode(), digest_size=DIGEST_BYTES).digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full block given its predecessor's hash (or the root)."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Callable[[int, int], list[int]],
    num_blocks: int,
    block_size: int,
    root: bytes,
) -> None:
    """Append hashes to ``hashes`` (in place) until it names ``num_blocks`` full blocks.

    ``token_ids(start, end)``: the sequence's tokens ``[start, end)``; every block asked
    for must be full (``num_blocks * block_size`` tokens exist).
    """
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids(i * block_size, (i + 1) * block_size)))


def prompt_block_hashes(token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """Hashes of every full block of a token list (the front-end's routing key)."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, lambda a, b: token_ids[a:b], len(token_ids) // block_size,
                        block_size, root)
    return hashes


@dataclass
class PrefixCacheStats:
    """Counters in tokens, as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``:
    every admission of a sequence (also after preemption) queries its tokens."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixRouter:
    """Cache-aware routing for a front-end over several attention replicas.

    The front-end cannot see the replicas' pools, so it remembers which full prompt
    blocks it sent where (per replica, least recently sent forgotten first beyond
    ``capacity_blocks``, about what a pool holds). A request goes to the replica that
    minimises ``load - reused tokens``: the replica holding its prefix wins while its
    outstanding work exceeds the others' by less than the prefill it saves, so a hot
    prefix never piles all traffic onto one replica. Ties go to the lower load, then index.
    Routing never changes outputs (prefix hits are bitwise invisible); it saves prefill.
    """

    def __init__(self, num_replicas: int, block_size: int, root: bytes,
                 capacity_blocks: int = 1 << 16) -> None:
        self.block_size = block_size
        self.root = root
        self.capacity_blocks = capacity_blocks
        self._sent: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]

    def matched_tokens(self, replica: int, block_hashes: list[bytes]) -> int:
        """Tokens of the longest prefix of ``block_hashes`` sent to ``replica``."""
        sent = self._sent[replica]
        count = 0
        for block_hash in block_hashes:
            if block_hash not in sent:
                break
            count += 1
        return count * self.block_size

    def route(self, token_ids: list[int], loads: list[int]) -> int:
        """The replica for a prompt given each replica's outstanding work (tokens);
        records the prompt's full blocks as sent there."""
        hashes = prompt_block_hashes(token_ids, self.block_size, self.root)
        usable = hashes[: (len(token_ids) - 1) // self.block_size]  # the last token always runs
        replica = min(range(len(loads)),
                      key=lambda r: (loads[r] - self.matched_tokens(r, usable), loads[r], r))
        sent = self._sent[replica]
        for block_hash in hashes:
            sent[block_hash] = None
            sent.move_to_end(block_hash)
        while len(sent) > self.capacity_blocks:
            sent.popitem(last=False)
        return replica
