"""Block-FP8 GEMMs on a CUDA GPU: values against a float64 reference of the same
quantized operands, bitwise batch invariance at M in 1..4096, and no unwritten output."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.poison import poisoned_empty

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
SIZES = (1, 2, 3, 17, 64, 65, 127, 300, 1000, 4096)


def _weight(n: int, k: int, experts: int | None = None, seed: int = 0):
    from megaserve.models.quantization import quantize

    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (experts or 1, n, k)
    w = torch.randn(shape, generator=g, device="cuda") / k**0.5
    q, s = zip(*(quantize(w[e]) for e in range(shape[0])))
    q, s = torch.stack(q), torch.stack(s)
    return (q, s) if experts else (q[0], s[0])


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``dequant(quantize_rows(x)) @ dequant(q).T``, and the same product of the
    absolute values (the scale of the accumulation error)."""
    from megaserve.kernels.fp8 import dequantize
    from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows

    xq, xs = quantize_rows(x)
    k = x.shape[1]
    scale = xs.double().repeat_interleave(128, 1)[:, :k]
    xd = xq.double() * scale
    wd = dequantize(q, s, torch.float64)
    return xd @ wd.T, xd.abs() @ wd.abs().T


def _close(got: torch.Tensor, ref: torch.Tensor, ref_abs: torch.Tensor) -> bool:
    """Within one bf16 rounding of the output plus the accumulation error: Hopper's FP8
    tensor cores keep about 14 bits while they sum a 128-wide group (the DeepSeek-V3
    report, 3.3.2), then each group's dot is added in fp32: 2^-11 of sum |x||w| bounds it
    with room; a wrong scale or block index is off by O(|ref|)."""
    return bool(((got.double() - ref).abs() <= ref.abs() * 2**-8 + ref_abs * 2**-11).all())


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (576, 7168), (300, 200)])
def test_fp8_linear_matches_float64_and_is_batch_invariant(n, k):
    from megaserve.kernels import fp8_linear

    q, s = _weight(n, k, seed=n + k)
    x = torch.randn(4096, k, device="cuda", dtype=BF16)
    with poisoned_empty(cuda_only=True):
        full = fp8_linear(x, q, s)
    assert not full.isnan().any()
    assert _close(full[:512], *_reference(x[:512], q, s))
    for m in SIZES:
        with poisoned_empty(cuda_only=True):
            part = fp8_linear(x[:m], q, s)
        assert torch.equal(part, full[:m]), f"M={m}"
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(fp8_linear(x[perm], q, s), full[perm])


@pytest.mark.parametrize("experts,n,k,top_k", [(128, 1536, 2048, 8), (8, 256, 384, 2)])
def test_fp8_grouped_gemm_matches_float64_and_is_batch_invariant(experts, n, k, top_k):
    from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows
    from megaserve.kernels.triton_impl.fp8_moe import fp8_grouped_gemm

    q, s = _weight(n, k, experts, seed=experts)
    tokens = 1024
    x = torch.randn(tokens, k, device="cuda", dtype=BF16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    xq, xs = quantize_rows(x)
    with poisoned_empty(cuda_only=True):
        full = fp8_grouped_gemm(xq, xs, ids.reshape(-1), q, s, BF16, rows_per_token=top_k)
    assert not full.isnan().any()
    for t in (0, 5, 1023):
        for j in range(top_k):
            e = int(ids[t, j])
            ref, ref_abs = _reference(x[t:t + 1], q[e], s[e])
            assert _close(full[t * top_k + j][None], ref, ref_abs)
    for m in SIZES[:-1]:
        part = fp8_grouped_gemm(xq[:m], xs[:m], ids[:m].reshape(-1), q, s, BF16, rows_per_token=top_k)
        assert torch.equal(part, full[:m * top_k]), f"tokens={m}"
    # Rows routed nowhere (id E) are skipped and do not disturb the others.
    dropped = ids.reshape(-1).clone()
    dropped[::3] = experts
    part = fp8_grouped_gemm(xq, xs, dropped, q, s, BF16, rows_per_token=top_k)
    keep = dropped != experts
    assert torch.equal(part[keep], full[keep])


@pytest.mark.parametrize("n,k", [(2048, 4096), (576, 7168), (5120, 2048)])
def test_fp8_linear_launches_give_the_same_bits(n, k):
    """Tiles (wgmma N 32..256, 4 or 8 warps), K splits folded in registers or through the
    workspace, the activation quantized in the K loop or before, the Gluon kernel (one K
    split at 5120 x 2048, several at the others): one set of bits."""
    from megaserve.kernels.triton_impl import fp8_gemm_gluon
    from megaserve.kernels.triton_impl.fp8_gemm import LinearLaunch, fp8_linear, quantize_rows

    q, s = _weight(n, k, seed=7)
    for m in (1, 64, 300, 1100):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        assert fp8_gemm_gluon.applies(quantize_rows(x)[0], q)
        ref = fp8_linear(x, q, s, launch=LinearLaunch())
        for lp in (LinearLaunch(64, 64, parts=True, quant_a=True), LinearLaunch(128, 128, 8),
                   LinearLaunch(64, 32, 4, 4, quant_a=True), LinearLaunch(64, 256, parts=True),
                   LinearLaunch(64, 64, 4, 4, parts=True), LinearLaunch(gluon=True)):
            with poisoned_empty(cuda_only=True):
                got = fp8_linear(x, q, s, launch=lp)
            assert torch.equal(got, ref), f"M={m} {lp}"


@pytest.mark.parametrize("n,k", [(2048, 4096), (576, 7168)])
def test_fp8_parts_folded_by_the_norm_give_the_same_bits(n, k):
    """The linear that leaves its split parts to the norm (fp8_linear_parts: the Triton
    launch's parts) gives linear_rms_norm the bits of the folded linear then rms_norm, and
    writes every part (poisoned workspaces)."""
    from megaserve.kernels import api
    from megaserve.kernels.fp8 import BlockFp8
    from megaserve.kernels.triton_impl.fp8_gemm import (LinearLaunch, fp8_linear,
                                                        fp8_linear_parts, split_groups)
    from megaserve.kernels.triton_impl.parts import Parts
    from megaserve.kernels.triton_impl.rowwise import rms_norm

    q, s = _weight(n, k, seed=11)
    norm_w = torch.rand(n, device="cuda", dtype=BF16) + 0.5
    sg = split_groups(n, k)
    splits = math.ceil(math.ceil(k / 128) / sg)
    assert splits > 1
    for m in (1, 17, 64, 65, 256, 300):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        res = torch.randn(m, n, device="cuda", dtype=BF16)
        ref = rms_norm(fp8_linear(x, q, s), norm_w, 1e-6, res)
        with poisoned_empty(cuda_only=True):
            got = [api.linear_rms_norm(x, BlockFp8(q, s), norm_w, 1e-6, res)]
            parts = fp8_linear_parts(x, q, s, launch=LinearLaunch(64, 64, 4, 4, parts=True))
            assert isinstance(parts, Parts)
            assert parts.ws.shape[0] == splits
            got.append(rms_norm(parts, norm_w, 1e-6, res))
        for i, (out, h) in enumerate(got):
            assert torch.equal(out, ref[0]) and torch.equal(h, ref[1]), f"M={m} form {i}"


def test_fp8_expert_ffn_launches_give_the_same_bits():
    """Every expert-FFN launch equals the unfused chain (quantize, grouped GEMM, SwiGLU and
    quantize, grouped GEMM), at decode and prefill sizes."""
    from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows, silu_mul_quantize_rows
    from megaserve.kernels.triton_impl.fp8_moe import Fp8MoeLaunch, fp8_expert_ffn, fp8_grouped_gemm

    experts, d, inter, top_k = 128, 2048, 768, 8
    wgu, sgu = _weight(2 * inter, d, experts, seed=3)
    wd, sd = _weight(d, inter, experts, seed=4)
    for tokens in (1, 8, 256, 2048):
        x = torch.randn(tokens, d, device="cuda", dtype=BF16)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k]
                           for _ in range(tokens)]).reshape(-1)
        xq, xs = quantize_rows(x)
        hq, hs = silu_mul_quantize_rows(fp8_grouped_gemm(xq, xs, ids, wgu, sgu, BF16, top_k))
        ref = fp8_grouped_gemm(hq, hs, ids, wd, sd, BF16)
        for lp in (None, Fp8MoeLaunch(64, 32, 64, 4, 4), Fp8MoeLaunch(64, 64, 128, 4, 3),
                   Fp8MoeLaunch(128, 64, 128, 8, 3, x_in_loop=False, h_in_loop=False),
                   Fp8MoeLaunch(64, 64, 128, 4, 3, x_in_loop=True, h_in_loop=False),
                   Fp8MoeLaunch(64, 64, 128, 4, 3, x_in_loop=False, h_in_loop=True),
                   Fp8MoeLaunch(64, 128, 256, 4, 3, x_in_loop=False, h_in_loop=False),
                   Fp8MoeLaunch(64, 128, 128, 4, 3, x_in_loop=False, h_in_loop=False, fused=False),
                   Fp8MoeLaunch(64, 128, 128, 4, 3, x_in_loop=False, h_in_loop=False, fused=False,
                                gluon=True),
                   Fp8MoeLaunch(128, 128, 128, 8, 3, x_in_loop=True, h_in_loop=False, fused=False)):
            got = fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, top_k, launch=lp)
            assert torch.equal(got, ref), f"tokens={tokens} {lp}"


@pytest.mark.parametrize("experts,n,k,top_k", [(128, 1536, 2048, 8), (8, 200, 384, 2)])
def test_fp8_moe_gluon_equals_the_triton_kernel(experts, n, k, top_k):
    """fp8_moe_gluon's grouped GEMM (weights as wgmma's A operand, 16 to 64 positions a
    tile) gives the Triton kernel's bits in both forms: rows gathered by token (gate_up)
    and rows in grouped order scattered back (down), rows routed nowhere included."""
    from megaserve.kernels.triton_impl import fp8_moe_gluon
    from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows
    from megaserve.kernels.triton_impl.fp8_moe import align, fp8_grouped_gemm
    from megaserve.kernels.triton_impl.matmul import num_sms

    q, s = _weight(n, k, experts, seed=11)
    for tokens in (9, 64, 256, 1024):
        x = torch.randn(tokens, k, device="cuda", dtype=BF16)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k]
                           for _ in range(tokens)]).reshape(-1)
        ids[::5] = experts  # routed nowhere
        xq, xs = quantize_rows(x)
        assert fp8_moe_gluon.applies(xq, q, gather=True)
        offsets, order = align(ids, experts)
        ref = fp8_grouped_gemm(xq, xs, ids, q, s, BF16, rows_per_token=top_k)
        keep = ids != experts
        # down form: rows already in grouped order, products scattered to order[p]
        live = int(offsets[-1])
        rows = order[:live].long() // top_k
        grouped_x = torch.zeros(ids.shape[0], k, dtype=torch.uint8, device="cuda")
        grouped_x[:live] = xq.view(torch.uint8)[rows]
        grouped_x = grouped_x.view(xq.dtype)
        grouped_xs = torch.ones(ids.shape[0], xs.shape[1], device="cuda")
        grouped_xs[:live] = xs[rows]
        for block_t in (16, 32, 64):
            with poisoned_empty(cuda_only=True):
                up = torch.empty(ids.shape[0], n, dtype=BF16, device="cuda")
                down = torch.empty(ids.shape[0], n, dtype=BF16, device="cuda")
            fp8_moe_gluon.grouped(xq, xs, q, s, up, offsets, order, num_sms(xq.device),
                                  gather=True, scatter=False, rows_per_token=top_k,
                                  block_t=block_t)
            fp8_moe_gluon.grouped(grouped_x, grouped_xs, q, s, down, offsets, order,
                                  num_sms(xq.device), gather=False, scatter=True,
                                  block_t=block_t)
            assert torch.equal(up[:live], ref[order[:live].long()]), f"{tokens} {block_t}"
            assert torch.equal(down[keep], ref[keep]), f"{tokens} {block_t}"


def test_fp8_expert_ffn_close_to_bf16_and_batch_invariant():
    from megaserve.kernels import expert_ffn, fp8_expert_ffn
    from megaserve.kernels.fp8 import dequantize

    experts, d, inter, top_k = 16, 1024, 512, 4
    wgu, sgu = _weight(2 * inter, d, experts, seed=1)
    wd, sd = _weight(d, inter, experts, seed=2)
    x = torch.randn(512, d, device="cuda", dtype=BF16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(512)]).reshape(-1)
    full = fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, rows_per_token=top_k)
    ref = expert_ffn(x, ids, dequantize(wgu, sgu, BF16), dequantize(wd, sd, BF16), rows_per_token=top_k)
    rel = (full.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 0.08  # e4m3 activations (3 mantissa bits) in both GEMMs
    for m in (1, 7, 64, 200):
        part = fp8_expert_ffn(x[:m], ids[:m * top_k], wgu, sgu, wd, sd, rows_per_token=top_k)
        assert torch.equal(part, full[:m * top_k]), f"tokens={m}"


@pytest.mark.parametrize("tokens", [8, 64, 256])  # Triton linear + inline grouping; Gluon
def test_fp8_pdl_keeps_the_bits_in_a_graph(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """A decode layer's FP8 chain (quantize, qkv- and o_proj-shaped linears, the expert
    FFN), three layers captured back to back in a CUDA graph with every FP8 kernel
    launched with PDL, gives the bits of eager launches without PDL: a kernel that read
    or wrote before its wait would race with the one before it."""
    from megaserve.kernels.triton_impl import fp8_gemm, pdl
    from megaserve.kernels.triton_impl.fp8_gemm import fp8_linear
    from megaserve.kernels.triton_impl.fp8_moe import fp8_expert_ffn

    experts, d, inter, top_k = 128, 2048, 768, 8
    layers = [(_weight(4096, d, seed=10 * i), _weight(d, 4096, seed=10 * i + 1),
               _weight(2 * inter, d, experts, seed=10 * i + 2),
               _weight(d, inter, experts, seed=10 * i + 3)) for i in range(3)]
    x = torch.randn(tokens, d, device="cuda", dtype=BF16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k]
                       for _ in range(tokens)]).reshape(-1)

    def step():
        h = x
        for (wq, sq), (wo, so), (wgu, sgu), (wd, sd) in layers:
            h = fp8_linear(fp8_linear(h, wq, sq), wo, so)
            h = fp8_expert_ffn(h, ids, wgu, sgu, wd, sd, top_k).view(tokens, top_k, d)[:, 1]
        return h

    monkeypatch.setenv(fp8_gemm._PDL_ENV, "")
    want = step().clone()
    monkeypatch.setenv(fp8_gemm._PDL_ENV, ",".join(fp8_gemm.PDL_KERNELS))
    monkeypatch.setenv(pdl.ENV, "1")
    step()  # compiled outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
