"""A gRPC client for ``megaserve.v1.Generation`` (``megaserve generate --server``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import grpc

from megaserve.server import generation_pb2 as pb
from megaserve.server.grpc_protocol import SERVICE_NAME

EXIT_USAGE = 2
# What a refused request exits with: bad input is the caller's to fix (2), the rest is 1.
_USAGE_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED}


def build_request(prompt: str | list[int], *, stream: bool = False,
                  request_id: str = "", **sampling: object) -> pb.GenerateRequest:
    """A GenerateRequest; ``sampling`` are SamplingParams fields (None means unset):
    lists for the repeated ones, a dict for ``logit_bias``, a ``pb.StructuredOutput`` for
    ``structured_output``."""
    sp = pb.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids", "bad_words"):
            getattr(sp, name).extend(value)
        elif name == "logit_bias":
            sp.logit_bias.update(value)
        elif name == "structured_output":
            sp.structured_output.CopyFrom(value)
        else:
            setattr(sp, name, value)
    req = pb.GenerateRequest(request_id=request_id, sampling_params=sp, stream=stream)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def generation_stub(channel: grpc.Channel) -> dict[str, grpc.UnaryStreamMultiCallable]:
    """The four RPCs on a (sync) channel, by method name."""
    def path(name: str) -> str:
        return f"/{SERVICE_NAME}/{name}"
    return {
        "Generate": channel.unary_stream(
            path("Generate"), request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString),
        "Abort": channel.unary_unary(
            path("Abort"), request_serializer=pb.AbortRequest.SerializeToString,
            response_deserializer=pb.AbortResponse.FromString),
        "GetModelInfo": channel.unary_unary(
            path("GetModelInfo"), request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.GetModelInfoResponse.FromString),
        "GetServerInfo": channel.unary_unary(
            path("GetServerInfo"), request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.GetServerInfoResponse.FromString),
    }


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a server started with ``--api-key`` expects (empty without a key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def stream_generate(server: str, request: pb.GenerateRequest, timeout: float | None = None,
                    api_key: str | None = None) -> Iterator[pb.GenerateResponse]:
    """Yields the responses of one Generate call; raises grpc.RpcError on failure."""
    with grpc.insecure_channel(server) as channel:
        yield from generation_stub(channel)["Generate"](
            request, timeout=timeout, metadata=auth_metadata(api_key))


def generate_remote(args: argparse.Namespace) -> int:
    """Runs ``megaserve generate --server host:port PROMPT``; returns the exit code.

    ``args``: server ("host:port"), prompt, stream, max_tokens, temperature, top_p, top_k,
    min_p, seed, stop (list), ignore_eos, logprobs. Text goes to stdout (as it streams with
    --stream); the finish reason and token counts to stderr.
    """
    if not isinstance(args.server, str) or ":" not in args.server:
        print(f"megaserve generate: --server must be host:port, got {args.server!r}",
              file=sys.stderr)
        return EXIT_USAGE
    request = build_request(
        args.prompt, stream=bool(args.stream), max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, stop=list(args.stop or ()), ignore_eos=bool(args.ignore_eos),
        logprobs=args.logprobs)
    try:
        api_key = getattr(args, "api_key", None) or os.environ.get("MEGASERVE_API_KEY")
        for response in stream_generate(args.server, request, api_key=api_key):
            kind = response.WhichOneof("response")
            if kind == "chunk":
                sys.stdout.write(response.chunk.text)
                sys.stdout.flush()
            elif kind == "complete":
                done = response.complete
                if not args.stream:
                    sys.stdout.write(done.text)
                sys.stdout.write("\n")
                print(f"[finish_reason={done.finish_reason} "
                      f"prompt_tokens={done.usage.prompt_tokens} "
                      f"completion_tokens={done.usage.completion_tokens}]", file=sys.stderr)
                if args.logprobs is not None:
                    for p in done.logprobs:
                        print(f"  {p.sampled.token_id}\t{p.sampled.logprob:.6f}", file=sys.stderr)
            elif kind == "error":
                print(f"megaserve generate: server error {response.error.code}: "
                      f"{response.error.message}", file=sys.stderr)
                return 1
    except grpc.RpcError as e:
        code = e.code()
        print(f"megaserve generate: {args.server}: {code.name}: {e.details()}", file=sys.stderr)
        return EXIT_USAGE if code in _USAGE_CODES else 1
    return 0
