"""The attention side's elementwise kernels at prefill and decode sizes: this
tree's rotary_and_cache launches against a base tree's kernel, rms_norm (residual mode)
and top-k routing, each with PDL off and where the tree puts it, on a CUDA device.

Shape legend: T = tokens, Hq / Hkv = query / KV heads, Dh = head dim, D = hidden.

    source lab/device/setup.sh
    git archive <base commit> | tar -x -C base
    python lab/rotary_bench.py --base base --out $OUT/rotary.json

Each time is the GPU's, back to back: a ``torch.cuda._sleep`` first keeps the host ahead
of the GPU, so a loop of ``--iters`` calls runs without host gaps (PDL then overlaps a
call's launch with the previous call's tail, as in a captured decode step); the median of
``--reps`` loops, per call. "pair" rows time the kernel after the linear that feeds it in
a layer (the QKV projection, o_proj) minus that linear alone. PDL modes: off
(``MEGASERVE_PDL=0``), auto (where each tree's launch puts it). Every rotary launch is
checked bitwise (q and both caches) against the base kernel's output. ``--smoke``: a CPU
dry run under TRITON_INTERPRET=1 (tiny shapes, float16, host timings; the base tree is this
one unless ``--base`` names another).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = __name__ == "__main__" and "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined

import torch  # noqa: E402

from megaserve.kernels import triton_impl as ti  # noqa: E402
from megaserve.kernels.triton_impl import attention, pdl  # noqa: E402

DEVICE, DTYPE = ("cpu", torch.float16) if SMOKE else ("cuda", torch.bfloat16)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The engine's linear (torch's on the smoke run: only the elementwise kernels are
    under test there)."""
    return x @ w.T if SMOKE else ti.linear(x, w)

# Launches timed beside the default: tiles of (token, head) rows (rows, warps, tiles), then
# tiles of tokens with all their heads (tokens, warps, tiles)
LAUNCHES = [attention.RotaryLaunch(rows, warps, tiles) for rows, warps, tiles in (
    (1, 1, 1), (4, 4, 1), (8, 8, 1), (16, 16, 1), (4, 4, 4), (8, 2, 1), (16, 2, 1), (16, 4, 1),
    (32, 4, 1), (16, 4, 2), (32, 8, 1), (64, 16, 1))] + [
    attention.RotaryLaunch(warps=warps, tiles=tiles, tokens=tokens) for tokens, warps, tiles in (
        (1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 4, 1), (2, 8, 1), (4, 8, 1), (1, 4, 2), (1, 4, 4))]


def _name(launch: attention.RotaryLaunch) -> str:
    """``r<rows>w<warps>x<tiles>`` for tiles of rows, ``t<tokens>w<warps>x<tiles>`` for
    tiles of tokens."""
    size = f"t{launch.tokens}" if launch.tokens else f"r{launch.rows}"
    return f"{size}w{launch.warps}x{launch.tiles}"


def _load_base(base: Path, name: str):
    """The base tree's ``kernels/triton_impl/<name>.py`` as a sibling module of this
    tree's (its relative imports resolve to this tree's helpers)."""
    full = f"megaserve.kernels.triton_impl._base_{name}"
    spec = importlib.util.spec_from_file_location(full, base / "kernels" / "triton_impl"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _pdl(mode: str):
    """PDL off, or where each tree's launch puts it ('auto')."""
    saved_env = os.environ.get(pdl.ENV)
    os.environ[pdl.ENV] = "0" if mode == "off" else "1"
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(pdl.ENV)
        else:
            os.environ[pdl.ENV] = saved_env


def _time_us(fn, iters: int, reps: int) -> float:
    """Median GPU microseconds per ``fn()`` over ``reps`` back-to-back loops."""
    fn()
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(int(2e6) + iters * 200_000)  # the host enqueues ahead of the GPU
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / iters)
    return statistics.median(times)


def _rotary_inputs(t: int, hq: int, hkv: int, dh: int, block_size: int = 16):
    """Qwen3-like inputs: qkv `[T, (Hq + 2 Hkv) * Dh]` bf16, q/k norms, a paged cache with
    the blocks in shuffled order."""
    g = torch.Generator(device=DEVICE).manual_seed(t)
    dev, dt = DEVICE, DTYPE
    qkv = torch.randn(t, (hq + 2 * hkv) * dh, device=dev, generator=g).to(dt)
    positions = torch.arange(t, device=dev)
    inv = 1.0 / (1e6 ** (torch.arange(0, dh, 2, device=dev).float() / dh))
    freqs = torch.arange(max(t, 1), device=dev).float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    qn = (torch.rand(dh, device=dev, generator=g) + 0.5).to(dt)
    kn = (torch.rand(dh, device=dev, generator=g) + 0.5).to(dt)
    blocks = -(-t // block_size) + 1
    order = torch.randperm(blocks, device=dev, generator=g)
    slots = (order[:, None] * block_size + torch.arange(block_size, device=dev)).flatten()[:t]
    caches = [torch.zeros(blocks, block_size, hkv, dh, device=dev, dtype=dt) for _ in range(2)]
    return (qkv, positions, cos, sin, qn, kn, 1e-6), caches, slots


def bench_rotary(base, args, rows: list[dict]) -> list[dict]:
    """rotary_and_cache alone at each T: base kernel, this tree's default and LAUNCHES."""
    hq, hkv, dh = args.hq, args.hkv, args.dh
    failures = []
    for t in args.tokens:
        inputs, caches, slots = _rotary_inputs(t, hq, hkv, dh)
        ref_caches = [torch.zeros_like(c) for c in caches]
        ref_q = base.rotary_and_cache(*inputs, *ref_caches, slots, hq)
        num_rows = t * (hq + 2 * hkv)
        variants = [("base", None), ("default", None)]
        variants += [(_name(x), x) for x in LAUNCHES]
        for name, launch in variants:
            if name == "base":
                def fn():
                    return base.rotary_and_cache(*inputs, *caches, slots, hq)
            else:
                def fn(launch=launch):
                    return ti.rotary_and_cache(*inputs, *caches, slots, hq, launch=launch)
                for c in caches:
                    c.zero_()
                q = fn()
                same = torch.equal(q, ref_q) and all(
                    torch.equal(c, r) for c, r in zip(caches, ref_caches))
                if not same:
                    failures.append(f"T={t} {name}")
            chosen = launch or (attention.rotary_launch(num_rows, True) if name == "default"
                                else None)
            chosen = chosen and _name(chosen)
            for mode in ("off", "auto"):
                with _pdl(mode):
                    us = _time_us(fn, args.iters, args.reps)
                rows.append({"kernel": "rotary", "T": t, "variant": name, "launch": chosen,
                             "pdl": mode, "us": us})
                print(f"rotary T={t:5d} {name:9s} pdl={mode:4s} {us:9.2f} us", flush=True)
    return failures


def bench_pairs(base, base_rowwise, args, rows: list[dict]) -> None:
    """At each prefill T: rotary after the QKV linear, rms_norm (residual) after o_proj,
    each minus its linear alone, and top-k routing alone; PDL off / auto."""
    hq, hkv, dh, d = args.hq, args.hkv, args.dh, args.hidden
    dev, dt = DEVICE, DTYPE
    for t in args.pair_tokens:
        inputs, caches, slots = _rotary_inputs(t, hq, hkv, dh)
        x = torch.randn(t, d, device=dev, dtype=dt)
        w_qkv = torch.randn((hq + 2 * hkv) * dh, d, device=dev, dtype=dt) * 0.02
        attn = torch.randn(t, hq * dh, device=dev, dtype=dt)
        w_o = torch.randn(d, hq * dh, device=dev, dtype=dt) * 0.02
        res = torch.randn(t, d, device=dev, dtype=dt)
        norm_w = torch.rand(d, device=dev, dtype=dt) + 0.5
        logits = torch.randn(t, args.experts, device=dev, dtype=dt)

        def rotary(fused):
            qkv = _linear(x, w_qkv)
            return fused(qkv, *inputs[1:], *caches, slots, hq)

        cases = {
            "qkv linear": lambda: _linear(x, w_qkv),
            "rotary base": lambda: rotary(base.rotary_and_cache),
            "rotary new": lambda: rotary(ti.rotary_and_cache),
            "o_proj linear": lambda: _linear(attn, w_o),
            "rms base": lambda: base_rowwise.rms_norm(_linear(attn, w_o), norm_w, 1e-6, res),
            "rms new": lambda: ti.rms_norm(_linear(attn, w_o), norm_w, 1e-6, res),
            "rms alone": lambda: ti.rms_norm(x, norm_w, 1e-6, res),
            "topk alone": lambda: ti.topk_route(logits, 8, True),
        }
        for mode in ("off", "auto"):
            with _pdl(mode):
                us = {name: _time_us(fn, args.pair_iters, args.reps)
                      for name, fn in cases.items()}
            net = {"rotary base": us["rotary base"] - us["qkv linear"],
                   "rotary new": us["rotary new"] - us["qkv linear"],
                   "rms base": us["rms base"] - us["o_proj linear"],
                   "rms new": us["rms new"] - us["o_proj linear"]}
            rows.append({"kernel": "pairs", "T": t, "pdl": mode, "us": us, "net_us": net})
            print(f"pairs T={t} pdl={mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items())
                  + " | net: " + ", ".join(f"{k} {v:.1f}" for k, v in net.items()), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=not SMOKE, help="base tree (git archive)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1000, 4096])
    parser.add_argument("--pair-tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=4)
    parser.add_argument("--dh", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--pair-iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU dry run (module docstring)")
    if SMOKE:  # tiny shapes under the interpreter; 11 tokens leave a tail tile
        parser.set_defaults(base=Path(__file__).resolve().parents[1], tokens=[1, 11],
                            pair_tokens=[8], hq=6, hkv=2, dh=64, hidden=64, experts=8,
                            iters=1, pair_iters=1, reps=1)
    args = parser.parse_args()
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).parent))
        from sweep_support import patch_interpreter

        patch_interpreter()
    base = _load_base(args.base, "attention")
    base_rowwise = _load_base(args.base, "rowwise")
    rows: list[dict] = []
    failures = bench_rotary(base, args, rows)
    bench_pairs(base, base_rowwise, args, rows)
    device = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    report = {"device": device, "shape": vars(args) | {
        "base": str(args.base), "out": str(args.out)}, "bitwise_failures": failures,
        "rows": rows}
    print(f"{report['device']}: bitwise failures against the base kernel: {failures or 'none'}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
