"""Paged KV cache: the block pool (ids, reference counts, prefix cache) and the per-layer
tensors.

NOTE: block ids never influence numerics. A token's K/V lives at slot
``block_id * block_size + offset`` and attention reads slots through the sequence's block
table, so which blocks a sequence gets (and hence preemption, prefix-cache hits, or other
requests) cannot change its output.

    block table of a sequence       cache tensor [num_blocks, block_size, Hkv, Dh]
    [7, 2, 9]  ─────────────────▶   block 7: tokens 0..15
                                    block 2: tokens 16..31
                                    block 9: tokens 32..(len-1), rest unused

Prefix caching (megaserve.engine.prefix_cache): a full, computed block can be registered
under its chained hash. When its last reference goes it stays cached but counts as free:

    free queue (eviction order) ─▶ [ 4 | 11 | 3* | 8* ]   * = cached, reusable by hash
                                     ▲ allocate() pops here; a cached block popped is
                                       evicted (its hash forgotten) at that moment
    free() appends at the tail; share() of a cached free block takes it out of the queue.

A block with references is never in the queue, so eviction can never free a block in
use; full blocks are never written again, so copy-on-write is never needed.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class BlockPool:
    """Fixed set of KV blocks with reference counts and a hash → block prefix cache.

    Checks are separate from changes: ``can_allocate`` / ``lookup`` / ``num_evictable``
    change nothing; ``allocate`` / ``share`` / ``free`` / ``cache`` do.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # Blocks without references, least recently freed first (the eviction order).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks nobody references, cached ones included (they are reusable)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (reference count 1), evicting cached ones in LRU
        order. Call :meth:`can_allocate` first."""
        if count > len(self._free):
            raise RuntimeError(f"allocating {count} KV blocks with {len(self._free)} free")
        blocks = []
        for _ in range(count):
            b, _ = self._free.popitem(last=False)
            block_hash = self._hash_of.pop(b, None)
            if block_hash is not None:
                del self._by_hash[block_hash]
                self.num_evictions += 1
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add a reference to each block: one in use (prefix sharing), or a cached free
        block (a prefix-cache hit), which leaves the free queue."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                assert b in self._hash_of, f"sharing free uncached block {b}"
                del self._free[b]
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks reaching zero join the free queue's tail
        in the given order (pass a sequence's blocks last-first, so that the ends of
        prompts are evicted before the prefixes they share)."""
        for b in blocks:
            assert self._ref_counts[b] > 0, f"double free of block {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    # -- prefix cache -------------------------------------------------------------------

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of ``block_hashes``."""
        blocks = []
        for block_hash in block_hashes:
            b = self._by_hash.get(block_hash)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (sharing them uses free blocks)."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full block whose K/V are computed, in use by the caller. A hash
        already cached under another block (two sequences computed the same prefix) keeps
        the first block; this one stays private and is freed as usual."""
        assert self._ref_counts[block] > 0, f"caching unreferenced block {block}"
        if block_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self._by_hash.clear()
        self._hash_of.clear()


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    shared_kv: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer a (k, v) pair of `[num_blocks, block_size, Hkv, Dh]` tensors; with
    ``shared_kv`` (MLA's latent cache) the pair is one tensor twice."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    pairs = []
    for _ in range(num_layers):
        k = torch.zeros(shape, dtype=dtype, device=device)
        pairs.append((k, k if shared_kv else torch.zeros(shape, dtype=dtype, device=device)))
    return pairs


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
