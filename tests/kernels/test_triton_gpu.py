"""Triton kernels on a CUDA GPU: float64 references, poisoned outputs, bitwise invariance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.poison import poisoned_empty

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.fixture(autouse=True)
def _poison_allocator():
    """Poison freshly allocated memory: outputs must be fully written (NaN shows gaps)."""
    with poisoned_empty(cuda_only=True):
        yield


@pytest.mark.parametrize("k,n", [(4096, 14336), (2048, 7168), (7168, 2048), (1024, 96)])
def test_linear_reference_and_row_invariance(k: int, n: int) -> None:
    from megaserve.kernels.triton_impl import linear

    torch.manual_seed(k + n)
    w = torch.randn(n, k, device="cuda", dtype=BF16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=BF16)
    x_all = torch.randn(4096, k, device="cuda", dtype=BF16)
    full = linear(x_all, w, b)
    assert not full.isnan().any()
    ref = x_all[:64].double() @ w.double().T + b.double()
    assert _rel_err(full[:64], ref) < 1e-2
    gen = torch.Generator().manual_seed(1)
    for m in [1, 2, 3, 7, 16, 63, 64, 65, 100, 128, 129, 200, 511, 1000, 2047, 4096]:
        rows = torch.randperm(4096, generator=gen)[:m].cuda()
        out = linear(x_all[rows], w, b)
        assert not out.isnan().any(), f"M={m}: unwritten or NaN output"
        assert torch.equal(out, full[rows]), f"M={m}: rows differ from the M=4096 batch"
    # Every launch the planner can pick (tile shapes, swap, parallel fold): fold's bits.
    from megaserve.kernels.triton_impl.matmul import _TALL, Launch, config_for, small_k_rule

    launches = list(_TALL.values()) + [
        Launch("swap", 128, num_warps=4, num_stages=4),
        Launch("swap", 128, num_warps=4, num_stages=4, fold_last=False),
        Launch("swap", 64, num_warps=4, num_stages=3)]
    rule = small_k_rule()
    if rule is not None and k <= rule.max_k:  # the small-K rule's decode launches
        launches += [lp for _, lp in rule.swap]
    if config_for(n, k, BF16).split_len % 128 == 0:  # a launch's own K step: same k16 chain
        launches += [Launch("swap", 64, num_warps=4, block_k=128),
                     Launch("fold", 64, 128, 4, 3, block_k=128)]
    for m in (5, 33, 64, 100, 300):
        fold = linear(x_all[:m], w, b, mode="fold")
        for lp in launches:
            if lp.mode != "swap" or m <= 64:
                assert torch.equal(linear(x_all[:m], w, b, launch=lp), fold), f"M={m}: {lp}"


def test_rms_norm_and_rowwise() -> None:
    from megaserve.kernels.triton_impl import combine, log_softmax, rms_norm, silu_and_mul

    x = torch.randn(300, 4096, device="cuda", dtype=BF16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    y, h = rms_norm(x, w, 1e-5, res)
    hd = (x + res).double()
    ref = w.double() * hd * torch.rsqrt((hd * hd).mean(-1, keepdim=True) + 1e-5)
    assert _rel_err(y, ref) < 1e-2 and not y.isnan().any()
    assert torch.equal(rms_norm(x[7:9], w, 1e-5, res[7:9])[0], y[7:9])
    gu = torch.randn(33, 2 * 1408, device="cuda", dtype=BF16)
    g, u = gu.double().chunk(2, -1)
    assert _rel_err(silu_and_mul(gu), g * torch.sigmoid(g) * u) < 1e-2
    eo = torch.randn(50, 8, 2048, device="cuda", dtype=BF16)
    wt = torch.rand(50, 8, device="cuda")
    assert _rel_err(combine(eo, wt), (eo.double() * wt.double()[..., None]).sum(1)) < 1e-5
    logits = torch.randn(20, 151936, device="cuda") * 5
    lsm = log_softmax(logits)
    assert _rel_err(lsm, torch.log_softmax(logits.double(), -1)) < 1e-5
    assert torch.equal(log_softmax(logits[3:4]), lsm[3:4])
    # bf16 logits (the LM head's output); the greedy tokens are torch.argmax's (ties: the
    # first maximum), also across chunks
    half = logits.to(BF16)
    half[0, [70000, 150000, 900]] = 40.0
    half[1, 151935] = 40.0
    greedy = torch.full((20,), -1, dtype=torch.int64, device="cuda")
    lsm = log_softmax(half, greedy)
    assert _rel_err(lsm, torch.log_softmax(half.double(), -1)) < 1e-5
    assert torch.equal(log_softmax(half[3:5]), lsm[3:5])
    assert torch.equal(greedy, lsm.argmax(-1)) and greedy[:2].tolist() == [900, 151935]


@pytest.mark.parametrize("reload", [True, False])
@pytest.mark.parametrize("d,k", [(2048, 4096), (4096, 4096), (1024, 2048), (3072, 2048),
                                 (4096, 14336)])
def test_norm_folds_linear_parts(monkeypatch, reload: bool, d: int, k: int) -> None:
    """o_proj's split-K parts folded by the post-attention norm (decode rows, up to
    PARTS_MAX_M, and split launches' token-major parts at any M) give the folded linear's
    bits, row by row; the same for a router's parts folded by the top-k. ``reload=False`` reduces the folded row as it is (the kernels'
    PARTS_RELOAD knob): checked so that a layout that happens to match is known."""
    from megaserve.kernels.triton_impl import linear, matmul, rms_norm, rowwise, topk_route

    monkeypatch.setattr(rowwise, "PARTS_RELOAD", reload)
    torch.manual_seed(d + k)
    x = torch.randn(8, k, device="cuda", dtype=BF16)
    w = torch.randn(d, k, device="cuda", dtype=BF16) / k**0.5
    nw = torch.randn(d, device="cuda", dtype=BF16)
    res = torch.randn(8, d, device="cuda", dtype=BF16)
    routers = {e: torch.randn(e, k, device="cuda", dtype=BF16) / k**0.5
               for e in (8, 60, 128, 256)}
    for m in range(1, matmul.PARTS_MAX_M + 1):
        parts = matmul.linear_parts(x[:m], w)
        assert isinstance(parts, matmul.Parts), (d, k, m)  # these shapes split K
        got = rms_norm(parts, nw, 1e-6, res[:m])
        want = rms_norm(linear(x[:m], w), nw, 1e-6, res[:m])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (d, k, m)
        for e, wr in routers.items():
            for top_k, renorm in ((8, True), (2, False)):
                parts = matmul.linear_parts(x[:m], wr)
                if not isinstance(parts, matmul.Parts):
                    continue
                got = topk_route(parts, top_k, renorm)
                want = topk_route(linear(x[:m], wr), top_k, renorm)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (e, m)
    # split launches with a fold launch leave token-major parts at any M (the router and
    # o_proj of decode batches above 64)
    xs = torch.randn(300, k, device="cuda", dtype=BF16)
    rs = torch.randn(300, d, device="cuda", dtype=BF16)
    split = matmul.Launch("split", fold_last=False)
    for m in (65, 256, 300):
        parts = matmul.linear_parts(xs[:m], w, launch=split)
        assert isinstance(parts, matmul.Parts) and parts.token_major, (d, k, m)
        got = rms_norm(parts, nw, 1e-6, rs[:m])
        want = rms_norm(linear(xs[:m], w), nw, 1e-6, rs[:m])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (d, k, m)
        for e, wr in routers.items():
            got = topk_route(matmul.linear_parts(xs[:m], wr, launch=split), 8, True)
            want = topk_route(linear(xs[:m], wr), 8, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (e, m)


def test_embed_tokens_gpu() -> None:
    from megaserve.kernels.triton_impl import embed_tokens

    table = torch.randn(1000, 2048, device="cuda", dtype=BF16)
    rows = torch.tensor([[3, 2], [7, -1], [999, 0], [0, -1]], dtype=torch.int32, device="cuda")
    sampled = torch.tensor([11, 12, 13], device="cuda")
    out = embed_tokens(table, rows[:, 0], rows[:, 1], sampled)
    assert torch.equal(out, table[torch.tensor([13, 7, 11, 0], device="cuda")])


def test_paged_attention_decode_equals_prefill_and_chunks(monkeypatch) -> None:
    from megaserve.kernels.triton_impl import attention, paged_attention, write_kv_cache

    monkeypatch.setattr(attention, "POISON_BUFFERS", True)  # unwritten elements -> NaN
    torch.manual_seed(0)
    hq, hkv, dh, bs, length = 32, 8, 128, 16, 2500  # 3 chunks of 1024 keys
    kc = torch.randn(200, bs, hkv, dh, device="cuda", dtype=BF16)
    vc = torch.randn_like(kc)
    table = torch.randperm(200, device="cuda")[: -(-length // bs)].int()
    k = torch.randn(length, hkv, dh, device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    pos = torch.arange(length, device="cuda")
    write_kv_cache(k, v, kc, vc, table.long()[pos // bs] * bs + pos % bs)
    q = torch.randn(length, hq, dh, device="cuda", dtype=BF16)
    scale = dh**-0.5

    def run(rows: torch.Tensor, ctx: int) -> torch.Tensor:
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        qsl = torch.tensor([0, rows.shape[0]], device="cuda", dtype=torch.int32)
        return paged_attention(rows, kc, vc, table[None], lens, qsl, scale)

    full = run(q, length)
    kr, vr = k.double().repeat_interleave(4, 1), v.double().repeat_interleave(4, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kr) * scale
    s = s.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vr)
    assert _rel_err(full, ref) < 1e-2 and not full.isnan().any()
    for t in torch.randint(0, length, (12,)).tolist() + [0, 63, 64, length - 1]:
        assert torch.equal(run(q[t : t + 1], t + 1)[0], full[t]), f"decode token {t}"
    for chunk in (1, 37, 256, 512):
        outs = [run(q[a : a + chunk], min(a + chunk, length)) for a in range(0, length, chunk)]
        assert torch.equal(torch.cat(outs), full), f"chunked prefill, chunk {chunk}"
    # Chunk mode (few sequences' auto choice) and serial mode: same bits, mixed batch too.
    lens = torch.tensor([2500, 1, 64, 65, 1999, 1100], device="cuda", dtype=torch.int32)
    n_new = torch.tensor([1, 1, 64, 3, 1, 130], device="cuda", dtype=torch.int32)
    qsl = torch.cat([n_new.new_zeros(1), n_new.cumsum(0)]).int()
    tables = table[None].expand(6, -1).contiguous()
    qm = torch.randn(int(n_new.sum()), hq, dh, device="cuda", dtype=BF16)
    serial = paged_attention(qm, kc, vc, tables, lens, qsl, scale, mode="serial")
    got = paged_attention(qm, kc, vc, tables, lens, qsl, scale, mode="chunk")
    assert torch.equal(got, serial), "chunk"
    one_len = torch.tensor([length], device="cuda", dtype=torch.int32)
    one_qsl = torch.tensor([0, length], device="cuda", dtype=torch.int32)
    got = paged_attention(q, kc, vc, table[None], one_len, one_qsl, scale, mode="chunk")
    assert torch.equal(got, full), "chunk"
    # Tiles are a launch choice: 16-row (mma v2) and 64/128-row (wgmma) tiles, any warps
    # and pipeline depth, serial or chunk, give the same bits (module NOTE).
    from megaserve.kernels.triton_impl.attention import AttentionLaunch

    for launch in (AttentionLaunch("serial", 16, 4, 3), AttentionLaunch("serial", 32, 2, 2),
                   AttentionLaunch("serial", 64, 4, 2), AttentionLaunch("serial", 128, 8, 3),
                   AttentionLaunch("chunk", 16, 4, 3, fold_unroll=16),
                   AttentionLaunch("chunk", 64, 4, 2, fold_tokens=8),
                   # loop switches: unmasked full splits, block ids one ahead,
                   # long rows first, fold over head_dim chunks
                   AttentionLaunch("serial", 128, 8, 3, mask_tail=True, prefetch=True,
                                   long_first=True),
                   AttentionLaunch("serial", 64, 4, 2, mask_tail=True),
                   AttentionLaunch("chunk", 16, 2, 3, fold_unroll=16, mask_tail=True,
                                   prefetch=True, fold_block_d=32),
                   AttentionLaunch("chunk", 16, 4, 4, mask_tail=True, prefetch=True,
                                   long_first=True),
                   # prefill 128-row tiles with unmasked full splits, decode
                   # serial 4 stages, folds over 16 columns with one warp
                   AttentionLaunch("serial", 128, 8, 2, mask_tail=True),
                   AttentionLaunch("serial", 16, 2, 4, mask_tail=True, prefetch=True),
                   # decode tiles under a register cap (spills: registers only)
                   AttentionLaunch("serial", 16, 2, 2, mask_tail=True, prefetch=True,
                                   maxnreg=128),
                   AttentionLaunch("serial", 16, 2, 1, mask_tail=True, prefetch=True,
                                   maxnreg=96),
                   AttentionLaunch("chunk", 16, 2, 3, fold_unroll=16, mask_tail=True,
                                   prefetch=True, fold_block_d=16, fold_warps=1),
                   # chunk mode (a program per chunk, then the fold), 4-warp
                   # decode tiles, 8-warp prefill tiles
                   AttentionLaunch("chunk", 16, 2, 3, mask_tail=True, prefetch=True,
                                   fold_block_d=16, fold_warps=1),
                   AttentionLaunch("chunk", 16, 4, 3, mask_tail=True, prefetch=True),
                   AttentionLaunch("chunk", 64, 4, 2, fold_tokens=8),
                   AttentionLaunch("serial", 16, 4, 3, mask_tail=True, prefetch=True),
                   AttentionLaunch("serial", 64, 8, 2, mask_tail=True),
                   # issue 14: prefill tiles whose K/V loads stay in flight across splits
                   # (3-4 stages, block ids one ahead), the 16-column l-dot, long rows
                   # first (the default serial prefill tile: 3 stages and all of these)
                   AttentionLaunch("serial", 128, 8, 3, mask_tail=True, prefetch=True,
                                   l_cols=16),
                   AttentionLaunch("serial", 128, 8, 2, mask_tail=True, long_first=True,
                                   l_cols=16),
                   AttentionLaunch("serial", 128, 8, 4, mask_tail=True, prefetch=True),
                   AttentionLaunch("serial", 64, 4, 2, mask_tail=True, prefetch=True,
                                   l_cols=16),
                   AttentionLaunch("chunk", 16, 2, 3, fold_unroll=16, mask_tail=True,
                                   prefetch=True, l_cols=16),
                   AttentionLaunch("chunk", 64, 4, 2, l_cols=16)):
        launch = dataclasses.replace(launch, gluon=False)  # the Triton tiles (default: Gluon)
        got = paged_attention(q, kc, vc, table[None], one_len, one_qsl, scale, launch=launch)
        assert torch.equal(got, full), f"{launch}: bits differ from the default launch"
        got = paged_attention(qm, kc, vc, tables, lens, qsl, scale, launch=launch)
        assert torch.equal(got, serial), f"{launch}: mixed batch differs"
    # A decode batch read as one token per sequence (the decode graphs' promise), with
    # block-table entries past each context out of range: each token's own call's bits.
    dec = [2500, 1, 64, 65, 1999, 1100, 1024, 1025]
    dec_tables = table[None].repeat(len(dec), 1)
    for row, c in zip(dec_tables, dec):
        row[-(-c // bs):] = 10**6
    dec_lens = torch.tensor(dec, device="cuda", dtype=torch.int32)
    dec_qsl = torch.arange(len(dec) + 1, device="cuda", dtype=torch.int32)
    want = torch.stack([full[c - 1] for c in dec])
    for mode in (None, "serial", "chunk"):
        got = paged_attention(torch.stack([q[c - 1] for c in dec]), kc, vc, dec_tables,
                              dec_lens, dec_qsl, scale, mode=mode, one_token_per_seq=True)
        assert torch.equal(got, want), f"one token per sequence, mode {mode}"


@pytest.mark.parametrize("hkv, bs", [(4, 16), (8, 16), (16, 16), (8, 32), (4, 128)])
def test_paged_attention_gluon_prefill_equals_triton(monkeypatch, hkv: int, bs: int) -> None:
    """Hopper's Gluon prefill kernel (attention_gluon) gives the Triton serial kernel's bits:
    whole prompts, chunked prefill (context longer than the new tokens), prompts that end
    mid-tile and mid-block, several sequences per call; K/V past each context poisoned
    with NaN; cache blocks smaller and larger than a split (its TMA boxes); within bf16
    rounding of a float64 reference; a sequence's rows the same alone and batched."""
    from megaserve.kernels.triton_impl import attention
    from megaserve.kernels.triton_impl.attention import AttentionLaunch, paged_attention

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's (wgmma)")
    monkeypatch.setattr(attention, "POISON_BUFFERS", True)
    torch.manual_seed(hkv)
    hq, dh = 32, 128
    ctx = [3001, 77, 1024, 700, 4096]
    new = [701, 77, 1024, 1, 333]
    blocks = [-(-c // bs) for c in ctx]
    kc = torch.randn(sum(blocks) + 2, bs, hkv, dh, device="cuda", dtype=BF16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(sum(blocks), device="cuda").int() + 2  # blocks 0, 1: spare
    tables = torch.zeros(len(ctx), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, (c, b) in enumerate(zip(ctx, blocks)):
        tables[i, :b] = perm[start : start + b]
        start += b
        if c % bs:  # keys past the context in its last block
            kc[tables[i, b - 1], c % bs:] = float("nan")
            vc[tables[i, b - 1], c % bs:] = float("nan")
    kc[:2] = float("nan")
    vc[:2] = float("nan")
    q = torch.randn(sum(new), hq, dh, device="cuda", dtype=BF16)
    lens = torch.tensor(ctx, device="cuda", dtype=torch.int32)
    qsl = torch.tensor([0] + new, device="cuda", dtype=torch.int32).cumsum(0).int()
    scale = dh**-0.5
    assert attention.gluon_applies(q, kc, vc, 32 // hkv)
    triton_serial = AttentionLaunch("serial", 128, 8, 3, mask_tail=True, prefetch=True,
                                    long_first=True, l_cols=16, gluon=False)
    want = paged_attention(q, kc, vc, tables, lens, qsl, scale, launch=triton_serial)
    got = paged_attention(q, kc, vc, tables, lens, qsl, scale, mode="serial")
    assert not got.isnan().any()
    assert torch.equal(got, want), "Gluon against Triton, mixed batch"
    a = 0
    for i, (c, n) in enumerate(zip(ctx, new)):
        one = paged_attention(q[a : a + n], kc, vc, tables[i : i + 1], lens[i : i + 1],
                              torch.tensor([0, n], device="cuda", dtype=torch.int32), scale,
                              mode="serial")
        assert torch.equal(one, got[a : a + n]), f"sequence {i} alone"
        keys = torch.arange(c, device="cuda")
        k = kc[tables[i].long()[keys // bs], keys % bs].double().repeat_interleave(hq // hkv, 1)
        v = vc[tables[i].long()[keys // bs], keys % bs].double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[a : a + n].double(), k) * scale
        qpos = torch.arange(c - n, c, device="cuda")
        s = s.masked_fill(keys[None, None, :] > qpos[None, :, None], float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        assert _rel_err(one, ref) < 1e-2, f"sequence {i} against float64"
        a += n


def test_paged_attention_exp2_chunk_equals_serial() -> None:
    """The EXP2 arithmetic: within bf16 rounding of the ``exp`` form, and its
    serial and chunk modes give the same bits (a device run found serial and
    split mode 1 ulp apart before the split's max got its select; this checks that fix)."""
    from megaserve.kernels.triton_impl.attention import AttentionLaunch, paged_attention

    torch.manual_seed(1)
    hq, hkv, dh, bs, length = 32, 8, 128, 16, 1000
    kc = torch.randn(100, bs, hkv, dh, device="cuda", dtype=BF16)
    vc = torch.randn_like(kc)
    table = torch.randperm(100, device="cuda")[: -(-length // bs)].int()[None]
    q = torch.randn(length, hq, dh, device="cuda", dtype=BF16)
    scale = dh**-0.5

    def run(rows, ctx, **kw):
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        qsl = torch.tensor([0, rows.shape[0]], device="cuda", dtype=torch.int32)
        return paged_attention(rows, kc, vc, table, lens, qsl, scale, exp2=True, **kw)

    new = run(q, length, mode="serial")
    old = paged_attention(q, kc, vc, table, torch.tensor([length], device="cuda").int(),
                          torch.tensor([0, length], device="cuda").int(), scale, exp2=False)
    assert (new.float() - old.float()).abs().max().item() < 3e-2
    for launch in (AttentionLaunch("chunk", 16, 2, 3, fold_unroll=16, mask_tail=True,
                                   prefetch=True, fold_block_d=32, fold_warps=1),
                   AttentionLaunch("chunk", 64, 4, 2, fold_tokens=8),
                   AttentionLaunch("serial", 128, 8, 2, mask_tail=True)):
        assert torch.equal(run(q, length, launch=launch), new), f"EXP2 {launch}"
    for t in (0, 63, 64, 500, length - 1):
        for mode in ("serial", "chunk"):
            got = run(q[t : t + 1], t + 1, mode=mode)[0]
            assert torch.equal(got, new[t]), f"decode {t} {mode}"


def test_moe_and_sampling() -> None:
    from megaserve.kernels.triton_impl import sample, topk_route

    logits = torch.randn(500, 64, device="cuda")
    ids, w = topk_route(logits, 6, True)
    assert torch.equal(topk_route(logits[10:11], 6, True)[0], ids[10:11])
    ref = torch.sort(torch.softmax(logits.double(), -1), dim=-1, descending=True, stable=True)
    assert torch.equal(ids, ref.indices[:, :6])
    lp = torch.log_softmax(torch.randn(4, 32000, device="cuda"), -1)
    args = [torch.tensor(a, device="cuda") for a in
            ([0.0, 0.7, 1.0, 1.3], [0, 40, 0, 0], [1.0, 0.95, 0.8, 1.0], [0.0, 0.0, 0.0, 0.1],
             [1, 2, 3, 4], [10, 11, 12, 13])]
    tokens = sample(lp, *args)
    assert int(tokens[0]) == int(lp[0].argmax())
    for r in range(1, 4):
        assert int(sample(lp[r : r + 1], *(a[r : r + 1] for a in args))[0]) == int(tokens[r])


@pytest.mark.parametrize("e,d,i,r,k", [(16, 640, 200, 20000, 2), (128, 2048, 768, 32768, 8)])
def test_expert_gemms_gluon_equal_triton(e: int, d: int, i: int, r: int, k: int) -> None:
    """moe_gluon's persistent GEMMs (Hopper) against the Triton TMA kernels of the same
    launch, the gate_up form (gathered rows, SwiGLU) and the down form (scattered rows):
    the same bits on every routed row, within bf16 rounding of float64; an empty expert,
    rows routed nowhere, output columns not a multiple of the tile, K of the down GEMM not
    a multiple of its step (d, i: hidden and expert sizes, k: rows per token)."""
    from megaserve.kernels.triton_impl import moe

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("moe_gluon's kernel is for Hopper GPUs")
    torch.manual_seed(e + r)
    x = torch.randn(r // k, d, device="cuda", dtype=BF16)
    wgu = torch.randn(e, 2 * i, d, device="cuda", dtype=BF16) / d**0.5
    wd = torch.randn(e, d, i, device="cuda", dtype=BF16) / i**0.5
    ids = torch.randint(0, e + 1, (r,), device="cuda")  # id e: routed nowhere
    ids[ids == 3] = 4  # expert 3 gets no rows
    grouping = moe._align(ids, e)
    offsets, order = grouping
    n = int(offsets[e])  # grouped positions with an expert

    def gemm(a, w, tiles, gluon, **kw):
        tiles = dataclasses.replace(tiles, gluon=gluon)
        return moe._expert_gemm(a, w, ids, grouping, tiles, **kw)

    up = dict(swiglu=True, gather=True, scatter=False, rows_per_token=k)
    hidden = gemm(x, wgu, moe._PREFILL.up, True, **up)
    assert not hidden[:n].isnan().any(), "gate_up rows left unwritten"
    assert torch.equal(hidden[:n], gemm(x, wgu, moe._PREFILL.up, False, **up)[:n])
    routed = ids < e
    down = dict(swiglu=False, gather=False, scatter=True)
    out = gemm(hidden, wd, moe._PREFILL.down, True, **down)
    assert not out[routed].isnan().any(), "down rows left unwritten"
    assert torch.equal(out[routed], gemm(hidden, wd, moe._PREFILL.down, False, **down)[routed])
    for p in (0, n // 2, n - 1):  # grouped positions
        row = int(order[p])
        g, u = (wgu[ids[row]].double() @ x[row // k].double()).chunk(2)
        assert _rel_err(hidden[p], g * torch.sigmoid(g) * u) < 1e-2, p
        assert _rel_err(out[row], wd[ids[row]].double() @ hidden[p].double()) < 1e-2, p


@pytest.mark.parametrize("e,d,i,r", [(8, 1024, 512, 3000), (128, 2048, 768, 2048)])
def test_expert_ffn_reference_launches_and_row_invariance(e: int, d: int, i: int,
                                                          r: int) -> None:
    """Float64 reference, routed rows fully written, the fused SwiGLU epilogue equal to
    GEMM + silu_and_mul, and the same bits for every launch and every subset of rows
    (decode-sized calls take other tiles than prefill-sized ones: moe.plan_launch)."""
    from megaserve.kernels.triton_impl import expert_ffn, moe

    torch.manual_seed(e + r)
    x = torch.randn(r, d, device="cuda", dtype=BF16)
    wgu = torch.randn(e, 2 * i, d, device="cuda", dtype=BF16) / d**0.5
    wd = torch.randn(e, d, i, device="cuda", dtype=BF16) / i**0.5
    eids = torch.randint(0, e + 1, (r,), device="cuda")  # id e: routed nowhere
    routed = eids < e
    for ids in (eids, torch.randint(0, e + 1, (20000,), device="cuda")):  # 5 scan blocks
        for chunked in (False, True):  # both align passes: the same integers
            offsets, order = moe._align(ids, e, chunked=chunked)
            counts = torch.bincount(ids, minlength=e + 1)[:e]
            assert offsets.tolist() == [0] + counts.cumsum(0).tolist()
            n = int((ids < e).sum())
            assert torch.equal(order[:n].long(), torch.sort(ids, stable=True).indices[:n])
    out = expert_ffn(x, eids, wgu, wd)
    assert not out[routed].isnan().any(), "routed rows left unwritten"
    for row in routed.nonzero()[:4, 0].tolist():
        g, u = (wgu[eids[row]].double() @ x[row].double()).chunk(2)
        ref = wd[eids[row]].double() @ (g * torch.sigmoid(g) * u)
        assert _rel_err(out[row], ref) < 1e-2, row
    unfused = expert_ffn(x, eids, wgu, wd, fused=False)
    assert torch.equal(unfused[routed], out[routed]), "fused SwiGLU differs from unfused"
    T = moe.GemmTiles
    launches = [moe.plan_launch(m) for m in (1, 64, 2048, 10**6)] + [
        moe.MoeLaunch(T(16, 16, 2, 4), T(16, 32, 2, 6)),
        moe.MoeLaunch(T(32, 64, 4, 4), T(64, 128, 4, 3)),
        moe.MoeLaunch(T(64, 64, 4, 3), T(128, 256, 8, 3)),
        moe.MoeLaunch(T(128, 32, 4, 4), T(128, 64, 4, 4))]
    for lp in launches:
        got = expert_ffn(x, eids, wgu, wd, launch=lp)
        assert torch.equal(got[routed], out[routed]), f"{lp} changed the bits"
    gen = torch.Generator().manual_seed(2)
    for m in (1, 2, 8, 37, 64, 512, r):
        sub = torch.randperm(r, generator=gen)[:m].cuda()
        got = expert_ffn(x[sub], eids[sub], wgu, wd)
        keep = routed[sub]
        assert torch.equal(got[keep], out[sub][keep]), f"{m} rows: bits changed"
