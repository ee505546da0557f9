"""``megaserve bench kernels``: our batch-invariant kernels vs cuBLAS / SDPA, same run.

Prints (with the device name) the matmul table of issue 3 — (K, N) × M, our linear vs
``torch.mm`` — with the geometric mean of the speed ratio, then paged-attention decode
and prefill vs torch SDPA (flash backend). Times are medians of CUDA-event timings
(``triton.testing.do_bench``) on random data.
"""

from __future__ import annotations

import argparse
import math
import sys

from .testing import paged_inputs, time_ms

SHAPES_KN = [(4096, 14336), (14336, 4096), (7168, 2048), (2048, 7168), (4096, 4096)]
MS = [1, 8, 32, 128, 512, 2048, 8192]


def bench_matmul(dtype, ms: list[int], shapes: list[tuple[int, int]], config_fn=None,
                 eager: bool = True) -> list[dict]:
    """Rows of {K, N, M, ours_us, cublas_us, ratio, tflops, eager_us}; ratio = cublas / ours
    (graph replays for both). ``config_fn(n, k, dtype)`` overrides the tiling (tuning)."""
    import torch

    from .triton_impl.matmul import linear

    rows = []
    for k, n in shapes:
        w = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w_t = w.t()
            cfg = config_fn(n, k, dtype) if config_fn else None
            ours = time_ms(lambda: linear(x, w, config=cfg))
            ref = time_ms(lambda: torch.mm(x, w_t))
            eager_ms = time_ms(lambda: linear(x, w, config=cfg), graph=False) if eager else 0.0
            rows.append(dict(K=k, N=n, M=m, ours_us=ours * 1e3, cublas_us=ref * 1e3,
                             ratio=ref / ours, tflops=2 * m * n * k / ours / 1e9,
                             eager_us=eager_ms * 1e3))
    return rows


def bench_attention(dtype) -> list[dict]:
    """Decode (1 new token) and prefill (causal) vs SDPA's flash backend, same data."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .triton_impl.attention import paged_attention

    hq, hkv, dh = 32, 8, 128
    cases = [("decode", 64, 4096, 1), ("decode", 8, 8192, 1), ("prefill", 4, 4096, 4096)]
    rows = []
    for name, seqs, ctx, new in cases:
        q, kc, vc, table, lens, qsl, kd, vd = paged_inputs(seqs, ctx, new, hq, hkv, dh, dtype)
        scale = dh**-0.5
        ours = time_ms(lambda: paged_attention(q, kc, vc, table, lens, qsl, scale))
        qd = q.view(seqs, new, hq, dh).transpose(1, 2)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = time_ms(lambda: F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=new > 1, scale=scale, enable_gqa=True))
        causal_pairs = new * ctx - new * (new - 1) / 2
        rows.append(dict(case=f"{name} S={seqs} ctx={ctx} new={new}", ours_us=ours * 1e3,
                         sdpa_us=ref * 1e3, ratio=ref / ours,
                         tflops=4 * seqs * hq * dh * causal_pairs / ours / 1e9))
    return rows


# Qwen3-30B-A3B per-layer shape (hidden 2048, 32 q / 4 kv heads of 128, 128 experts,
# top-8, expert intermediate 768, vocab 151936); only the layer count is cut.
ENGINE_MODEL = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16",
)


def write_engine_checkpoint(path: str, num_layers: int) -> None:
    """A random bf16 HF checkpoint of :data:`ENGINE_MODEL`'s shape with ``num_layers``
    layers in ``path`` (config.json + model.safetensors; no tokenizer: token-id prompts)."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    cfg = dict(ENGINE_MODEL, num_hidden_layers=num_layers)
    d, v, dh = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    hq, hkv, e, i = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                     cfg["num_experts"], cfg["moe_intermediate_size"])
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen) * std
        return t.to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(v, d), "lm_head.weight": rand(v, d),
               "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)}
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            a + "q_proj.weight": rand(hq * dh, d), a + "k_proj.weight": rand(hkv * dh, d),
            a + "v_proj.weight": rand(hkv * dh, d), a + "o_proj.weight": rand(d, hq * dh),
            a + "q_norm.weight": torch.ones(dh, dtype=torch.bfloat16),
            a + "k_norm.weight": torch.ones(dh, dtype=torch.bfloat16),
            p + "mlp.gate.weight": rand(e, d),
        })
        for x in range(e):
            m = f"{p}mlp.experts.{x}."
            tensors.update({m + "gate_proj.weight": rand(i, d), m + "up_proj.weight": rand(i, d),
                            m + "down_proj.weight": rand(d, i)})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def bench_engine(path: str, num_prompts: int, input_len: int, output_len: int,
                 repeats: int = 2) -> list[dict]:
    """Generated tokens/s of ``megaserve bench throughput`` on CUDA bf16, one child process
    per run (the backend is chosen once per process), ``repeats`` rounds of three runs:
    our kernels and ``MEGASERVE_KERNELS=reference`` (cuBLAS/SDPA) both eager (the same
    engine, only the kernels differ: the cost of invariance), then ours with decode CUDA
    graphs (the reference backend cannot be captured: its varlen attention reads lengths
    on the host). The first round also fills Triton's compile cache. Runs the CLI as a
    program: kernels never imports megaserve."""
    import os
    import subprocess

    rows = []
    for backend, graphs in (("triton", False), ("reference", False), ("triton", True)) * repeats:
        env = dict(os.environ)
        env.pop("MEGASERVE_KERNELS", None)
        if backend == "reference":
            env["MEGASERVE_KERNELS"] = "reference"
        cmd = [sys.executable, "-m", "megaserve.cli", "bench", "throughput", "--model", path,
               "--device", "cuda", "--dtype", "bfloat16", "--num-prompts", str(num_prompts),
               "--max-num-seqs", str(num_prompts), "--input-len", str(input_len),
               "--output-len", str(output_len)] + ([] if graphs else ["--no-cuda-graphs"])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        tok_s = _tokens_per_s(proc.stdout) if proc.returncode == 0 else None
        if tok_s is None:
            raise RuntimeError(f"engine bench ({backend}) failed: {proc.stderr[-2000:]}"
                               f"{proc.stdout[-1000:]}")
        rows.append(dict(backend=backend, cuda_graphs=graphs, tokens_per_s=tok_s))
    return rows


def _tokens_per_s(stdout: str) -> float | None:
    """The 'tok/s' column of the 'this layout' row of ``bench throughput``'s table (found
    by the header, so added columns do not break it); None if absent."""
    lines = stdout.splitlines()
    header = next((ln.split() for ln in lines if ln.split()[:1] == ["run"]), None)
    row = next((ln for ln in lines if ln.startswith("this layout")), None)
    if header is None or row is None or "tok/s" not in header:
        return None
    cells = row[len("this layout"):].split()  # the run name is two words
    try:
        return float(cells[header.index("tok/s") - 1])
    except (IndexError, ValueError):
        return None


def _print_tables(device: str, mm: list[dict], attn: list[dict]) -> None:
    print(f"device: {device}")
    print("times: median of CUDA-graph replays (both sides); 'eager' = ours without a graph")
    print(f"{'K':>6} {'N':>6} {'M':>5} {'ours us':>9} {'cuBLAS us':>9} {'ratio':>6} "
          f"{'TFLOP/s':>8} {'eager us':>9}")
    for r in mm:
        print(f"{r['K']:>6} {r['N']:>6} {r['M']:>5} {r['ours_us']:>9.1f} {r['cublas_us']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['tflops']:>8.1f} {r['eager_us']:>9.1f}")
    if mm:
        geo = math.exp(sum(math.log(r["ratio"]) for r in mm) / len(mm))
        small = [r["ratio"] for r in mm if r["M"] <= 64]
        print(f"matmul geomean ratio (cuBLAS time / ours): {geo:.3f}; "
              f"min at M<=64: {min(small) if small else float('nan'):.3f}")
    for r in attn:
        print(f"attention {r['case']:<32} ours {r['ours_us']:>8.1f} us  SDPA-flash "
              f"{r['sdpa_us']:>8.1f} us  ratio {r['ratio']:.2f}  ({r['tflops']:.0f} TFLOP/s)")


def main(argv: list[str]) -> int:
    """Entry point of ``megaserve bench kernels``; returns an exit code."""
    parser = argparse.ArgumentParser(prog="megaserve bench kernels", description=__doc__)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--m", type=int, nargs="*", default=MS, help="row counts M")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-matmul", action="store_true")
    parser.add_argument("--engine-layers", type=int, default=0,
                        help="also time the engine (ours vs cuBLAS/SDPA) on a random "
                             "Qwen3-30B-A3B-shaped checkpoint of this many layers (0 = off)")
    parser.add_argument("--engine-prompts", type=int, default=64)
    parser.add_argument("--engine-input-len", type=int, default=128)
    parser.add_argument("--engine-output-len", type=int, default=128)
    args = parser.parse_args(argv)
    if any(m < 1 for m in args.m):
        print("megaserve bench kernels: --m values must be >= 1", file=sys.stderr)
        return 2
    if args.engine_layers < 0 or min(args.engine_prompts, args.engine_input_len,
                                     args.engine_output_len) < 1:
        print("megaserve bench kernels: --engine-* values must be positive", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("megaserve bench kernels: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    mm = [] if args.skip_matmul else bench_matmul(dtype, args.m, SHAPES_KN)
    attn = [] if args.skip_attention else bench_attention(dtype)
    _print_tables(torch.cuda.get_device_name(), mm, attn)
    if args.engine_layers:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="megaserve-engine-bench-") as path:
            write_engine_checkpoint(path, args.engine_layers)
            engine = bench_engine(path, args.engine_prompts, args.engine_input_len,
                                  args.engine_output_len)
        print(f"engine ({args.engine_layers} Qwen3-30B-A3B-shaped layers, bf16, "
              f"{args.engine_prompts} prompts x {args.engine_input_len} in / "
              f"{args.engine_output_len} out, greedy), generated tok/s per run:")
        for ours, ref, graphs in zip(engine[::3], engine[1::3], engine[2::3]):
            print(f"  eager: ours {ours['tokens_per_s']:.1f}  cuBLAS/SDPA {ref['tokens_per_s']:.1f}  "
                  f"ratio {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}   "
                  f"ours with CUDA graphs {graphs['tokens_per_s']:.1f} "
                  f"({graphs['tokens_per_s'] / ref['tokens_per_s']:.2f}x cuBLAS/SDPA eager)")
    return 0
