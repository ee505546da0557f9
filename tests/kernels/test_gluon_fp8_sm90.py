"""The Gluon FP8 kernels (Hopper only: no interpreter runs them) compile for sm_90 on the
CPU with Triton's bundled ptxas, at the launches the plans make: a broken kernel fails
here, not first on a GPU. Each must keep its FP8 tensor-core instructions (QGMMA), fit
an H100/H200's shared memory and, where the plan relies on it, spill nothing; each
waits for the kernel before it (PDL's ACQBULK) where fp8_gemm.PDL_KERNELS launches it with
PDL, and not elsewhere."""

from __future__ import annotations

import pytest

SMEM_PER_BLOCK = 232448  # bytes an sm_90 block may use


@pytest.mark.parametrize("gather,block_t", [(True, 16), (False, 16), (True, 32)])
def test_fp8_moe_gluon_compiles_for_sm90(gather: bool, block_t: int) -> None:
    """The decode expert GEMM, gate_up (rows gathered by cp.async) and down (rows by TMA)
    forms of Qwen3-30B-A3B's experts, at both token tiles of fp8_moe_gluon.token_tile."""
    from megaserve.kernels.triton_impl import fp8_moe_gluon as fg
    from megaserve.kernels.triton_impl.fp8_gemm import PDL_KERNELS

    n, k = (1536, 2048) if gather else (2048, 768)
    pdl = "gluon_moe" in PDL_KERNELS
    build = fg.sm90_build(128, n, k, gather=gather, block_t=block_t, pdl=pdl)
    assert build.count("QGMMA") >= fg.MMA_GROUPS  # each MMA group's fp8 wgmma
    assert build.smem <= SMEM_PER_BLOCK
    assert (build.count("ACQBULK") > 0) == pdl
    if block_t == 16:  # the decode plan's tile up to 16 rows an expert
        assert build.stack == 0  # nothing spills


@pytest.mark.parametrize("block_m,split_groups", [(64, 32), (128, 32), (128, 8)])
def test_fp8_linear_gluon_compiles_for_sm90(block_m: int, split_groups: int) -> None:
    """The prefill-sized FP8 linear (Qwen3-30B-A3B's o_proj shape) at both tile heights,
    with one K split and with four, output by TMA store."""
    from megaserve.kernels.triton_impl import fp8_gemm_gluon as fg
    from megaserve.kernels.triton_impl.fp8_gemm import PDL_KERNELS

    pdl = "gluon_linear" in PDL_KERNELS
    build = fg.sm90_build(4096, 2048, 4096, split_groups, block_m=block_m, pdl=pdl)
    assert build.count("QGMMA") >= 2
    assert build.smem <= SMEM_PER_BLOCK
    assert (build.count("ACQBULK") > 0) == pdl
    assert build.stack == 0
