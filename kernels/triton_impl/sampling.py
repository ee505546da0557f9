"""Counter-based RNG and batch-invariant sampling on CUDA.

Shape legend: B = rows (requests), V = vocabulary.

The uniforms use the same 32-bit hash as ``megaserve.kernels.cpu.counter_uniform`` in int64
arithmetic (every product stays below 2**59), so they equal the CPU draws bit for bit;
the contract only requires that they be a pure function of (seed, position, index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..filters import filter_row
from .rowwise import log_softmax


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    h = _mix32((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF))
    h = _mix32(h ^ (pos & 0xFFFFFFFF))
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    bits = _mix32(_mix32(((h ^ cols.to(tl.int64)) + 0x7F4A7C15) & 0xFFFFFFFF))
    u = (bits.to(tl.float64) + 0.5) / 4294967296.0
    tl.store(out_ptr + row * V + cols, u, mask=cols < V)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, positions `[B]` int64 → `[B, vocab_size]` float64 uniforms in (0, 1)."""
    b = seeds.shape[0]
    out = torch.empty(b, vocab_size, dtype=torch.float64, device=seeds.device)
    block = 1024
    if b and vocab_size:
        _uniform_kernel[(b, triton.cdiv(vocab_size, block))](
            seeds.long().contiguous(), positions.long().contiguous(), out, vocab_size,
            BLOCK=block, num_warps=4)
    return out


def sample(logprobs: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
           top_ps: torch.Tensor, min_ps: torch.Tensor, seeds: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """See ``megaserve.kernels.api.sample``: logprobs `[B, V]` float32 → tokens `[B]` int64.

    Greedy rows: argmax (first maximum). Sampled rows are processed one at a time with
    Gumbel-max over :func:`counter_uniform` noise (NOTE: this reads temperatures, top_ks,
    top_ps and min_ps on the host, so it is not CUDA-graph capturable; the engine passes
    them as host tensors, so the read is no stream synchronisation).
    """
    tokens = logprobs.argmax(dim=-1)
    params = torch.stack([temperatures.float(), top_ps.float(), min_ps.float()], 1).tolist()
    top_k_list = top_ks.tolist()
    vocab = logprobs.shape[1]
    for row, (temp, top_p, min_p) in enumerate(params):
        if temp <= 0:
            continue
        tempered = log_softmax(logprobs[row : row + 1] / temp)[0]
        filtered = filter_row(tempered, int(top_k_list[row]), top_p, min_p).double()
        u = counter_uniform(seeds[row : row + 1], positions[row : row + 1], vocab)[0]
        tokens[row] = torch.argmax(filtered - torch.log(-torch.log(u)))
    return tokens
