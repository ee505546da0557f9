"""Block-FP8 GEMM benchmarks on one CUDA GPU (``python -m megaserve.kernels.fp8_bench``).

Every time is device time: the calls are captured in one CUDA graph and replayed (no
host launch overhead, as in a decode step), and a call cycles through enough copies of
its weights that they come from device memory, not the L2 (as in a model's layers).

1. GEMMs: the batch-invariant FP8 linear (activation quantization included) against
   ``torch._scaled_mm`` (cuBLAS FP8) twice: row-wise scales on operands already quantized
   (the cheapest cuBLAS FP8 there is), and the same arithmetic as ours, 1 x 128 activation
   groups and 128 x 128 weight blocks, operands also already quantized (where this torch
   and cuBLAS take block scales; "n/a" otherwise); and the
   batch-invariant bf16 linear; on the linears of Qwen3-30B-A3B and DeepSeek-V3.
2. One Qwen3-30B-A3B MoE layer's weight GEMMs at decode batch sizes (qkv, o_proj, 128
   experts top-8): FP8 against bf16, and the FP8 time against the roofline of the weight
   bytes it reads (HBM bandwidth measured in the same run by a device copy).
   Attention, norms, routing and the LM head are not in: it is a layer's GEMM time, not
   an engine's decode step.
3. ``--sweep``: the expert FFN and the decode linears under each bit-neutral launch
   (``Fp8MoeLaunch``, ``LinearLaunch``), to choose the defaults.

``--resources`` needs no GPU: it compiles the kernels at their planned launches for sm_90
and prints registers, spilled bytes, shared memory, QGMMA and async-copy counts (a K loop
without async copies is not software-pipelined). ``--decode-json`` / ``--decode-roofline``
summarise ``megaserve bench decode --json-out`` files.
"""

from __future__ import annotations

import argparse
import math

import torch

_COLD_BYTES = 256 << 20  # weights cycled per timed call: past an H200's 60 MB L2


def graph_us(fns: list, reps: int = 20) -> float:
    """Median device microseconds of one call of ``fns`` (each called in turn), from a
    CUDA graph of all of them replayed ``reps`` times."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for fn in fns:
                fn()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def copies(nbytes: int) -> int:
    return max(1, min(16, -(-_COLD_BYTES // nbytes)))


def random_fp8(n: int, k: int, experts: int | None = None):
    from .triton_impl.fp8_gemm import FP8

    shape = (experts, n, k) if experts else (n, k)
    w = (torch.randn(shape, device="cuda") * 0.02).to(FP8)
    s = torch.rand(*shape[:-2], -(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-4
    return w, s


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = min(graph_us([lambda: dst.copy_(src)], reps=10) for _ in range(3))  # clocks up
    return 2 * src.numel() / (us * 1e-6)


# The linears timed against cuBLAS: name -> (N, K)
GEMM_SHAPES = {"qwen3-30b qkv": (5120, 2048), "qwen3-30b o_proj": (2048, 4096),
               "qwen3-30b lm_head": (151936, 2048), "deepseek-v3 q_b": (24576, 1536),
               "deepseek-v3 o_proj": (7168, 16384), "deepseek-v3 dense up": (36864, 7168)}


def bench_gemms(sizes: list[int]) -> list[float]:
    import dataclasses

    from . import api as kernels
    from .triton_impl.fp8_gemm import fp8_linear, plan_linear, quantize_rows

    ratios, block_ratios, triton_ratios = [], [], []
    block_reason = None  # why cuBLAS first refused block scales (printed once)
    print(f"{'GEMM':22} {'M':>5} {'fp8 (ours) us':>14} {'triton us':>10} {'_scaled_mm us':>14}"
          f" {'block us':>9} {'bf16 (ours) us':>15} {'cuBLAS/ours':>12} {'block/ours':>11}")
    for name, (n, k) in GEMM_SHAPES.items():
        c = copies(n * k)
        fp8 = [random_fp8(n, k) for _ in range(c)]
        bf16 = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(c)]
        sb = torch.rand(1, n, device="cuda")
        for m in sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = graph_us([lambda w=w, s=s: kernels.fp8_linear(x, w, s) for w, s in fp8])
            tri_launch = dataclasses.replace(plan_linear(m, n, k), gluon=False)  # the Triton kernel
            tri = graph_us([lambda w=w, s=s: fp8_linear(x, w, s, launch=tri_launch)
                             for w, s in fp8])
            xq, _ = quantize_rows(x)
            sa = torch.rand(m, 1, device="cuda")
            cublas = graph_us([lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb,
                                                              out_dtype=torch.bfloat16)
                                for w, _ in fp8])
            try:
                block = _block_scaled_us(x, fp8, quantize_rows)
            except (RuntimeError, ValueError) as e:
                block = None
                if block_reason is None:
                    block_reason = str(e).splitlines()[0][:160]
                    print(f"(cuBLAS block-scaled FP8 not available here: {block_reason})")
            b16 = graph_us([lambda w=w: kernels.linear(x, w) for w in bf16])
            ratios.append(cublas / ours)
            triton_ratios.append(cublas / tri)
            if block is not None:
                block_ratios.append(block / ours)
            block_txt = f"{block:9.1f}" if block is not None else f"{'n/a':>9}"
            ratio_txt = f"{block / ours:11.2f}" if block is not None else f"{'n/a':>11}"
            print(f"{name:22} {m:5d} {ours:14.1f} {tri:10.1f} {cublas:14.1f} {block_txt}"
                  f" {b16:15.1f} {cublas / ours:12.2f} {ratio_txt}")
        del fp8, bf16
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"geomean cuBLAS FP8 time / our FP8 time: {geo:.2f} (row-wise scales, quantize not timed)")
    geo_t = math.exp(sum(math.log(r) for r in triton_ratios) / len(triton_ratios))
    print(f"geomean cuBLAS FP8 time / the Triton kernel's time: {geo_t:.2f} (the plan without "
          f"fp8_gemm_gluon)")
    if block_ratios:
        geo_b = math.exp(sum(math.log(r) for r in block_ratios) / len(block_ratios))
        print(f"geomean cuBLAS FP8 time / our FP8 time: {geo_b:.2f} (1 x 128 / 128 x 128 block "
              f"scales as ours, quantize not timed; {len(block_ratios)} of {len(ratios)} shapes)")
    return ratios


def _block_scaled_us(x: torch.Tensor, fp8: list, quantize_rows) -> float:
    """Device us of cuBLAS on our arithmetic, operands already quantized (x by our launch,
    untimed, as for the row-wise baseline): ``torch._scaled_mm`` with the activation's
    1 x 128 group scales `[M, K/128]` (column-major, as cuBLAS's block scaling reads them)
    and the weight's 128 x 128 block scales. Raises what torch raises where this torch or
    cuBLAS takes no block scales."""
    xq, xs = quantize_rows(x)
    sa = xs.t().contiguous().t()  # [M, K/128], stride (1, M)

    def call(w, s):
        return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=s.t(), out_dtype=torch.bfloat16)

    call(*fp8[0])
    torch.cuda.synchronize()
    return graph_us([lambda w=w, s=s: call(w, s) for w, s in fp8])


def _routing(batch: int, experts: int, top_k: int) -> torch.Tensor:
    return torch.stack([torch.randperm(experts, device="cuda")[:top_k]
                        for _ in range(batch)]).reshape(-1)


def bench_moe_layer(batches: list[int], bandwidth: float) -> None:
    from . import api as kernels

    d, inter, experts, top_k, qkv_n, o_k = 2048, 768, 128, 8, 5120, 4096
    wq, sq = random_fp8(qkv_n, d)
    wo, so = random_fp8(d, o_k)
    wgu, sgu = random_fp8(2 * inter, d, experts)
    wd, sd = random_fp8(d, inter, experts)
    bq = (torch.randn(qkv_n, d, device="cuda") * 0.02).bfloat16()
    bo = (torch.randn(d, o_k, device="cuda") * 0.02).bfloat16()
    bgu = (torch.randn(experts, 2 * inter, d, device="cuda") * 0.02).bfloat16()
    bd = (torch.randn(experts, d, inter, device="cuda") * 0.02).bfloat16()
    print(f"\nQwen3-30B-A3B MoE layer GEMMs (qkv, o_proj, experts top-{top_k} of {experts}); "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'batch':>5} {'bf16 us':>9} {'fp8 us':>9} {'fp8/bf16 speed':>15} {'fp8 roofline us':>16}"
          f" {'fp8 % roofline':>15}")
    for b in batches:
        x = torch.randn(b, d, device="cuda", dtype=torch.bfloat16)
        xo = torch.randn(b, o_k, device="cuda", dtype=torch.bfloat16)
        ids = _routing(b, experts, top_k)
        hit = int(torch.unique(ids).numel())

        def run_bf16():
            kernels.linear(x, bq)
            kernels.linear(xo, bo)
            kernels.expert_ffn(x, ids, bgu, bd, rows_per_token=top_k)

        def run_fp8():
            kernels.fp8_linear(x, wq, sq)
            kernels.fp8_linear(xo, wo, so)
            kernels.fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, rows_per_token=top_k)

        t16 = graph_us([run_bf16])
        t8 = graph_us([run_fp8])
        weight_bytes = qkv_n * d + d * o_k + hit * 3 * inter * d  # e4m3: one byte each
        roof = weight_bytes / bandwidth * 1e6
        print(f"{b:5d} {t16:9.1f} {t8:9.1f} {t16 / t8:15.2f} {roof:16.1f} {100 * roof / t8:14.0f}%")


# (block_m, up_n, down_n, warps, stages, x_in_loop, h_in_loop, fused)
MOE_SWEEP = ((64, 64, 128, 4, 3, 1, 1, 1), (64, 64, 128, 4, 3, 0, 0, 1),
             (64, 128, 128, 4, 4, 0, 0, 0), (64, 128, 128, 4, 5, 0, 0, 0),
             (64, 128, 64, 4, 4, 0, 0, 0), (64, 64, 128, 4, 4, 0, 0, 0),
             (64, 128, 128, 8, 4, 0, 0, 0), (128, 128, 128, 8, 3, 0, 0, 0))
# (block_m, block_n, warps, stages, parts, quant_a)
LINEAR_SWEEP = ((64, 64, 4, 4, 1, 1), (64, 64, 4, 4, 1, 0), (64, 64, 4, 3, 1, 0),
                (64, 128, 4, 4, 1, 0), (64, 128, 4, 3, 0, 0), (128, 64, 8, 4, 1, 0),
                (128, 128, 8, 3, 0, 0))


def sweep(batches: list[int], bandwidth: float) -> None:
    """The expert FFN (Qwen3-30B-A3B shape) and decode linears under each launch."""
    from . import api as kernels
    from .triton_impl.fp8_gemm import LinearLaunch, fp8_linear
    from .triton_impl.fp8_moe import Fp8MoeLaunch, fp8_expert_ffn

    d, inter, experts, top_k = 2048, 768, 128, 8
    wgu, sgu = random_fp8(2 * inter, d, experts)
    wd, sd = random_fp8(d, inter, experts)
    bgu = (torch.randn(experts, 2 * inter, d, device="cuda") * 0.02).bfloat16()
    bd = (torch.randn(experts, d, inter, device="cuda") * 0.02).bfloat16()
    print(f"\nexpert FFN sweep (us; roofline: the fp8 expert bytes at {bandwidth / 1e12:.2f} TB/s)")
    print("launch (m, up_n, down_n, warps, stages, x_in_loop, h_in_loop, fused): "
          + " | ".join(str(c) for c in MOE_SWEEP))
    for b in batches:
        x = torch.randn(b, d, device="cuda", dtype=torch.bfloat16)
        ids = _routing(b, experts, top_k)
        roof = int(torch.unique(ids).numel()) * 3 * inter * d / bandwidth * 1e6
        t16 = graph_us([lambda: kernels.expert_ffn(x, ids, bgu, bd, rows_per_token=top_k)])
        times = [graph_us([lambda lp=Fp8MoeLaunch(*c[:5], *(bool(f) for f in c[5:])):
                            fp8_expert_ffn(x, ids, wgu, sgu, wd, sd, top_k, lp)])
                 for c in MOE_SWEEP]
        best = min(range(len(times)), key=times.__getitem__)
        print(f"batch {b:5d}: bf16 {t16:7.1f}  fp8 " + " ".join(f"{t:7.1f}" for t in times)
              + f"  best {MOE_SWEEP[best]} {100 * roof / times[best]:.0f}% of roofline")
    print("\nlinear sweep (us), launch (m, n, warps, stages, parts, quant_a): "
          + " | ".join(str(c) for c in LINEAR_SWEEP))
    for name, (n, k) in {"qkv": (5120, 2048), "o_proj": (2048, 4096),
                         "ds kv_a": (576, 7168), "ds o_proj": (7168, 16384)}.items():
        c = copies(n * k)
        fp8 = [random_fp8(n, k) for _ in range(c)]
        bf16 = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(c)]
        for m in (1, 64, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t16 = graph_us([lambda w=w: kernels.linear(x, w) for w in bf16])
            times = []
            for cfg in LINEAR_SWEEP:
                lp = LinearLaunch(*cfg[:4], parts=bool(cfg[4]), quant_a=bool(cfg[5]))
                times.append(graph_us([lambda w=w, s=s: fp8_linear(x, w, s, launch=lp)
                                        for w, s in fp8]))
            roof = n * k / bandwidth * 1e6
            print(f"{name:10} M={m:3d}: bf16 {t16:6.1f} fp8 " + " ".join(f"{t:6.1f}" for t in times)
                  + f"  roof {roof:5.1f}")
        del fp8, bf16


def _compile_sm90(fn, ptr_types: dict, constexprs: dict, num_warps: int,
                  num_stages: int) -> dict:
    """Compile ``fn`` for sm_90 (an H100/H200) without a GPU: {regs, stack (spilled bytes),
    smem (bytes), qgmma (fp8 wgmma instructions in the SASS), async_copies (TTGIR)}."""
    from .triton_impl.sm90 import compile_sm90

    args = {name: ptr_types.get(name, "i32") for name in fn.arg_names if name not in constexprs}
    build = compile_sm90(fn, args, constexprs, num_warps=num_warps, num_stages=num_stages,
                         divisible=tuple(n for n in args if n.startswith("stride")
                                         or n in ("N", "K")))  # as the JIT marks them here
    return dict(_usage(build), async_copies=build.ttgir.count("async_copy"))


def resources() -> None:
    """Registers, spills, shared memory and QGMMA count of the FP8 kernels at the planned
    launches, compiled for sm_90 on this machine (no GPU needed): the Triton kernels, and
    the Gluon ones where the plan runs them on Hopper."""
    from .triton_impl import fp8_gemm, fp8_gemm_gluon, fp8_moe, fp8_moe_gluon

    moe_ptrs = dict(a_ptr="*bf16", as_ptr="*fp32", w_ptr="*fp8e4nv", wsc_ptr="*fp32",
                    c_ptr="*bf16", ids_ptr="*i64", order_ptr="*i32", offsets_ptr="*i32")
    rows_launches = {1: 8, 64: 512, 256: 2048, 1024: 8192}
    for batch, rows in rows_launches.items():
        lp = fp8_moe.plan_moe(rows, 128)
        inline = rows <= fp8_moe.INLINE_ALIGN_MAX_ROWS
        for name, n, swiglu, quant, gather in (
                ("gate_up", 768 if lp.fused else 1536, lp.fused, lp.x_in_loop, True),
                ("down", 2048, False, lp.h_in_loop, False)):
            ptrs = dict(moe_ptrs, a_ptr="*bf16" if quant else "*fp8e4nv",
                        c_ptr="*fp32" if swiglu else "*bf16")
            if name == "down":
                ptrs["a_ptr"] = ("*fp32" if lp.fused else "*bf16") if quant else "*fp8e4nv"
            block_n = lp.up_n if name == "gate_up" else lp.down_n
            cx = dict(QUANT_A=quant, SWIGLU=swiglu, ROUND=1, GATHER=gather,
                      SCATTER=not gather, ROWS_PER_TOKEN=8 if gather else 1, INLINE=inline,
                      BLOCK_M=lp.block_m, BLOCK_N=block_n, BLOCK_E=128,
                      BLOCK_R=max(16, rows) if inline else 16,
                      WS_SCALAR=block_n <= 128, GROUP=128, FP8_MAX=448.0)
            res = _compile_sm90(fp8_moe.expert_kernel, ptrs, cx, lp.num_warps,
                                lp.num_stages)
            print(f"expert {name:7} batch {batch:5d} {lp}: {res}", flush=True)
            if lp.gluon and not inline:
                block_t = fp8_moe_gluon.token_tile(rows, 128)
                build = fp8_moe_gluon.sm90_build(128, n, 2048 if gather else 768,
                                                 gather=gather, block_t=block_t,
                                                 pdl="gluon_moe" in fp8_gemm.PDL_KERNELS)
                print(f"expert {name:7} batch {batch:5d} Gluon, {block_t} positions a tile: "
                      f"{_usage(build)}", flush=True)
    lin_ptrs = dict(a_ptr="*bf16", as_ptr="*bf16", b_ptr="*fp8e4nv", bs_ptr="*fp32",
                    c_ptr="*bf16", ws_ptr="*fp32")
    for m in (1, 256, 4096):
        for n, k in ((5120, 2048), (2048, 4096)):
            lp = fp8_gemm.plan_linear(m, n, k)
            sg = fp8_gemm.split_groups(n, k)
            splits = -(-(-(-k // 128)) // sg)
            ptrs = dict(lin_ptrs) if lp.quant_a else dict(lin_ptrs, a_ptr="*fp8e4nv",
                                                          as_ptr="*fp32")
            cx = dict(SPLIT_GROUPS=sg, SPLITS=splits, PARTS=lp.parts and splits > 1,
                      QUANT_A=lp.quant_a, BLOCK_M=lp.block_m, BLOCK_N=lp.block_n, GROUP=128,
                      FP8_MAX=448.0, PDL=True)
            res = _compile_sm90(fp8_gemm.linear_kernel, ptrs, cx, lp.num_warps,
                                lp.num_stages)
            print(f"linear {n}x{k} M={m:5d} {lp}: {res}", flush=True)
            if lp.gluon:
                build = fp8_gemm_gluon.sm90_build(
                    m, n, k, sg, block_m=fp8_gemm_gluon.tile_rows(m, n, 132),
                    pdl="gluon_linear" in fp8_gemm.PDL_KERNELS)
                print(f"linear {n}x{k} M={m:5d} Gluon: {_usage(build)}", flush=True)


def _usage(build) -> dict:
    return dict(regs=build.regs, stack=build.stack, smem=build.smem, qgmma=build.count("QGMMA"))


def summarize_decode(bf16_json: str, fp8_json: str) -> None:
    """The fp8-vs-bf16 table of two ``megaserve bench decode --json-out`` files of one
    model: tok/s of each and the FP8 step against the roofline of the bytes FP8 moves
    (attention and expert weights one byte each; KV and LM head stay 16-bit)."""
    import json

    bf16, fp8 = (json.loads(open(f).read()) for f in (bf16_json, fp8_json))
    bandwidth = fp8["copy_bandwidth_gbs"] * 1e9
    print(f"\n{fp8['model']} decode on {fp8['device']}: fp8 vs bf16 (copy {bandwidth / 1e12:.2f} TB/s)")
    print(f"{'batch':>5} {'bf16 tok/s':>11} {'fp8 tok/s':>10} {'fp8/bf16':>9} {'fp8 roof ms':>12}"
          f" {'fp8 step ms':>12} {'fp8 % roof':>11}{_STEADY_HEAD}")
    for a, b in zip(bf16["decode"], fp8["decode"]):
        roof = fp8_roofline_ms(fp8, b, bandwidth)
        print(f"{b['batch']:5d} {a['tok_s']:11.0f} {b['tok_s']:10.0f} {b['tok_s'] / a['tok_s']:9.2f}"
              f" {roof:12.3f} {b['step_ms_median']:12.3f}"
              f" {100 * roof / b['step_ms_median']:10.0f}%{_steady(b, roof)}")


def summarize_roofline(fp8_json: str) -> None:
    """One fp8 ``megaserve bench decode --json-out`` file against its bytes' roofline
    (no bf16 run: a model whose bf16 weights do not fit one GPU)."""
    import json

    fp8 = json.loads(open(fp8_json).read())
    bandwidth = fp8["copy_bandwidth_gbs"] * 1e9
    print(f"\n{fp8['model']} ({fp8['num_layers']} layers) fp8 decode on {fp8['device']} "
          f"(copy {bandwidth / 1e12:.2f} TB/s)")
    print(f"{'batch':>5} {'tok/s':>8} {'step ms':>9} {'roof ms':>9} {'% roof':>7}{_STEADY_HEAD}")
    for b in fp8["decode"]:
        roof = fp8_roofline_ms(fp8, b, bandwidth)
        print(f"{b['batch']:5d} {b['tok_s']:8.0f} {b['step_ms_median']:9.3f} {roof:9.3f}"
              f" {100 * roof / b['step_ms_median']:6.0f}%{_steady(b, roof)}")


# The steady step (back to back, as a serving loop runs; bench decode's steady_step_ms,
# absent from older reports) beside the synchronised median.
_STEADY_HEAD = f" {'steady ms':>10} {'% roof':>7}"


def _steady(run: dict, roof: float) -> str:
    ms = run.get("steady_step_ms")
    return f" {ms:10.3f} {100 * roof / ms:6.0f}%" if ms else f" {'-':>10} {'-':>7}"


def fp8_roofline_ms(report: dict, run: dict, bandwidth: float) -> float:
    """Milliseconds to move one decode step's bytes with attention and expert weights in
    FP8 (one byte each; KV and LM head 16-bit) at ``bandwidth`` bytes/s. ``run``: one of
    ``report``'s decode runs; a report whose weights were FP8 (``weight_elt_bytes`` 1)
    counted them so already, an older one at two bytes."""
    by = run["bytes"]
    weights = by["attention_weights"] + by["expert_weights"]
    if report.get("weight_elt_bytes") != 1:
        weights /= 2
    return (weights + by["kv_read"] + by["kv_write"] + by["lm_head"]) / bandwidth * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemm-sizes", type=int, nargs="+", default=[64, 256, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--sweep", action="store_true", help="also time every launch (sweep)")
    parser.add_argument("--decode-json", nargs=2, metavar=("BF16", "FP8"),
                        help="only summarise two `megaserve bench decode --json-out` files")
    parser.add_argument("--decode-roofline", metavar="FP8",
                        help="only summarise one fp8 decode file against its roofline")
    parser.add_argument("--resources", action="store_true",
                        help="only compile the FP8 kernels for sm_90 (no GPU needed) and print "
                             "registers, spills, shared memory and QGMMA count")
    args = parser.parse_args()
    if args.resources:
        resources()
        return
    if args.decode_json:
        summarize_decode(*args.decode_json)
        return
    if args.decode_roofline:
        summarize_roofline(args.decode_roofline)
        return
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    bandwidth = copy_bandwidth()
    bench_gemms(args.gemm_sizes)
    bench_moe_layer(args.batches, bandwidth)
    if args.sweep:
        sweep(args.batches, bandwidth)


if __name__ == "__main__":
    main()
