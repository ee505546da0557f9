"""``megaserve bench cpu``: the CPU path on issue 14's workload.

A tiny random Mixtral (the shape of ``transformers``' ``MixtralConfig(vocab_size=512,
hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2)``, weights
drawn like HF's initialiser: normal, std 0.02) serves N requests of P random prompt
tokens and G generated tokens, greedy, ignore_eos. Prints generated tokens/s of the batch
and the time per output token of a lone request (decode steps only: its first token,
which includes the prefill, is excluded). ``--repeat R`` measures R times and prints
each run, so a change can be compared with alternating runs on a shared machine;
``--baseline-tree DIR`` does that against another source tree (e.g. ``git archive <commit>
kernels megaserve | tar -x -C DIR``): each run in a fresh process, the two trees in turn,
with the ratio of every round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_MIXTRAL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=8,
    num_experts_per_tok=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta=1e6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)
INIT_STD = 0.02  # MixtralConfig.initializer_range


def tiny_mixtral_path() -> Path:
    """Directory of the tiny random Mixtral checkpoint, written on first use into
    ``$MEGASERVE_CACHE/random/tiny-mixtral`` (default cache: ~/.cache/megaserve)."""
    root = Path(os.environ.get("MEGASERVE_CACHE", Path.home() / ".cache" / "megaserve"))
    path = root / "random" / "tiny-mixtral"
    if not (path / "model.safetensors").is_file():
        _write_tiny_mixtral(path)
    return path


def _write_tiny_mixtral(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    c = TINY_MIXTRAL
    d, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hq, hkv, dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * INIT_STD

    tensors = {"model.embed_tokens.weight": rand(v, d), "model.norm.weight": torch.ones(d),
               "lm_head.weight": rand(v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(d),
                    p + "post_attention_layernorm.weight": torch.ones(d),
                    p + "self_attn.q_proj.weight": rand(hq * dh, d),
                    p + "self_attn.k_proj.weight": rand(hkv * dh, d),
                    p + "self_attn.v_proj.weight": rand(hkv * dh, d),
                    p + "self_attn.o_proj.weight": rand(d, hq * dh),
                    p + "block_sparse_moe.gate.weight": rand(c["num_local_experts"], d)}
        for e in range(c["num_local_experts"]):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors |= {q + "w1.weight": rand(inter, d), q + "w3.weight": rand(inter, d),
                        q + "w2.weight": rand(d, inter)}
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp))
    config = dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                  torch_dtype="float32", **c)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tmp.replace(path / "model.safetensors")


def run_workload(llm, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:
    """Time one batch of ``num_prompts`` requests and one lone request on ``llm``.

    Returns ``{"tokens_per_s", "seconds", "cpu_seconds", "generated", "tpot_ms"}``;
    ``cpu_seconds`` is this process's CPU time for the batch (steadier than wall time on a
    shared machine); ``tpot_ms`` is the lone request's mean time per output token after
    its first.
    """
    from megaserve import SamplingParams

    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]}
               for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    engine = llm.engine
    engine.add_request("bench-lone", prompts[0]["prompt_token_ids"], params)
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    tpot_ms = 1e3 * (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {"tokens_per_s": generated / seconds, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "generated": generated, "tpot_ms": tpot_ms}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaserve bench cpu", description=__doc__)
    parser.add_argument("--model", default="tiny-mixtral",
                        help="'tiny-mixtral' (default) or any model path / builtin:NAME")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="threads the CPU kernels spread their tiles over (default: "
                             "EngineConfig's, every CPU of this process)")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs after one warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-tree", default=None,
                        help="a source tree (holding kernels/ and megaserve/) measured in turn "
                             "with this one, each run in a fresh process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _measure(args: argparse.Namespace, repeat: int) -> list[dict]:
    """One warm-up, then ``repeat`` timed runs in this process."""
    from megaserve import LLM

    model = str(tiny_mixtral_path()) if args.model == "tiny-mixtral" else args.model
    options = dict(model=model, dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.input_len + args.output_len + 1)
    if args.cpu_threads is not None:  # else the tree's own default (a baseline tree's too)
        options["cpu_threads"] = args.cpu_threads
    with LLM(**options) as llm:
        run_workload(llm, args.num_prompts, args.input_len, args.output_len, args.seed)
        return [run_workload(llm, args.num_prompts, args.input_len, args.output_len, args.seed)
                for _ in range(repeat)]


def _row(name: str, res: dict, extra: str = "") -> str:
    return (f"{name:>10} {res['seconds']:>8.2f} {res['tokens_per_s']:>10.1f} "
            f"{res['generated'] / res['cpu_seconds']:>10.1f} {res['tpot_ms']:>13.2f}{extra}")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.worker:  # one run of a --baseline-tree comparison (megaserve.bench.baseline_tree)
        print(json.dumps(_measure(args, 1)[0]))
        return 0
    from megaserve.engine.config import EngineConfig
    from megaserve.kernels import cpu_ext

    threads = args.cpu_threads or f"{EngineConfig(device='cpu').cpu_threads} (default)"
    print(f"device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{cpu_ext.default_isa()} kernels)  "
          f"model: {args.model}  dtype: {args.dtype}  threads: {threads}  "
          f"prompts: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), greedy")
    print(f"{'run':>10} {'seconds':>8} {'gen tok/s':>10} {'tok/CPU-s':>10} {'lone TPOT ms':>13}")
    try:
        if args.baseline_tree:
            # Imported here: a worker runs this file on a tree that may predate it.
            from megaserve.bench import baseline_tree

            worker_argv = baseline_tree.passthrough(argv)
            base, this = [], []
            for r in range(args.repeat):  # one warm-up and one timed run per process
                base.append(baseline_tree.run(Path(args.baseline_tree), __file__, "cpu",
                                              worker_argv))
                print(_row(f"base {r}", base[-1]), flush=True)
                this.append(baseline_tree.run(baseline_tree.CHECKOUT, __file__, "cpu",
                                              worker_argv))
                ratio = this[-1]["tokens_per_s"] / base[-1]["tokens_per_s"]
                print(_row(f"this {r}", this[-1], f"  x{ratio:.2f}"), flush=True)
            results = this
            print(f"{'base':>10} median {statistics.median(r['tokens_per_s'] for r in base):>12.1f}")
        else:
            results = _measure(args, args.repeat)
            for r, res in enumerate(results):
                print(_row(str(r), res), flush=True)
    except ValueError as e:
        print(f"megaserve bench: {e}", file=sys.stderr)
        return 2
    if len(results) > 1:
        print(f"{'median':>10} {'':>8} {statistics.median(r['tokens_per_s'] for r in results):>10.1f} "
              f"{statistics.median(r['generated'] / r['cpu_seconds'] for r in results):>10.1f} "
              f"{statistics.median(r['tpot_ms'] for r in results):>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
