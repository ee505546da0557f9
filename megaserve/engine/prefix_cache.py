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
