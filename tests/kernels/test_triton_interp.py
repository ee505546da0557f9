"""Triton kernels under the Triton interpreter (CPU, CI): correctness and batch invariance.

TRITON_INTERPRET=1 must be set before kernels are defined, so the checks run in a child
process (this file run as a script) and report one line per check as JSON. The child's
``tl.dot`` has a fixed serial order (tests/kernels/interp_support.py), so the bitwise checks
hold on every x86-64 host whatever its BLAS. fp16 is used
for the tensor-core paths: the interpreter mis-reads bfloat16 through TMA descriptors.
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels import interp_support
from tests.kernels.poison import poisoned_empty

CHECKS = ["linear", "rms_norm", "linear_parts", "rowwise", "attention", "moe", "moe_tma", "sampling"]


def _rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def check_linear(torch, ti) -> None:
    import dataclasses
    import os

    # The interpreter's dot accumulates serially over k (interp_support), not in the tensor
    # cores' k16 steps, so a launch's own K step is checked on the GPU only: here the
    # committed small-K rule runs with its launches at the config's K step.
    rule = ti.matmul.SMALL_K_RULE
    if rule is not None:
        rule = dataclasses.replace(rule, swap=tuple(
            (m, dataclasses.replace(lp, block_k=0)) for m, lp in rule.swap))
    os.environ["MEGASERVE_MATMUL_SMALL_K"] = rule.to_json() if rule is not None else "none"
    try:
        _check_linear(torch, ti)
    finally:
        del os.environ["MEGASERVE_MATMUL_SMALL_K"]


def _check_linear(torch, ti) -> None:
    Launch = ti.matmul.Launch
    variants = [  # launches that must give the fold mode's bits (tile shapes, folds, grids)
        Launch("fold", flat=0), Launch("split"), Launch("split", fold_last=False),
        Launch("split", block_m=64, block_n=64, num_warps=4, fold_last=False),
        Launch("fold", block_m=64, num_warps=4), Launch("fold", persistent=2),
        Launch("swap", num_warps=4), Launch("swap", block_m=64, fold_last=False),
    ]
    for m, n, k in [(37, 48, 512), (3, 64, 320), (20, 200, 1000)]:
        x = torch.randn(m, k, dtype=torch.float16)
        w = torch.randn(n, k, dtype=torch.float16)
        b = torch.randn(n, dtype=torch.float16)
        fold = ti.linear(x, w, b, mode="fold")
        for lp in variants:
            assert torch.equal(ti.linear(x, w, b, launch=lp), fold), f"{lp} differs from fold"
        assert torch.equal(ti.linear(x, w, None, launch=variants[2]),
                           ti.linear(x, w, None, mode="fold")), "no-bias split"
        ref = x.double() @ w.double().T + b.double()
        assert _rel_err(fold, ref) < 1e-2, _rel_err(fold, ref)
        for r in (0, m // 2, m - 1):
            alone = ti.linear(x[r : r + 1], w, b)
            assert torch.equal(alone[0], fold[r]), f"row {r} changed with M"
        # The one-split swap path (direct store, no workspace) keeps fold's bits. (A
        # launch's own K step is checked on the GPU only: the interpreter's dot is serial
        # over k, not the tensor cores' k16 steps.)
        mm = ti.matmul
        for cfg in (mm.MatmulConfig(64, 256), mm.MatmulConfig(64, 1024)):
            fold = ti.linear(x, w, b, mode="fold", config=cfg)
            for lp in (Launch("swap", num_warps=4), Launch("swap", 64, num_warps=4,
                                                           fold_last=False)):
                out = ti.linear(x, w, b, config=cfg, launch=lp)
                assert torch.equal(out, fold), f"{cfg} {lp} differs from fold"
    # The small-K rule: a function of (N, K) only, JSON round trip, launches by M bucket.
    rule = mm.SmallKRule(2048, 132, swap=((16, Launch("swap", 64, num_warps=4, block_k=128)),
                                           (64, Launch("swap", 128, num_warps=4))))
    assert mm.SmallKRule.from_json(rule.to_json()) == rule
    assert rule.config(7168, 2048) == mm.MatmulConfig(64, 1024)
    assert rule.config(96, 1024) == mm.MatmulConfig(64, 256)
    # at_most_target: (tile, split) programs of 64 rows within target_programs.
    wave = mm.SmallKRule(4096, 132, at_most_target=True)
    assert mm.SmallKRule.from_json(wave.to_json()) == wave
    assert wave.config(5120, 2048) == mm.MatmulConfig(64, 2048)  # 80 tiles: one split
    assert wave.config(2048, 4096) == mm.MatmulConfig(64, 1024)  # 32 tiles x 4 splits
    assert wave.config(128, 2048) == mm.MatmulConfig(64, 256)  # min_steps bounds it: 8
    cfg = rule.config(7168, 2048)
    assert mm.plan_launch(8, 7168, 2048, cfg) != rule.swap[0][1]  # another rule in force
    import os

    before = os.environ["MEGASERVE_MATMUL_SMALL_K"]
    os.environ["MEGASERVE_MATMUL_SMALL_K"] = rule.to_json()
    try:
        assert mm.config_for(7168, 2048, torch.float16) == cfg
        assert mm.plan_launch(8, 7168, 2048, cfg) == rule.swap[0][1]
        assert mm.plan_launch(40, 7168, 2048, cfg) == rule.swap[1][1]
        assert mm.config_for(4096, 4096, torch.float16) != rule.config(4096, 4096)
        x, w = torch.randn(5, 320, dtype=torch.float16), torch.randn(64, 320, dtype=torch.float16)
        assert torch.equal(ti.linear(x, w), ti.linear(x, w, mode="fold"))
    finally:
        os.environ["MEGASERVE_MATMUL_SMALL_K"] = before


def check_rms_norm(torch, ti) -> None:
    x = torch.randn(9, 200, dtype=torch.float16)
    res = torch.randn(9, 200, dtype=torch.float16)
    w = torch.randn(200, dtype=torch.float16)
    y, h = ti.rms_norm(x, w, 1e-6, res)
    h_ref = x + res
    assert torch.equal(h, h_ref)
    hd = h_ref.double()
    ref = w.double() * (hd / torch.sqrt((hd * hd).mean(-1, keepdim=True) + 1e-6))
    assert _rel_err(y, ref) < 1e-2
    y1, _ = ti.rms_norm(x[4:5], w, 1e-6, res[4:5])
    assert torch.equal(y1[0], y[4])


def check_linear_parts(torch, ti) -> None:
    """A decode linear's split-K parts left to its consumer (o_proj's to the norm, the
    router's to the top-k) give the bits of the folded output, with and without the
    reload before the reduction; more rows than PARTS_MAX_M fold in the swap launch, and
    a split launch with a fold launch leaves token-major parts at any M."""
    mm, rowwise = ti.matmul, ti.rowwise
    x = torch.randn(12, 512, dtype=torch.float16)
    w = torch.randn(64, 512, dtype=torch.float16) / 16
    b = torch.randn(64, dtype=torch.float16)
    nw = torch.randn(64, dtype=torch.float16)
    res = torch.randn(12, 64, dtype=torch.float16)
    assert mm.config_for(64, 512, torch.float16).split_len == 256  # two splits
    for reload in (True, False):
        rowwise.PARTS_RELOAD = reload
        for m in (1, 5, mm.PARTS_MAX_M, mm.PARTS_MAX_M + 1):
            for bias in (None, b):
                parts = mm.linear_parts(x[:m], w, bias)
                assert isinstance(parts, mm.Parts) == (m <= mm.PARTS_MAX_M), m
                out = ti.linear(x[:m], w, bias)
                want = ti.rms_norm(out, nw, 1e-6, res[:m])
                got = ti.rms_norm(parts, nw, 1e-6, res[:m])
                assert all(torch.equal(g, v) for g, v in zip(got, want)), (m, reload)
                for k, renorm in ((8, True), (3, True), (2, False)):
                    want = ti.topk_route(out, k, renorm)
                    got = ti.topk_route(mm.linear_parts(x[:m], w, bias), k, renorm)
                    assert all(torch.equal(g, v) for g, v in zip(got, want)), (m, k, reload)
            got = ti.linear_rms_norm(x[:m], w, nw, 1e-6, res[:m])
            want = ti.rms_norm(ti.linear(x[:m], w), nw, 1e-6, res[:m])
            assert all(torch.equal(g, v) for g, v in zip(got, want)), m
            got = ti.route(x[:m], w, 8, True)
            want = ti.topk_route(ti.linear(x[:m], w), 8, True)
            assert all(torch.equal(g, v) for g, v in zip(got, want)), m
        # split mode with a fold launch leaves token-major parts at any M
        split = mm.Launch("split", block_m=64, block_n=64, num_warps=4, fold_last=False)
        for m in (1, 12):
            for bias in (None, b):
                parts = mm.linear_parts(x[:m], w, bias, launch=split)
                assert isinstance(parts, mm.Parts) and parts.token_major, m
                out = ti.linear(x[:m], w, bias)
                got = ti.rms_norm(parts, nw, 1e-6, res[:m])
                want = ti.rms_norm(out, nw, 1e-6, res[:m])
                assert all(torch.equal(g, v) for g, v in zip(got, want)), ("split", m, reload)
                got = ti.topk_route(mm.linear_parts(x[:m], w, bias, launch=split), 8, True)
                want = ti.topk_route(out, 8, True)
                assert all(torch.equal(g, v) for g, v in zip(got, want)), ("split", m, reload)
        assert not isinstance(mm.linear_parts(x, w, launch=mm.Launch("split")), mm.Parts)
    rowwise.PARTS_RELOAD = True
    # a token's bits whatever the other rows
    alone = ti.linear_rms_norm(x[3:4], w, nw, 1e-6, res[3:4])
    many = ti.linear_rms_norm(x[:7], w, nw, 1e-6, res[:7])
    assert torch.equal(alone[0][0], many[0][3]) and torch.equal(alone[1][0], many[1][3])


def check_rowwise(torch, ti) -> None:
    gu = torch.randn(5, 2 * 70, dtype=torch.float16)
    g, u = gu.double().chunk(2, -1)
    assert _rel_err(ti.silu_and_mul(gu), g * torch.sigmoid(g) * u) < 1e-2
    eo = torch.randn(6, 3, 40, dtype=torch.float16)
    wt = torch.rand(6, 3)
    ref = (wt.double()[..., None] * eo.double()).sum(1)
    out = ti.combine(eo, wt)
    assert out.dtype == torch.float32 and _rel_err(out, ref) < 1e-5
    logits = torch.randn(4, 5000) * 4
    lsm = ti.log_softmax(logits)
    assert _rel_err(lsm, torch.log_softmax(logits.double(), -1)) < 1e-5
    assert torch.equal(ti.log_softmax(logits[2:3])[0], lsm[2])
    buffer = torch.full((6, 5000), float("nan"))  # out=: the first rows of a reused buffer
    assert torch.equal(ti.log_softmax(logits, out=buffer[:4]), lsm) and buffer[4:].isnan().all()
    # greedy_out: torch.argmax of the output (first maximum), across chunks of 4096 too
    logits[0, 4500] = logits[0, 4700] = logits[0, 900] = 30.0  # three-way tie: 900
    logits[1, 4999] = 30.0  # the last column of the last, partial chunk
    logits[2, 4100] = logits[2, 4101] = 30.0  # tie inside the second chunk
    greedy = torch.full((4,), -7, dtype=torch.int64)
    lsm = ti.log_softmax(logits, greedy)
    assert greedy.tolist()[:3] == [900, 4999, 4100]
    assert torch.equal(greedy, lsm.argmax(-1))
    # half logits (the LM head's output dtype), computed in fp32
    half = logits.half()
    lsm = ti.log_softmax(half)
    assert _rel_err(lsm, torch.log_softmax(half.double(), -1)) < 1e-5
    assert torch.equal(ti.log_softmax(half[1:3]), lsm[1:3])
    # embed_tokens: rows from the tokens, or from ``sampled`` where a source is set
    table = torch.randn(50, 72, dtype=torch.float16)
    rows = torch.tensor([[3, 1], [7, -1], [49, 0], [0, -1]], dtype=torch.int32)
    sampled = torch.tensor([11, 12, 13], dtype=torch.int64)
    out = ti.embed_tokens(table, rows[:, 0], rows[:, 1], sampled)  # strided int32 columns
    assert torch.equal(out, table[torch.tensor([12, 7, 11, 0])])
    assert torch.equal(ti.embed_tokens(table, torch.tensor([5, 5, 2])), table[[5, 5, 2]])


def _attention_ref(torch, q, k, v, positions, scale):
    """q `[n, Hq, Dh]`, k/v `[L, Hkv, Dh]` float64 causal reference."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] > positions[:, None]
    p = torch.softmax(s.masked_fill(mask[None], float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, v)


def check_attention(torch, ti) -> None:
    hq, hkv, dh, bs, length = 4, 2, 16, 4, 150
    num_blocks = 64
    kc = torch.randn(num_blocks, bs, hkv, dh, dtype=torch.float16)
    vc = torch.randn(num_blocks, bs, hkv, dh, dtype=torch.float16)
    table = torch.randperm(num_blocks)[: -(-length // bs)].int()
    # write_kv_cache of the context's K/V into the (shuffled) blocks
    k_new = torch.randn(length, hkv, dh, dtype=torch.float16)
    v_new = torch.randn(length, hkv, dh, dtype=torch.float16)
    pos = torch.arange(length)
    slots = table.long()[pos // bs] * bs + pos % bs
    ti.write_kv_cache(k_new, v_new, kc, vc, slots)
    assert torch.equal(kc.view(-1, hkv, dh)[slots], k_new)
    q = torch.randn(length, hq, dh, dtype=torch.float16)
    scale = dh**-0.5

    def run(q_rows, ctx_len, mode=None):
        n = q_rows.shape[0]
        return ti.paged_attention(q_rows, kc, vc, table[None], torch.tensor([ctx_len]).int(),
                                  torch.tensor([0, n]).int(), scale, mode=mode)

    full = run(q, length, "serial")  # prefill of all tokens
    ref = _attention_ref(torch, q, k_new, v_new, pos, scale)
    assert _rel_err(full, ref) < 1e-2
    # chunk mode (a program per chunk, ordered fold) gives the serial mode's bits
    assert torch.equal(run(q, length, "chunk"), full), "chunk and serial modes differ"
    for t in (0, 64, 149):
        assert torch.equal(run(q[t : t + 1], t + 1, "chunk")[0], full[t]), f"chunk decode {t}"
    for t in (0, 63, 64, 149):  # decode: token t alone with a context of t + 1
        assert torch.equal(run(q[t : t + 1], t + 1)[0], full[t]), f"decode token {t}"
    for chunk in (17, 64):  # chunked prefill
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            assert torch.equal(run(q[start:end], end), full[start:end]), f"chunk {chunk}@{start}"
    # two sequences in one launch: the second's rows equal its solo run
    both = ti.paged_attention(torch.cat([q[:5], q[:9]]), kc, vc, torch.stack([table, table]),
                              torch.tensor([5, 100]).int(), torch.tensor([0, 5, 14]).int(), scale)
    assert torch.equal(both[5:], run(q[:9], 100))


def check_moe(torch, ti) -> None:
    logits = torch.randn(7, 8)
    logits[0, 2] = logits[0, 5] = 9.0  # tie: expert 2 must come first
    ids, w = ti.topk_route(logits, 2, True)
    assert ids[0].tolist() == [2, 5]
    assert torch.allclose(w.sum(-1), torch.ones(7))
    ref_ids = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True).indices
    assert torch.equal(ids, ref_ids[:, :2])
    for k in (3, 4):  # a padded BLOCK_K (k = 3) and a full one
        ids, w = ti.topk_route(logits, k, True)
        assert torch.equal(ids, ref_ids[:, :k])
        probs = torch.softmax(logits.double(), -1).gather(1, ids)
        assert _rel_err(w, probs / probs.sum(-1, keepdim=True)) < 1e-6
    _check_expert_ffn(torch, ti)


def _check_expert_ffn(torch, ti) -> None:
    moe = ti.moe
    e, d, i, r = 6, 96, 48, 45  # K tails (96, 48 vs BLOCK_K 64), I not a multiple of 32
    x = torch.randn(r, d, dtype=torch.float16)
    wgu = torch.randn(e, 2 * i, d, dtype=torch.float16) / 8
    wd = torch.randn(e, d, i, dtype=torch.float16) / 8
    eids = torch.randint(0, e + 1, (r,))  # id e: routed nowhere
    eids[:3] = torch.tensor([e, 2, 2])
    routed = eids < e
    # The align pass: offsets are the counts' prefix sums, order a stable grouping (9000
    # rows: several blocks of the scan).
    for ids, chunked in ((eids, False), (eids, True), (torch.randint(0, e + 1, (9000,)), False),
                         (torch.randint(0, e + 1, (9000,)), True)):  # both align passes
        offsets, order = moe._align(ids, e, chunked=chunked)
        counts = torch.bincount(ids, minlength=e + 1)[:e]
        assert offsets.tolist() == [0] + counts.cumsum(0).tolist(), offsets
        n = int((ids < e).sum())
        stable = torch.sort(ids, stable=True).indices[:n]
        assert torch.equal(order[:n].long(), stable), f"order not stably grouped ({chunked})"
    with poisoned_empty():  # outputs must be written wherever they are defined
        out = ti.expert_ffn(x, eids, wgu, wd)
        assert not out[routed].isnan().any(), "routed rows left unwritten"
        for row in routed.nonzero()[:, 0].tolist():
            gu = wgu[eids[row]].double() @ x[row].double()
            g, u = gu.chunk(2)
            ref = wd[eids[row]].double() @ (g * torch.sigmoid(g) * u)
            assert _rel_err(out[row], ref) < 2e-2, row
        # Fused SwiGLU epilogue == GEMM + silu_and_mul, bitwise; every launch the same bits.
        unfused = ti.expert_ffn(x, eids, wgu, wd, fused=False)
        assert torch.equal(unfused[routed], out[routed]), "fused SwiGLU differs"
        T = moe.GemmTiles
        # K steps 128 and 256 over K = 96 and 48 (zero-padded tails): the same bits.
        launches = [moe.plan_launch(n) for n in (1, 64, 2048, 10**6)] + [
            moe.MoeLaunch(T(32, 16, 2, 2), T(64, 32, 4, 1)),
            moe.MoeLaunch(T(128, 128, 8, 3), T(16, 128, 4, 4)),
            moe.MoeLaunch(T(16, 32, 4, 4, 128), T(16, 64, 4, 4, 256)),
            moe.MoeLaunch(T(64, 16, 4, 3, 256), T(32, 32, 4, 3, 128)),
            # rows grouped inside the GEMMs from the ids (no align launch)
            moe.MoeLaunch(T(16, 32, 4, 3, 128), T(16, 128, 4, 3, 128), inline_align=True),
            moe.MoeLaunch(T(32, 16, 2, 2), T(64, 32, 4, 1), inline_align=True)]
        for lp in launches:
            got = ti.expert_ffn(x, eids, wgu, wd, launch=lp)
            assert torch.equal(got[routed], out[routed]), f"{lp} changed the bits"
            unfused_lp = ti.expert_ffn(x, eids, wgu, wd, launch=lp, fused=False)
            assert torch.equal(unfused_lp[routed], out[routed]), f"{lp} unfused"
        # rows_per_token: routed row r reads token row r // k, the bits of the expanded call.
        for k in (1, 3, 5):
            tokens = x[: r // k]
            ids_k = eids[: tokens.shape[0] * k]
            keep = ids_k < e
            expanded = ti.expert_ffn(tokens.repeat_interleave(k, 0), ids_k, wgu, wd)
            for lp in (None, launches[-2], launches[-1]):
                got = ti.expert_ffn(tokens, ids_k, wgu, wd, rows_per_token=k, launch=lp)
                assert got.shape == expanded.shape
                assert torch.equal(got[keep], expanded[keep]), f"rows_per_token={k} {lp}"
            assert torch.equal(ti.expert_ffn(tokens, ids_k, wgu, wd, rows_per_token=k,
                                             fused=False)[keep], expanded[keep])
        try:
            ti.expert_ffn(x[:4], eids[:9], wgu, wd, rows_per_token=2)
        except ValueError:
            pass
        else:
            raise AssertionError("x rows * rows_per_token != ids rows accepted")
        # Batch invariance: a row's bits do not depend on the other rows of the call.
        for rows in ([4], [40, 3, 17], list(range(10, 45)), list(range(r)) * 3):
            sub = torch.tensor(rows)
            got = ti.expert_ffn(x[sub], eids[sub], wgu, wd)
            keep = routed[sub]
            assert torch.equal(got[keep], out[sub][keep]), f"rows {rows[:5]} changed"


def check_moe_tma(torch, ti) -> None:
    """The expert GEMMs' TMA paths (moe.GemmTiles.tma, join, n_major) give the pointer
    path's bits; rows that are not 16-byte aligned fall back to the pointer path."""
    moe = ti.moe
    T = moe.GemmTiles
    pointer = moe.MoeLaunch(T(32, 16, 4, 3), T(32, 32, 4, 3))  # the reference bits
    launches = [
        moe.MoeLaunch(T(32, 16, 4, 3, tma=True), T(32, 32, 4, 3, tma=True)),
        moe.MoeLaunch(T(16, 32, 4, 3, tma=True, join=True),
                      T(16, 64, 4, 3, 128, tma=True, n_major=True)),
        moe.MoeLaunch(T(64, 16, 4, 3, 128, tma=True, join=True, n_major=True),
                      T(64, 16, 4, 3, tma=True)),
        moe.MoeLaunch(T(16, 32, 4, 3, tma=True, join=True), T(16, 64, 4, 3, 128, tma=True),
                      inline_align=True),
    ]
    # (D, I): K tails (96, 48 vs K steps 64/128), I not a multiple of the column tiles;
    # then rows that are not 16-byte aligned (D = 100, I = 44: the pointer path).
    for e, d, i in ((6, 96, 48), (5, 100, 44)):
        for rows_per_token, num_tokens in ((1, 45), (3, 17)):
            r = num_tokens * rows_per_token  # odd
            x = torch.randn(num_tokens, d, dtype=torch.float16)
            wgu = torch.randn(e, 2 * i, d, dtype=torch.float16) / 8
            wd = torch.randn(e, d, i, dtype=torch.float16) / 8
            # Ragged: expert 0 and 3 get no rows, expert 1 most; id e: routed nowhere.
            ids = torch.tensor([1, 1, 2, 1, 4, e, 1, 2, 1][: e] * (r // 5 + 1))[:r]
            ids[-1] = e - 1
            routed = ids < e
            with poisoned_empty():
                ref = ti.expert_ffn(x, ids, wgu, wd, rows_per_token=rows_per_token,
                                    launch=pointer)
                assert not ref[routed].isnan().any(), "routed rows left unwritten"
                for lp in launches:
                    for fused in (True, False):
                        got = ti.expert_ffn(x, ids, wgu, wd, rows_per_token=rows_per_token,
                                            launch=lp, fused=fused)
                        assert torch.equal(got[routed], ref[routed]), \
                            f"{lp} fused={fused} D={d} k'={rows_per_token}"
            row = int(routed.nonzero()[0, 0])
            g, u = (wgu[ids[row]].double() @ x[row // rows_per_token].double()).chunk(2)
            want = wd[ids[row]].double() @ (g * torch.sigmoid(g) * u)
            assert float((ref[row].double() - want).norm() / want.norm()) < 2e-2
    _check_moe_tails(torch, ti)
    try:
        T(64, 64, 4, 3, join=True)
    except ValueError:
        pass
    else:
        raise AssertionError("join without tma accepted")


def _check_moe_tails(torch, ti) -> None:
    """Tail tiles (moe.GemmTiles.tail_m: an expert's last tile, at most tail_m rows left,
    runs with tail_m rows) give the pointer path's bits at every remainder of a 32-row
    tile (counts 0, 1, 15 .. 49)."""
    moe = ti.moe
    T = moe.GemmTiles
    counts = [0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 49]
    e, d, i = len(counts), 96, 48
    ids = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    ids = ids[torch.randperm(ids.numel())]  # [R] ragged, shuffled
    x = torch.randn(ids.numel(), d, dtype=torch.float16)
    wgu = torch.randn(e, 2 * i, d, dtype=torch.float16) / 8
    wd = torch.randn(e, d, i, dtype=torch.float16) / 8
    launches = [
        moe.MoeLaunch(T(32, 16, 4, 3, tma=True, join=True, n_major=True, tail_m=16),
                      T(32, 32, 4, 3, 128, tma=True, tail_m=16)),
        moe.MoeLaunch(T(64, 32, 4, 3, tma=True, join=True, tail_m=32),
                      T(64, 16, 4, 3, tma=True, n_major=True, tail_m=16))]
    with poisoned_empty():
        ref = ti.expert_ffn(x, ids, wgu, wd, launch=moe.MoeLaunch(T(32, 16, 4, 3),
                                                                  T(32, 32, 4, 3)))
        assert not ref.isnan().any(), "rows left unwritten"
        for lp in launches:
            for fused in (True, False):
                got = ti.expert_ffn(x, ids, wgu, wd, launch=lp, fused=fused)
                assert torch.equal(got, ref), f"{lp} fused={fused}"
    # Tail tiles where an expert's padding is a large share: up to 512 rows an expert.
    assert moe.plan_launch(256 * 128, 128).up.tail_m == 64
    assert moe.plan_launch(1024 * 8, 8).up.tail_m == moe.plan_launch(64 * 8, 8).up.tail_m == 0
    for bad in (dict(tail_m=16), dict(tma=True, tail_m=32), dict(tma=True, tail_m=24),
                dict(tma=True, tail_m=8)):
        try:
            T(32, 32, **bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"GemmTiles {bad} accepted")


def check_sampling(torch, ti) -> None:
    import megaserve.kernels.cpu as cpu

    seeds = torch.tensor([1, 2**40 + 7, 12345])
    positions = torch.tensor([0, 5, 99])
    u = ti.counter_uniform(seeds, positions, 3000)
    assert torch.equal(u, cpu.counter_uniform(seeds, positions, 3000))
    lp = torch.log_softmax(torch.randn(3, 3000), -1)
    args = (torch.tensor([0.0, 0.8, 1.2]), torch.tensor([0, 50, 0]),
            torch.tensor([1.0, 0.9, 1.0]), torch.tensor([0.0, 0.0, 0.05]), seeds, positions)
    tokens = ti.sample(lp, *args)
    assert int(tokens[0]) == int(lp[0].argmax())
    alone = ti.sample(lp[1:2], *(a[1:2] for a in args))
    assert int(alone[0]) == int(tokens[1])


def _child() -> None:
    interp_support.install()  # fixed-order tl.dot: bits independent of the host BLAS
    interp_support.run_checks(globals(), CHECKS)


interp_results = interp_support.results_fixture(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_triton_kernel_under_interpreter(interp_results: dict[str, dict], name: str) -> None:
    interp_support.assert_check_passed(interp_results, name)


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
