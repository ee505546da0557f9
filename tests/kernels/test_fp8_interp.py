"""The block-FP8 Triton GEMMs under the Triton interpreter (CPU, CI): values against a
float64 reference of the same quantized operands, per-row independence (any M, any
grouping of routed rows, rows routed nowhere), no unwritten output.

The interpreter's ``tl.dot`` is a fixed serial fp32 sum (tests/kernels/interp_support.py),
not Hopper's FP8 tensor-core accumulation: the bitwise checks here test the kernels'
structure (a row's chain never depends on the other rows); tests/kernels/test_fp8_gpu.py
checks the hardware's bits.
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels import interp_support
from tests.kernels.poison import poisoned_empty

CHECKS = ["fp8_linear", "fp8_linear_launches", "fp8_grouped", "fp8_expert_ffn"]


def _weights(torch, n, k, experts=None):
    from megaserve.models.quantization import quantize

    parts = [quantize(torch.randn(n, k) / k**0.5) for _ in range(experts or 1)]
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return (q, s) if experts else (q[0], s[0])


def _reference(torch, x, q, s):
    """float64 dequant(quantize_rows(x)) @ dequant(q).T and the |x| @ |w| bound."""
    from megaserve.kernels.fp8 import dequantize
    from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows

    xq, xs = quantize_rows(x)
    xd = xq.double() * xs.double().repeat_interleave(128, 1)[:, : x.shape[1]]
    wd = dequantize(q, s, torch.float64)
    return xd @ wd.T, xd.abs() @ wd.abs().T


def _close(got, ref, ref_abs) -> bool:
    """float32 outputs (the interpreter truncates float32 to bfloat16 where the GPU rounds):
    fp32 accumulation, relative to sum |x||w| (results may cancel)."""
    return bool(((got.double() - ref).abs() <= ref_abs * 2**-20).all())


def check_fp8_linear(torch, ti) -> None:
    from megaserve.kernels.triton_impl.fp8_gemm import fp8_linear

    for n, k in [(300, 200), (128, 384), (130, 129)]:  # ragged N and K blocks
        q, s = _weights(torch, n, k)
        x = torch.randn(70, k).bfloat16()
        with poisoned_empty():
            full = fp8_linear(x, q, s)
        assert not full.isnan().any(), "unwritten output"
        full32 = fp8_linear(x, q, s, out_dtype=torch.float32)
        assert _close(full32, *_reference(torch, x, q, s)), f"values {n}x{k}"
        for m in (1, 3, 64, 65):
            assert torch.equal(fp8_linear(x[:m], q, s), full[:m]), f"M={m}"
        perm = torch.randperm(70)
        assert torch.equal(fp8_linear(x[perm], q, s), full[perm]), "row order"


def check_fp8_linear_launches(torch, ti) -> None:
    """Every launch (tiles, K splits folded in registers or through the workspace, the
    activation quantized in the K loop or before) gives the same bits; the split rule
    splits a small-N, long-K weight."""
    from megaserve.kernels.triton_impl.fp8_gemm import LinearLaunch, fp8_linear, split_groups

    n, k = 130, 1100  # 9 groups, ragged N and K
    assert split_groups(n, k) < 9, "the split rule does not split this weight"
    q, s = _weights(torch, n, k)
    x = torch.randn(5, k).bfloat16()
    ref = fp8_linear(x, q, s, launch=LinearLaunch())
    assert _close(fp8_linear(x, q, s, out_dtype=torch.float32),
                  *_reference(torch, x, q, s)), "values"
    for lp in (LinearLaunch(64, 64, parts=True, quant_a=True), LinearLaunch(128, 32, 8, 2),
               LinearLaunch(64, 256, parts=True), LinearLaunch(128, 128, quant_a=True)):
        with poisoned_empty():
            got = fp8_linear(x, q, s, launch=lp)
        assert torch.equal(got, ref), f"launch {lp}"
    check_fp8_parts_folded_by_the_norm(torch, ti, q, s, x)


def check_fp8_parts_folded_by_the_norm(torch, ti, q, s, x) -> None:
    """The parts launch left to the norm (fp8_linear_parts: no fold launch) gives the
    folded linear then the norm's bits, every part written (a poisoned workspace)."""
    from megaserve.kernels.triton_impl.fp8_gemm import (LinearLaunch, fp8_linear,
                                                        fp8_linear_parts)
    from megaserve.kernels.triton_impl.parts import Parts

    n = q.shape[0]
    x = x.half()  # the interpreter adds bf16 as raw uint16 (check_linear_parts: fp16 too)
    w = torch.rand(n).half() + 0.5
    res = torch.randn(x.shape[0], n).half()
    ref = ti.rms_norm(fp8_linear(x, q, s), w, 1e-6, res)
    with poisoned_empty():
        parts = fp8_linear_parts(x, q, s, launch=LinearLaunch(64, 64, parts=True))
    assert isinstance(parts, Parts) and parts.ws.shape[0] > 1
    out, h = ti.rms_norm(parts, w, 1e-6, res)
    assert torch.equal(out, ref[0]) and torch.equal(h, ref[1]), "norm of the parts"


def check_fp8_grouped(torch, ti) -> None:
    from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows
    from megaserve.kernels.triton_impl.fp8_moe import fp8_grouped_gemm

    experts, top_k, tokens = 5, 2, 70
    q, s = _weights(torch, 200, 160, experts)
    x = torch.randn(tokens, 160).bfloat16()
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).reshape(-1)
    xq, xs = quantize_rows(x)
    with poisoned_empty():
        full = fp8_grouped_gemm(xq, xs, ids, q, s, torch.bfloat16, rows_per_token=top_k)
    assert not full.isnan().any(), "unwritten output"
    full32 = fp8_grouped_gemm(xq, xs, ids, q, s, torch.float32, rows_per_token=top_k)
    for r in (0, 1, 77, 139):
        e = int(ids[r])
        assert _close(full32[r][None], *_reference(torch, x[r // top_k][None], q[e], s[e])), f"row {r}"
    for m in (1, 2, 33):  # 2 and 4 rows: inline grouping; 66: the align launch
        part = fp8_grouped_gemm(xq[:m], xs[:m], ids[: m * top_k], q, s, torch.bfloat16, top_k)
        assert torch.equal(part, full[: m * top_k]), f"tokens={m}"
    tiles = fp8_grouped_gemm(xq, xs, ids, q, s, torch.bfloat16, top_k, block_m=128, block_n=64)
    assert torch.equal(tiles, full), "tile shape"
    dropped = ids.clone()
    dropped[::3] = experts  # routed nowhere
    part = fp8_grouped_gemm(xq, xs, dropped, q, s, torch.bfloat16, top_k)
    keep = dropped != experts
    assert torch.equal(part[keep], full[keep]), "rows routed nowhere disturbed the others"


def check_fp8_expert_ffn(torch, ti) -> None:
    from megaserve.kernels.fp8 import dequantize
    from megaserve.kernels.triton_impl.fp8_gemm import quantize_rows, silu_mul_quantize_rows
    from megaserve.kernels.triton_impl.fp8_moe import Fp8MoeLaunch, fp8_expert_ffn, fp8_grouped_gemm

    experts, d, inter, top_k = 4, 256, 128, 2
    wgu, sgu = _weights(torch, 2 * inter, d, experts)
    wd, sd = _weights(torch, d, inter, experts)
    x = torch.randn(40, d).bfloat16()
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(40)]).reshape(-1)
    full = fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, top_k)
    # against the float SwiGLU on the dequantized weights: e4m3 activations in both GEMMs
    xf = x.double()
    ref = torch.stack([
        dequantize(wd[e], sd[e], torch.float64)
        @ (lambda gu: torch.nn.functional.silu(gu[:inter]) * gu[inter:])(
            dequantize(wgu[e], sgu[e], torch.float64) @ xf[r // top_k])
        for r, e in enumerate(ids.tolist())])
    # e4m3 activations in both GEMMs (0.06 on the GPU); the interpreter's float32 -> e4m3
    # rounding drops the carry into the exponent (124.3 -> 64, not 128: ~2% of values), so
    # the bound here is looser. A wiring error (halves swapped, no silu) is off by O(1).
    rel = float((full.double() - ref).norm() / ref.norm())
    assert rel < 0.15, f"values: relative error {rel:.4f}"
    for m in (1, 7):
        part = fp8_expert_ffn(x[:m], ids[: m * top_k], wgu, sgu, wd, sd, top_k)
        assert torch.equal(part, full[: m * top_k]), f"tokens={m}"
    # The fused launches equal the unfused chain: quantize, grouped GEMM, SwiGLU and
    # quantize, grouped GEMM; and each other (quantization in the K loops or in the
    # epilogue, other tiles).
    xq, xs = quantize_rows(x)
    gate_up = fp8_grouped_gemm(xq, xs, ids, wgu, sgu, torch.bfloat16, top_k)
    hq, hs = silu_mul_quantize_rows(gate_up)
    down = fp8_grouped_gemm(hq, hs.contiguous(), ids, wd, sd, torch.bfloat16, 1)
    assert torch.equal(down, full), "fused chain differs from the unfused one"
    for lp in (Fp8MoeLaunch(128, 128, 64, 8, 2, x_in_loop=False, h_in_loop=False),
               Fp8MoeLaunch(64, 32, 256, h_in_loop=False), Fp8MoeLaunch(64, 256, 64, x_in_loop=False),
               Fp8MoeLaunch(64, 64, 128, x_in_loop=False, h_in_loop=False, fused=False)):
        with poisoned_empty():
            got = fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, top_k, launch=lp)
        assert torch.equal(got, full), f"launch {lp}"


def _child() -> None:
    interp_support.install()  # fixed-order tl.dot: bits independent of the host BLAS
    interp_support.run_checks(globals(), CHECKS)


interp_results = interp_support.results_fixture(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_fp8_kernel_under_interpreter(interp_results: dict[str, dict], name: str) -> None:
    interp_support.assert_check_passed(interp_results, name)


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
