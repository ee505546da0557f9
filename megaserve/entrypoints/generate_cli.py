"""``megaserve generate``: generate text locally or from a running server."""

from __future__ import annotations

import argparse
import sys

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


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """Model and placement flags shared by generate, serve and bench."""
    parser.add_argument("--model", default="builtin:tiny-moe", help="HF directory or builtin:NAME")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="fp8: block-FP8 linear weights (128 x 128 scales) quantized at load")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when a GPU is visible, else CPU), cpu, cuda or cuda:N")
    parser.add_argument("--max-model-len", type=int, default=None)
    add_kv_cache_flags(parser)
    parser.add_argument("--attention-replicas", type=int, default=1)
    parser.add_argument("--expert-workers", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="N attention replicas, one worker each (vLLM's flag); with "
                             "--enable-expert-parallel each also holds 1/N of the experts")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="co-located expert parallelism over the --data-parallel-size "
                             "workers (dispatch/combine between them)")
    parser.add_argument("--attention-gpus", type=_gpu_list, default=None, metavar="0,1",
                        help="the GPU of each attention replica (--device cuda)")
    parser.add_argument("--expert-gpus", type=_gpu_list, default=None, metavar="2",
                        help="the GPU of each expert worker (--device cuda)")
    parser.add_argument("--transport", default="inproc")
    parser.add_argument("--plan", default=None,
                        help="a `megaserve plan` file: its layout (replicas, expert workers and "
                             "placement, micro-batches, batch) overrides the flags above")
    parser.add_argument("--plan-unit", type=int, default=0, help="which unit of --plan (default 0)")
    parser.add_argument("--aggregation", default="per_layer", choices=["per_layer", "lockstep"],
                        help="how expert workers batch the tokens of several replicas")
    parser.add_argument("--expert-aggregation-wait-ms", type=float, default=0.5,
                        help="expert workers gather frames this long to batch replicas together")
    parser.add_argument("--disaggregate", action="store_true",
                        help="run attention and experts as separate workers even for one "
                             "replica and one expert worker in this process")
    parser.add_argument("--data-plane", default="auto", choices=["auto", "device", "host"],
                        help="dispatch/combine on CUDA: device (stream flags, CUDA graphs for "
                             "both roles; one attention replica, inproc or cuda_ipc), host "
                             "(frames), auto (device where it applies)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run decode steps eagerly on CUDA (default: captured CUDA graphs)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="overlap the host's scheduling and output processing with the "
                             "device in steady decode, as vLLM (default: off)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse the KV cache of shared prompt prefixes "
                        "(bitwise invisible in outputs; default: on)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM: {"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 3} or '
                             '{"model": DRAFT_PATH, "num_speculative_tokens": 4}')


def add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    """Batch and KV-cache flags (vLLM's names); defaults from EngineConfig."""
    from megaserve.engine.config import EngineConfig

    d = EngineConfig.__dataclass_fields__
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences per step (default: vLLM's for the device: 1024 on a "
                             "GPU of >= 70 GiB other than an A100, else 256; 128 for a server "
                             "on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step (default: vLLM's for the device; on a GPU of "
                             ">= 70 GiB other than an A100 8192 for a server, 16384 offline)")
    parser.add_argument("--block-size", type=int, default=d["block_size"].default,
                        help="tokens per KV-cache block")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=d["gpu_memory_utilization"].default,
                        help="fraction of the GPU's memory the engine may use; the KV cache gets "
                             "what the weights, activations and CUDA graphs leave (CUDA only)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV-cache size in bytes per attention worker (overrides "
                             "--gpu-memory-utilization)")


def _gpu_list(value: str) -> tuple[int, ...]:
    """``"0,1"`` → (0, 1); argparse reports a bad list."""
    try:
        return tuple(int(g) for g in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1, got {value!r}") from None


def runtime_options(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from :func:`add_runtime_flags` flags.

    Raises ``ValueError`` for a bad ``--plan`` file.
    """
    options = dict(
        model=args.model, dtype=args.dtype, device=args.device,
        quantization=getattr(args, "quantization", None),
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        attention_replicas=args.attention_replicas, expert_workers=args.expert_workers,
        microbatches=args.microbatches, transport=args.transport,
        aggregation=args.aggregation, expert_aggregation_wait_ms=args.expert_aggregation_wait_ms,
        cuda_graphs=not args.no_cuda_graphs, async_scheduling=args.async_scheduling,
        disaggregate=args.disaggregate, data_plane=args.data_plane,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        attention_gpus=args.attention_gpus, expert_gpus=args.expert_gpus,
    )
    # The counts --data-parallel-size means, where not given (EngineConfig refuses a clash).
    if args.data_parallel_size > 1 and args.attention_replicas == 1:
        options["attention_replicas"] = args.data_parallel_size
        if args.enable_expert_parallel and args.expert_workers == 1:
            options["expert_workers"] = args.data_parallel_size
    options.update(enable_prefix_caching=args.enable_prefix_caching,
                   speculative_config=args.speculative_config)
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
