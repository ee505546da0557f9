"""kernels.testing: the paged inputs describe one K/V two ways, and bad sizes are refused."""

from __future__ import annotations

import pytest
import torch

from megaserve.kernels.testing import PagedInputs, paged_inputs, time_ms


def test_dense_kv_is_the_paged_cache_read_through_the_block_table():
    torch.manual_seed(0)
    num_seqs, ctx, new, hq, hkv, dh, bs = 3, 37, 5, 4, 2, 8, 16
    inp = paged_inputs(num_seqs, ctx, new, hq, hkv, dh, torch.float32, device="cpu", block_size=bs)
    assert isinstance(inp, PagedInputs)
    assert inp.q.shape == (num_seqs * new, hq, dh)
    assert inp.block_table.dtype == torch.int32 and inp.block_table.shape == (num_seqs, 3)
    assert sorted(inp.block_table.flatten().tolist()) == list(range(9))  # every block once
    assert inp.context_lens.tolist() == [ctx] * num_seqs
    assert inp.query_start_loc.tolist() == [0, 5, 10, 15]
    for s in range(num_seqs):
        for pos in (0, 15, 16, ctx - 1):
            block = int(inp.block_table[s, pos // bs])
            for cache, dense in ((inp.k_cache, inp.k_dense), (inp.v_cache, inp.v_dense)):
                assert torch.equal(dense[s, :, pos], cache[block, pos % bs])
    q, k_cache, v_cache, table, lens, qsl, k_dense, v_dense = inp  # paged_attention's order
    assert k_dense.shape == v_dense.shape == (num_seqs, hkv, ctx, dh)


@pytest.mark.parametrize("args, match", [
    ((0, 8, 1, 4, 2, 8), "must be >= 1"),
    ((1, 8, 9, 4, 2, 8), "exceed the context"),
    ((1, 8, 1, 3, 2, 8), "not a multiple"),
])
def test_bad_sizes_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        paged_inputs(*args, torch.float32, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_time_ms_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        time_ms(lambda: None)
