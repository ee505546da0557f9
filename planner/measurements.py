"""Engine measurement files and the planner's prediction of each measured run.

A measurement file (JSON; ``megaserve bench throughput --profile-out`` writes one, and
the files the shipped profile was fitted on are in planner/profiles/measurements/)::

    {"format": "megaserve-measurements/1",
     "gpu": "H200",                        # catalog name of the GPU measured
     "device": "NVIDIA H200",              # what the benchmark saw
     "source": {"command": "...", "commit": "...", "date": "...", "doc": "...",
                "async_scheduling": false,        # defaults of the runs' engine fields below
                "kv_cache_memory_bytes": 17179869184, "intra_node": true},
     "model": "qwen3-30b-a3b",             # built-in planner model (its per-layer shape)
     "num_layers": 48,                     # layers actually run (random:<preset>:<layers>)
     "runs": [                             # co-located engine on ONE GPU (tp 1, ep 1) unless
       {"batch": 64, "input_len": 64, "output_len": 256, "step_ms": 22.96, "tok_s": 2787},
       {"num_prompts": 128, "max_num_seqs": 64, "input_len": 128, "output_len": 64,
        "tok_s": 29474, "includes_prefill": true},
       {"layout": "disaggregated", "n_e": 1, "m": 2,   # 1 attention GPU + n_e expert GPUs
        "batch": 256, "input_len": 64, "output_len": 256, "step_ms": 36.41, "tok_s": 7031},
       {"layout": "colocated", "ep": 2, ...}],          # co-located EP over ep GPUs
     "measurements": [...]}                # optional kernel / transport entries (calibrate.py)

Engine fields of a run (each defaults to the file's ``source`` value, else the default
given): ``async_scheduling`` (false: synchronous, the host then the GPU each step; a run
is predicted under the scheduling it ran with, perf.engine_step), ``kv_cache_memory_bytes`` (the KV pool, on the attention GPU; null:
large enough for every sequence; a whole run it cannot hold is replayed with preemption,
planner/kv_schedule.py) and ``intra_node`` (true: a disaggregated run's GPUs share a host
and exchange over the intra-node link, ``cuda_ipc``; false: over the NICs).

``tok_s`` is the whole layout's (all its GPUs), ``batch`` the sequences of the whole
layout (a disaggregated run's attention GPU holds all of them in ``m`` micro-batches; a
co-located EP run's ``ep`` ranks hold ``batch / ep`` each).

A run with ``step_ms`` is decode only: ``batch`` sequences advance one token per step. A
run with ``includes_prefill`` is a whole ``LLM.generate`` (tokens/s = generated tokens /
wall time): ``ceil(num_prompts / max_num_seqs)`` waves, each a prefill of its prompts in
chunks of ``max_num_batched_tokens`` and ``output_len - 1`` decode steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from megaserve.planner import perf
from megaserve.planner.catalog import GpuSpec
from megaserve.planner.colocated import colocated_prefill, colocated_step
from megaserve.planner.errors import InputError
from megaserve.planner.kv_schedule import schedule
from megaserve.planner.model_spec import BUILTIN_CONFIGS, ModelSpec, spec_from_config
from megaserve.planner.profile import Efficiency, Profile

FORMAT = "megaserve-measurements/1"
MEASUREMENTS_DIR = Path(__file__).resolve().parent / "profiles" / "measurements"


@dataclass(frozen=True)
class Run:
    """One measured run (fields as in the module docstring)."""

    file: str
    gpu: str
    model: ModelSpec
    input_len: int
    output_len: int
    tok_s: float
    batch: int = 0  # decode-only runs
    step_ms: float | None = None  # decode-only runs: measured TPOT
    num_prompts: int = 0  # includes_prefill runs
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 2048
    layout: str = "colocated"  # or "disaggregated"
    ep: int = 1  # co-located: expert-parallel ranks (one GPU each)
    n_e: int = 1  # disaggregated: expert GPUs (one attention GPU)
    m: int = 1  # disaggregated: micro-batches
    async_scheduling: bool = False  # measured with async scheduling (host overlapped with the GPU)
    kv_cache_memory_bytes: float | None = None  # the KV pool; None: it held every sequence
    intra_node: bool = True  # disaggregated: exchange over the intra-node link (cuda_ipc)

    def __post_init__(self) -> None:
        if self.layout not in ("colocated", "disaggregated"):
            raise ValueError(f"layout must be 'colocated' or 'disaggregated', got {self.layout!r}")
        if self.ep < 1 or self.n_e < 1 or self.m < 1:
            raise ValueError("ep, n_e and m must be >= 1")
        if self.layout == "colocated" and self.m != 1:
            raise ValueError("a co-located run has no micro-batches (m = 1)")
        if self.layout == "disaggregated" and self.ep != 1:
            raise ValueError("ep is a co-located run's field (use n_e)")
        if self.kv_cache_memory_bytes is not None and not self.kv_cache_memory_bytes > 0:
            raise ValueError("kv_cache_memory_bytes must be positive (or null)")
        if self.input_len < 1 or self.output_len < 1 or not self.tok_s > 0:
            raise ValueError("input_len, output_len and tok_s must be positive")
        if self.step_ms is None and (self.num_prompts < 1 or self.max_num_seqs < 1):
            raise ValueError("a run needs step_ms and batch (decode only), or num_prompts and max_num_seqs")
        if self.step_ms is not None and (self.batch < 1 or not self.step_ms > 0):
            raise ValueError("a decode-only run needs batch >= 1 and step_ms > 0")
        if self.step_ms is not None and self.batch < self.m * self.ep:
            # Unequal parts are allowed (256 sequences in m = 3 micro-batches): the model
            # takes the mean part, batch / (m * ep).
            raise ValueError(f"batch {self.batch} must give each of m x ep = {self.m * self.ep} parts a sequence")

    @property
    def label(self) -> str:
        what = f"batch {self.batch}" if self.step_ms is not None else \
            f"{self.num_prompts} prompts, max_num_seqs {self.max_num_seqs}, with prefill"
        where = (f"1 attention + {self.n_e} expert GPU(s), m={self.m}" if self.layout == "disaggregated"
                 else f"co-located EP over {self.ep} GPUs" if self.ep > 1 else "co-located, 1 GPU")
        sched = ", async" if self.async_scheduling else ""
        return f"{self.gpu} {self.model.name} {where}, {what}, {self.input_len} in / {self.output_len} out{sched}"

    @property
    def gpus(self) -> int:
        """GPUs the run used."""
        return 1 + self.n_e if self.layout == "disaggregated" else self.ep


def model_with_layers(name: str, num_layers: int) -> ModelSpec:
    """A built-in model's per-layer shape with ``num_layers`` layers (random:<preset>:<layers>)."""
    if name not in BUILTIN_CONFIGS:
        raise InputError(f"measurement model {name!r}: expected a built-in ({', '.join(BUILTIN_CONFIGS)})")
    cfg = dict(BUILTIN_CONFIGS[name], num_hidden_layers=int(num_layers))
    return spec_from_config(cfg, name=f"{name}:{num_layers}l")


def parse_runs(data: Any, where: str) -> list[Run]:
    """The runs of a parsed measurement file; raises InputError naming the bad entry."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise InputError(f"{where}: expected an object with 'format': {FORMAT!r}")
    if not data.get("runs"):
        return []
    try:
        model = model_with_layers(str(data["model"]), int(data["num_layers"]))
        gpu = str(data["gpu"])
        source = data.get("source") or {}
        defaults = {"async_scheduling": False, "kv_cache_memory_bytes": None, "intra_node": True}
        defaults.update({k: source[k] for k in defaults if k in source})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{where}: needs 'gpu', 'model' and 'num_layers' ({e})") from None
    runs = []
    for n, r in enumerate(data.get("runs") or []):
        try:
            engine = {k: r.get(k, v) for k, v in defaults.items()}
            for k in ("async_scheduling", "intra_node"):
                if not isinstance(engine[k], bool):
                    raise ValueError(f"{k} must be true or false, got {engine[k]!r}")
            runs.append(Run(
                file=where, gpu=gpu, model=model, input_len=int(r["input_len"]), output_len=int(r["output_len"]),
                tok_s=float(r["tok_s"]), batch=int(r.get("batch", 0)),
                step_ms=None if r.get("includes_prefill") else float(r["step_ms"]),
                num_prompts=int(r.get("num_prompts", 0)), max_num_seqs=int(r.get("max_num_seqs", 0)),
                max_num_batched_tokens=int(r.get("max_num_batched_tokens", 2048)),
                layout=str(r.get("layout", "colocated")), ep=int(r.get("ep", 1)), n_e=int(r.get("n_e", 1)),
                m=int(r.get("m", 1)), async_scheduling=engine["async_scheduling"], intra_node=engine["intra_node"],
                kv_cache_memory_bytes=None if engine["kv_cache_memory_bytes"] is None
                else float(engine["kv_cache_memory_bytes"])))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: runs[{n}]: {e}") from None
    return runs


def load_file(path: str | Path) -> dict[str, Any]:
    """A measurement file as parsed JSON; raises InputError if unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"cannot read {str(path)!r}: {e.strerror}") from None
    except ValueError as e:
        raise InputError(f"cannot parse {str(path)!r} as JSON: {e}") from None


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Every run of every file, in order."""
    return [r for p in paths for r in parse_runs(load_file(p), Path(p).name)]


def shipped_files() -> list[Path]:
    """The measurement files shipped in the package (the shipped profile's data)."""
    return sorted(MEASUREMENTS_DIR.glob("*.json"))


@dataclass(frozen=True)
class Prediction:
    tok_s: float
    step_ms: float | None  # decode-only runs: predicted TPOT


def step_time(run: Run, hw: perf.Hw, work: perf.Workload, seqs):
    """Predicted seconds of one decode step of ``seqs`` sequences (a float or an array) in
    ``run``'s layout, under the scheduling ``work`` says."""
    if run.layout == "disaggregated":
        return perf.decode_step(run.model, work, hw, hw, 1, 1, 1, run.n_e, run.m, seqs / run.m, run.intra_node).t_total
    return colocated_step(run.model, work, hw, 1, run.ep, seqs / run.ep).t_total


def prefill_time(run: Run, hw: perf.Hw, work: perf.Workload, seqs):
    """Predicted seconds of one prefill chunk of ``seqs`` prompts (a float or an array) in
    ``run``'s layout (a disaggregated chunk: the co-located chunk's work plus a dispatch and
    a combine a layer), under the scheduling ``work`` says: within a run, an async engine
    prepares the next step while the GPU runs this one."""
    if run.layout == "disaggregated":
        t_c = perf.dispatch_time(run.model, work, hw, hw, 1, 1, 1, run.n_e, seqs * run.input_len, run.intra_node)
        total = colocated_prefill(run.model, work, hw, 1, 1, seqs) + 2 * run.model.num_moe_layers * t_c
        host = perf.step_overhead(hw, seqs)
    else:
        total = colocated_prefill(run.model, work, hw, 1, run.ep, seqs / run.ep)
        host = perf.step_overhead(hw, seqs / run.ep)  # what colocated_prefill added per rank
    return perf.engine_step(total - host, host, work.async_scheduling)


def kv_pool_tokens(run: Run) -> int | None:
    """KV slots of the run's pool (None: unbounded)."""
    if run.kv_cache_memory_bytes is None:
        return None
    return int(run.kv_cache_memory_bytes // run.model.kv_bytes_per_token)


def predict(run: Run, gpu: GpuSpec, eff: Efficiency) -> Prediction:
    """The planner's prediction of one run on ``gpu`` with efficiency factors ``eff``
    (tok/s of the whole layout, TPOT for decode-only runs), under the scheduling the run
    was measured with. A whole run whose KV pool cannot hold ``max_num_seqs`` full
    sequences is replayed with preemption (planner/kv_schedule.py)."""
    hw = perf.Hw([gpu], Profile(eff))
    work = perf.Workload(input_len=run.input_len, output_len=run.output_len, async_scheduling=run.async_scheduling)
    if run.step_ms is not None:
        step = float(step_time(run, hw, work, run.batch))
        return Prediction(run.batch / step, step * 1e3)
    pool = kv_pool_tokens(run)
    if pool is not None and run.max_num_seqs * (run.input_len + run.output_len) > pool:
        plan = schedule(run.num_prompts, run.max_num_seqs, run.input_len, run.output_len,
                        run.max_num_batched_tokens, pool)
        seqs, steps = (np.array(x, dtype=np.float64) for x in zip(*plan.decode))
        tokens, chunks = (np.array(x, dtype=np.float64) for x in zip(*plan.prefill))
        total = float(steps @ step_time(run, hw, work, seqs) + chunks @ prefill_time(run, hw, work, tokens / run.input_len))
        return Prediction(run.num_prompts * run.output_len / total, None)
    total = 0.0
    for wave in range(math.ceil(run.num_prompts / run.max_num_seqs)):
        seqs = min(run.max_num_seqs, run.num_prompts - wave * run.max_num_seqs)
        chunks = math.ceil(seqs * run.input_len / run.max_num_batched_tokens)
        total += chunks * float(prefill_time(run, hw, work, seqs / chunks))
        total += (run.output_len - 1) * float(step_time(run, hw, work, seqs))
    return Prediction(run.num_prompts * run.output_len / total, None)


def rel_errors(run: Run, pred: Prediction) -> tuple[float, float | None]:
    """(|predicted / measured tok/s - 1|, the same for TPOT or None)."""
    tpot = None if run.step_ms is None or pred.step_ms is None else abs(pred.step_ms / run.step_ms - 1)
    return abs(pred.tok_s / run.tok_s - 1), tpot
