"""EngineConfig: everything that shapes one engine instance, validated on construction."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace

from megaserve.comm.endpoint import PROVIDERS

TRANSPORTS = tuple(PROVIDERS)  # comm's provider registry: one list of names
DATA_PLANES = ("auto", "device", "host")
AGGREGATIONS = ("per_layer", "lockstep")
DEFAULT_MAX_MODEL_LEN = 4096
# KV pool of a CPU engine without kv_cache_memory_bytes: at most this, and no more than
# max_num_seqs full-length requests need (megaserve.engine.memory).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DEVICES = ("auto", "cpu", "cuda")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``speculative_config``.

    ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    "prompt_lookup_min": n0}`` proposes the k tokens that followed the latest earlier
    occurrence of the sequence's last n..n0 tokens (prompt lookup);
    ``{"model": path, "num_speculative_tokens": k}`` (method "draft_model") proposes with a
    smaller checkpoint of the same vocabulary. Raises ``ValueError`` naming the field.
    """

    num_speculative_tokens: int
    method: str | None = None  # None: "draft_model" if ``model`` is given, else "ngram"
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"speculative_config.num_speculative_tokens must be a positive "
                             f"integer, got {k!r}")
        if self.model is not None:
            object.__setattr__(self, "model", str(self.model))  # a Path is fine too
        method = self.method or ("draft_model" if self.model else "ngram")
        object.__setattr__(self, "method", method)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of "
                             f"{list(SPECULATIVE_METHODS)}, got {method!r}")
        if method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: the draft model's path is required "
                             "for method 'draft_model'")
        if method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo = lo if lo is not None else (hi if hi is not None else 1)
            hi = hi if hi is not None else max(lo, 3)
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"speculative_config.{name} must be a positive integer, "
                                     f"got {value!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) exceeds "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a config, a dict or a JSON object string (the ``--speculative-config``
        flag); None stays None. Unknown keys raise ``ValueError``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)


@dataclass(frozen=True)
class LayoutConfig:
    """How a deployment's attention replicas and expert workers are placed and talk
    (megaserve.runtime reads it; a replica's own engine never does). The defaults are one
    process with everything in it. ``EngineConfig.layout`` is this part of a config and
    ``EngineConfig.replica()`` the rest, the config each attention replica's engine runs.
    The fields are documented on :class:`EngineConfig`; megaserve.runtime.layout turns
    them into workers (disaggregated, co-located expert parallelism, data parallelism)."""

    attention_replicas: int = 1
    expert_workers: int = 1
    transport: str = "inproc"
    aggregation: str = "per_layer"
    expert_aggregation_wait_ms: float = 0.5
    expert_placement: tuple[tuple[int, ...], ...] | None = None
    launcher: str = "local"
    ray_address: str | None = None
    attention_gpu_type: str | None = None
    expert_gpu_type: str | None = None
    disaggregate: bool = False
    data_plane: str = "auto"
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    attention_gpus: tuple[int, ...] | None = None
    expert_gpus: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run a model. ``None`` fields are derived from the model.

    max_model_len: prompt + generated tokens per request (default: the model's
    max_position_embeddings, capped at 4096). device: "auto" (CUDA when torch sees a GPU,
    else CPU; resolved on construction), "cpu", "cuda" or "cuda:N".
    max_num_batched_tokens: tokens a step may schedule; max_num_seqs: sequences a step may
    hold (defaults, resolved on construction: :func:`default_batch_sizes` for the device,
    vLLM's table).
    KV pool of each attention worker (vLLM's names, megaserve.engine.memory), first match:
    num_kv_blocks (blocks), kv_cache_memory_bytes (bytes), else on CUDA
    gpu_memory_utilization (the fraction of the GPU's memory the engine process may use:
    the pool gets what the weights, a profiling forward of max_num_batched_tokens tokens
    and the CUDA graphs leave), on CPU ``max_num_seqs`` full-length requests within
    DEFAULT_CPU_KV_CACHE_BYTES. attention_replicas / expert_workers / microbatches / transport:
    the disaggregated layout (defaults: everything in this process, one micro-batch).
    cpu_threads: threads a CPU engine computes with: torch's intra-op threads stay at 1 and
    the CPU kernels spread their fixed-shape tiles over this many threads of their own
    (kernels.api.set_cpu_threads; results never depend on it). None (the default):
    :func:`default_cpu_threads`, every CPU this process may run on for an engine alone in
    its layout, else 1.
    cuda_graphs: run decode steps on CUDA through captured CUDA graphs (padded batch
    sizes; results are bitwise those of eager execution). Ignored on CPU.
    async_scheduling: overlap the host with the device (vLLM's ``--async-scheduling``):
    while the device runs step n, the host reads step n-1's tokens, makes its outputs
    and schedules step n+1, whose input tokens come from step n's sampled tokens on the
    device. A request that stops on a token (EOS, stop string) is found one step late and
    its extra token dropped; outputs are bitwise the same as without it. Applies to
    decode-graph steps and eager (prefill, mixed) steps on CUDA with in-process experts
    and no speculative decoding; other steps run synchronously. None (the default, as in
    vLLM): on for CUDA, off on CPU, whose "device" is synchronous (nothing to overlap:
    the same tokens at about the same speed, docs/serving.md).
    """

    model: str = "builtin:tiny-moe"
    dtype: str = "auto"
    # "fp8": round the linear weights of a bf16/fp32 checkpoint through block-FP8 at load
    # (megaserve.models.loader); None: the checkpoint's weights (block-FP8 ones included).
    quantization: str | None = None
    device: str = "auto"
    max_num_seqs: int | None = None  # None: default_max_num_seqs(device, ...)
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # None: default_max_num_batched_tokens(device)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    attention_replicas: int = 1
    expert_workers: int = 1
    microbatches: int = 1
    transport: str = "inproc"
    cpu_threads: int | None = None  # None: default_cpu_threads(self)
    # How expert workers batch the tokens of several replicas (docs/runtime.md):
    # "per_layer" takes whatever frames arrive within expert_aggregation_wait_ms;
    # "lockstep" advances all busy replicas one step at a time and waits for all of them.
    aggregation: str = "per_layer"
    expert_aggregation_wait_ms: float = 0.5
    # Expert ids held by each expert worker (default: an even contiguous split).
    expert_placement: tuple[tuple[int, ...], ...] | None = None
    cuda_graphs: bool = True
    async_scheduling: bool | None = None  # None: device != "cpu" (resolved here)
    # Reuse the K/V of full blocks shared with earlier requests (megaserve.engine.prefix_cache).
    enable_prefix_caching: bool = True
    # Speculative decoding: a SpeculativeConfig, or its dict / JSON form (vLLM's keys).
    speculative_config: SpeculativeConfig | None = None
    # Where the workers of a disaggregated layout run (megaserve.runtime.launcher): "local"
    # (threads or processes of this host) or "ray" (Ray actors; needs a process transport,
    # which megaserve.runtime.launcher.make_launcher checks).
    launcher: str = "local"
    ray_address: str | None = None  # the Ray cluster to join ("auto", "ray://host:10001")
    # The GPU type (Ray accelerator type, e.g. "H100") the launcher places attention replicas
    # / expert workers on, from a plan; None: any node with the resources.
    attention_gpu_type: str | None = None
    expert_gpu_type: str | None = None
    # Run attention and experts as separate workers even in the (1, 1, inproc) layout
    # (threads of this process with their own CUDA streams and the device data plane).
    disaggregate: bool = False
    # How dispatch/combine move on CUDA (megaserve.runtime.device_plane): "device" (buffers
    # registered once, device-side counts, stream flags, CUDA graphs for both roles),
    # "host" (frames through comm endpoints), "auto" (device where it applies: CUDA, one
    # attention replica, inproc or cuda_ipc).
    data_plane: str = "auto"
    # vLLM's data parallelism (``--data-parallel-size N``): N attention replicas, each in a
    # worker of its own. With ``enable_expert_parallel`` (co-located expert parallelism)
    # worker i is attention replica i *and* expert worker i, holding 1/N of the experts
    # (or ``expert_placement[i]``), and every replica's routed tokens go to the workers
    # holding their experts over the same dispatch/combine as a disaggregated layout;
    # without it each worker holds every expert (N independent engines). Sets
    # ``attention_replicas`` (and, with expert parallelism, ``expert_workers``) to N.
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # Which GPU (an index of the visible ones) each attention replica / expert worker
    # runs on, for ``device="cuda"``; None: round-robin over the visible GPUs, attention
    # replicas first (co-located expert parallelism: worker i on GPU i). Several workers
    # may share a GPU.
    attention_gpus: tuple[int, ...] | None = None
    expert_gpus: tuple[int, ...] | None = None

    @property
    def single_engine(self) -> bool:
        """Whether the layout is the one-process default that make_engine serves with one
        LLMEngine: one attention replica and one expert worker, inproc, no expert
        placement, not disaggregated."""
        return ((self.attention_replicas, self.expert_workers, self.transport) == (1, 1, "inproc")
                and self.expert_placement is None and not self.disaggregate)

    @property
    def colocated(self) -> bool:
        """Whether each worker runs an attention replica together with its share of the
        experts (``data_parallel_size`` with ``enable_expert_parallel``), rather than
        attention replicas and expert workers in workers of their own."""
        return self.enable_expert_parallel and not self.single_engine

    @property
    def data_parallel(self) -> bool:
        """Whether each worker is a whole engine, all experts in it (``data_parallel_size``
        > 1 without ``enable_expert_parallel``): no dispatch, no combine."""
        return self.data_parallel_size > 1 and not self.enable_expert_parallel

    @property
    def layout(self) -> LayoutConfig:
        """The layout part of this config (the fields LayoutConfig names)."""
        return LayoutConfig(**{f.name: getattr(self, f.name) for f in fields(LayoutConfig)})

    def replica(self, **changes) -> EngineConfig:
        """The config one attention replica's engine runs: this one with the layout at its
        one-process defaults (``microbatches`` stays: the replica splits its own steps),
        plus ``changes`` (e.g. the worker's ``device``)."""
        return replace(self, **{**asdict(LayoutConfig()), **changes})

    def __post_init__(self) -> None:
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {list(DATA_PLANES)}, got {self.data_plane!r}")
        if not isinstance(self.disaggregate, bool):
            raise ValueError(f"disaggregate must be True or False, got {self.disaggregate!r}")
        if self.launcher not in ("local", "ray"):
            raise ValueError(f"launcher must be one of ['local', 'ray'], got {self.launcher!r}")
        if self.ray_address is not None and self.launcher != "ray":
            raise ValueError("ray_address is only used with launcher='ray'")
        for name in ("attention_gpu_type", "expert_gpu_type"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a GPU type name such as 'H100', got {value!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "attention_replicas", "expert_workers", "microbatches", "cpu_threads"):
            value = getattr(self, name)
            if value is None and name in ("max_num_seqs", "max_num_batched_tokens", "cpu_threads"):
                continue  # defaults that depend on the device and layout, below
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._resolve_data_parallel()
        value = self.kv_cache_memory_bytes
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, got {value!r}")
        value = self.gpu_memory_utilization
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 1):
                raise ValueError(f"{name} must be an integer > 1, got {value!r}")
        if not isinstance(self.expert_aggregation_wait_ms, (int, float)) or self.expert_aggregation_wait_ms < 0:
            raise ValueError(
                f"expert_aggregation_wait_ms must be >= 0, got {self.expert_aggregation_wait_ms!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {self.transport!r}")
        if self.expert_placement is not None and len(self.expert_placement) != self.expert_workers:
            raise ValueError(
                f"expert_placement lists {len(self.expert_placement)} workers but "
                f"expert_workers={self.expert_workers}")
        for name in ("cuda_graphs", "async_scheduling"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "async_scheduling" and value is None):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in DEVICES or (
                self.device.startswith(("auto", "cpu")) and ":" in self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device == "auto":
            object.__setattr__(self, "device", resolve_device(self.device))
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", self.device != "cpu")
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens",
                               default_max_num_batched_tokens(self.device))
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", default_max_num_seqs(
                self.device, max_num_batched_tokens=self.max_num_batched_tokens))
        self._check_gpus()
        if self.cpu_threads is None:
            object.__setattr__(self, "cpu_threads", default_cpu_threads(self))

    def _resolve_data_parallel(self) -> None:
        """``data_parallel_size`` / ``enable_expert_parallel`` → the replica and expert
        worker counts they mean (a count given too must agree); raises ``ValueError``."""
        size, expert_parallel = self.data_parallel_size, self.enable_expert_parallel
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"data_parallel_size must be a positive integer, got {size!r}")
        if not isinstance(expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be True or False, got {expert_parallel!r}")
        if size == 1 and not expert_parallel:
            return
        counts = {"attention_replicas": size}
        if expert_parallel:
            counts["expert_workers"] = size
        for name, value in counts.items():
            if getattr(self, name) not in (1, value):
                raise ValueError(
                    f"{name}={getattr(self, name)} contradicts data_parallel_size={size}"
                    f"{' with enable_expert_parallel' if expert_parallel else ''}, which "
                    f"means {value}: give one or the other")
            object.__setattr__(self, name, value)
        if self.disaggregate:
            raise ValueError("data_parallel_size / enable_expert_parallel co-locate attention "
                             "and experts in each worker: they exclude disaggregate=True")
        if not expert_parallel:
            if self.expert_workers != 1 or self.expert_placement is not None:
                raise ValueError("data_parallel_size without enable_expert_parallel runs every "
                                 "expert in each replica: expert_workers / expert_placement "
                                 "need enable_expert_parallel=True")
            if self.aggregation != "per_layer":
                raise ValueError("aggregation applies to expert workers: data parallelism "
                                 "without enable_expert_parallel has none")

    def _check_gpus(self) -> None:
        """Validate ``attention_gpus`` / ``expert_gpus`` (lists become tuples)."""
        for name, count in (("attention_gpus", self.attention_replicas),
                            ("expert_gpus", self.expert_workers)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not all(
                    isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in value):
                raise ValueError(f"{name} must list GPU indices (integers >= 0), got {value!r}")
            value = tuple(value)
            object.__setattr__(self, name, value)
            if self.launcher != "local":
                raise ValueError(f"{name} places workers on this host's GPUs; launcher "
                                 f"{self.launcher!r} places them by GPU type "
                                 "(attention_gpu_type / expert_gpu_type)")
            if self.device != "cuda":
                raise ValueError(f"{name} places workers on the visible GPUs: it needs "
                                 f"device='cuda', not {self.device!r}")
            if len(value) != count:
                what = "attention replica" if name == "attention_gpus" else "expert worker"
                raise ValueError(f"{name} lists {len(value)} GPUs for {count} {what}(s): "
                                 f"give one GPU per {what}")
        if (self.colocated and self.expert_gpus is not None
                and self.expert_gpus != self.attention_gpus):
            raise ValueError("enable_expert_parallel puts expert worker i with attention "
                             "replica i: give attention_gpus only (expert_gpus must match it)")


# vLLM's defaults (EngineArgs.get_batch_defaults), (max_num_batched_tokens, max_num_seqs):
# GPUs of at least 70 GiB other than the A100 (H100, H200, MI300X) take larger steps; its
# PR 17885 found large steps slower on an A100. An offline engine (the LLM class) and an
# API server differ: the server keeps steps shorter for latency. A CPU engine takes vLLM's
# CPU batch sizes and keeps megaserve's 2048 tokens a step (its CPU floor in issue 14 was
# measured with it).
_BIG_GPU_BYTES = 70 << 30
_BATCH_DEFAULTS = {"big": {"llm": (16384, 1024), "server": (8192, 1024)},
                   "gpu": {"llm": (8192, 256), "server": (2048, 256)},
                   "cpu": {"llm": (2048, 256), "server": (2048, 128)}}
CPU_MAX_NUM_BATCHED_TOKENS = _BATCH_DEFAULTS["cpu"]["llm"][0]


def _batch_row(kind: str, usage: str) -> tuple[int, int]:
    if usage not in ("llm", "server"):
        raise ValueError(f"usage must be 'llm' or 'server', got {usage!r}")
    return _BATCH_DEFAULTS[kind][usage]


def batch_defaults_for(total_memory: int, name: str, usage: str = "llm") -> tuple[int, int]:
    """vLLM's default (``max_num_batched_tokens``, ``max_num_seqs``) for a GPU of
    ``total_memory`` bytes named ``name``; ``usage``: "llm" (offline, the LLM class) or
    "server" (an API server)."""
    big = total_memory >= _BIG_GPU_BYTES and "a100" not in name.lower()
    return _batch_row("big" if big else "gpu", usage)


def default_batch_sizes(device: str, usage: str = "llm") -> tuple[int, int]:
    """The default (``max_num_batched_tokens``, ``max_num_seqs``) on ``device`` (resolved,
    not "auto"): :func:`batch_defaults_for` the CUDA device's memory and name, or the CPU
    row. A process that cannot query the GPU (a Ray driver without one, as vLLM notes) gets
    the table's small-GPU row."""
    if not device.startswith("cuda"):
        return _batch_row("cpu", usage)
    import torch  # here, not at import: the config module stays light

    try:
        props = torch.cuda.get_device_properties(torch.device(device))
    except (AssertionError, RuntimeError):  # torch raises these without a usable CUDA
        return batch_defaults_for(0, "", usage)
    return batch_defaults_for(props.total_memory, props.name, usage)


def default_max_num_batched_tokens(device: str, usage: str = "llm") -> int:
    """The default ``max_num_batched_tokens`` on ``device`` (:func:`default_batch_sizes`)."""
    return default_batch_sizes(device, usage)[0]


def default_max_num_seqs(device: str, usage: str = "llm",
                         max_num_batched_tokens: int | None = None) -> int:
    """The default ``max_num_seqs`` on ``device`` (:func:`default_batch_sizes`), at most
    ``max_num_batched_tokens`` where given (a step holds one token of each sequence), as
    vLLM clamps it."""
    seqs = default_batch_sizes(device, usage)[1]
    return seqs if max_num_batched_tokens is None else min(seqs, max_num_batched_tokens)


def default_cpu_threads(config: EngineConfig) -> int:
    """``cpu_threads`` when not given: every CPU this process may run on (its affinity
    mask, as vLLM's CPU backend takes the cores it is given) for a CPU engine alone in its
    layout (``config.single_engine``); 1 otherwise, where worker processes share the cores
    and in-process workers share one kernel pool, which runs one parallel call at a time.
    1 on other devices (unused there)."""
    if config.device != "cpu" or not config.single_engine:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API (not Linux)
        return max(1, os.cpu_count() or 1)


def resolve_device(device: str) -> str:
    """``"auto"`` → ``"cuda"`` where torch sees a GPU, else ``"cpu"``; others unchanged."""
    if device != "auto":
        return device
    import torch  # here, not at import: the config module stays light

    return "cuda" if torch.cuda.is_available() else "cpu"
