"""Expert FFN (kernels/triton_impl/moe.py) on a CUDA GPU: time per call against the bytes
of the experts it reads (decode) or bf16 FLOPs (prefill), a named baseline in the same run.

Shape legend: R = routed rows, E = experts, D = hidden, I = expert intermediate, L = layers,
k' = rows per token (routed rows sharing one x row).

Each timed call is one of L layers (distinct weights, distinct uniform random expert ids,
so the experts a call reads are not in L2 from the previous call), replayed from a CUDA
graph (decode steps run in graphs). Bandwidth is the weight bytes of the experts hit over
the time, as a fraction of a 1 GiB device copy's (read + write bytes) measured here;
FLOP/s as a fraction of an 8192^3 bf16 torch.matmul's.

    source lab/device/setup.sh
    python lab/moe_bench.py --baseline OLD_MOE.py --sweep --out DIR
    python lab/moe_bench.py --shape mixtral-8x7b --rows 8192 --rows-per-token 2 \
        --tokens '' --sweep --grid prefill --layers 2 --reps 3 --out DIR

--baseline: a module file with ``expert_ffn`` (e.g. ``git show REV:kernels/triton_impl/moe.py``
with its relative imports made absolute), timed as "baseline"; "new-nopdl" is the new
module with $MEGASERVE_PDL=0 (no programmatic dependent launch). --sweep: also time each
GEMM alone over candidate launches (--grid buckets: the decode buckets' tiles x K steps x
stages; --grid prefill: tiles x warps x stages x K steps x weight paths, pointer / TMA /
TMA with gate and up in one dot; --grid tails: the prefill tiles with and without tail
tiles of 32 or 64 rows), each checked bitwise, in --workers parallel processes
(which also fill Triton's cache for the timings), against the planned launch and the old
prefill launch (pointer loads, K step 64); cells are timed until --deadline. --tokens: a
MoE layer's dispatch at T tokens, top-k: x expanded to [T*k, D] then expert_ffn (the old
LocalExperts.dispatch) against expert_ffn(x, rows_per_token=k). --gluon: each GEMM alone
at each size, the planned prefill launch's Triton TMA kernels (gluon=False) against
moe_gluon's persistent kernel (Hopper), bitwise:

    python lab/moe_bench.py --rows 32768,131072 --rows-per-token 8 --tokens '' \
        --layers 2 --gluon
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megaserve.bench.decode import measure_copy_bandwidth, measure_matmul_flops
from megaserve.kernels.triton_impl import moe, pdl

DT = torch.bfloat16


@dataclass(frozen=True)
class MoeShape:
    """One model's expert FFN: hidden D, expert intermediate I, E experts, top-k."""

    d: int
    i: int
    e: int
    top_k: int


SHAPES = {"qwen3-30b-a3b": MoeShape(2048, 768, 128, 8), "mixtral-8x7b": MoeShape(4096, 14336, 8, 2)}

# --grid buckets: (block_m, block_n, num_warps) bases by rows per call (the first bucket
# with R <= max_rows), each at every stage count and K step below; pointer loads.
SWEEP_BASES = (
    (512, [(16, 32, 4), (16, 64, 4)], [(16, 64, 4), (16, 128, 4)]),
    (8192, [(64, 64, 4), (64, 32, 4)], [(64, 64, 4), (64, 128, 4)]),
    (1 << 62, [(128, 64, 4), (128, 128, 8)], [(128, 128, 4), (128, 256, 8)]),
)
SWEEP_STAGES = (3, 4, 6)
SWEEP_BLOCK_K = (64, 128, 256)
# --grid prefill: every (block_m, block_n, warps, stages, block_k) below whose fp32
# accumulators take 64..128 registers a thread and whose pipeline fits in shared memory,
# for each weight path (MODES).
PREFILL_BLOCK_M = (64, 128)
PREFILL_BLOCK_N = (64, 128, 256)
PREFILL_WARPS = (4, 8)
PREFILL_STAGES = (3, 4, 5)
PREFILL_BLOCK_K = (64, 128)
MODES = {"ptr": {}, "tma": {"tma": True}, "join": {"tma": True, "join": True},
         "tma-n": {"tma": True, "n_major": True},
         "join-n": {"tma": True, "join": True, "n_major": True}}
SMEM_BYTES = 227 * 1024  # an H100's shared memory per block
# --grid tails: the planned prefill tiles at each tail_m (0: no tail tiles) and stage count
# below (GemmTiles.tail_m: an expert's last tile, at most tail_m rows left, with tail_m rows).
TAIL_M = (0, 32, 64)
TAIL_STAGES = (3, 4)
# The prefill launch before TMA (pointer loads, K step 64): every sweep cell's reference.
OLD_PREFILL = moe.MoeLaunch(moe.GemmTiles(128, 64, 4, 3), moe.GemmTiles(128, 128, 4, 3))


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


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("moe_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--grid", choices=("buckets", "prefill", "tails"), default="buckets")
    p.add_argument("--modes", default="ptr,tma,join", help="--grid prefill weight paths")
    p.add_argument("--block-m", default="", help="--grid prefill block_m values (default all)")
    p.add_argument("--workers", type=int, default=14, help="sweep check processes")
    p.add_argument("--deadline", type=float, default=1e9, help="s after start: stop timing")
    p.add_argument("--rows", default="8,64,512,2048,8192,32768")
    p.add_argument("--sweep-rows", default="", help="rows to sweep at (default: all)")
    p.add_argument("--rows-per-token", type=int, default=1,
                   help="k': x has R / k' rows (prefill: top-k)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=10, help="calls per graph replay")
    p.add_argument("--tokens", default="1,8,64,256", help="dispatch timing ('' to skip)")
    p.add_argument("--out", default=".")
    p.add_argument("--gluon", action="store_true", help="each GEMM: Triton vs moe_gluon")
    args = p.parse_args()
    t0 = time.time()
    shape = SHAPES[args.shape]
    out_dir = Path(args.out)
    out_file = out_dir / f"moe_bench_{args.shape}.json"
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    # the baselines of megaserve bench decode: a 1 GiB copy (read + write), an 8192^3 matmul
    bw, peak = measure_copy_bandwidth("cuda", 1 << 30), measure_matmul_flops("cuda", 8192)
    d, i, e, layers = shape.d, shape.i, shape.e, args.layers
    print(f"device {dev}; copy {bw / 1e12:.2f} TB/s (read+write); matmul {peak / 1e12:.0f} "
          f"TFLOP/s; {args.shape}: D={d} I={i} E={e} top-{shape.top_k} bf16, {layers} layers "
          f"cycled, k'={args.rows_per_token}")
    wgu, wd = _weights(shape, layers)
    base = load_baseline(args.baseline) if args.baseline else None
    results = {"device": dev, "shape": dataclasses.asdict(shape), "copy_Bps": bw,
               "matmul_flops": peak, "rows": {}}
    print(f"{'R':>6} {'impl':>9} {'us':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} "
          f"{'%mm':>5}  bits")
    for r in [int(v) for v in args.rows.split(",")]:
        k_rows = args.rows_per_token if r % args.rows_per_token == 0 else 1
        x, ids = _inputs(shape, r, k_rows, layers)
        hit = sum(int(t.unique().numel()) for t in ids) / layers
        weight_bytes = hit * 3 * i * d * 2
        flops = r * 3 * i * d * 2
        row = {"rows_per_token": k_rows}

        def ffn(fn, j, **kw):
            return fn(x, ids[j], wgu[j], wd[j], rows_per_token=k_rows, **kw)

        def report(name, us, same, extra=""):
            gbs, tf = weight_bytes / (us * 1e-6), flops / (us * 1e-6)
            row[name] = {"us": us, "weight_GBps": gbs / 1e9, "pct_copy": 100 * gbs / bw,
                         "tflops": tf / 1e12, "pct_matmul": 100 * tf / peak, "bits_equal": same}
            print(f"{r:>6} {name:>9} {us:>9.1f} {gbs / 1e9:>7.0f} {100 * gbs / bw:>6.1f} "
                  f"{tf / 1e12:>8.1f} {100 * tf / peak:>5.1f}  {same}{extra}", flush=True)

        impls = [("new", moe.expert_ffn, False), ("new-nopdl", moe.expert_ffn, True)] + (
            [("baseline", base.expert_ffn, True)] if base else [])
        ref = [ffn(moe.expert_ffn, j) for j in range(layers)]
        for name, fn, no_pdl in impls:
            with _pdl_off() if no_pdl else contextlib.nullcontext():
                us = graph_time_us(lambda fn=fn: [ffn(fn, j) for j in range(layers)],
                                   args.reps) / layers
                same = all(torch.equal(ffn(fn, j), ref[j]) for j in range(layers))
            report(name, us, same)
        if args.gluon:
            row["gluon"] = gemms_gluon(x, ids, wgu, wd, k_rows, e, peak, args.reps)
        row["align_us"] = graph_time_us(lambda: moe.align(ids[0], e))
        print(f"{r:>6} align {row['align_us']:.1f} us", flush=True)
        if args.sweep and str(r) in (args.sweep_rows or str(r)).split(","):
            row["sweep"] = sweep(args, shape, r, k_rows, x, ids, wgu, wd, weight_bytes, flops,
                                 bw, peak, t0)
            best = _best_launch(row["sweep"])
            if best is not None:  # the whole FFN at the sweep's fastest same-bits tiles
                with _pdl_off():
                    us = graph_time_us(lambda: [ffn(moe.expert_ffn, j, launch=best)
                                                for j in range(layers)], args.reps) / layers
                    same = all(torch.equal(ffn(moe.expert_ffn, j, launch=best), ref[j])
                               for j in range(layers))
                report("swept", us, same, f"  {best}")
                row["swept"]["launch"] = repr(best)
        results["rows"][str(r)] = row
        out_file.write_text(json.dumps(results, indent=1))
    if args.tokens:
        results["dispatch"] = dispatch(
            shape, [int(v) for v in args.tokens.split(",")], wgu, wd, base, layers)
        out_file.write_text(json.dumps(results, indent=1))


def gemms_gluon(x, ids, wgu, wd, rows_per_token: int, e: int, peak: float, reps: int) -> dict:
    """Each layer's gate_up and down GEMM alone: the prefill launch's Triton TMA kernels
    against moe_gluon's (us per call, the median of three alternating timings; TFLOP/s;
    bitwise on the rows written)."""
    layers = len(ids)
    grouping = [moe.align(t, e) for t in ids]
    routed = [t < e for t in ids]
    written = [int(g[0][e]) for g in grouping]

    def up(j, gluon):
        tiles = dataclasses.replace(moe.PREFILL.up, gluon=gluon)
        return moe.expert_gemm(x, wgu[j], ids[j], grouping[j], tiles, swiglu=True,
                                gather=True, scatter=False, rows_per_token=rows_per_token)

    hidden = [up(j, False) for j in range(layers)]

    def down(j, gluon):
        tiles = dataclasses.replace(moe.PREFILL.down, gluon=gluon)
        return moe.expert_gemm(hidden[j], wd[j], ids[j], grouping[j], tiles, swiglu=False,
                                gather=False, scatter=True)

    out = {}
    for name, fn, flops, rows in (
            ("gate_up", up, ids[0].shape[0] * 2 * wgu[0].shape[1] * wgu[0].shape[2],
             lambda j: slice(0, written[j])),
            ("down", down, ids[0].shape[0] * 2 * wd[0].shape[1] * wd[0].shape[2],
             lambda j: routed[j])):
        times = {False: [], True: []}
        for _ in range(3):  # alternating: a long run slows the clocks of what comes after
            for gluon in (False, True):
                times[gluon].append(graph_time_us(
                    lambda g=gluon, f=fn: [f(j, g) for j in range(layers)], reps) / layers)
        us = {g: sorted(ts)[1] for g, ts in times.items()}
        same = all(torch.equal(fn(j, True)[rows(j)], fn(j, False)[rows(j)])
                   for j in range(layers))
        out[name] = {"triton_us": us[False], "gluon_us": us[True], "bits_equal": same}
        print(f"{ids[0].shape[0]:>6} {name} GEMM: triton {us[False]:.1f} us "
              f"({flops / us[False] / 1e6:.0f} TFLOP/s), gluon {us[True]:.1f} us "
              f"({flops / us[True] / 1e6:.0f} TFLOP/s, {flops / us[True] * 1e6 / peak:.0%} of "
              f"matmul), bits equal {same}", flush=True)
    return out


def _weights(shape: MoeShape, layers: int):
    """(w_gate_up `[E, 2I, D]`, w_down `[E, D, I]`) per layer, bf16, seeded."""
    torch.manual_seed(1)
    wgu = [torch.randn(shape.e, 2 * shape.i, shape.d, device="cuda", dtype=DT) / shape.d**0.5
           for _ in range(layers)]
    wd = [torch.randn(shape.e, shape.d, shape.i, device="cuda", dtype=DT) / shape.i**0.5
          for _ in range(layers)]
    return wgu, wd


def _inputs(shape: MoeShape, r: int, rows_per_token: int, layers: int):
    """x `[R / k', D]` and uniform random expert ids `[R]` per layer, seeded by R."""
    torch.manual_seed(r)
    x = torch.randn(r // rows_per_token, shape.d, device="cuda", dtype=DT)
    ids = [torch.randint(0, shape.e, (r,), device="cuda") for _ in range(layers)]
    return x, ids


def dispatch(shape: MoeShape, token_counts, wgu, wd, base, layers: int) -> dict:
    """A MoE layer's experts at T tokens: the expanded copy + expert_ffn (old dispatch;
    also with the baseline module) against rows_per_token=k; bits compared."""
    res = {}
    d, k = shape.d, shape.top_k
    print(f"{'T':>5} {'dispatch':>22} {'us':>8}  bits")
    for t in token_counts:
        x = torch.randn(t, d, device="cuda", dtype=DT)
        ids = [torch.randint(0, shape.e, (t * k,), device="cuda") for _ in range(layers)]

        def expanded(j, fn=moe.expert_ffn):
            rows = x[:, None].expand(t, k, d).reshape(-1, d)  # [T*k, D]
            return fn(rows, ids[j], wgu[j], wd[j])

        def shared(j):
            return moe.expert_ffn(x, ids[j], wgu[j], wd[j], rows_per_token=k)

        cands = [("expand+ffn", expanded), ("rows_per_token", shared)]
        if base is not None:
            cands.insert(0, ("expand+baseline", lambda j: expanded(j, base.expert_ffn)))
        ref = [expanded(j) for j in range(layers)]
        res[str(t)] = {}
        for name, fn in cands:
            us = graph_time_us(lambda fn=fn: [fn(j) for j in range(layers)]) / layers
            same = all(torch.equal(fn(j), ref[j]) for j in range(layers))
            res[str(t)][name] = {"us": us, "bits_equal": same}
            print(f"{t:>5} {name:>22} {us:>8.1f}  {same}", flush=True)
    return res


def _tiles_key(t: moe.GemmTiles) -> str:
    return str(dataclasses.astuple(t))


def _best_launch(res: dict) -> moe.MoeLaunch | None:
    """The fastest up and down tiles of a sweep among those with the reference bits."""
    tiles = []
    for kind in ("up", "down"):
        ok = {k: v["us"] for k, v in res[kind].items() if v.get("bits_equal") and "us" in v}
        if not ok:
            return None
        tiles.append(moe.GemmTiles(*ast.literal_eval(min(ok, key=ok.get))))
    return moe.MoeLaunch(*tiles)


def candidates(shape: MoeShape, r: int, grid: str, modes: list[str],
               block_ms: list[int]) -> list[tuple[str, moe.GemmTiles]]:
    """(kind, tiles) sweep cells, kind "up" (gate_up, SwiGLU) or "down"; prefill: mode by
    mode (the order they are timed in)."""
    out = []
    if grid == "buckets":
        up_bases, down_bases = next((u, dn) for m, u, dn in SWEEP_BASES if r <= m)
        for kind, bases in (("up", up_bases), ("down", down_bases)):
            for bm, bn, warps in bases:
                for stages in SWEEP_STAGES:
                    for bk in SWEEP_BLOCK_K:
                        w_rows = 2 * bn if kind == "up" else bn
                        if stages * (bm + w_rows) * bk * 2 <= SMEM_BYTES:
                            out.append((kind, moe.GemmTiles(bm, bn, warps, stages, bk)))
        return out
    if grid == "tails":
        for kind in ("up", "down"):
            for stages in TAIL_STAGES:
                for tail_m in TAIL_M:
                    out.append((kind, dataclasses.replace(
                        getattr(moe.PREFILL, kind), num_stages=stages, tail_m=tail_m)))
        return out
    for mode in modes:
        for kind in ("up", "down"):
            if kind == "down" and MODES[mode].get("join"):
                continue  # gate and up: the gate_up GEMM only
            for bm in block_ms or PREFILL_BLOCK_M:
                for bn in PREFILL_BLOCK_N:
                    w_rows = 2 * bn if kind == "up" else bn
                    for warps in PREFILL_WARPS:
                        if not 64 <= bm * w_rows // (32 * warps) <= 128:
                            continue  # accumulator registers a thread
                        for bk in PREFILL_BLOCK_K:
                            for stages in PREFILL_STAGES:
                                if stages * (bm + w_rows) * bk * 2 <= SMEM_BYTES:
                                    out.append((kind, moe.GemmTiles(
                                        bm, bn, warps, stages, bk, **MODES[mode])))
    return out


_W: dict = {}  # a check worker's tensors (built once per process)


def _worker_init(shape: MoeShape, r: int, rows_per_token: int, layers: int) -> None:
    """Check worker: one layer's tensors and its references (old prefill, planned)."""
    wgu, wd = _weights(shape, 1)
    x, ids = _inputs(shape, r, rows_per_token, layers)
    grouping = moe.align(ids[0], shape.e)
    gemm = moe.expert_gemm
    ups = [gemm(x, wgu[0], ids[0], grouping, lp.up, swiglu=True, gather=True, scatter=False,
                rows_per_token=rows_per_token)
           for lp in (OLD_PREFILL, moe.plan_launch(r, shape.e))]
    downs = [gemm(ups[0], wd[0], ids[0], grouping, lp.down, swiglu=False, gather=False,
                  scatter=True)
             for lp in (OLD_PREFILL, moe.plan_launch(r, shape.e))]
    _W.update(x=x, wgu=wgu, wd=wd, ids=[ids[0]], grouping=[grouping], ups=ups, downs=downs,
              rpt=rows_per_token)


def _run_cell(w: dict, kind: str, tiles: moe.GemmTiles, j: int, ups: torch.Tensor):
    """One GEMM of layer j (``ups``: the down GEMM's input) at ``tiles``; w: per-layer lists
    "wgu", "wd", "ids", "grouping" (the align pass's) and "x", "rpt" (rows per token)."""
    if kind == "up":
        return moe.expert_gemm(w["x"], w["wgu"][j], w["ids"][j], w["grouping"][j], tiles,
                                swiglu=True, gather=True, scatter=False,
                                rows_per_token=w["rpt"])
    return moe.expert_gemm(ups, w["wd"][j], w["ids"][j], w["grouping"][j], tiles,
                            swiglu=False, gather=False, scatter=True)


def _worker_check(cell: tuple[str, moe.GemmTiles]) -> tuple[str, str, dict]:
    """Compile and run one cell; its bits against the old prefill and the planned launch."""
    kind, tiles = cell
    w = _W
    try:
        with _pdl_off():
            got = _run_cell(w, kind, tiles, 0, w["ups"][0])
    except Exception as e:  # noqa: BLE001 (a tile the compiler refuses: shared memory)
        return kind, _tiles_key(tiles), {"error": repr(e)[:300]}
    torch.cuda.synchronize()
    refs = w["ups"] if kind == "up" else w["downs"]
    return kind, _tiles_key(tiles), {"bits_equal_old": torch.equal(got, refs[0]),
                                     "bits_equal": torch.equal(got, refs[1])}


def sweep(args, shape: MoeShape, r: int, rows_per_token: int, x, ids, wgu, wd,
          weight_bytes: float, flops: float, bw: float, peak: float, t0: float) -> dict:
    """Each GEMM alone over :func:`candidates`, checked in worker processes (layer 0
    against the old prefill launch and the planned one), then timed here (layers cycled
    as above, PDL off) until ``args.deadline``."""
    cells = candidates(shape, r, args.grid, args.modes.split(","),
                       [int(v) for v in args.block_m.split(",") if v])
    res: dict = {"up": {}, "down": {}}
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers, initializer=_worker_init,
                  initargs=(shape, r, rows_per_token, args.layers)) as pool:
        for kind, key, check in pool.imap_unordered(_worker_check, cells):
            res[kind][key] = check
            if "error" in check or not check["bits_equal"]:
                print(f"  R={r} {kind} {key}: {check}", flush=True)
    print(f"  R={r}: {len(cells)} cells checked, {time.time() - t0:.0f} s", flush=True)
    state = {"x": x, "wgu": wgu, "wd": wd, "ids": ids,
             "grouping": [moe.align(t, shape.e) for t in ids], "rpt": rows_per_token}
    lp = moe.plan_launch(r, shape.e)
    ups = [_run_cell(state, "up", lp.up, j, None) for j in range(args.layers)]
    for kind, tiles in cells:
        key = _tiles_key(tiles)
        if "error" in res[kind][key]:
            continue
        if time.time() - t0 > args.deadline:
            res[kind][key]["skipped"] = "deadline"
            continue
        share = 2 / 3 if kind == "up" else 1 / 3
        try:
            with _pdl_off():
                us = graph_time_us(lambda: [_run_cell(state, kind, tiles, j, ups[j])
                                            for j in range(args.layers)], args.reps)
        except Exception as e:  # noqa: BLE001 (recorded, the sweep goes on)
            res[kind][key]["error"] = repr(e)[:300]
            print(f"  R={r} {kind} {key}: {e!r:.200}", flush=True)
            continue
        us /= args.layers
        gbs = weight_bytes * share / (us * 1e-6)
        tf = flops * share / (us * 1e-6)
        res[kind][key].update(us=us, pct_copy=100 * gbs / bw, tflops=tf / 1e12,
                              pct_matmul=100 * tf / peak)
        print(f"  R={r} {kind} {key}: {us:8.1f} us  {tf / 1e12:6.1f} TFLOP/s  "
              f"{100 * tf / peak:5.1f}% mm  {100 * gbs / bw:5.1f}% copy  bits old "
              f"{res[kind][key]['bits_equal_old']} plan {res[kind][key]['bits_equal']}",
              flush=True)
    for kind in ("up", "down"):
        ok = {k: v for k, v in res[kind].items() if "us" in v}
        if ok:
            best = min(ok, key=lambda k: ok[k]["us"])
            print(f"  R={r} {kind} best {best}: {ok[best]['us']:.1f} us", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
