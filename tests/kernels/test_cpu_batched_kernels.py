"""The batched CPU kernels (attention over all tokens in one bmm, expert tiles): float64
accuracy, and bitwise row invariance across batch composition, chunking and tiles."""

from __future__ import annotations

import pytest
import torch

from megaserve.kernels import cpu
from megaserve.kernels.api import KV_SPLIT_SIZE

from .test_cpu_kernels import _paged_setup

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _reference(q, k_cache, v_cache, table, positions, scale):
    length = int(positions.max()) + 1
    k = k_cache[table.long()].reshape(-1, *k_cache.shape[2:])[:length].double()
    v = v_cache[table.long()].reshape(-1, *v_cache.shape[2:])[:length].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->thl", q.double(), k) * scale
    scores = scores.masked_fill(torch.arange(length)[None, :] > positions[:, None, None], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(scores, -1), v)


def _attend(q, k_cache, v_cache, tables, lengths, num_new, scale):
    starts = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    return cpu.paged_attention(q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32),
                               starts, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)])
def test_attention_token_alone_equals_token_in_any_batch(dtype, heads):
    hq, hkv = heads
    dh = 32
    lengths = [1, 17, KV_SPLIT_SIZE, KV_SPLIT_SIZE + 1, 3 * KV_SPLIT_SIZE + 5]
    k_cache, v_cache, tables = _paged_setup(lengths, dtype, heads=heads, head_dim=dh,
                                            poison=True)
    g = torch.Generator().manual_seed(7)
    qs = [torch.randn(n, hq, dh, generator=g).to(dtype) for n in lengths]
    scale = dh ** -0.5
    # Every sequence as a whole prefill, all in one batch.
    full = _attend(torch.cat(qs), k_cache, v_cache, tables, lengths, lengths, scale)
    assert not full.isnan().any()
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for s, n in enumerate(lengths):
        ref = _reference(qs[s], k_cache, v_cache, tables[s], torch.arange(n), scale)
        assert rel_err(full[offsets[s]:offsets[s + 1]], ref) < 2 * TOL[dtype]
    # Each token alone, as a decode step (context = its position + 1).
    for s, n in enumerate(lengths):
        for p in sorted({0, n // 2, n - 1}):
            alone = _attend(qs[s][p:p + 1], k_cache, v_cache, tables[s:s + 1], [p + 1], [1], scale)
            assert torch.equal(alone[0], full[offsets[s] + p]), (s, p)
    # A mixed batch: a chunk of one sequence, decodes of others, a chunk across a split
    # boundary, a decode deep in the longest sequence.
    runs = [(4, 10, 13), (0, 0, 0), (2, 63, 63), (3, 60, 64), (4, 196, 196)]  # (seq, first, last)
    got = _attend(torch.cat([qs[s][a:b + 1] for s, a, b in runs]), k_cache, v_cache,
                  torch.stack([tables[s] for s, _, _ in runs]), [b + 1 for _, _, b in runs],
                  [b + 1 - a for _, a, b in runs], scale)
    assert torch.equal(got, torch.cat([full[offsets[s] + a:offsets[s] + b + 1] for s, a, b in runs]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_ffn_row_invariant_across_tile_boundaries(dtype):
    g = torch.Generator().manual_seed(3)
    e, d, inter = 4, 64, 48
    tile = cpu.EXPERT_ROW_TILE
    w_gate_up = (torch.randn(e, 2 * inter, d, generator=g) / 8).to(dtype)
    w_down = (torch.randn(e, d, inter, generator=g) / 8).to(dtype)
    # Loads crossing the tile: expert 0 gets 1 row, 1 a full tile, 2 a tile + 1, 3 none.
    ids = torch.tensor([0] + [1] * tile + [2] * (tile + 1))
    ids = ids[torch.randperm(len(ids), generator=g)]
    x = torch.randn(len(ids), d, generator=g).to(dtype)
    out = cpu.expert_ffn(x, ids, w_gate_up, w_down)
    gu = torch.einsum("rd,rkd->rk", x.double(), w_gate_up[ids].double())
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    ref = torch.einsum("ri,rdi->rd", act, w_down[ids].double())
    assert rel_err(out, ref) < 2 * TOL[dtype]
    for r in (0, 5, len(ids) - 1):
        assert torch.equal(cpu.expert_ffn(x[r:r + 1], ids[r:r + 1], w_gate_up, w_down)[0], out[r])
    for m in (2, tile - 1, tile + 3, 2 * tile + 7):
        rows = torch.randperm(len(ids), generator=g)[:m]
        assert torch.equal(cpu.expert_ffn(x[rows], ids[rows], w_gate_up, w_down), out[rows]), m


def test_lanes_change_no_bits():
    """Spreading rows, expert tasks and query tokens over helper threads gives the same bits."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(70, 64, generator=g)
    e, d, inter = 4, 64, 48
    w_gate_up = torch.randn(e, 2 * inter, d, generator=g) / 8
    w_down = torch.randn(e, d, inter, generator=g) / 8
    ids = torch.randint(0, e, (70,), generator=g)
    lengths = [5, 70, 130]
    k_cache, v_cache, tables = _paged_setup(lengths, torch.float32, poison=True)
    q = torch.randn(sum(lengths), 8, 32, generator=g)

    def run():
        return (cpu.linear(x, w), cpu.expert_ffn(x, ids, w_gate_up, w_down),
                _attend(q, k_cache, v_cache, tables, lengths, lengths, 32 ** -0.5))

    one = run()
    try:
        cpu.set_num_lanes(3)
        three = run()
    finally:
        cpu.set_num_lanes(1)
    for a, b in zip(one, three):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="num_lanes"):
        cpu.set_num_lanes(0)
