"""``megaserve serve``: one process serving the gRPC and OpenAI-compatible HTTP APIs."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import NoReturn

from megaserve.engine.config import (EngineConfig, default_max_num_batched_tokens,
                                     default_max_num_seqs, resolve_device)
from megaserve.entrypoints.generate_cli import add_runtime_flags, runtime_options
from megaserve.entrypoints.preflight import check_runtime
from megaserve.server.app import ServeConfig, serve

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    d = ServeConfig()
    p = argparse.ArgumentParser(
        prog="megaserve serve",
        description="Serve a MoE model over gRPC (megaserve.v1.Generation) and "
                    "OpenAI-compatible HTTP from one process.")
    add_runtime_flags(p)  # --model --dtype --device --max-model-len --max-num-seqs, placement
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed for requests without one (default: %(default)s)")
    p.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port)
    p.add_argument("--http-port", "--port", dest="http_port", type=int, default=d.http_port,
                   help="OpenAI-compatible HTTP port (--port: vLLM's name; default: "
                        "%(default)s)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="requests allowed beyond --max-num-seqs before refusing with "
                        "RESOURCE_EXHAUSTED / HTTP 429 (default: %(default)s)")
    p.add_argument("--grace-period", type=float, default=d.grace_period,
                   help="seconds from SIGTERM to exit: in-flight requests get all of it "
                        "but min(1 s, a quarter) to finish, then the rest are aborted "
                        "(default: %(default)s)")
    p.add_argument("--api-key", nargs="+", default=None,
                   help="require 'Authorization: Bearer <key>' with one of these keys on "
                        "HTTP /v1/* and as gRPC 'authorization' metadata on "
                        "megaserve.v1.Generation; /health, /metrics and gRPC health stay "
                        "open. Each key is a caller identity: request ids are scoped by it "
                        "(default: $MEGASERVE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) the API serves the model under; the first labels the "
                        "metrics (default: --model)")
    p.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS: origins whose browsers may call the HTTP API ('*': any; "
                        "default: none, no CORS headers)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="add X-Request-Id to every HTTP response: the request's own, "
                        "else one the server makes up")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model choose tool calls (tool_choice "auto", the default '
                        "with tools); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="how tool calls are read from the output with tool_choice auto: "
                        "hermes (<tool_call> JSON blocks: Qwen2.5, Qwen3, Hermes)")
    p.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                   help="seconds an HTTP connection may go without a complete request "
                        "head, idle keep-alive included, before it is closed "
                        "(default: %(default)s)")
    p.add_argument("--launcher", default="local", choices=["local", "ray"],
                   help="where the workers of a disaggregated layout run: processes of this "
                        "host, or Ray actors placed by the plan's GPU types (pip install "
                        "'megaserve[ray]'; needs --transport tcp or another process "
                        "transport) (default: %(default)s)")
    p.add_argument("--ray-address", default=None,
                   help="the Ray cluster to join with --launcher ray: 'auto' (the one "
                        "this node belongs to), ray://HOST:10001 or HOST:6379 (default: "
                        "the one already connected, else a new local one)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _launcher_options(args: argparse.Namespace) -> dict:
    """EngineConfig options of --launcher / --ray-address (GPU types from --plan for Ray)."""
    if args.launcher == "local":
        if args.ray_address is not None:
            raise ValueError("--ray-address: only used with --launcher ray")
        return {}
    if runtime_options(args).get("transport", "inproc") == "inproc":
        raise ValueError("--launcher ray: the workers are Ray actors, each its own process; "
                         "add --transport tcp")
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError("--launcher ray: Ray is not installed; pip install 'megaserve[ray]'")
    options = {"launcher": "ray", "ray_address": args.ray_address}
    if args.plan:
        from megaserve.deploy.plans import plan_gpu_options

        options.update(plan_gpu_options(args.plan, args.plan_unit))
    return options


def _tool_parser(args: argparse.Namespace) -> str | None:
    """--tool-call-parser, which --enable-auto-tool-choice needs (vLLM's pairing)."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    return args.tool_call_parser


def main(argv: list[str]) -> int:
    """Entry point of ``megaserve serve``; returns the exit code (2 for bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the message
        return int(e.code or 0)
    try:
        engine = {**runtime_options(args), "seed": args.seed, **_launcher_options(args)}
        device = resolve_device(engine["device"])
        if engine["max_num_batched_tokens"] is None:  # vLLM's API-server defaults
            engine["max_num_batched_tokens"] = default_max_num_batched_tokens(device, "server")
        if engine["max_num_seqs"] is None:
            engine["max_num_seqs"] = default_max_num_seqs(device, "server",
                                                          engine["max_num_batched_tokens"])
        EngineConfig(**engine)  # refuse bad engine flags now, not after binding ports
        config = ServeConfig(engine=engine, host=args.host, grpc_port=args.grpc_port,
                             http_port=args.http_port, max_waiting=args.max_waiting,
                             grace_period=args.grace_period,
                             api_key=args.api_key or os.environ.get("MEGASERVE_API_KEY"),
                             timeout_keep_alive=args.timeout_keep_alive,
                             served_model_names=tuple(args.served_model_name or ()),
                             allowed_origins=tuple(args.allowed_origins or ()),
                             enable_request_id_headers=args.enable_request_id_headers,
                             tool_call_parser=_tool_parser(args))
        check_runtime(engine)  # model (and with --launcher local: device, workers, transport)
    except ValueError as e:
        print(f"megaserve serve: {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_open_files_limit()
    try:
        code = asyncio.run(serve(config))
    except ModuleNotFoundError as e:  # an incomplete install, e.g. no grpcio-health-checking
        print(f"megaserve serve: missing Python package for module {e.name!r}; install "
              "megaserve's dependencies (pip install -e .)", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"megaserve serve: cannot listen: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"megaserve serve: {e}", file=sys.stderr)
        return 1
    _exit_now(code)


def _raise_open_files_limit(wanted: int = 65536) -> None:
    """Raises this process's soft limit on open files towards ``wanted`` (within the hard
    limit), as vLLM's API server does: each connection is a file, and a common default
    soft limit (1,024) is below a burst of 1,000 connections plus the server's own."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as e:
            logging.getLogger(__name__).warning(
                "could not raise the open-files limit from %d to %d: %s", soft, target, e)


def _exit_now(code: int) -> NoReturn:
    """Ends the process once the server has stopped (its engine shut down, its streams
    ended): the interpreter's own teardown (torch, joining idle pool threads) takes
    seconds on a loaded machine, and the grace period, after which an orchestrator kills
    the process, does not have them."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
