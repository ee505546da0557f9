"""Prefill paged attention: launch candidates against the default launch, one device call
(issue 14, prefill floor).

Run on one GPU: ``PYTHONPATH=. python3 lab/attn_prefill_bench.py [--out DIR]``.
The shape of the Qwen3-30B-A3B layer (Hq 32, Hkv 4, head_dim 128, bf16, cache blocks of
16): a 4,096-token prompt in one chunk (causal, context 4,096) and the second 4,096-token
chunk of an 8,192-token prompt (context 8,192, the first half from the cache). Every
variant is timed (median of CUDA-graph replays) next to the default launch
(:func:`choose_launch`'s pick, ``default``) and SDPA flash (the whole 4,096 causal prompt;
for the second chunk, flash's causal 8,192-token prompt, whose FLOP/s is the reference),
and checked bitwise (``torch.equal``) against the default launch (on Hopper the Gluon
serial kernel; the variants are Triton tiles, ``gluon=False`` unless they say otherwise):
on both timed shapes and,
in parallel child processes, on the shapes of lab/attn_sweep.py (whole prefill, chunked
prefill of 37 and 1000 tokens, single decodes, a mixed batch). TFLOP/s counts the causal
FLOPs ``4 * T * ctx_avg * Hq * Dh`` (``ctx_avg``: a row's mean number of visible keys).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HQ, HKV, DH = 32, 4, 128
# (name, context, new tokens): the prompt in one chunk, the second chunk of a longer one.
CASES = [("prefill 4096", 4096, 4096), ("chunk 2 of 8192", 8192, 4096)]
PF = dict(mode="serial", rows=128, num_warps=8, mask_tail=True)
# The baseline: the round-8 prefill tile (the default before issue 14), timed first and last.
BASELINE = ("round-8 tile r128 w8 s2", dict(PF, num_stages=2))
LF = dict(PF, long_first=True)
VARIANTS = [
    ("r128 w8 s2 prefetch l16 long_first", dict(LF, num_stages=2, prefetch=True, l_cols=16)),
    ("r128 w8 s3 prefetch l16 long_first", dict(LF, num_stages=3, prefetch=True, l_cols=16)),
    ("r128 w8 s4 prefetch l16 long_first", dict(LF, num_stages=4, prefetch=True, l_cols=16)),
    ("r64 w4 s2 l16 long_first", dict(LF, rows=64, num_warps=4, num_stages=2, l_cols=16)),
    ("r64 w4 s2 prefetch l16 long_first", dict(LF, rows=64, num_warps=4, num_stages=2,
                                               prefetch=True, l_cols=16)),
    ("r64 w4 s3 prefetch l16 long_first", dict(LF, rows=64, num_warps=4, num_stages=3,
                                               prefetch=True, l_cols=16)),
]
# (Rounds 1-2 below timed the per-split arithmetic of the time; round 3, roofline round 8,
# the one accumulator at 8 splits a chunk: docs/benchmarks.md.)
# Round 1 of issue 14 (an H100, S=1 x 4096 / second 4096 of 8192, us; 5 x 155 checks passed):
# round-8 tile 526 / 1456; s2 prefetch 523 / 1446; s3 555 / 1518; s3 prefetch 545 / 1495;
# s4 prefetch 554 / 1521; s3 prefetch long_first 481 / 1365; s2 l16 489 / 1356; s3 prefetch
# l16 515 / 1417; s4 prefetch l16 507 / 1391; s3 prefetch l16 long_first 455 / 1295; r64 w4
# s2 prefetch 497 / 1396; r64 w4 s2 prefetch l16 491 / 1385; r64 w4 s3 prefetch l16 659 /
# 1774; SDPA flash 499 (4096 causal), 1757 (8192 causal).
# Round 2 (an H100, same shapes, 5 x 111 checks passed; the default then was s2 l16
# long_first): round-8 tile 526 / 1437; s2 l16 489 / 1350; s2 long_first 507 / 1325; s2 l16
# long_first 485 / 1272; s2 prefetch l16 long_first 489 / 1283; s3 prefetch l16 long_first
# 455 / 1291; s4 prefetch l16 long_first 449 / 1280 (now the serial prefill default); r64 w4
# s2 prefetch l16 long_first 482 / 1319; SDPA flash 499, 1748.
# Check shapes (Hq, Hkv, Dh, block_size, context): lab/attn_sweep.py's and this one's.
CHECK_SHAPES = [(32, 8, 128, 16, 8192), (8, 8, 128, 32, 3000), (32, 4, 64, 32, 5000),
                (16, 4, 64, 16, 2100), (HQ, HKV, DH, 16, 4096)]
# Launches also checked (not timed): chunk mode with the narrow l-dot.
EXTRA_CHECKS = [dict(mode="chunk", rows=16, num_warps=2, num_stages=3, fold_unroll=16,
                     mask_tail=True, prefetch=True, l_cols=16),
                dict(mode="chunk", rows=64, num_warps=4, num_stages=2, l_cols=16)]


def check_shape(idx: int) -> dict:
    """Every variant (and EXTRA_CHECKS) against the default launch at CHECK_SHAPES[idx]."""
    import torch

    from attn_sweep import LaunchChecks, setup_case as _setup

    hq, hkv, dh, bs, length = CHECK_SHAPES[idx]
    q, k, v, kc, vc, table = _setup(hq, hkv, dh, bs, length, 100 + idx)
    checks = LaunchChecks(kc, vc, table, dh**-0.5)
    run, expect = checks.run, checks.expect

    full = run(q, [length], [length])
    expect("round-3 tile (serial r64 w4 s2)", run(q, [length], [length], launch=dict(
        mode="serial", rows=64, num_warps=4, num_stages=2)), full)
    launches = [BASELINE[1]] + [v for _, v in VARIANTS] + EXTRA_CHECKS
    for var in launches:
        expect(f"prefill {var}", run(q, [length], [length], launch=var), full)
        for chunk in (37, 1000):
            outs = [run(q[a : a + chunk], [min(a + chunk, length)], [min(chunk, length - a)],
                        launch=var) for a in range(0, length, chunk)]
            expect(f"chunked {chunk} {var}", torch.cat(outs), full)
        for t in (0, 63, 64, 1023, 1024, length // 2 + 5, length - 1):
            expect(f"decode {t} {var}", run(q[t : t + 1], [t + 1], [1], launch=var)[0],
                   full[t])
        lens, n_new = [length, 1, 65, 64, length // 2], [1, 1, 3, 64, 130]
        qb = torch.cat([q[c - m : c] for c, m in zip(lens, n_new)])
        want = torch.cat([full[c - m : c] for c, m in zip(lens, n_new)])
        expect(f"batch {var}", run(qb, lens, n_new, launch=var), want)
    return dict(shape=CHECK_SHAPES[idx], checks=checks.checks, failures=checks.failures)


def flops(ctx: int, new: int) -> float:
    """Causal FLOPs of ``new`` rows ending at ``ctx``: 2 dots of 2 flops per visible key."""
    visible = sum(range(ctx - new + 1, ctx + 1))  # row i sees ctx - new + i + 1 keys
    return 4.0 * visible * HQ * DH


def time_cases(budget_s: float) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megaserve.kernels.testing import paged_inputs, time_ms
    from megaserve.kernels.triton_impl.attention import AttentionLaunch, paged_attention

    rows = []
    t_end = time.time() + budget_s
    for case, ctx, new in CASES:
        q, kc, vc, table, lens, qsl, kd, vd = paged_inputs(1, ctx, new, HQ, HKV, DH,
                                                            torch.bfloat16)
        scale = DH**-0.5
        if new == ctx:
            qd, fl_sdpa = q.view(1, new, HQ, DH).transpose(1, 2), flops(ctx, new)
        else:  # flash has no bottom-right causal mask: time the whole prompt instead
            qd = torch.randn(1, HQ, ctx, DH, device="cuda", dtype=torch.bfloat16)
            fl_sdpa = flops(ctx, ctx)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_us = time_ms(lambda: F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)) * 1e3
        fl = flops(ctx, new)
        print(f"{case}: SDPA flash {sdpa_us:.1f} us, {fl_sdpa / sdpa_us / 1e6:.0f} TFLOP/s "
              f"({'same rows' if new == ctx else f'whole {ctx}-token prompt'})", flush=True)
        base = base_us = None
        for name, var in [BASELINE, ("default", None)] + VARIANTS + [
                (BASELINE[0] + " (again)", BASELINE[1])]:
            if time.time() > t_end:
                print(f"  {case} {name}: skipped (budget)", flush=True)
                continue
            launch = None if var is None else AttentionLaunch(**{"gluon": False, **var})
            fn = lambda launch=launch: paged_attention(  # noqa: E731
                q, kc, vc, table, lens, qsl, scale, launch=launch)
            try:
                out = fn()
                us = time_ms(fn) * 1e3
            except Exception as exc:  # e.g. out of shared memory
                print(f"  {case} {name}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            if base is None:
                base, base_us = out, us
            same = bool(torch.equal(out, base))
            row = dict(case=case, variant=name, launch=var, us=us, tflops=fl / us / 1e6,
                       vs_baseline=base_us / us, same_bits=same, sdpa_us=sdpa_us,
                       sdpa_tflops=fl_sdpa / sdpa_us / 1e6)
            rows.append(row)
            print(f"  {case} {name:36s} {us:8.1f} us {row['tflops']:6.1f} TFLOP/s  x"
                  f"{row['vs_baseline']:.3f} vs round-8  bits {'equal' if same else 'DIFFER'}",
                  flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--child", type=int, default=-1)
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-timings", action="store_true")
    args = parser.parse_args()
    if args.child >= 0:
        print("RESULT " + json.dumps(check_shape(args.child)), flush=True)
        return 0
    t0 = time.time()
    ok = True
    if not args.no_checks:  # first, in parallel: they also compile the timed launches
        from scripts.attn_sweep import child_results

        results = child_results([[sys.executable, __file__, "--child", str(i)]
                                 for i in range(len(CHECK_SHAPES))])
        for i, (res, text) in enumerate(results):
            if res is None:
                ok = False
                print(f"check child {i} failed:\n{text[-3000:]}")
                continue
            ok &= not res["failures"]
            print(f"checks {res['shape']}: {res['checks']} checks, "
                  f"{len(res['failures'])} failures", flush=True)
            for f in res["failures"][:10]:
                print(f"   FAIL {f}")
        print(f"checks done in {time.time() - t0:.0f}s", flush=True)
    rows = [] if args.no_timings else time_cases(args.budget_s)
    ok &= all(r["same_bits"] for r in rows)
    with open(os.path.join(args.out, "attn_prefill_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    import torch

    print(f"device: {torch.cuda.get_device_name()}; all bitwise checks "
          f"{'PASSED' if ok else 'FAILED'}; total {time.time() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
