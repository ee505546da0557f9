"""CPU kernels: accuracy against float64 references and bitwise batch invariance."""

from __future__ import annotations

import pytest
import torch

from megaserve.kernels import cpu
from megaserve.kernels.api import KV_SPLIT_SIZE

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(64, 96), (100, 7), (256, 512)])
def test_linear_accuracy_and_row_invariance(dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(70, k, generator=g).to(dtype)
    out = cpu.linear(x, w, bias)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, x.double() @ w.double().T + bias.double()) < TOL[dtype]
    for m in (1, 2, 3, 15, 16, 17, 33, 70):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for r in {0, m // 2, m - 1}:
                batch = torch.randn(m, k, generator=g).to(dtype)
                batch[r] = x[5]
                assert torch.equal(cpu.linear(batch, w, bias)[r], out[5]), (m, r, threads)
    torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_accuracy_invariance_and_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=g).to(dtype)
    res = torch.randn(40, 96, generator=g).to(dtype)
    w = torch.rand(96, generator=g).to(dtype)
    h = (x + res).double()
    ref = w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    y, h_out = cpu.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(h_out, x + res)
    assert rel_err(y, ref) < TOL[dtype]
    for m in (1, 3, 40):
        assert torch.equal(cpu.rms_norm(x[:m], w, 1e-6, residual=res[:m])[0][m - 1], y[m - 1])


def _paged_setup(lengths, dtype, block_size=16, heads=(8, 2), head_dim=32, seed=0,
                 poison=False):
    """A KV cache holding `lengths` tokens per sequence in shuffled blocks; with ``poison``
    every slot no sequence owns (and the tail of each last block) is NaN."""
    g = torch.Generator().manual_seed(seed)
    hkv = heads[1]
    blocks_per = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    tables = torch.zeros(len(lengths), max(blocks_per), dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for s, nb in enumerate(blocks_per):
        ids = [perm.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        for p in range(lengths[s]):
            owned[ids[p // block_size] * block_size + p % block_size] = True
    if poison:
        k_cache.view(-1, hkv, head_dim)[~owned] = float("nan")
        v_cache.view(-1, hkv, head_dim)[~owned] = float("nan")
    return k_cache, v_cache, tables


def _reference_attention(q, k_cache, v_cache, table, length, positions, scale):
    k = k_cache[table.long()].reshape(-1, *k_cache.shape[2:])[:length].double()
    v = v_cache[table.long()].reshape(-1, *v_cache.shape[2:])[:length].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->thl", q.double(), k) * scale
    mask = torch.arange(length)[None, :] > positions[:, None]
    scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_accuracy_and_chunk_invariance(dtype):
    lengths = [1, 45, 2 * KV_SPLIT_SIZE + 9]
    k_cache, v_cache, tables = _paged_setup(lengths, dtype)
    g = torch.Generator().manual_seed(1)
    scale = 32**-0.5
    qs = [torch.randn(n, 8, 32, generator=g).to(dtype) for n in lengths]
    # Full prefill of every sequence in one call.
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    full = cpu.paged_attention(torch.cat(qs), k_cache, v_cache, tables,
                               torch.tensor(lengths, dtype=torch.int32), starts, scale)
    for s, n in enumerate(lengths):
        ref = _reference_attention(qs[s], k_cache, v_cache, tables[s], n, torch.arange(n), scale)
        assert rel_err(full[starts[s]:starts[s + 1]], ref) < TOL[dtype]
    # The longest sequence again: as decode steps and as chunked prefill of several sizes.
    s, n = 2, lengths[2]
    expected = full[starts[s]:starts[s + 1]]
    for chunk in (1, 7, KV_SPLIT_SIZE, 100):
        for begin in range(0, n, chunk):
            end = min(begin + chunk, n)
            part = cpu.paged_attention(
                qs[s][begin:end], k_cache, v_cache, tables[s:s + 1],
                torch.tensor([end], dtype=torch.int32), torch.tensor([0, end - begin], dtype=torch.int32),
                scale,
            )
            assert torch.equal(part, expected[begin:end]), (chunk, begin)


def test_topk_route_stable_ties_and_renormalisation():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    ids, weights = cpu.topk_route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    probs = torch.softmax(logits.double(), -1)
    assert torch.allclose(weights.double(), probs.gather(1, ids), atol=1e-7)
    ids, weights = cpu.topk_route(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(2)) and weights.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_composed_projections_are_their_compositions(dtype):
    """linear_rms_norm and route (one launch's worth of work on the GPU) give the bits of
    the calls they compose, through the API's dispatch."""
    from megaserve import kernels

    torch.manual_seed(3)
    x = torch.randn(5, 128).to(dtype)
    w = (torch.randn(64, 128) / 12).to(dtype)
    nw, res = torch.randn(64).to(dtype), torch.randn(5, 64).to(dtype)
    got = kernels.linear_rms_norm(x, w, nw, 1e-6, res)
    want = cpu.rms_norm(cpu.linear(x, w), nw, 1e-6, res)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = kernels.route(x, w, 4, True)
    want = cpu.topk_route(cpu.linear(x, w), 4, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_ffn_accuracy_and_invariance(dtype):
    g = torch.Generator().manual_seed(2)
    e, d, inter = 4, 64, 48
    w_gate_up = (torch.randn(e, 2 * inter, d, generator=g) / 8).to(dtype)
    w_down = (torch.randn(e, d, inter, generator=g) / 8).to(dtype)
    x = torch.randn(30, d, generator=g).to(dtype)
    ids = torch.randint(0, e, (30,), generator=g)
    out = cpu.expert_ffn(x, ids, w_gate_up, w_down)
    gu = torch.einsum("rd,rkd->rk", x.double(), w_gate_up[ids].double())
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    ref = torch.einsum("ri,rdi->rd", act, w_down[ids].double())
    assert rel_err(out, ref) < 2 * TOL[dtype]
    for r in (0, 13, 29):
        assert torch.equal(cpu.expert_ffn(x[r:r + 1], ids[r:r + 1], w_gate_up, w_down)[0], out[r])
    # rows_per_token: row r reads token row r // k; the expanded call's bits.
    for num_tokens, k in ((10, 1), (10, 3), (1, 2)):
        ids_k = torch.randint(0, e + 1, (num_tokens * k,), generator=g)  # e: routed nowhere
        keep = ids_k < e
        tokens = x[:num_tokens]
        want = cpu.expert_ffn(tokens.repeat_interleave(k, 0), ids_k, w_gate_up, w_down)
        got = cpu.expert_ffn(tokens, ids_k, w_gate_up, w_down, rows_per_token=k)
        assert got.shape == want.shape and torch.equal(got[keep], want[keep])
    with pytest.raises(ValueError, match="rows_per_token"):
        cpu.expert_ffn(x[:4], ids[:9], w_gate_up, w_down, rows_per_token=2)


def test_combine_fixed_order_fp32():
    g = torch.Generator().manual_seed(3)
    out = torch.randn(5, 3, 8, generator=g).bfloat16()
    w = torch.rand(5, 3, generator=g)
    got = cpu.combine(out, w)
    assert got.dtype == torch.float32
    expected = (w[:, 0:1] * out[:, 0].float() + w[:, 1:2] * out[:, 1].float()) + w[:, 2:3] * out[:, 2].float()
    assert torch.equal(got, expected)


def test_log_softmax_accuracy_and_invariance():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 1000, generator=g) * 5
    got = cpu.log_softmax(logits)
    assert rel_err(got, torch.log_softmax(logits.double(), -1)) < 1e-6
    assert torch.equal(cpu.log_softmax(logits[3:4])[0], got[3])
    greedy = torch.full((9,), -1, dtype=torch.int64)
    assert torch.equal(cpu.log_softmax(logits, greedy), got)
    assert torch.equal(greedy, got.argmax(-1))


def test_log_softmax_into_rows_of_a_buffer():
    """``out=``: the first rows of a reused buffer receive the same bits; bad buffers are
    refused with ValueError (kernels.api checks them for every backend)."""
    from megaserve import kernels

    logits = torch.randn(5, 700, generator=torch.Generator().manual_seed(9)) * 4
    buffer = torch.full((8, 700), float("nan"))
    got = kernels.log_softmax(logits[:3], out=buffer[:3])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, cpu.log_softmax(logits[:3]))
    assert buffer[3:].isnan().all()
    for bad in (buffer[:4], buffer[:3].double(), buffer[:3, :350], buffer[:3].t().contiguous().t()):
        with pytest.raises(ValueError, match="out must be"):
            kernels.log_softmax(logits[:3], out=bad)


def test_embed_tokens_from_tokens_or_sampled():
    table = torch.randn(20, 8)
    rows = torch.tensor([[3, 1], [7, -1], [19, 0]], dtype=torch.int32)
    out = cpu.embed_tokens(table, rows[:, 0], rows[:, 1], torch.tensor([5, 6]))
    assert torch.equal(out, table[[6, 7, 5]])
    with pytest.raises(ValueError, match="both"):
        cpu.embed_tokens(table, rows[:, 0], rows[:, 1])


def test_counter_uniform_is_a_pure_function():
    seeds = torch.tensor([1, 2, 2**40 + 1])
    pos = torch.tensor([0, 5, 5])
    u = cpu.counter_uniform(seeds, pos, 64)
    assert ((u > 0) & (u < 1)).all()
    assert torch.equal(cpu.counter_uniform(seeds[1:2], pos[1:2], 64)[0], u[1])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[1], u[2])
    big = cpu.counter_uniform(torch.tensor([9]), torch.tensor([3]), 20000)[0]
    assert abs(big.mean().item() - 0.5) < 0.01


def test_sample_is_row_invariant_and_respects_filters():
    g = torch.Generator().manual_seed(5)
    lp = cpu.log_softmax(torch.randn(6, 50, generator=g) * 2)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.0, 1.0, 1.3])
    top_k = torch.tensor([0, 0, 3, 0, 0, 1])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3, 0.0])
    seeds = torch.arange(6) * 1000
    pos = torch.arange(6) + 10
    tokens = cpu.sample(lp, temps, top_k, top_p, min_p, seeds, pos)
    assert tokens[0] == lp[0].argmax() and tokens[5] == lp[5].argmax()
    assert tokens[2] in torch.topk(lp[2], 3).indices
    assert lp[4, tokens[4]].exp() >= 0.3 * lp[4].exp().max()
    for r in range(6):
        alone = cpu.sample(lp[r:r + 1], temps[r:r + 1], top_k[r:r + 1], top_p[r:r + 1],
                           min_p[r:r + 1], seeds[r:r + 1], pos[r:r + 1])
        assert alone[0] == tokens[r]
    # The draw follows the distribution: frequencies over many positions.
    n = 3000
    row = lp[1:2].expand(n, -1)
    draws = cpu.sample(row, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n),
                       torch.zeros(n), torch.full((n,), 7), torch.arange(n))
    freq = torch.bincount(draws, minlength=50).double() / n
    assert (freq - lp[1].double().exp()).abs().max() < 0.05
