"""``megaserve plan``: plan a deployment; ``megaserve plan calibrate``: fit a profile.

Every bad or infeasible input ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np

from megaserve.planner.errors import PlanError

EXIT_USAGE = 2
logger = logging.getLogger(__name__)


SCHEDULING = ("async, the engine's default on CUDA: a step takes max(GPU time, host time), the host "
              "preparing step n + 1 while the GPU runs step n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megaserve plan",
        description="Plan an MoE deployment over a GPU inventory: disaggregated units (attention and experts "
        "on different GPUs, possibly of different types) against co-located ones (both on the same GPUs). "
        "'megaserve plan calibrate --help' fits efficiency factors from measurements.",
    )
    p.add_argument("--model", required=True,
                   help="built-in name (e.g. mixtral-8x22b), an HF checkpoint directory or its "
                   "config.json, or builtin:NAME (megaserve's generated test models)")
    p.add_argument("--cluster", required=True, help="cluster YAML: inventory and GPU overrides (examples/cluster.yaml)")
    p.add_argument("--tpot-ms", type=float, default=150.0, help="time-per-output-token SLO (default 150)")
    p.add_argument("--ttft-ms", type=float, default=None, help="time-to-first-token SLO (default: none)")
    p.add_argument("--input-len", type=int, default=2048, help="prompt tokens per request (default 2048)")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request (default 256)")
    p.add_argument("--objective", choices=("throughput", "cost"), default="throughput",
                   help="maximise tokens/s, or tokens per unit cost (min cost with --target-rate)")
    p.add_argument("--target-rate", type=float, default=None, help="tokens/s to reach at minimum cost")
    p.add_argument("--expert-skew", type=float, default=1.0, help="busiest expert worker load / mean (>= 1)")
    p.add_argument("--reserve", type=float, default=0.10, help="fraction of GPU memory kept free (default 0.1)")
    p.add_argument("--max-microbatches", type=int, default=8, help="N_m: largest m tried (default 8)")
    p.add_argument("--max-batch", type=int, default=1024, help="largest batch per attention replica")
    p.add_argument("--profile", default="hopper",
                   help="efficiency profile: a YAML file from 'megaserve plan calibrate', a shipped profile "
                   "('hopper': measured on H200, default), or 'none' (datasheet defaults)")
    p.add_argument("--layouts", default="disaggregated,colocated",
                   help="candidate layouts, comma-separated (default: both)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="ILP time limit in seconds (default: grows with atoms x GPU types, 2 to 60 s; "
                   "CBC stops earlier once optimal). The plan is never worse than the greedy baseline")
    p.add_argument("--top", type=int, default=10, help="rows of the deployment-unit table (default 10)")
    p.add_argument("-o", "--output", default=None, help="write the plan YAML here")
    p.add_argument("--json", action="store_true", help="print the plan and the table as JSON")
    p.add_argument("--explain", type=int, nargs="?", const=0, default=None, metavar="RANK",
                   help="show the arithmetic of the plan's first unit, or of table row RANK")
    return p


def _calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megaserve plan calibrate",
        description="Fit efficiency factors and fixed overheads from measurement files (engine runs from "
        "'megaserve bench throughput --profile-out', kernel and transport entries; format: docs/planner.md) "
        "and write a profile for 'megaserve plan --profile'. Prints each run's error before and after.")
    p.add_argument("files", nargs="*", help="measurement JSON files")
    p.add_argument("--from", dest="bench", action="append", default=[], help="a measurement file (repeatable)")
    p.add_argument("--gpu", default=None, help="catalog GPU name (default: each file's 'gpu')")
    p.add_argument("--cluster", default=None, help="cluster YAML with custom GPUs (optional)")
    p.add_argument("--profile", default=None, help="existing profile to update: a file, a shipped name, or none")
    p.add_argument("--transfer", action="append", default=[], metavar="DST=SRC",
                   help="also give GPU DST the fitted factors of SRC, marked as not measured (repeatable)")
    p.add_argument("-o", "--output", required=True, help="profile YAML to write")
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage or help
        return int(e.code or 0)


def _calibrate(argv: list[str]) -> int:
    args = _parse(_calibrate_parser(), argv)
    if isinstance(args, int):
        return args
    from megaserve.planner import calibrate, catalog, profile

    files = [*args.files, *args.bench]
    if not files:
        raise PlanError("calibrate: give at least one measurement file")
    gpus = catalog.load_cluster(args.cluster).gpus if args.cluster else catalog.DEFAULT_GPUS
    prof = profile.load_profile(args.profile) if args.profile else profile.Profile()
    prof, fits = calibrate.calibrate(files, gpus, prof, args.gpu)
    for pair in args.transfer:
        prof = calibrate.transfer(prof, pair, gpus)
    profile.save_profile(prof, args.output)
    for fit in fits.values():
        print(calibrate.error_table(fit))
    print(f"wrote {args.output}: {json.dumps(prof.to_dict()['gpus'])}")
    return 0


def _plan(argv: list[str]) -> int:
    args = _parse(_parser(), argv)
    if isinstance(args, int):
        return args
    from megaserve.planner import ilp, plan_file, report, search
    from megaserve.planner.catalog import load_cluster
    from megaserve.planner.model_spec import load_model
    from megaserve.planner.perf import Workload
    from megaserve.planner.profile import load_profile

    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    prof = load_profile(args.profile)
    layouts = tuple(x.strip() for x in args.layouts.split(",") if x.strip())
    if not layouts or set(layouts) - set(search.LAYOUTS):
        raise PlanError(f"--layouts {args.layouts!r}: choose from {', '.join(search.LAYOUTS)}")
    try:
        work = Workload(input_len=args.input_len, output_len=args.output_len, tpot_ms=args.tpot_ms,
                        ttft_ms=args.ttft_ms, expert_skew=args.expert_skew, reserve_frac=args.reserve,
                        max_batch_per_replica=args.max_batch, max_microbatches=args.max_microbatches)
    except ValueError as e:
        raise PlanError(f"bad workload: {e}") from None
    atoms = search.find_atoms(model, work, cluster, prof, layouts=layouts)
    counts = np.array([e.count for e in cluster.available()])
    sel = ilp.solve(atoms, counts, args.objective, args.target_rate, args.time_limit)
    plan = plan_file.plan_dict(args.model, model, work, args.objective, atoms, sel)
    ranked = report.rank(atoms, args.objective)[: max(args.top, 1)]
    if args.output:
        plan_file.write_plan(plan, args.output)
    types = [e.gpu for e in cluster.available()]
    if args.json:
        print(json.dumps({"plan": plan, "top": [report.table_row(model, atoms, i) for i in ranked],
                          "profile": {"source": prof.source, "fits": {t: prof.fits.get(t) for t in types}},
                          "scheduling": "async"},
                         indent=1))
    else:
        print(report.summary(model, work, cluster, atoms, sel, args.objective))
        print(prof.describe(types))
        print(f"scheduling: {SCHEDULING}")
        print()
        print(report.table(model, atoms, ranked, args.objective))
    if args.explain is not None:
        from megaserve.planner.explain import compare_layouts, explain

        if args.explain > len(ranked):
            raise PlanError(f"--explain {args.explain}: the table has only {len(ranked)} rows")
        i = sel.atom_ids[0] if args.explain == 0 else ranked[args.explain - 1]
        print()
        print(explain(model, work, cluster, prof, atoms, int(i)))
        print()
        print(compare_layouts(model, work, cluster, atoms, counts, args.objective, args.target_rate, args.time_limit,
                             prof))
    if args.output:
        print(f"\nwrote {args.output}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``megaserve plan``; returns the exit code (2 for bad input)."""
    try:
        if argv and argv[0] == "calibrate":
            return _calibrate(argv[1:])
        return _plan(argv)
    except PlanError as e:
        print(f"megaserve plan: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"megaserve plan: error: {e.strerror}: {e.filename}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
