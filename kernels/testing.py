"""Helpers that benchmarks, experiments (``lab/``) and tests share: kernel timing and
random paged-attention inputs.

Shape legend: S = sequences, L = context tokens of each sequence, n = new (query) tokens of
each sequence, Hq / Hkv = query / KV heads, Dh = head dim, B = blocks in the pool,
b = block size, W = blocks a sequence's table holds.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

BLOCK_SIZE = 16


def time_ms(fn: Callable[[], object], graph: bool = True) -> float:
    """Median milliseconds of one call of ``fn`` on the current CUDA device.

    ``fn`` runs once first (compilation, allocation) outside any timing. With ``graph``
    (default) the median is over replays of a CUDA graph of ``fn``, so host launch cost is
    excluded, as in a graph-captured decode step; ``graph=False`` times eager calls.
    Raises ``RuntimeError`` without a CUDA device.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("time_ms times CUDA work and needs a CUDA device; none is visible")
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


class PagedInputs(NamedTuple):
    """Inputs of ``paged_attention`` over a shuffled block pool, and the same K/V dense.

    Unpacks in ``paged_attention``'s argument order (then the dense K/V).
    """

    q: object  #: `[S * n, Hq, Dh]`, the new tokens' queries
    k_cache: object  #: `[B, b, Hkv, Dh]`
    v_cache: object  #: `[B, b, Hkv, Dh]`
    block_table: object  #: `[S, W]` int32, a random permutation of the pool's blocks
    context_lens: object  #: `[S]` int32, every entry L
    query_start_loc: object  #: `[S + 1]` int32, 0, n, 2n, ...
    k_dense: object  #: `[S, Hkv, L, Dh]`, each sequence's keys contiguous (for SDPA)
    v_dense: object  #: `[S, Hkv, L, Dh]`


def paged_inputs(num_seqs: int, ctx: int, new: int, hq: int, hkv: int, dh: int, dtype,
                 device: str = "cuda", block_size: int = BLOCK_SIZE) -> PagedInputs:
    """Random paged-attention inputs: ``num_seqs`` sequences of ``ctx`` context tokens, the
    last ``new`` of which are queries, K/V in a pool of ``block_size``-token blocks placed
    by a random block table. Values are drawn from the current torch RNG (seed it for
    reproducible inputs). Raises ``ValueError`` on non-positive sizes, ``new > ctx`` or
    ``hq`` not a multiple of ``hkv``.
    """
    import torch

    if min(num_seqs, ctx, new, hq, hkv, dh, block_size) < 1:
        raise ValueError(f"paged_inputs: every size must be >= 1, got num_seqs={num_seqs}, "
                         f"ctx={ctx}, new={new}, hq={hq}, hkv={hkv}, dh={dh}, "
                         f"block_size={block_size}")
    if new > ctx:
        raise ValueError(f"paged_inputs: new={new} query tokens exceed the context ctx={ctx}")
    if hq % hkv:
        raise ValueError(f"paged_inputs: hq={hq} query heads are not a multiple of hkv={hkv}")
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, hkv, dh, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=device).int().view(num_seqs, blocks_per_seq)
    q = torch.randn(num_seqs * new, hq, dh, device=device, dtype=dtype)
    context_lens = torch.full((num_seqs,), ctx, device=device, dtype=torch.int32)
    query_start_loc = torch.arange(0, num_seqs * new + 1, new, device=device, dtype=torch.int32)
    k_dense = k_cache[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v_dense = v_cache[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    return PagedInputs(q, k_cache, v_cache, table, context_lens, query_start_loc, k_dense, v_dense)
