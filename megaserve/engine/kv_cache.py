"""Paged KV cache: the block pool (ids, reference counts) and the per-layer tensors.

NOTE: block ids never influence numerics. A token's K/V lives at slot
``block_id * block_size + offset`` and attention reads slots through the sequence's block
table, so which blocks a sequence gets (and hence preemption, or other requests) cannot
change its output.

    block table of a sequence       cache tensor [num_blocks, block_size, Hkv, Dh]
    [7, 2, 9]  ─────────────────▶   block 7: tokens 0..15
                                    block 2: tokens 16..31
                                    block 9: tokens 32..(len-1), rest unused
"""

from __future__ import annotations

from collections import deque

import torch


class BlockPool:
    """Fixed set of KV blocks with reference counts. Checks are separate from changes."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (reference count 1). Call :meth:`can_allocate` first."""
        if count > len(self._free):
            raise RuntimeError(f"allocating {count} KV blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add a reference to blocks already in use (prefix sharing)."""
        for b in blocks:
            assert self._ref_counts[b] > 0, f"sharing free block {b}"
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks reaching zero return to the pool."""
        for b in blocks:
            assert self._ref_counts[b] > 0, f"double free of block {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer a (k, v) pair of `[num_blocks, block_size, Hkv, Dh]` tensors."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
