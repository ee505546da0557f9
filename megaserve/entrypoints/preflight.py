"""Checks of a runtime configuration that the CLI runs before loading anything heavy.

What would otherwise fail minutes later, deep in a worker thread or process, with a
traceback (a model path that is not a checkpoint, ``--device cuda`` on a machine without
a GPU, more worker processes than the machine can hold, a transport this machine lacks:
rdma without pyverbs or a device, cuda_ipc without a GPU) fails here with a ValueError of
one line that says what to change; the CLI prints it and exits with status 2.

With a launcher other than ``local`` (Ray) the workers run on other machines, so only the
model and its expert count are checked here.
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
    arguments) cannot run on this machine. Reads no weights."""
    num_experts = _num_experts(str(options.get("model", "builtin:tiny-moe")))
    local = options.get("launcher", "local") == "local"
    if local:
        _check_device(str(options.get("device", "cpu")))
    replicas = int(options.get("attention_replicas", 1))
    workers = int(options.get("expert_workers", 1))
    if options.get("expert_placement") is None and num_experts is not None \
            and not 1 <= workers <= num_experts:
        raise ValueError(f"expert_workers must be in 1..{num_experts} (the model has "
                         f"{num_experts} experts), got {workers}")
    limit = max_worker_processes()
    if local and replicas + workers > limit:
        raise ValueError(
            f"attention_replicas + expert_workers = {replicas + workers} worker processes: "
            f"this machine runs at most {limit} ({WORKERS_PER_CORE} per CPU core, at least "
            f"{MIN_WORKER_LIMIT}); lower --attention-replicas / --expert-workers")
    if local:
        _check_transport(str(options.get("transport", "inproc")))


def _num_experts(model: str) -> int | None:
    """The model's expert count; ValueError for an unknown built-in or a path that is not
    an HF checkpoint. A built-in model is not generated here (that happens while the
    server already answers health checks)."""
    from megaserve.models import builtin
    from megaserve.models.config import ModelConfig

    if model.startswith(builtin.BUILTIN_PREFIX):
        name = model[len(builtin.BUILTIN_PREFIX):]
        if name not in builtin.BUILTIN_MODELS:
            known = ", ".join(builtin.BUILTIN_PREFIX + n for n in builtin.BUILTIN_MODELS)
            raise ValueError(f"unknown built-in model {model!r}; built-in models: {known}")
        return _builtin_configs().get(name, {}).get("num_experts")
    path = builtin.resolve_model(model)  # ValueError: not an existing directory
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r}: {path} has no config.json, so it is not an HF "
                         "checkpoint directory")
    return ModelConfig.from_dir(path).num_experts


def _builtin_configs() -> dict[str, dict[str, Any]]:
    from megaserve.models.builtin import TINY_MOE_CONFIG

    return {"tiny-moe": TINY_MOE_CONFIG}


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
        from megaserve.comm.rdma import rdma_unavailable

        reason = rdma_unavailable()
        if reason is not None:
            raise ValueError(f"transport 'rdma': {reason}; use --transport tcp")
    elif transport == "cuda_ipc":  # (nccl runs over gloo on CPU)
        import torch

        if not torch.cuda.is_available():
            raise ValueError("transport 'cuda_ipc' needs a CUDA GPU and none is visible; "
                             "use --transport tcp or inproc")
