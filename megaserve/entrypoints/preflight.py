"""Checks of a runtime configuration that the CLI runs before loading anything heavy.

What would otherwise fail minutes later, deep in a worker thread or process, with a
traceback (a model path that is not a checkpoint, ``--device cuda`` on a machine without
a GPU, more worker processes than the machine can hold, a transport this machine lacks)
fails here with a ValueError of one line that says what to change; the CLI prints it and
exits with status 2.
"""

from __future__ import annotations

import os
from typing import Any

# Worker processes (attention replicas + expert workers) per CPU core, and at least this
# many in all: each loads torch and its part of the model.
WORKERS_PER_CORE = 4
MIN_WORKER_LIMIT = 16


def max_worker_processes() -> int:
    """How many worker processes this machine is allowed to start."""
    return max(MIN_WORKER_LIMIT, WORKERS_PER_CORE * (os.cpu_count() or 1))


def check_runtime(options: dict[str, Any]) -> None:
    """Raises ValueError (one line, naming the flag) if ``options`` (EngineConfig keyword
    arguments) cannot run on this machine. Generates a built-in model if needed."""
    from megaserve.models.builtin import resolve_model
    from megaserve.models.config import ModelConfig

    model = options.get("model", "builtin:tiny-moe")
    path = resolve_model(model)  # ValueError: unknown built-in, not a directory
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r}: {path} has no config.json, so it is not an HF "
                         "checkpoint directory")
    model_config = ModelConfig.from_dir(path)
    _check_device(str(options.get("device", "cpu")))
    replicas = int(options.get("attention_replicas", 1))
    workers = int(options.get("expert_workers", 1))
    if options.get("expert_placement") is None and not 1 <= workers <= model_config.num_experts:
        raise ValueError(f"expert_workers must be in 1..{model_config.num_experts} (the model "
                         f"has {model_config.num_experts} experts), got {workers}")
    limit = max_worker_processes()
    if replicas + workers > limit:
        raise ValueError(
            f"attention_replicas + expert_workers = {replicas + workers} worker processes: "
            f"this machine runs at most {limit} ({WORKERS_PER_CORE} per CPU core, at least "
            f"{MIN_WORKER_LIMIT}); lower --attention-replicas / --expert-workers")
    _check_transport(str(options.get("transport", "inproc")))


def _check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA GPU is visible to torch "
                         "(torch.cuda.is_available() is False); use --device cpu")
    index = device.partition(":")[2]
    count = torch.cuda.device_count()
    if index and (not index.isdigit() or int(index) >= count):
        raise ValueError(f"device {device!r}: this machine has {count} CUDA GPU(s), "
                         f"cuda:0..cuda:{count - 1}")


def _check_transport(transport: str) -> None:
    if transport == "rdma":
        from comm.rdma import rdma_unavailable

        reason = rdma_unavailable()
        if reason is not None:
            raise ValueError(f"transport 'rdma': {reason}; use --transport tcp")
    elif transport in ("cuda_ipc", "nccl"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"transport {transport!r} needs a CUDA GPU and none is visible; "
                             "use --transport tcp or inproc")
