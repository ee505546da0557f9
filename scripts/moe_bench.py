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
with its relative imports made absolute), timed as "baseline"; "new-nopdl" is the new
module with $MEGASERVE_PDL=0 (no programmatic dependent launch). --sweep: also time each
GEMM alone over candidate tiles x K steps x stages, each checked bitwise against the same
tile's block_k=64 launch and the planned launch. --tokens: a MoE layer's dispatch at
T tokens, top-k: x expanded to [T*k, D] then expert_ffn (the old LocalExperts.dispatch)
against expert_ffn(x, rows_per_token=k).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

from megaserve.kernels.triton_impl import moe, pdl

D, I, E, TOP_K, LAYERS = 2048, 768, 128, 8, 4
DT = torch.bfloat16

# Sweep candidates: (block_m, block_n, num_warps) bases by rows per call (the first
# bucket with R <= max_rows), each at every stage count and K step below.
SWEEP_BASES = (
    (512, [(16, 32, 4), (16, 64, 4)], [(16, 64, 4), (16, 128, 4)]),
    (8192, [(64, 64, 4), (64, 32, 4)], [(64, 64, 4), (64, 128, 4)]),
    (1 << 62, [(128, 64, 4), (128, 128, 8)], [(128, 128, 4), (128, 256, 8)]),
)
SWEEP_STAGES = (3, 4, 6)
SWEEP_BLOCK_K = (64, 128, 256)
SMEM_BYTES = 227 * 1024  # an H100's shared memory per block


class _pdl_off:
    """$MEGASERVE_PDL=0 while active (launches, and graphs captured, without PDL)."""

    def __enter__(self):
        self.old = os.environ.get(pdl.ENV)
        os.environ[pdl.ENV] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            del os.environ[pdl.ENV]
        else:
            os.environ[pdl.ENV] = self.old


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
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rows", default="8,64,512,2048,8192,32768")
    p.add_argument("--tokens", default="1,8,64,256", help="dispatch timing ('' to skip)")
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
        impls = [("new", moe.expert_ffn, False), ("new-nopdl", moe.expert_ffn, True)] + (
            [("baseline", base.expert_ffn, True)] if base else [])
        ref = [moe.expert_ffn(x, ids[j], wgu[j], wd[j]) for j in range(LAYERS)]
        for name, fn, no_pdl in impls:
            def call(fn=fn):
                for j in range(LAYERS):
                    fn(x, ids[j], wgu[j], wd[j])
            with _pdl_off() if no_pdl else contextlib.nullcontext():
                us = graph_time_us(call) / LAYERS
                same = all(torch.equal(fn(x, ids[j], wgu[j], wd[j]), ref[j])
                           for j in range(LAYERS))
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
            best = _best_launch(row["sweep"])
            if best is not None:  # the whole FFN at the sweep's fastest same-bits tiles
                def swept(j, lp=best):
                    return moe.expert_ffn(x, ids[j], wgu[j], wd[j], launch=lp)
                us = graph_time_us(lambda: [swept(j) for j in range(LAYERS)]) / LAYERS
                same = all(torch.equal(swept(j), ref[j]) for j in range(LAYERS))
                gbs = weight_bytes / (us * 1e-6)
                row["swept"] = {"launch": repr(best), "us": us, "pct_copy": 100 * gbs / bw,
                                "bits_equal": same}
                print(f"{r:>6} {'swept':>9} {us:>9.1f} {gbs / 1e9:>7.0f} {100 * gbs / bw:>6.1f}"
                      f"  bits {same}  {best}", flush=True)
        results["rows"][str(r)] = row
        (out_dir / "moe_bench.json").write_text(json.dumps(results, indent=1))
    if args.tokens:
        results["dispatch"] = dispatch(
            [int(v) for v in args.tokens.split(",")], wgu, wd, base)
        (out_dir / "moe_bench.json").write_text(json.dumps(results, indent=1))


def dispatch(token_counts, wgu, wd, base) -> dict:
    """A MoE layer's experts at T tokens: the expanded copy + expert_ffn (old dispatch;
    also with the baseline module) against rows_per_token=k; bits compared."""
    res = {}
    print(f"{'T':>5} {'dispatch':>22} {'us':>8}  bits")
    for t in token_counts:
        x = torch.randn(t, D, device="cuda", dtype=DT)
        ids = [torch.randint(0, E, (t * TOP_K,), device="cuda") for _ in range(LAYERS)]

        def expanded(j, fn=moe.expert_ffn):
            rows = x[:, None].expand(t, TOP_K, D).reshape(-1, D)  # [T*k, D]
            return fn(rows, ids[j], wgu[j], wd[j])

        def shared(j):
            return moe.expert_ffn(x, ids[j], wgu[j], wd[j], rows_per_token=TOP_K)

        cands = [("expand+ffn", expanded), ("rows_per_token", shared)]
        if base is not None:
            cands.insert(0, ("expand+baseline", lambda j: expanded(j, base.expert_ffn)))
        ref = [expanded(j) for j in range(LAYERS)]
        res[str(t)] = {}
        for name, fn in cands:
            us = graph_time_us(lambda fn=fn: [fn(j) for j in range(LAYERS)]) / LAYERS
            same = all(torch.equal(fn(j), ref[j]) for j in range(LAYERS))
            res[str(t)][name] = {"us": us, "bits_equal": same}
            print(f"{t:>5} {name:>22} {us:>8.1f}  {same}", flush=True)
    return res


def _best_launch(res: dict) -> moe.MoeLaunch | None:
    """The fastest up and down tiles of a sweep among those with the planned bits."""
    tiles = []
    for kind in ("up", "down"):
        ok = {k: v["us"] for k, v in res[kind].items() if v.get("bits_equal")}
        if not ok:
            return None
        tiles.append(moe.GemmTiles(*ast.literal_eval(min(ok, key=ok.get))))
    return moe.MoeLaunch(*tiles)


def sweep(r, x, ids, wgu, wd, weight_bytes, flops, bw, peak) -> dict:
    """Each GEMM alone over SWEEP_BASES x SWEEP_STAGES x SWEEP_BLOCK_K (layers cycled as
    above); bits checked against the same tile's block_k=64 launch and the planned one."""
    lp = moe.plan_launch(r)
    gemm = moe._expert_gemm
    aligned = [moe._align(t, E) for t in ids]  # (offsets, order) per layer
    ups = [gemm(x, wgu[j], o, off, lp.up, swiglu=True, gather=True, scatter=False)
           for j, (off, o) in enumerate(aligned)]
    downs = [gemm(ups[j], wd[j], o, off, lp.down, swiglu=False, gather=False, scatter=True)
             for j, (off, o) in enumerate(aligned)]
    up_bases, down_bases = next((u, d) for m, u, d in SWEEP_BASES if r <= m)
    res = {"up": {}, "down": {}}
    for kind, bases, share in (("up", up_bases, 2 / 3), ("down", down_bases, 1 / 3)):
        planned = ups if kind == "up" else downs

        def one(j, t, kind=kind):
            off, o = aligned[j]
            if kind == "up":
                return gemm(x, wgu[j], o, off, t, swiglu=True, gather=True, scatter=False)
            return gemm(ups[j], wd[j], o, off, t, swiglu=False, gather=False, scatter=True)

        for bm, bn, warps in bases:
            for stages in SWEEP_STAGES:
                k64 = None  # this tile's block_k=64 outputs
                for bk in SWEEP_BLOCK_K:
                    w_rows = 2 * bn if kind == "up" else bn
                    if stages * (bm + w_rows) * bk * 2 > SMEM_BYTES:
                        continue  # its pipeline cannot fit in shared memory
                    t = moe.GemmTiles(bm, bn, warps, stages, bk)
                    key = str((bm, bn, warps, stages, bk))
                    try:
                        outs = [one(j, t) for j in range(LAYERS)]
                        us = graph_time_us(lambda t=t: [one(j, t) for j in range(LAYERS)])
                        us /= LAYERS
                    except Exception as e:  # a tile the compiler refuses (shared memory)
                        res[kind][key] = {"error": repr(e)[:200]}
                        print(f"  R={r} {kind} {key}: {e!r:.100}", flush=True)
                        continue
                    if bk == 64:
                        k64 = outs
                    same_k64 = k64 is not None and all(
                        torch.equal(a, b) for a, b in zip(outs, k64))
                    same_plan = all(torch.equal(a, b) for a, b in zip(outs, planned))
                    gbs = weight_bytes * share / (us * 1e-6)
                    tf = flops * share / (us * 1e-6)
                    res[kind][key] = {"us": us, "pct_copy": 100 * gbs / bw,
                                      "pct_matmul": 100 * tf / peak,
                                      "bits_equal_k64": same_k64, "bits_equal": same_plan}
                    print(f"  R={r} {kind} {key}: {us:8.1f} us  {100 * gbs / bw:5.1f}% copy  "
                          f"{100 * tf / peak:5.1f}% mm  bits k64 {same_k64} plan {same_plan}",
                          flush=True)
        ok = {k: v for k, v in res[kind].items() if "us" in v}
        if ok:
            best = min(ok, key=lambda k: ok[k]["us"])
            print(f"  R={r} {kind} best {best}: {ok[best]['us']:.1f} us", flush=True)
    return res

if __name__ == "__main__":
    sys.exit(main())
