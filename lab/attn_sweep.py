"""Device sweep for paged attention: bitwise checks, then timings. (Split-mode launches
run as chunk mode: the per-split arithmetic is gone.)

Run on one GPU: ``PYTHONPATH=. python3 lab/attn_sweep.py [--out DIR] [--phase P]``.
Phase 1 runs the checks of each shape (``--parts`` children per shape) and a compile
warm-up of the timed variants in parallel child processes; phase 2 times every variant
against SDPA flash in this process and prints a line per variant. Checks, per shape (GQA group, head dim, block size, context): the reference is
the reference tile (serial, 64 rows, 4 warps); every launch variant of the full prefill,
decode of single tokens, chunked prefill with several chunk sizes and a mixed batch of
sequences must equal it bitwise (``torch.equal``); float64 error of sampled rows <= 1e-2.
The checks use paged_attention's default arithmetic (the EXP2 form; run with
``MEGASERVE_ATTN_EXP2=0`` to check the exp form); the timed variants name theirs. The
variants are Triton tiles (``gluon=False`` unless a variant says otherwise: on Hopper the
default serial prefill launch is the Gluon kernel).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

# (Hq, Hkv, Dh, block_size, context)
SHAPES = [(32, 8, 128, 16, 8192), (8, 8, 128, 32, 3000), (32, 4, 64, 32, 5000),
          (16, 4, 64, 16, 2100)]
REF = dict(mode="serial", rows=64, num_warps=4, num_stages=2)
NEW = dict(mask_tail=True, prefetch=True)  # loop switches
R4_DECODE = dict(mode="chunk", rows=16, num_warps=2, num_stages=3, fold_unroll=16)
CHECK_VARIANTS = [
    dict(mode="serial", rows=16, num_warps=4, num_stages=3),
    dict(mode="serial", rows=16, num_warps=1, num_stages=2),
    dict(mode="serial", rows=32, num_warps=4, num_stages=2),
    dict(mode="serial", rows=128, num_warps=8, num_stages=2),
    dict(mode="serial", rows=128, num_warps=8, num_stages=3),
    dict(mode="serial", rows=64, num_warps=4, num_stages=3),
    dict(mode="chunk", rows=16, num_warps=4, num_stages=3),
    dict(mode="chunk", rows=64, num_warps=4, num_stages=2, fold_tokens=4),
    R4_DECODE,
    # loop switches (indices 9..)
    dict(mode="serial", rows=64, num_warps=4, num_stages=2, mask_tail=True),
    dict(mode="serial", rows=64, num_warps=4, num_stages=3, **NEW),
    dict(mode="serial", rows=128, num_warps=8, num_stages=3, long_first=True, **NEW),
    dict(mode="serial", rows=16, num_warps=2, num_stages=3, **NEW),
    dict(mode="chunk", rows=16, num_warps=2, num_stages=3, fold_unroll=16, **NEW),
    dict(mode="chunk", rows=16, num_warps=4, num_stages=4, fold_block_d=32, long_first=True, **NEW),
    dict(mode="chunk", rows=64, num_warps=4, num_stages=3, prefetch=True, fold_tokens=4),
]
# Candidates (timed below): the two-level reduction (attention NOTE) with chunk
# mode, decode tiles of 2 and 4 warps (the mma layout now splits head_dim across warps),
# prefill tiles of 8 warps (the chunk accumulator made 4-warp 64-row tiles spill).
CH = dict(mode="chunk", rows=16, num_warps=2, num_stages=3, fold_unroll=16, fold_block_d=16,
          fold_warps=1, **NEW)  # a split-mode decode tile, now run as chunk mode
DECODE_VARIANTS = [
    ("chunk r16 w2 s2", dict(CH, num_stages=2), True),
    ("chunk r16 w2 s3", CH, True),
    ("chunk r16 w2 s4", dict(CH, num_stages=4), True),
    ("chunk r16 w4 s2", dict(CH, num_warps=4, num_stages=2), True),
    ("chunk r16 w4 s3", dict(CH, num_warps=4), True),
    ("chunk r16 w4 s4", dict(CH, num_warps=4, num_stages=4), True),
    ("chunk r16 w1 s3", dict(CH, num_warps=1), True),
    ("chunk r16 w4 s3 fold_d32 fw1", dict(CH, num_warps=4, fold_block_d=32), True),
    ("serial r16 w2 s4 (2-warp serial)", dict(mode="serial", rows=16, num_warps=2,
                                              num_stages=4, **NEW), True),
    ("serial r16 w4 s3", dict(mode="serial", rows=16, num_warps=4, num_stages=3, **NEW), True),
    ("serial r16 w4 s4", dict(mode="serial", rows=16, num_warps=4, num_stages=4, **NEW), True),
]
# Split- and chunk-mode variants whose parts kernel is also timed alone (fold = rest).
PARTS_TIMED = {n for n, v, _ in DECODE_VARIANTS if v["mode"] != "serial"}
MT = dict(mode="serial", mask_tail=True)
PREFILL_VARIANTS = [
    ("r64 w4 s2 mask_tail (64-row default)", dict(MT, rows=64, num_warps=4, num_stages=2),
     True),
    ("r64 w8 s2 mask_tail", dict(MT, rows=64, num_warps=8, num_stages=2), True),
    ("r64 w8 s3 mask_tail", dict(MT, rows=64, num_warps=8, num_stages=3), True),
    ("r128 w8 s2 mask_tail", dict(MT, rows=128, num_warps=8, num_stages=2), True),
    ("r128 w8 s2 mask_tail long_first", dict(MT, rows=128, num_warps=8, num_stages=2,
                                             long_first=True), True),
    ("chunk r128 w8 s2 mask_tail", dict(MT, mode="chunk", rows=128, num_warps=8,
                                        num_stages=2), True),
]
# Every timed launch with the default arithmetic is also checked bitwise (prefill, single
# decodes for decode candidates, batches), so a winner can become the default.
for _vs in (DECODE_VARIANTS, PREFILL_VARIANTS):
    for _n, _var, _e2 in _vs:
        if _var is not None and _e2 and _var not in CHECK_VARIANTS:
            CHECK_VARIANTS.append(_var)
_NEW_CHECKS = list(range(16, len(CHECK_VARIANTS)))
DECODE_CHECKS = [0, 1, 6, 8, 12, 13, 14] + [
    i for i in _NEW_CHECKS if CHECK_VARIANTS[i]["rows"] == 16]  # also on single decodes
BATCH_CHECKS = [0, 3, 6, 8, 10, 11, 12, 13, 14, 15] + _NEW_CHECKS  # and on batches
CASES = [("decode", 8, 8192, 1), ("decode", 64, 4096, 1), ("decode", 32, 2048, 1),
         ("decode", 2, 8192, 1), ("decode", 1, 4096, 1), ("prefill", 4, 4096, 4096),
         ("prefill", 1, 8192, 512)]  # the last: chunked prefill; flash's mask differs there


def setup_case(hq, hkv, dh, bs, length, seed):
    import torch

    from megaserve.kernels.triton_impl import write_kv_cache

    torch.manual_seed(seed)
    nb = -(-length // bs)
    kc = torch.randn(nb + 7, bs, hkv, dh, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(nb + 7, device="cuda")[:nb].int()
    k = torch.randn(length, hkv, dh, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.arange(length, device="cuda")
    write_kv_cache(k, v, kc, vc, table.long()[pos // bs] * bs + pos % bs)
    q = torch.randn(length, hq, dh, device="cuda", dtype=torch.bfloat16)
    return q, k, v, kc, vc, table


class LaunchChecks:
    """paged_attention over one shape's cache (:meth:`run`) and bitwise comparisons that
    record a failure instead of raising (:meth:`expect`), for the device scripts' checks."""

    def __init__(self, kc, vc, table, scale: float) -> None:
        self.kc, self.vc, self.table, self.scale = kc, vc, table, scale
        self.failures: list[str] = []
        self.checks = 0

    def run(self, rows, lens, n_new, tables=None, launch=None):
        import torch

        from megaserve.kernels.triton_impl.attention import AttentionLaunch, paged_attention

        lens_t = torch.tensor(lens, device="cuda", dtype=torch.int32)
        qsl = torch.tensor([0, *itertools.accumulate(n_new)], device="cuda",
                           dtype=torch.int32)
        tb = (self.table[None].expand(len(lens), -1).contiguous() if tables is None
              else tables)
        if launch is not None:
            launch = AttentionLaunch(**{"gluon": False, **launch})
        return paged_attention(rows, self.kc, self.vc, tb, lens_t, qsl, self.scale,
                               launch=launch)

    def expect(self, name, got, want) -> None:
        import torch

        self.checks += 1
        if got.isnan().any() or not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().nan_to_num(1e9).max().item()
            self.failures.append(f"{name} (max diff {diff:.3g})")


def check_shape(idx: int, part: int = 0, parts: int = 1) -> dict:
    """The bitwise checks of SHAPES[idx] whose CHECK_VARIANTS index is ``part`` mod
    ``parts`` (part 0 also the default launch's and the diagnostics); returns {shape,
    failures, checks, rel_err}."""
    import torch

    hq, hkv, dh, bs, length = SHAPES[idx]
    q, k, v, kc, vc, table = setup_case(hq, hkv, dh, bs, length, idx)
    scale = dh**-0.5
    checks = LaunchChecks(kc, vc, table, scale)
    run, expect, fails = checks.run, checks.expect, checks.failures

    full = run(q, [length], [length], launch=REF)
    gen = torch.Generator().manual_seed(idx)
    sample = torch.randint(0, length, (48,), generator=gen).tolist() + [0, 63, 64, length - 1]
    rows = torch.tensor(sample, device="cuda")
    group = hq // hkv
    kr = k.double().repeat_interleave(group, 1)
    vr = v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q[rows].double(), kr) * scale
    s = s.masked_fill(torch.arange(length, device="cuda")[None, None, :] > rows[None, :, None],
                      float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vr)
    rel = float((full[rows].double() - ref).norm() / ref.norm())
    if not rel <= 1e-2 or full.isnan().any():
        fails.append(f"float64 reference rel err {rel:.3g}")
    expect("default launch, prefill", run(q, [length], [length]), full)

    def mine(vars_):  # this child's share of a list of launches (None: the default)
        return [v for v in vars_ if (v is None and part == 0) or (
            v is not None and CHECK_VARIANTS.index(v) % parts == part)]

    for var in mine(CHECK_VARIANTS):
        expect(f"prefill {var}", run(q, [length], [length], launch=var), full)
    for t in sample[:12] + [0, 63, 64, length - 1]:
        for var in mine([None] + [CHECK_VARIANTS[i] for i in DECODE_CHECKS]):
            expect(f"decode {t} {var}", run(q[t : t + 1], [t + 1], [1], launch=var)[0], full[t])
    for chunk in (37, 256, 1000):
        for var in mine([None, CHECK_VARIANTS[9], CHECK_VARIANTS[11]] + [
                CHECK_VARIANTS[i] for i in _NEW_CHECKS if CHECK_VARIANTS[i]["rows"] >= 64]):
            outs = [run(q[a : a + chunk], [min(a + chunk, length)], [min(chunk, length - a)],
                        launch=var) for a in range(0, length, chunk)]
            expect(f"chunked prefill {chunk} {var}", torch.cat(outs), full)
    # Batch compositions: each sequence's rows equal the same tokens of ``full``.
    comps = [([length, 1, 65, 64, length // 2], [1, 1, 3, 64, 130]),
             ([5, length, 2000 % length + 1, 100], [5, 1, 1, 1]),
             ([length - 10 * i for i in range(16)], [1] * 16)]
    for lens, n_new in comps:
        qb = torch.cat([q[c - n : c] for c, n in zip(lens, n_new)])
        want = torch.cat([full[c - n : c] for c, n in zip(lens, n_new)])
        for var in mine([None] + [CHECK_VARIANTS[i] for i in BATCH_CHECKS]):
            expect(f"batch {n_new} {var}", run(qb, lens, n_new, launch=var), want)
    return dict(shape=SHAPES[idx], checks=checks.checks, failures=fails, rel_err=rel)


def paged_inputs(num_seqs, ctx, new, hq, hkv, dh):
    from megaserve.kernels.testing import paged_inputs as make

    import torch

    return make(num_seqs, ctx, new, hq, hkv, dh, torch.bfloat16)


def time_cases(warm_only: bool, budget_s: float = 1e9, only: str = "") -> list[dict]:
    """Every timed variant of every case whose name contains ``only`` (and SDPA flash);
    warm_only: one call each. Variants still untimed after ``budget_s`` seconds are listed
    as skipped."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megaserve.kernels.testing import time_ms
    from megaserve.kernels.triton_impl.attention import AttentionLaunch, paged_attention

    hq, hkv, dh = 32, 8, 128
    rows = []
    t_end = time.time() + budget_s
    for name, seqs, ctx, new in CASES:
        case = f"{name} S={seqs} ctx={ctx} new={new}"
        if only not in case:
            continue
        q, kc, vc, table, lens, qsl, kd, vd = paged_inputs(seqs, ctx, new, hq, hkv, dh)
        scale = dh**-0.5
        variants = [("default", None, True)] + (DECODE_VARIANTS if name == "decode"
                                                else PREFILL_VARIANTS)
        qd = q.view(seqs, new, hq, dh).transpose(1, 2)
        sdpa = float("nan")  # flash has no causal mask for new < ctx (chunked prefill)
        if not warm_only and (new == 1 or new == ctx):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa = time_ms(lambda: F.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=new > 1, scale=scale, enable_gqa=True))
        base = None
        for vname, var, exp2 in variants:
            if not warm_only and time.time() > t_end:
                print(f"  {case} {vname}: skipped (sweep budget)", flush=True)
                continue
            launch = None if var is None else AttentionLaunch(**{"gluon": False, **var})
            fn = lambda launch=launch, exp2=exp2: paged_attention(  # noqa: E731
                q, kc, vc, table, lens, qsl, scale, launch=launch, exp2=exp2)
            try:
                out = fn()
                if base is None:
                    base = out
                us = 0.0 if warm_only else time_ms(fn) * 1e3
                p_us = None
                if vname in PARTS_TIMED:  # the parts kernel alone; the fold is the rest
                    parts = lambda launch=launch: paged_attention(  # noqa: E731
                        q, kc, vc, table, lens, qsl, scale, launch=launch, parts_only=True)
                    parts()
                    p_us = 0.0 if warm_only else time_ms(parts) * 1e3
            except Exception as exc:  # a launch the GPU cannot run (e.g. shared memory)
                print(f"  {case} {vname}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            row = dict(case=case, variant=vname, us=us, sdpa_us=sdpa * 1e3,
                       ratio=(sdpa * 1e3 / us) if us else 0, launch=var, exp2=exp2,
                       same_bits=bool(torch.equal(out, base)) if exp2 else None)
            if p_us is not None:
                row.update(parts_us=p_us, fold_us=us - p_us)
            rows.append(row)
            if not warm_only:
                extra = (f"  (parts {p_us:.1f}, fold {us - p_us:.1f})"
                         if p_us is not None else "")
                print(f"  {case} {vname}: {us:.1f} us (flash {sdpa * 1e3:.1f}, ratio "
                      f"{row['ratio']:.2f}){extra}", flush=True)
        del q, kc, vc, kd, vd
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--child", default="")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds for the timing phase; later variants are skipped")
    parser.add_argument("--phase", choices=["all", "checks", "timings"], default="all",
                        help="checks (+ compile warm-up) only, timings only, or both")
    parser.add_argument("--parts", type=int, default=2, help="check children per shape")
    parser.add_argument("--only", default="", help="time only cases whose name contains this")
    args = parser.parse_args()
    if args.child:
        kind, idx, part = (args.child.split(":") + ["0"])[:3]
        res = (check_shape(int(idx), int(part), args.parts) if kind == "check"
               else time_cases(warm_only=True))
        print("RESULT " + json.dumps(res if kind == "check" else {"warm": len(res)}))
        return 0
    t0 = time.time()
    ok = True
    if args.phase != "timings":
        ok = _checks(args.parts)
    if args.phase == "checks":
        return 0 if ok else 1
    rows = time_cases(warm_only=False, budget_s=args.budget_s, only=args.only)
    with open(os.path.join(args.out, "attn_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    import torch

    print(f"device: {torch.cuda.get_device_name()}; times: median of CUDA-graph replays; "
          f"'default' = choose_launch's pick; flash timed in the same process")
    print(f"total {time.time() - t0:.0f}s")
    return 0 if ok else 1


def child_results(commands: list[list[str]]):
    """Run ``commands`` (child processes of a device script) in parallel; yield, in order,
    (the JSON of each child's ``RESULT `` line, or None if it printed none, its output)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    for p in procs:
        text, _ = p.communicate()
        line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
        yield (None if line is None else json.loads(line[7:])), text


def _checks(parts: int) -> bool:
    """Phase 1: every shape's checks, ``parts`` children per shape, and a compile
    warm-up of the timed variants, all in parallel; prints a line per child."""
    t0 = time.time()
    children = [f"check:{i}:{p}" for i in range(len(SHAPES)) for p in range(parts)]
    children.append("warm:0")
    ok = True
    results = child_results([[sys.executable, __file__, "--child", c, "--parts", str(parts)]
                             for c in children])
    for c, (res, text) in zip(children, results):
        if res is None:
            ok = False
            print(f"{c}: child failed:\n{text[-3000:]}")
            continue
        if c.startswith("check"):
            ok &= not res["failures"]
            print(f"{c} shape={res['shape']} checks={res['checks']} failures="
                  f"{len(res['failures'])} rel_err={res['rel_err']:.2e}")
            for f in res["failures"][:8]:
                print(f"   FAIL {f}")
    from megaserve.kernels.triton_impl.attention import exp2_default

    print(f"phase 1 (checks, parallel, exp2={exp2_default()}) {time.time() - t0:.0f}s; "
          "all bitwise checks "
          f"{'PASSED' if ok else 'FAILED'}", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
