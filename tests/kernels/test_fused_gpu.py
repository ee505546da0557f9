"""The fused decode-path kernels on a CUDA GPU: the interpreter checks of
tests/kernels/test_fused_interp.py (float64 reference, poisoned outputs and caches, row
invariance, bitwise equality with the unfused kernels) in bfloat16, float16 and float32,
at Qwen3-30B-A3B's shapes and at odd ones.

The rotary check's "equal to the unfused kernels" runs in bfloat16 and float16 only. With
float32 inputs the fused and the unfused kernel differed in the last bit on an H100,
likely because each kernel's compiled sum of squares may or may not contract a square
into an FMA (a square is exact in fp32 for 16-bit inputs, not for fp32 ones). Each kernel
is still batch-invariant, and the CUDA engine never runs float32 (``linear`` refuses it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels import test_fused_interp as checks

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_rotary_and_cache_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    # (Hq, Hkv, Dh): Qwen3-30B-A3B, Mixtral, odd head dims, one KV head
    shapes = [(32, 4, 128), (32, 8, 128), (8, 2, 48), (4, 4, 16), (14, 2, 64), (16, 1, 80)]
    checks.check_rotary_and_cache(torch, ti, "cuda", [dtype], shapes, t=37)
    checks.check_rotary_and_cache(torch, ti, "cuda", [dtype], [(32, 4, 128)], t=700)


@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_rotary_and_cache_prefill_launches_gpu(dtype: torch.dtype) -> None:
    """Prefill sizes, where the default launch tiles tokens with all their heads: each
    launch (row tiles, token tiles) bitwise equal to the unfused kernels, to the default
    launch and to the float64 reference, at a 4096-token chunk and an odd token count."""
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    launches = checks.ROTARY_LAUNCHES + [
        dataclasses.astuple(ti.attention.ROTARY_PREFILL), (8, 8, 1), (4, 4, 4), (32, 32, 1),
        (16, 16, 2), (32, 8, 1), (64, 16, 1), (16, 4, 2), (16, 2, 1), (1, 8, 1, 1),
        (1, 4, 1, 2), (1, 8, 1, 2), (1, 4, 2, 1), (1, 8, 1, 4)]
    checks.check_rotary_and_cache(torch, ti, "cuda", [dtype], [(32, 4, 128)], t=4096,
                                  launches=launches)
    checks.check_rotary_and_cache(torch, ti, "cuda", [dtype], [(32, 4, 128)], t=1000,
                                  launches=launches)
    # (Hq, Hkv, Dh): odd head dims, narrow heads, a 256-wide head, one KV head
    shapes = [(8, 2, 48), (4, 4, 16), (16, 1, 80), (8, 2, 256), (16, 1, 64), (4, 2, 32)]
    checks.check_rotary_and_cache(torch, ti, "cuda", [dtype], shapes, t=1000,
                                  launches=checks.ROTARY_LAUNCHES)


def test_rotary_and_cache_refuses_a_split_row_gpu() -> None:
    """float32 rows of 256 do not fit one warp's 16-byte accesses: the default launch keeps
    one row per program at any size, and a tiled launch is refused."""
    import megaserve.kernels.triton_impl as ti

    t, hq, hkv, dh = 200, 4, 2, 256
    qkv = torch.randn(t, (hq + 2 * hkv) * dh, device="cuda")
    pos = torch.arange(t, device="cuda")
    cos, sin = checks._rotary_tables(torch, t, dh, torch.float32, "cuda")
    caches = [torch.zeros(t, 1, hkv, dh, device="cuda") for _ in range(2)]
    slots = torch.arange(t, device="cuda")
    args = (qkv, pos, cos, sin, None, None, 1e-6, *caches, slots, hq)
    q = ti.rotary_and_cache(*args)
    assert torch.equal(q, ti.rotary_and_cache(*args, launch=ti.attention.ROTARY_ONE_ROW))
    with pytest.raises(ValueError):
        ti.rotary_and_cache(*args, launch=ti.attention.ROTARY_PREFILL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_residual_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    # (k, D): Qwen3-30B-A3B, Mixtral, Qwen2-MoE, top-1, odd hidden sizes
    shapes = [(8, 2048), (2, 4096), (4, 2048), (1, 2048), (1, 64), (3, 200), (8, 7168)]
    checks.check_combine_residual(torch, ti, "cuda", [dtype], shapes, t=37)
    checks.check_combine_residual(torch, ti, "cuda", [dtype], [(8, 2048)], t=600)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_rms_norm_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    checks.check_residual_rms_norm(torch, ti, "cuda", [dtype], (2048, 4096, 7168, 64, 200),
                                   t=300)
