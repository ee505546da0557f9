"""Expert FFN (kernels/triton_impl/moe.py) on a CUDA GPU: time per call against the bytes
of the experts it reads (decode) or bf16 FLOPs (prefill), a named baseline in the same run.

Shape legend: R = routed rows, E = experts, D = hidden, I = expert intermediate, L = layers.

Each timed call is one of L layers (distinct weights, distinct uniform random expert ids,
so the experts a call reads are not in L2 from the previous call), replayed from a CUDA
graph (decode steps run in graphs). Bandwidth is the weight bytes of the experts hit over
the time, as a fraction of a 1 GiB device copy's (read + write bytes) measured here;
FLOP/s as a fraction of an 8192^3 bf16 torch.matmul's.

    source scripts/device_setup.sh
    python scripts/moe_bench.py --baseline OLD_MOE.py --sweep --out DIR

--baseline: a module file with ``expert_ffn`` (e.g. ``git show REV:kernels/triton_impl/moe.py``
with its relative import made absolute), timed as "baseline". --sweep: also time each
GEMM alone over candidate tiles (and check their bits against the planned launch's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

from megaserve.kernels.triton_impl import moe

D, I, E, TOP_K, LAYERS = 2048, 768, 128, 8, 4
DT = torch.bfloat16

UP_TILES = [(16, 32, 4, 6), (16, 32, 4, 8), (16, 16, 4, 6), (16, 32, 8, 6), (64, 64, 4, 3),
            (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3),
            (128, 128, 8, 3), (128, 32, 4, 3)]
DOWN_TILES = [(16, 64, 4, 4), (16, 64, 4, 6), (16, 32, 2, 4), (64, 64, 4, 4), (64, 128, 4, 3),
              (128, 128, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3), (128, 128, 8, 3),
              (256, 128, 8, 3)]


def graph_time_us(fn, reps: int = 10) -> float:
    """Mean us per fn() call, fn replayed ``reps`` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device copy, read + write."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() * 2 / (us * 1e-6)


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    us = graph_time_us(lambda: a @ a, reps=5)
    return 2 * 8192**3 / (us * 1e-6)


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("moe_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rows", default="8,64,512,2048,8192,32768")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out_dir = Path(args.out)
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    bw, peak = copy_bandwidth(), matmul_flops()
    print(f"device {dev}; copy {bw / 1e12:.2f} TB/s (read+write); matmul {peak / 1e12:.0f} "
          f"TFLOP/s; D={D} I={I} E={E} top-{TOP_K} bf16, {LAYERS} layers cycled")
    wgu = [torch.randn(E, 2 * I, D, device="cuda", dtype=DT) / D**0.5 for _ in range(LAYERS)]
    wd = [torch.randn(E, D, I, device="cuda", dtype=DT) / I**0.5 for _ in range(LAYERS)]
    base = load_baseline(args.baseline) if args.baseline else None
    results = {"device": dev, "copy_Bps": bw, "matmul_flops": peak, "rows": {}}
    print(f"{'R':>6} {'impl':>9} {'us':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} "
          f"{'%mm':>5}  bits")
    for r in [int(v) for v in args.rows.split(",")]:
        x = torch.randn(r, D, device="cuda", dtype=DT)
        ids = [torch.randint(0, E, (r,), device="cuda") for _ in range(LAYERS)]
        hit = sum(int(t.unique().numel()) for t in ids) / LAYERS
        weight_bytes = hit * 3 * I * D * 2
        flops = r * 3 * I * D * 2
        row = {}
        impls = [("new", moe.expert_ffn)] + ([("baseline", base.expert_ffn)] if base else [])
        ref = [moe.expert_ffn(x, ids[j], wgu[j], wd[j]) for j in range(LAYERS)]
        for name, fn in impls:
            def call(fn=fn):
                for j in range(LAYERS):
                    fn(x, ids[j], wgu[j], wd[j])
            us = graph_time_us(call) / LAYERS
            same = all(torch.equal(fn(x, ids[j], wgu[j], wd[j]), ref[j]) for j in range(LAYERS))
            gbs = weight_bytes / (us * 1e-6)
            tf = flops / (us * 1e-6)
            row[name] = {"us": us, "weight_GBps": gbs / 1e9, "pct_copy": 100 * gbs / bw,
                         "tflops": tf / 1e12, "pct_matmul": 100 * tf / peak, "bits_equal": same}
            print(f"{r:>6} {name:>9} {us:>9.1f} {gbs / 1e9:>7.0f} {100 * gbs / bw:>6.1f} "
                  f"{tf / 1e12:>8.1f} {100 * tf / peak:>5.1f}  {same}", flush=True)
        row["align_us"] = graph_time_us(lambda: moe._align(ids[0], E))
        row["sort_search_us"] = graph_time_us(lambda: torch.searchsorted(
            torch.sort(ids[0], stable=True)[0], torch.arange(E + 1, device="cuda")))
        print(f"{r:>6} align {row['align_us']:.1f} us; sort+searchsorted "
              f"{row['sort_search_us']:.1f} us", flush=True)
        if args.sweep:
            row["sweep"] = sweep(r, x, ids, wgu, wd, weight_bytes, flops, bw, peak)
        results["rows"][str(r)] = row
        (out_dir / "moe_bench.json").write_text(json.dumps(results, indent=1))


def sweep(r, x, ids, wgu, wd, weight_bytes, flops, bw, peak) -> dict:
    """Each GEMM alone over candidate tiles (layers cycled as above); bits checked against
    the planned launch's."""
    lp = moe.plan_launch(r)
    gemm = moe._expert_gemm
    aligned = [moe._align(t, E) for t in ids]  # (offsets, order) per layer
    ups = [gemm(x, wgu[j], o, off, lp.up, swiglu=True, gather=True, scatter=False)
           for j, (off, o) in enumerate(aligned)]
    downs = [gemm(ups[j], wd[j], o, off, lp.down, swiglu=False, gather=False, scatter=True)
             for j, (off, o) in enumerate(aligned)]
    res = {"up": {}, "down": {}}
    for kind, cands, share in (("up", UP_TILES, 2 / 3), ("down", DOWN_TILES, 1 / 3)):
        for c in cands:
            t = moe.GemmTiles(*c)

            def one(j, t=t, kind=kind):
                off, o = aligned[j]
                if kind == "up":
                    return gemm(x, wgu[j], o, off, t, swiglu=True, gather=True, scatter=False)
                return gemm(ups[j], wd[j], o, off, t, swiglu=False, gather=False, scatter=True)

            try:
                same = all(torch.equal(one(j), (ups if kind == "up" else downs)[j])
                           for j in range(LAYERS))
                us = graph_time_us(lambda: [one(j) for j in range(LAYERS)]) / LAYERS
            except Exception as e:  # a tile the compiler refuses (shared memory): reported
                res[kind][str(c)] = {"error": repr(e)[:200]}
                print(f"  {kind} {c}: {e!r:.120}", flush=True)
                continue
            gbs = weight_bytes * share / (us * 1e-6)
            tf = flops * share / (us * 1e-6)
            res[kind][str(c)] = {"us": us, "pct_copy": 100 * gbs / bw,
                                 "pct_matmul": 100 * tf / peak, "bits_equal": same}
            print(f"  R={r} {kind} {c}: {us:8.1f} us  {100 * gbs / bw:5.1f}% copy  "
                  f"{100 * tf / peak:5.1f}% mm  bits {same}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
