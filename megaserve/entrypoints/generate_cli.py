"""``megaserve generate``: generate text locally or from a running server."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Mapping

EXIT_BAD_INPUT = 2


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """Sampling flags shared by the commands that generate."""
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token")


@dataclass(frozen=True)
class EngineFlag:
    """A command-line flag that sets one :class:`EngineConfig` field.

    ``flag`` (``--max-num-seqs``) sets ``field`` (``max_num_seqs``): the parsed value is
    ``args.<field>`` and goes to EngineConfig unchanged. ``options`` are argparse's keyword
    arguments; the default is the field's default in EngineConfig, never restated here.
    """

    flag: str
    field: str
    options: Mapping[str, Any] = dataclass_field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.flag.startswith("--"):
            raise ValueError(f"EngineFlag.flag must start with '--', got {self.flag!r}")
        if "default" in self.options or "dest" in self.options:
            raise ValueError(f"EngineFlag {self.flag}: the default and dest come from "
                             f"EngineConfig.{self.field}; remove them from options")


def _gpu_list(value: str) -> tuple[int, ...]:
    """``"0,1"`` → (0, 1); argparse reports a bad list."""
    try:
        return tuple(int(g) for g in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1, got {value!r}") from None


# The model, batch, KV-cache and placement flags of generate, serve and bench, in --help's
# order; vLLM's names where vLLM has the setting.
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("--model", "model", dict(help="HF directory or builtin:NAME")),
    EngineFlag("--dtype", "dtype", dict(choices=["auto", "float32", "bfloat16", "float16"])),
    EngineFlag("--quantization", "quantization", dict(
        choices=["fp8"], help="fp8: block-FP8 linear weights (128 x 128 scales) quantized at load")),
    EngineFlag("--device", "device", dict(
        help="auto (CUDA when a GPU is visible, else CPU), cpu, cuda or cuda:N")),
    EngineFlag("--max-model-len", "max_model_len", dict(type=int)),
    EngineFlag("--max-num-seqs", "max_num_seqs", dict(
        type=int, help="sequences per step (default: vLLM's for the device: 1024 on a "
                       "GPU of >= 70 GiB other than an A100, else 256; 128 for a server "
                       "on CPU)")),
    EngineFlag("--max-num-batched-tokens", "max_num_batched_tokens", dict(
        type=int, help="tokens per step (default: vLLM's for the device; on a GPU of "
                       ">= 70 GiB other than an A100 8192 for a server, 16384 offline)")),
    EngineFlag("--block-size", "block_size", dict(type=int, help="tokens per KV-cache block")),
    EngineFlag("--gpu-memory-utilization", "gpu_memory_utilization", dict(
        type=float, help="fraction of the GPU's memory the engine may use; the KV cache gets "
                         "what the weights, activations and CUDA graphs leave (CUDA only)")),
    EngineFlag("--kv-cache-memory-bytes", "kv_cache_memory_bytes", dict(
        type=int, help="KV-cache size in bytes per attention worker (overrides "
                       "--gpu-memory-utilization)")),
    EngineFlag("--attention-replicas", "attention_replicas", dict(type=int)),
    EngineFlag("--expert-workers", "expert_workers", dict(type=int)),
    EngineFlag("--microbatches", "microbatches", dict(type=int)),
    EngineFlag("--data-parallel-size", "data_parallel_size", dict(
        type=int, help="N attention replicas, one worker each (vLLM's flag); with "
                       "--enable-expert-parallel each also holds 1/N of the experts")),
    EngineFlag("--enable-expert-parallel", "enable_expert_parallel", dict(
        action="store_true", help="co-located expert parallelism over the --data-parallel-size "
                                  "workers (dispatch/combine between them)")),
    EngineFlag("--attention-gpus", "attention_gpus", dict(
        type=_gpu_list, metavar="0,1", help="the GPU of each attention replica (--device cuda)")),
    EngineFlag("--expert-gpus", "expert_gpus", dict(
        type=_gpu_list, metavar="2", help="the GPU of each expert worker (--device cuda)")),
    EngineFlag("--transport", "transport"),
    EngineFlag("--aggregation", "aggregation", dict(
        choices=["per_layer", "lockstep"],
        help="how expert workers batch the tokens of several replicas")),
    EngineFlag("--expert-aggregation-wait-ms", "expert_aggregation_wait_ms", dict(
        type=float, help="expert workers gather frames this long to batch replicas together")),
    EngineFlag("--disaggregate", "disaggregate", dict(
        action="store_true", help="run attention and experts as separate workers even for one "
                                  "replica and one expert worker in this process")),
    EngineFlag("--data-plane", "data_plane", dict(
        choices=["auto", "device", "host"],
        help="dispatch/combine on CUDA: device (stream flags, CUDA graphs for both roles; one "
             "attention replica, inproc or cuda_ipc), host (frames), auto (device where it "
             "applies)")),
    EngineFlag("--no-cuda-graphs", "cuda_graphs", dict(
        action="store_false",
        help="run decode steps eagerly on CUDA (default: captured CUDA graphs)")),
    EngineFlag("--async-scheduling", "async_scheduling", dict(
        action=argparse.BooleanOptionalAction,
        help="overlap the host's scheduling and output processing with the device, as vLLM "
             "(default: on for CUDA, off on CPU, where there is nothing to overlap)")),
    EngineFlag("--enable-prefix-caching", "enable_prefix_caching", dict(
        action=argparse.BooleanOptionalAction, help="reuse the KV cache of shared prompt "
        "prefixes (bitwise invisible in outputs; default: on)")),
    EngineFlag("--speculative-config", "speculative_config", dict(
        metavar="JSON", help='speculative decoding, as vLLM: {"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 3} or '
                             '{"model": DRAFT_PATH, "num_speculative_tokens": 4}')),
)


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """Model and placement flags shared by generate, serve and bench: every
    :data:`ENGINE_FLAGS` entry (defaults from EngineConfig), then ``--plan`` and
    ``--plan-unit``."""
    from megaserve.engine.config import EngineConfig

    defaults = EngineConfig.__dataclass_fields__
    for entry in ENGINE_FLAGS:
        parser.add_argument(entry.flag, dest=entry.field, default=defaults[entry.field].default,
                            **entry.options)
    parser.add_argument("--plan", default=None,
                        help="a `megaserve plan` file: its layout (replicas, expert workers and "
                             "placement, micro-batches, batch) overrides the flags above")
    parser.add_argument("--plan-unit", type=int, default=0, help="which unit of --plan (default 0)")


def runtime_options(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from :func:`add_runtime_flags` flags: one per
    :data:`ENGINE_FLAGS` entry, then what ``--data-parallel-size`` implies and what
    ``--plan`` sets.

    Raises ``ValueError`` for a bad ``--plan`` file.
    """
    options = {entry.field: getattr(args, entry.field) for entry in ENGINE_FLAGS}
    # The counts --data-parallel-size means, where not given (EngineConfig refuses a clash).
    if args.data_parallel_size > 1 and args.attention_replicas == 1:
        options["attention_replicas"] = args.data_parallel_size
        if args.enable_expert_parallel and args.expert_workers == 1:
            options["expert_workers"] = args.data_parallel_size
    if args.plan:
        from megaserve.runtime.plan import engine_options_from_plan

        options.update(engine_options_from_plan(args.plan, args.plan_unit))
    return options


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaserve generate", description=__doc__)
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--server", default=None, help="host:port of a megaserve gRPC server")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive (--server)")
    parser.add_argument("--api-key", default=None,
                        help="the server's --api-key (--server; default: $MEGASERVE_API_KEY)")
    add_runtime_flags(parser)
    add_sampling_flags(parser)
    args = parser.parse_args(argv)
    if args.server:
        from megaserve.server.client import generate_remote

        return generate_remote(args)
    from megaserve import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
            ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        )
        from megaserve.entrypoints.preflight import check_runtime

        options = runtime_options(args)
        check_runtime(options)
        with LLM(**options) as llm:
            out = llm.generate(args.prompt, params)[0]
    except ValueError as e:
        print(f"megaserve generate: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    completion = out.outputs[0]
    print(completion.text)
    if args.logprobs is not None:
        for token, logprobs in zip(completion.token_ids, completion.logprobs or []):
            print(f"{token}\t{logprobs[token]:.6f}", file=sys.stderr)
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0
