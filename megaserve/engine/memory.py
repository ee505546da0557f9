"""KV-cache sizing: how many blocks an attention worker's pool gets, vLLM's way.

Three sources, first match wins:

1. ``num_kv_blocks``: exactly that many blocks.
2. ``kv_cache_memory_bytes``: as many blocks as fit in that many bytes.
3. On CUDA, ``gpu_memory_utilization`` (default 0.9): the engine process may use that
   fraction of the GPU's memory. What it needs besides the KV cache is measured at
   startup: the weights, the peak of a profiling forward over ``max_num_batched_tokens``
   tokens, the CUDA graphs (the decode forward at ``max_num_seqs`` rows plus the
   log-prob buffers their captured sizes write into), and memory that grew outside torch's
   allocator (cuBLAS workspaces, compiled kernels). The rest is the KV pool::

       KV bytes = utilization x total - (weights + activation peak + CUDA graphs + non-torch)

   Memory in use on the device before the engine started (other processes, this
   process's CUDA context) is not charged to the budget, but the budget must be free.
   On CPU (no utilization to apply) the pool holds ``max_num_seqs`` full-length requests
   within DEFAULT_CPU_KV_CACHE_BYTES; a CPU pool of any source must fit in the host's
   available memory (:func:`check_host_kv_memory`).

Shape legend: T = tokens of the profiling batch, S = its sequences, D = hidden, k = top-k.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from megaserve.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from megaserve.engine.kv_cache import allocate_kv_tensors, blocks_for

logger = logging.getLogger(__name__)

GIB = 1 << 30


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    shared_kv: bool = False,
) -> int:
    """Bytes of one KV block over all layers: K and V, `[block_size, Hkv, Dh]` each (one
    tensor with ``shared_kv``, MLA's latent cache)."""
    return (1 if shared_kv else 2) * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class MemoryProfile:
    """What an engine process uses on its GPU besides the KV cache, in bytes."""

    total_bytes: int  # the device's memory
    free_at_start_bytes: int  # free when the engine started (before its weights)
    weights_bytes: int
    activation_peak_bytes: int  # peak of the profiling forward above the weights
    cuda_graph_bytes: int  # estimate for the decode CUDA graphs (0 where none are used)
    non_torch_bytes: int  # growth outside torch's allocator during startup

    @property
    def non_kv_bytes(self) -> int:
        return (self.weights_bytes + self.activation_peak_bytes + self.cuda_graph_bytes
                + self.non_torch_bytes)


def kv_budget_from_utilization(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """KV-cache bytes for an engine allowed ``gpu_memory_utilization`` of the device.

    Raises ``ValueError`` (naming the option) where the budget is not free at startup or
    leaves nothing for the KV cache.
    """
    budget = int(profile.total_bytes * gpu_memory_utilization)
    if budget > profile.free_at_start_bytes:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of {profile.total_bytes / GIB:.2f} "
            f"GiB is {budget / GIB:.2f} GiB but only {profile.free_at_start_bytes / GIB:.2f} GiB "
            f"were free at startup (other processes use the GPU); lower "
            f"gpu_memory_utilization or set kv_cache_memory_bytes")
    kv = budget - profile.non_kv_bytes
    if kv <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} x {profile.total_bytes / GIB:.2f} "
            f"GiB leaves no memory for the KV cache (weights {profile.weights_bytes / GIB:.2f} "
            f"GiB, activations {profile.activation_peak_bytes / GIB:.2f} GiB, CUDA graphs "
            f"{profile.cuda_graph_bytes / GIB:.2f} GiB, other {profile.non_torch_bytes / GIB:.2f} "
            f"GiB); raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, "
            f"or set kv_cache_memory_bytes")
    return kv


@dataclass(frozen=True)
class KVCachePlan:
    """The size of one attention worker's KV pool and where it came from."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    source: str  # "num_kv_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "cpu default"

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def memory_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_full_length_requests(self) -> int:
        """Requests of ``max_model_len`` tokens that fit at once."""
        return self.num_blocks // blocks_for(self.max_model_len, self.block_size)

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.memory_bytes / GIB:.2f} GiB "
                f"(from {self.source}); {self.max_full_length_requests} concurrent requests of "
                f"max_model_len={self.max_model_len} fit "
                f"({self.num_tokens / self.max_model_len:.2f}x)")


def host_available_bytes() -> int | None:
    """Host memory a new allocation can still take: ``/proc/meminfo``'s MemAvailable, capped
    by this process's cgroup limit less its usage (v2 or v1) where one is set; None where
    unknown (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" / a huge v1 number: no limit
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def check_host_kv_memory(pool_bytes: int, num_pools: int, source: str,
                         available_bytes: int | None = None) -> None:
    """Raise ``ValueError`` (naming ``source``, the option that sized the pools) where
    ``num_pools`` CPU KV pools of ``pool_bytes`` each do not fit in the host's available
    memory (``available_bytes``, default :func:`host_available_bytes`; unknown: no check).

    NOTE: a CPU pool is zero-filled at startup, so every page of it is touched: a pool
    larger than what is free does not fail its allocation, the kernel's OOM killer ends
    the process part-way through filling it. Processes that start together each see the
    whole host free, so a front-end checks their sum before starting them."""
    available = host_available_bytes() if available_bytes is None else available_bytes
    need = pool_bytes * num_pools
    if available is None or need <= available:
        return
    pools = f"{num_pools} KV pools of {pool_bytes / GIB:.2f} GiB" if num_pools > 1 else \
        f"a KV pool of {pool_bytes / GIB:.2f} GiB"
    raise ValueError(
        f"{source}: {pools} need {need / GIB:.2f} GiB of host memory, but only "
        f"{available / GIB:.2f} GiB are available (the kernel would kill a worker while it "
        f"fills its pool); lower {source}, or on CPU leave kv_cache_memory_bytes and "
        f"num_kv_blocks unset (the pool then holds max_num_seqs full-length requests within "
        f"{DEFAULT_CPU_KV_CACHE_BYTES / GIB:.0f} GiB)")


def blocks_in(budget_bytes: int, bytes_per_block: int) -> int:
    return max(0, budget_bytes) // bytes_per_block


def plan_kv_cache(
    config: EngineConfig,
    bytes_per_block: int,
    max_model_len: int,
    profile: MemoryProfile | None = None,
) -> KVCachePlan:
    """The KV pool for ``config`` (module docstring). ``profile``: the CUDA measurement,
    needed only when the size comes from ``gpu_memory_utilization``.

    Raises ``ValueError`` where the pool cannot hold one request of ``max_model_len``.
    """
    bs = config.block_size
    per_seq = blocks_for(max_model_len, bs)
    if config.num_kv_blocks is not None:
        num, source = config.num_kv_blocks, "num_kv_blocks"
    elif config.kv_cache_memory_bytes is not None:
        num, source = blocks_in(config.kv_cache_memory_bytes, bytes_per_block), "kv_cache_memory_bytes"
    elif profile is not None:
        budget = kv_budget_from_utilization(profile, config.gpu_memory_utilization)
        num, source = blocks_in(budget, bytes_per_block), "gpu_memory_utilization"
    else:
        cap = blocks_in(DEFAULT_CPU_KV_CACHE_BYTES, bytes_per_block)
        num, source = min(config.max_num_seqs * per_seq, cap), "cpu default"
    if num < per_seq:
        raise ValueError(
            f"num_kv_blocks: {num} blocks of {bs} tokens ({source}) cannot hold one request of "
            f"max_model_len={max_model_len} ({per_seq} blocks); raise kv_cache_memory_bytes / "
            f"gpu_memory_utilization / num_kv_blocks or lower max_model_len")
    return KVCachePlan(num, bs, bytes_per_block, max_model_len, source)


# -- measuring on CUDA --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSnapshot:
    """The device's state when an engine starts (before its weights load)."""

    device: torch.device
    total_bytes: int
    free_bytes: int
    torch_reserved_bytes: int
    torch_allocated_bytes: int


def snapshot(device: torch.device | str) -> DeviceSnapshot | None:
    """The start snapshot of a CUDA device (None on other devices); resets peak stats."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # mem_get_info needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    torch.cuda.set_device(device)
    gc.collect()  # engines of this process that are gone but not yet collected hold memory
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    return DeviceSnapshot(device, total, free, torch.cuda.memory_reserved(device),
                          torch.cuda.memory_allocated(device))


class _NoExperts:
    """ExpertClient for profiling an attention worker whose experts live elsewhere:
    returns zeros of the shape ``combine`` promises and moves nothing."""

    def begin_step(self, num_microbatches: int) -> None:
        pass

    def dispatch(self, layer: int, microbatch: int, x: torch.Tensor, topk_ids: torch.Tensor) -> Any:
        return x.new_zeros(x.shape[0], topk_ids.shape[1], x.shape[1])  # [T, k, D]

    def combine(self, handle: Any) -> torch.Tensor:
        return handle


def _profile_forward(attention, experts, num_tokens: int, num_seqs: int, block_size: int,
                     max_model_len: int) -> int:
    """One forward over ``num_tokens`` prompt tokens in ``num_seqs`` sequences (as even as
    ``max_model_len`` allows), with a scratch KV cache, plus log-probs of each sequence's
    last token: the largest step the scheduler can form. Returns the scratch cache's bytes."""
    from megaserve.models.attention_part import AttentionMetadata
    from megaserve.models.forward import MicroBatch, run_layers

    from megaserve import kernels
    device, cfg = attention.device, attention.config
    num_seqs = max(1, min(num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    lengths = [min(base + (i < extra), max_model_len - 1) for i in range(num_seqs)]
    lengths = [n for n in lengths if n > 0]
    blocks = [blocks_for(n, block_size) for n in lengths]
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    slots, positions, first = [], [], 0
    for s, (n, nb) in enumerate(zip(lengths, blocks)):
        ids = torch.arange(first, first + nb, dtype=torch.int32)
        tables[s, :nb] = ids
        positions.append(torch.arange(n))
        slots.append(ids.long().repeat_interleave(block_size)[:n] * block_size
                     + torch.arange(n) % block_size)
        first += nb
    kv = allocate_kv_tensors(cfg.num_layers, first, block_size, cfg.cache_kv_heads,
                             cfg.cache_head_dim, attention.dtype, device, cfg.cache_shares_kv)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        positions=torch.cat(positions).to(device), slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(cfg.vocab_size, (sum(lengths),), generator=g).to(device)
    experts.begin_step(1)
    (hidden,) = run_layers(attention, experts, [MicroBatch(ids, meta)], kv)
    last = (starts[1:] - 1).long().to(device)
    kernels.log_softmax(attention.logits(hidden[last]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sum(k.numel() * k.element_size() * 2 for k, _ in kv)


def profile_cuda(
    start: DeviceSnapshot,
    attention,
    experts,
    config: EngineConfig,
    max_model_len: int,
    cuda_graphs: bool,
) -> MemoryProfile:
    """Measure the engine's non-KV memory (module docstring) after its weights loaded.

    attention: the AttentionPart; experts: its ExpertClient (a ``LocalExperts`` runs for
    real; any other is replaced by zeros: those experts live on other workers).
    ``cuda_graphs``: whether decode CUDA graphs will be captured (they are counted).
    """
    from megaserve.models.forward import LocalExperts

    device = start.device
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device) - start.torch_allocated_bytes
    local = experts if isinstance(experts, LocalExperts) else _NoExperts()
    # Free cached blocks first: activations must not hide in memory that loading reserved.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base_reserved = torch.cuda.memory_reserved(device)
    scratch = _profile_forward(attention, local, config.max_num_batched_tokens,
                               config.max_num_seqs, config.block_size, max_model_len)
    peak = max(0, torch.cuda.max_memory_reserved(device) - base_reserved - scratch)
    graphs = 0
    if cuda_graphs and isinstance(experts, LocalExperts):
        from megaserve.engine.cuda_graphs import capture_sizes
        from megaserve.engine.spec_graphs import MAX_GRAPH_BATCH

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base_reserved = torch.cuda.memory_reserved(device)
        scratch = _profile_forward(attention, local, config.max_num_seqs, config.max_num_seqs,
                                   config.block_size, max_model_len)
        decode_peak = max(0, torch.cuda.max_memory_reserved(device) - base_reserved - scratch)
        # The graphs' one `[b, V]` float32 log-prob buffer (DecodeGraphs), at the largest
        # size, and the verification graphs' `[b * Q, V]` one (spec_graphs).
        rows = capture_sizes(config.max_num_seqs)[-1]
        if config.speculative_config is not None:
            rows += (min(config.max_num_seqs, MAX_GRAPH_BATCH)
                     * (config.speculative_config.num_speculative_tokens + 1))
        graphs = decode_peak + rows * attention.lm_head.shape[0] * 4  # the buffers' width
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_now = start.free_bytes - free  # this process's growth since the snapshot
    reserved_growth = torch.cuda.memory_reserved(device) - start.torch_reserved_bytes
    non_torch = max(0, used_now - reserved_growth)
    profile = MemoryProfile(total, start.free_bytes, weights, peak, graphs, non_torch)
    logger.info(
        "memory profile on %s: %.2f GiB total, weights %.2f GiB, activation peak %.2f GiB "
        "(%d tokens), CUDA graphs %.2f GiB, non-torch %.2f GiB", device, total / GIB,
        weights / GIB, peak / GIB, config.max_num_batched_tokens, graphs / GIB, non_torch / GIB)
    return profile
