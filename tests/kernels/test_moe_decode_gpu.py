"""The expert FFN's launches on a CUDA GPU: a launch's K step (block_k 64/128/256, K
tails included), rows_per_token against the expanded rows, PDL on/off, and the prefill
launches' weight paths (TMA, gate and up in one dot, column-tile order) against pointer
loads, all bitwise.

Shape legend: T = tokens, k = top-k, R = T * k routed rows, E = experts, D = hidden,
I = expert intermediate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.poison import poisoned_empty

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _poison_allocator():
    """Poison freshly allocated memory: outputs must be fully written (NaN shows gaps)."""
    with poisoned_empty(cuda_only=True):
        yield


def _weights(e: int, d: int, i: int):
    wgu = torch.randn(e, 2 * i, d, device="cuda", dtype=BF16) / d**0.5
    wd = torch.randn(e, d, i, device="cuda", dtype=BF16) / i**0.5
    return wgu, wd


# (E, D, I): Qwen3-30B-A3B's experts, and K tails (D = 1000, I = 200: not multiples of 64).
SHAPES = [(128, 2048, 768), (8, 1000, 200)]


@pytest.mark.parametrize("e,d,i", SHAPES)
@pytest.mark.parametrize("r", [8, 64, 512, 2048])
def test_k_step_keeps_the_bits(e: int, d: int, i: int, r: int) -> None:
    """Each GEMM at block_k 128 and 256 equals the same tile at block_k 64 bitwise (and the
    planned launch), fused and unfused; float64 reference on a few rows."""
    from megaserve.kernels.triton_impl import expert_ffn, moe

    torch.manual_seed(e + d + r)
    wgu, wd = _weights(e, d, i)
    x = torch.randn(r, d, device="cuda", dtype=BF16)
    eids = torch.randint(0, e + 1, (r,), device="cuda")  # id e: routed nowhere
    routed = eids < e
    out = expert_ffn(x, eids, wgu, wd)
    assert not out[routed].isnan().any(), "routed rows left unwritten"
    for row in routed.nonzero()[:3, 0].tolist():
        g, u = (wgu[eids[row]].double() @ x[row].double()).chunk(2)
        ref = wd[eids[row]].double() @ (g * torch.sigmoid(g) * u)
        assert float((out[row].double() - ref).norm() / ref.norm()) < 1e-2, row
    T = moe.GemmTiles
    for up, down in [((16, 32, 4, 4), (16, 64, 4, 4)), ((64, 64, 4, 3), (64, 64, 4, 3)),
                     ((16, 64, 4, 3), (16, 128, 4, 3))]:
        k64 = expert_ffn(x, eids, wgu, wd, launch=moe.MoeLaunch(T(*up), T(*down)))
        assert torch.equal(k64[routed], out[routed]), f"{up} {down} at block_k 64"
        for bk in (128, 256):
            stages = 2 if bk == 256 else None  # shared memory: 2 stages of 256 of K
            lp = moe.MoeLaunch(T(*up[:3], stages or up[3], bk),
                               T(*down[:3], stages or down[3], bk))
            for fused in (True, False):
                got = expert_ffn(x, eids, wgu, wd, launch=lp, fused=fused)
                assert torch.equal(got[routed], k64[routed]), f"{lp} fused={fused}"


@pytest.mark.parametrize("e", [128, 8])
@pytest.mark.parametrize("r", [1, 8, 37, 64])
def test_inline_align_keeps_the_bits(e: int, r: int) -> None:
    """The GEMMs grouping the rows themselves (MoeLaunch.inline_align, no align launch)
    give the align launch's bits, pointer and TMA weights, ids of E (routed nowhere)
    included; the planned launch of a decode-sized call is inline."""
    from megaserve.kernels.triton_impl import expert_ffn, moe

    torch.manual_seed(e * 100 + r)
    d, i = 2048, 768
    wgu, wd = _weights(e, d, i)
    x = torch.randn(r, d, device="cuda", dtype=BF16)
    eids = torch.randint(0, e + 1, (r,), device="cuda")
    eids[: min(r, 3)] = torch.tensor([e, 1, 1][: min(r, 3)], device="cuda")
    routed = eids < e
    assert moe.plan_launch(r, e).inline_align == (r <= 4 * e)
    T = moe.GemmTiles
    for up, down in [(T(16, 32, 4, 3, 128), T(16, 128, 4, 3, 128)),
                     (T(16, 32, 4, 3, 128, tma=True, join=True), T(16, 64, 4, 3, 128, tma=True)),
                     (T(64, 64, 4, 4, 128), T(64, 128, 4, 4, 128))]:
        want = expert_ffn(x, eids, wgu, wd, launch=moe.MoeLaunch(up, down))
        assert not want[routed].isnan().any()
        for k in (1, r):
            if r % k == 0:
                got = expert_ffn(x[:: k], eids, wgu, wd, rows_per_token=k,
                                 launch=moe.MoeLaunch(up, down, inline_align=True))
                ref = want if k == 1 else expert_ffn(
                    x[::k], eids, wgu, wd, rows_per_token=k, launch=moe.MoeLaunch(up, down))
                assert torch.equal(got[routed], ref[routed]), f"{up} {down} k'={k}"


@pytest.mark.parametrize("top_k", [1, 8])
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
def test_rows_per_token_equals_expanded_rows(top_k: int, num_tokens: int) -> None:
    """expert_ffn(x [T, D], ids [T*k], rows_per_token=k) == the call on x's rows repeated
    k times, bitwise, every routed row written; LocalExperts.dispatch the same bits."""
    from megaserve.kernels.triton_impl import expert_ffn, moe
    from megaserve.models.expert_part import ExpertPart
    from megaserve.models.forward import LocalExperts

    e, d, i = 128, 2048, 768
    torch.manual_seed(num_tokens * 10 + top_k)
    wgu, wd = _weights(e, d, i)
    x = torch.randn(num_tokens, d, device="cuda", dtype=BF16)
    topk_ids = torch.stack([torch.randperm(e, device="cuda")[:top_k]
                            for _ in range(num_tokens)])  # [T, k] distinct per token
    ids = topk_ids.reshape(-1)  # [R]
    expanded = x[:, None].expand(num_tokens, top_k, d).reshape(-1, d)  # [R, D]
    want = expert_ffn(expanded, ids, wgu, wd)
    got = expert_ffn(x, ids, wgu, wd, rows_per_token=top_k)
    assert got.shape == (num_tokens * top_k, d) and not got.isnan().any()
    assert torch.equal(got, want)
    for lp in (moe.plan_launch(10**6), moe.plan_launch(1)):
        assert torch.equal(expert_ffn(x, ids, wgu, wd, rows_per_token=top_k, launch=lp), want)
    assert torch.equal(expert_ffn(x, ids, wgu, wd, rows_per_token=top_k, fused=False), want)
    part = ExpertPart(list(range(e)), e, {0: wgu}, {0: wd})
    assert torch.equal(LocalExperts(part).dispatch(0, 0, x, topk_ids),
                       want.view(num_tokens, top_k, d))


@pytest.mark.parametrize("t", [8, 16])  # 64 routed rows: inline grouping; 128: align launch
def test_pdl_keeps_the_bits_in_a_graph(monkeypatch: pytest.MonkeyPatch, t: int) -> None:
    """The MoE launches with and without PDL (captured back to back in a CUDA graph,
    layer after layer, as decode runs them) give the same bits as eager launches. Every
    kernel launches with it here (moe.PDL_KERNELS may leave some out)."""
    from megaserve.kernels.triton_impl import expert_ffn, moe, pdl, topk_route

    monkeypatch.setattr(moe, "PDL_KERNELS", frozenset({"topk", "align", "up", "down"}))

    e, d, i, k = 128, 2048, 768, 8
    torch.manual_seed(3)
    layers = [_weights(e, d, i) for _ in range(3)]
    x = torch.randn(t, d, device="cuda", dtype=BF16)
    logits = torch.randn(t, e, device="cuda")

    def step():
        h = x
        for wgu, wd in layers:
            ids, _ = topk_route(logits, k, True)
            h = expert_ffn(h, ids.reshape(-1), wgu, wd, rows_per_token=k).view(t, k, d)[:, 0]
        return h

    results = {}
    for on in ("1", "0"):
        monkeypatch.setenv(pdl.ENV, on)
        eager = step().clone()
        step()  # compiled outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"PDL={on}: graph replay differs from eager"
        results[on] = eager
    assert torch.equal(results["1"], results["0"])


def _prefill_launches():
    """Prefill launches of every weight path (TMA, gate and up in one dot, column-tile
    order, K steps 64/128, 64- and 128-row tiles, 64-row tail tiles), and the planned one."""
    from megaserve.kernels.triton_impl import moe

    T = moe.GemmTiles
    return [
        moe.MoeLaunch(T(128, 64, 4, 3, 64, tma=True), T(128, 128, 4, 3, 64, tma=True)),
        moe.MoeLaunch(T(128, 128, 8, 3, 64, tma=True, join=True),
                      T(128, 256, 8, 3, 64, tma=True)),
        moe.MoeLaunch(T(64, 128, 4, 4, 64, tma=True, join=True, n_major=True),
                      T(64, 256, 4, 3, 64, tma=True)),
        moe.MoeLaunch(T(128, 64, 4, 3, 128, tma=True, join=True),
                      T(128, 128, 8, 3, 128, tma=True)),
        moe.MoeLaunch(T(128, 128, 8, 4, 64, tma=True, join=True, n_major=True, tail_m=64),
                      T(128, 256, 8, 4, 64, tma=True, tail_m=32)),
        moe.plan_launch(10**9)]


# The prefill launch before TMA (pointer loads, K step 64): the reference bits.
_POINTER_PREFILL = ((128, 64, 4, 3), (128, 128, 4, 3))


def _skewed_topk(num_tokens: int, e: int, k: int) -> torch.Tensor:
    """`[T, k]` distinct experts per token, ragged: the lower half of the experts get no
    rows, the upper ones more and more (expert e - 1 the most)."""
    p = torch.arange(e, device="cuda", dtype=torch.float32) - (e // 2 - 1)
    p = p.clamp(min=0) ** 2
    return torch.multinomial(p.repeat(num_tokens, 1), k, replacement=False)


@pytest.mark.parametrize("e,d,i,num_tokens,k,skewed", [
    (128, 2048, 768, 4096, 8, True),   # Qwen3-30B-A3B at a 4096-token prefill, ragged
    (128, 2048, 768, 4096, 8, False),  # the same, uniform routing
    (8, 1000, 200, 3001, 1, False),    # K and I tails, odd R, rows routed nowhere
    (8, 1004, 196, 2049, 2, True),     # rows not 16-byte aligned: TMA falls back to pointers
])
def test_prefill_launches_keep_the_bits(e: int, d: int, i: int, num_tokens: int, k: int,
                                        skewed: bool) -> None:
    """Every prefill launch (TMA weights, joined gate/up, column-tile order) equals the
    pointer-load launch at K step 64 bitwise on every routed row, fused and unfused; a
    subset of the tokens (a decode-sized call, other tiles) gives its rows' bits; float64
    reference on a few rows."""
    from megaserve.kernels.triton_impl import expert_ffn, moe

    torch.manual_seed(e + d + num_tokens)
    wgu, wd = _weights(e, d, i)
    x = torch.randn(num_tokens, d, device="cuda", dtype=BF16)
    if skewed:
        ids = _skewed_topk(num_tokens, e, k).reshape(-1)  # [R]
    else:
        ids = torch.randint(0, e + 1, (num_tokens * k,), device="cuda")  # e: nowhere
    routed = ids < e
    T = moe.GemmTiles
    ref = expert_ffn(x, ids, wgu, wd, rows_per_token=k, launch=moe.MoeLaunch(
        T(*_POINTER_PREFILL[0]), T(*_POINTER_PREFILL[1])))
    assert not ref[routed].isnan().any(), "routed rows left unwritten"
    counts = torch.bincount(ids, minlength=e + 1)[:e]
    if skewed:
        assert int((counts == 0).sum()) >= e // 2 - 1 and int(counts.max()) > 2 * 128
    for row in routed.nonzero()[:: max(1, int(routed.sum()) // 4), 0][:4].tolist():
        g, u = (wgu[ids[row]].double() @ x[row // k].double()).chunk(2)
        want = wd[ids[row]].double() @ (g * torch.sigmoid(g) * u)
        assert float((ref[row].double() - want).norm() / want.norm()) < 1e-2, row
    for n, lp in enumerate(_prefill_launches()):
        got = expert_ffn(x, ids, wgu, wd, rows_per_token=k, launch=lp)
        assert torch.equal(got[routed], ref[routed]), f"{lp}"
        if n == 1:
            unfused = expert_ffn(x, ids, wgu, wd, rows_per_token=k, launch=lp, fused=False)
            assert torch.equal(unfused[routed], ref[routed]), f"{lp} unfused"
    sub = num_tokens // 40  # a few rows per expert: a decode bucket's tiles
    got = expert_ffn(x[:sub], ids[: sub * k], wgu, wd, rows_per_token=k)
    assert torch.equal(got[routed[: sub * k]], ref[: sub * k][routed[: sub * k]])


def _untailed(tiles):
    return dataclasses.replace(tiles, tail_m=0)


@pytest.mark.parametrize("e,d,i,k,counts", [
    # Qwen3-30B-A3B's experts; every remainder class of a 128-row tile around 64 and 128
    (128, 2048, 768, 8, [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257,
                         319, 320, 321, 385]),
    (8, 1000, 200, 2, [0, 1, 64, 129, 257, 321, 1025, 2000]),  # K and I tails, few experts
])
def test_prefill_tail_tiles_keep_the_bits(e: int, d: int, i: int, k: int,
                                          counts: list[int]) -> None:
    """The prefill launch with tail tiles (an expert's last tile, at most tail_m rows left,
    with tail_m rows) equals the launch without them and the pointer-load launch bitwise
    on ragged counts (experts cycle through ``counts``; rows routed nowhere too), fused
    and unfused; decode launches have no tail tiles."""
    from megaserve.kernels.triton_impl import expert_ffn, moe

    torch.manual_seed(e + d)
    wgu, wd = _weights(e, d, i)
    per_expert = torch.tensor([counts[j % len(counts)] for j in range(e)])
    ids = torch.repeat_interleave(torch.arange(e), per_expert)
    nowhere = k + (-ids.numel()) % k  # id e: routed nowhere
    ids = torch.cat([ids, torch.full((nowhere,), e)])
    ids = ids[torch.randperm(ids.numel())].cuda()  # [R]
    routed = ids < e
    x = torch.randn(ids.numel() // k, d, device="cuda", dtype=BF16)
    planned = moe.plan_launch(ids.numel(), e)
    for rows in (1, 64, 512, 64 * e):
        lp = moe.plan_launch(rows, e)
        assert not lp.up.tail_m and not lp.down.tail_m
    T = moe.GemmTiles
    up, down = _untailed(planned.up), _untailed(planned.down)
    ref = expert_ffn(x, ids, wgu, wd, rows_per_token=k, launch=moe.MoeLaunch(up, down))
    assert not ref[routed].isnan().any(), "routed rows left unwritten"
    pointer = expert_ffn(x, ids, wgu, wd, rows_per_token=k, launch=moe.MoeLaunch(
        T(*_POINTER_PREFILL[0]), T(*_POINTER_PREFILL[1])))
    assert torch.equal(pointer[routed], ref[routed])
    for row in routed.nonzero()[:: max(1, int(routed.sum()) // 4), 0][:4].tolist():
        g, u = (wgu[ids[row]].double() @ x[row // k].double()).chunk(2)
        want = wd[ids[row]].double() @ (g * torch.sigmoid(g) * u)
        assert float((ref[row].double() - want).norm() / want.norm()) < 1e-2, row
    launches = [
        planned,
        moe.MoeLaunch(dataclasses.replace(up, tail_m=64), dataclasses.replace(down, tail_m=64)),
        moe.MoeLaunch(dataclasses.replace(up, tail_m=32), dataclasses.replace(down, tail_m=32)),
        moe.MoeLaunch(T(64, 128, 4, 4, tma=True, join=True, tail_m=32),
                      T(64, 256, 4, 3, tma=True, n_major=True, tail_m=16))]
    for lp in launches:
        for fused in (True, False):
            got = expert_ffn(x, ids, wgu, wd, rows_per_token=k, launch=lp, fused=fused)
            assert not got[routed].isnan().any(), f"{lp} left rows unwritten"
            assert torch.equal(got[routed], ref[routed]), f"{lp} fused={fused}"
