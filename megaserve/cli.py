"""The ``megaserve`` command: a thin dispatcher to each subsystem's own CLI module.

Subcommands are imported only when used, so ``megaserve plan --help`` never imports torch.
Every target is ``module:function`` where ``function(argv: list[str]) -> int``.
"""

from __future__ import annotations

import importlib
import sys

from megaserve import __version__

COMMANDS = {
    "generate": ("megaserve.entrypoints.generate_cli:main", "generate text (local model or --server)"),
    "serve": ("megaserve.server.cli:main", "serve gRPC and OpenAI-compatible HTTP"),
    "plan": ("megaserve.planner.cli:main", "plan a deployment over heterogeneous GPUs"),
    "deploy": ("megaserve.deploy.cli:main", "write deployment manifests for a plan (k8s: KubeRay)"),
    "bench": (None, "benchmarks ('megaserve bench --help' lists them)"),
}

# name → (target, what it measures); `megaserve bench --help` prints them without importing.
BENCHMARKS = {
    "throughput": ("megaserve.bench.throughput:main", "offline generation throughput of the engine"),
    "decode": ("megaserve.bench.decode:main", "decode and prefill against the memory and compute rooflines"),
    "kernels": ("megaserve.kernels.bench:main", "batch-invariant kernels vs cuBLAS / SDPA, same run"),
    "comm": ("megaserve.comm.bench:main", "M->N exchange latency and throughput, transports vs NCCL"),
    "planner": ("megaserve.planner.bench:main", "plan a 1,000-GPU heterogeneous inventory, against baselines"),
    "cpu": ("megaserve.bench.cpu:main", "the CPU path on a tiny random Mixtral"),
    "device-plane": ("megaserve.bench.device_plane:main", "the device data plane against the co-located engine"),
    "device-layouts": ("megaserve.bench.device_layouts:main", "multi-GPU layouts (EP, DP, split) per GPU against one GPU"),
    "plane-tick": ("megaserve.bench.plane_tick:main", "one tick's dispatch + combine across GPUs vs NCCL send/recv"),
    "host": ("megaserve.bench.host:main", "host (Python) time per decode step, by phase"),
}

EXIT_USAGE = 2


def _usage() -> str:
    lines = [f"megaserve {__version__}", "", "usage: megaserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'megaserve <command> --help' for a command's options."]
    return "\n".join(lines)


def _bench_usage() -> str:
    lines = ["usage: megaserve bench <benchmark> [options]", "", "benchmarks:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in BENCHMARKS.items()]
    lines += ["", "Run 'megaserve bench <benchmark> --help' for a benchmark's options."]
    return "\n".join(lines)


def _run(target: str, argv: list[str]) -> int:
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"megaserve: {module_name} is not available in this build", file=sys.stderr)
            return EXIT_USAGE
        raise
    return int(getattr(module, func_name)(argv) or 0)


def _plan_argv(argv: list[str]) -> list[str]:
    """``megaserve plan`` arguments with ``--model builtin:NAME`` (megaserve's built-in test
    models, which the planner does not know) replaced by the generated checkpoint
    directory, so every model ``megaserve serve`` takes can be planned. The planner itself
    never imports megaserve (nor torch)."""
    out = list(argv)
    for i, arg in enumerate(out):
        value = out[i + 1] if arg == "--model" and i + 1 < len(out) else \
            arg.partition("=")[2] if arg.startswith("--model=") else None
        if value is None or not value.startswith("builtin:"):
            continue
        from megaserve.models.resolved import ResolvedModel

        try:
            path = str(ResolvedModel.resolve(value).path)
        except ValueError as e:
            raise SystemExit(f"megaserve plan: {e}") from None
        if arg == "--model":
            out[i + 1] = path
        else:
            out[i] = f"--model={path}"
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        print(f"megaserve {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"megaserve: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_USAGE
    if command == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(_bench_usage())
            return 0
        if not rest or rest[0] not in BENCHMARKS:
            given = f"unknown benchmark {rest[0]!r}" if rest else "no benchmark given"
            print(f"megaserve bench: {given}\n\n{_bench_usage()}", file=sys.stderr)
            return EXIT_USAGE
        return _run(BENCHMARKS[rest[0]][0], rest[1:])
    if command == "plan":
        try:
            rest = _plan_argv(rest)
        except SystemExit as e:
            print(e, file=sys.stderr)
            return EXIT_USAGE
    return _run(COMMANDS[command][0], rest)


if __name__ == "__main__":
    sys.exit(main())
