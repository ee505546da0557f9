"""``megaserve bench planner``: plan a large heterogeneous inventory, against baselines.

Measured in the same run: the full planner (atom search over all GPU-type pairs + ILP), the
same atoms with the ILP replaced by a greedy choice, and a homogeneous-only search (each
unit on one GPU type) with the ILP. Prints wall times (median of --repeat runs) and the
throughput each reaches.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np

from megaserve.planner import ilp, search
from megaserve.planner.catalog import parse_cluster
from megaserve.planner.errors import PlanError
from megaserve.planner.model_spec import load_model
from megaserve.planner.perf import Workload

DEFAULT_INVENTORY = {"H20": 250, "L40S": 250, "H800": 250, "A100-80G": 250}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str]) -> int:
    """Run the benchmark; returns 0, or 2 for bad arguments."""
    p = argparse.ArgumentParser(prog="megaserve bench planner", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--tpot-ms", type=float, default=150.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=None,
                   help="ILP time limit in seconds (default: grows with the problem, 2 to 60 s)")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        model = load_model(args.model)
        cluster = parse_cluster({"inventory": {k: {"count": v, "gpus_per_node": 8} for k, v in DEFAULT_INVENTORY.items()}})
        work = Workload(tpot_ms=args.tpot_ms)
        counts = np.array([e.count for e in cluster.available()])

        def full():
            atoms = search.find_atoms(model, work, cluster)
            return atoms, ilp.solve(atoms, counts, "throughput", time_limit_s=args.time_limit)

        t_full, (atoms, sel) = _timed(full, args.repeat)
        t_search, _ = _timed(lambda: search.find_atoms(model, work, cluster), args.repeat)
        t_greedy, greedy = _timed(lambda: ilp.greedy(search.find_atoms(model, work, cluster), counts), args.repeat)

        def homo():
            h = search.find_atoms(model, work, cluster, homogeneous=True)
            return ilp.solve(h, counts, "throughput", time_limit_s=args.time_limit)

        t_homo, homo_sel = _timed(homo, args.repeat)
    except PlanError as e:
        print(f"megaserve bench planner: error: {e}", file=sys.stderr)
        return 2
    inv = ", ".join(f"{k} {v}" for k, v in DEFAULT_INVENTORY.items())
    print(f"device: {_cpu_name()} (CPU; planner is numpy + CBC), python {platform.python_version()}")
    print(f"model {model.name}, TPOT <= {args.tpot_ms:g} ms, inventory {sum(DEFAULT_INVENTORY.values())} GPUs: {inv}")
    print(f"atoms after pruning: {len(atoms)}; median of {args.repeat} runs")
    print(f"{'method':<44} {'time s':>8} {'tokens/s':>12} {'GPUs used':>10}  ILP")
    rows = [
        ("full: all type pairs + ILP", t_full, sel),
        ("  (atom search alone)", t_search, None),
        ("baseline: all type pairs + greedy", t_greedy, greedy),
        ("baseline: homogeneous units only + ILP", t_homo, homo_sel),
    ]
    for name, t, s in rows:
        if s is None:
            print(f"{name:<44} {t:>8.3f}")
        else:
            gap = "" if s.gap != s.gap else f", gap {s.gap:.2%}"
            print(f"{name:<44} {t:>8.3f} {s.throughput:>12,.0f} {sum(s.gpus_used.values()):>10}  {s.status}{gap}")
    print(f"ILP time limit {args.time_limit or ilp.default_time_limit(atoms):g} s"
          + (f"; full: {sel.note}" if sel.note else ""))
    return 0
