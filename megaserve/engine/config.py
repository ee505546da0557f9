"""EngineConfig: everything that shapes one engine instance, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("inproc", "tcp", "cuda_ipc", "rdma", "nccl")
AGGREGATIONS = ("per_layer", "lockstep")
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run a model. ``None`` fields are derived from the model.

    max_model_len: prompt + generated tokens per request (default: the model's
    max_position_embeddings, capped at 4096). num_kv_blocks: size of each attention
    replica's KV pool (default: enough for ``max_num_seqs`` full-length requests within
    ``kv_cache_bytes``). attention_replicas / expert_workers / microbatches / transport:
    the disaggregated layout (defaults: everything in this process, one micro-batch).
    cpu_threads: torch intra-op threads of a CPU engine, pinned per process. One thread is
    the default: the CPU kernels run many small fixed-shape GEMM tiles, which OpenMP
    thread teams slow down badly on a loaded machine (measured here: 40x on 2 busy cores).
    cuda_graphs: run decode steps on CUDA through captured CUDA graphs (padded batch
    sizes; results are bitwise those of eager execution). Ignored on CPU.
    """

    model: str = "builtin:tiny-moe"
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    seed: int = 0
    attention_replicas: int = 1
    expert_workers: int = 1
    microbatches: int = 1
    transport: str = "inproc"
    cpu_threads: int = 1
    # How expert workers batch the tokens of several replicas (docs/runtime.md):
    # "per_layer" takes whatever frames arrive within expert_aggregation_wait_ms;
    # "lockstep" advances all busy replicas one step at a time and waits for all of them.
    aggregation: str = "per_layer"
    expert_aggregation_wait_ms: float = 0.5
    # Expert ids held by each expert worker (default: an even contiguous split).
    expert_placement: tuple[tuple[int, ...], ...] | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_bytes",
                     "attention_replicas", "expert_workers", "microbatches", "cpu_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
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
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
