"""The Gluon FP8 kernels (Hopper only: no interpreter runs them) compile for sm_90 on the
CPU with Triton's bundled ptxas, at the launches the plans make: a broken kernel fails
here, not first on a GPU. Each must keep its FP8 tensor-core instructions (QGMMA), fit
an H100/H200's shared memory and, where the plan relies on it, spill nothing."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

SMEM_PER_BLOCK = 232448  # bytes an sm_90 block may use


def _compile(fn, args: dict, constexprs: dict, maxnreg: int) -> tuple[str, str, int]:
    """(SASS, ptxas -v report, shared bytes) of ``fn`` compiled for sm_90, the arguments
    specialised as a launch with these values would specialise them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig, attrs, const = {}, {}, {}
    for name, value in args.items():
        index = fn.arg_names.index(name)
        if value is None:
            sig[name], const[(index,)] = "constexpr", None
            continue
        sig[name] = mangle_type(value)
        if isinstance(value, torch.Tensor) or (isinstance(value, int) and value % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name, value in constexprs.items():
        sig[name], const[(fn.arg_names.index(name),)] = "constexpr", value
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, maxnreg=maxnreg))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run(
            [os.path.join(bin_dir, "ptxas"), "-v", "-arch=sm_90a", f"--maxrregcount={maxnreg}",
             os.path.join(tmp, "k.ptx"), "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass",
                               os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
    return sass, report, compiled.metadata.shared


def _desc(t: torch.Tensor, block: list[int], dtype):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor.from_tensor(t, block, layout)


@pytest.mark.parametrize("gather,block_t", [(True, 16), (False, 16), (True, 32)])
def test_fp8_moe_gluon_compiles_for_sm90(gather: bool, block_t: int) -> None:
    """The decode expert GEMM, gate_up (rows gathered by cp.async) and down (rows by TMA)
    forms, at both token tiles of fp8_moe_gluon.token_tile."""
    from triton.experimental.gluon import language as gl

    from megaserve.kernels.triton_impl import fp8_moe_gluon as fg

    experts, n, k = 128, (1536 if gather else 2048), (2048 if gather else 768)
    fp8 = torch.float8_e4m3fn
    w = torch.empty(experts * n, k, dtype=fp8)
    x = torch.empty(1024, k, dtype=fp8)
    ids = torch.empty(1024, dtype=torch.int32)
    args = dict(x_ptr=x, x_desc=None if gather else _desc(x, [block_t, 128], gl.float8e4nv),
                xs_ptr=torch.empty(1024, k // 128),
                w_desc=_desc(w, [fg.BLOCK_W, 128], gl.float8e4nv),
                ws_ptr=torch.empty(experts, n // 128, k // 128),
                c_ptr=torch.empty(1024, n, dtype=torch.bfloat16), order_ptr=ids, offsets_ptr=ids,
                num_experts=experts, N=n, K=k, stride_xm=k, stride_xsm=k // 128,
                stride_wse=n * k // 128**2, stride_wsn=k // 128, stride_cm=n)
    constexprs = dict(GATHER=gather, SCATTER=not gather, ROWS_PER_TOKEN=8 if gather else 1,
                      BLOCK_T=block_t, BLOCK_E=experts, STAGES=fg.stages(block_t), PROGRAMS=132,
                      MMA_REGS=fg.MMA_REGS, LOAD_REGS=fg.LOAD_REGS)
    sass, report, shared = _compile(fg.grouped_kernel, args, constexprs, fg.MAXNREG)
    assert sass.count("QGMMA") >= fg.MMA_GROUPS  # each MMA group's fp8 wgmma
    assert shared <= SMEM_PER_BLOCK
    if block_t == 16:  # the decode plan's tile up to 16 rows an expert
        assert "0 bytes spill stores" in report, report


@pytest.mark.parametrize("block_m", [64, 128])
def test_fp8_linear_gluon_compiles_for_sm90(block_m: int) -> None:
    """The prefill-sized FP8 linear at both tile heights, output by TMA store."""
    from triton.experimental.gluon import language as gl

    from megaserve.kernels.triton_impl import fp8_gemm_gluon as fg

    m, n, k = 4096, 2048, 4096
    fp8 = torch.float8_e4m3fn
    a = torch.empty(m, k, dtype=fp8)
    w = torch.empty(n, k, dtype=fp8)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    box = [64, fg.BLOCK_N if block_m == 128 else fg.BLOCK_N // 2]
    args = dict(a_desc=_desc(a, [block_m, 128], gl.float8e4nv),
                w_desc=_desc(w, [fg.BLOCK_N, 128], gl.float8e4nv),
                as_ptr=torch.empty(m, k // 128), bs_ptr=torch.empty(n // 128, k // 128),
                c_ptr=out, c_desc=_desc(out, box, gl.bfloat16), M=m, N=n, K=k,
                stride_asm=k // 128, stride_bsn=k // 128, stride_cm=n)
    constexprs = dict(SPLIT_GROUPS=0, BLOCK_M=block_m, BLOCK_N=fg.BLOCK_N, STAGES=fg.STAGES,
                      GROUP_M=fg.GROUP_M, PROGRAMS=132, C_TMA=True, MMA_REGS=fg.MMA_REGS,
                      LOAD_REGS=fg.LOAD_REGS)
    sass, report, shared = _compile(fg.linear_kernel, args, constexprs, fg.MAXNREG)
    assert sass.count("QGMMA") >= 2
    assert shared <= SMEM_PER_BLOCK
    assert "0 bytes spill stores" in report, report
