"""Checks of a runtime configuration that the CLI runs before loading anything heavy.

What would otherwise fail minutes later, deep in a worker thread or process, with a
traceback (a model path that is not a checkpoint, ``--device cuda`` on a machine without
a GPU, more worker processes than the machine can hold, a transport this machine lacks:
rdma without pyverbs or a device, cuda_ipc without a GPU, a dtype the device's kernels do
not run, a ``--max-model-len`` beyond the model's positions) fails here with a ValueError of
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
    model = _model_config(str(options.get("model", "builtin:tiny-moe")))
    num_experts = model.num_experts
    local = options.get("launcher", "local") == "local"
    if local:
        _check_device(str(options.get("device", "cpu")))
    _check_dtype(str(options.get("dtype", "auto")), str(options.get("device", "cpu")), model)
    _check_max_model_len(options.get("max_model_len"), model)
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


def _model_config(model: str):
    """The model's ModelConfig; ValueError for an unknown built-in or a path that is not
    an HF checkpoint. A built-in model is not generated here (that happens while the
    server already answers health checks)."""
    from megaserve.models import builtin
    from megaserve.models.config import ModelConfig
    from megaserve.models.resolved import ResolvedModel

    if model.startswith(builtin.BUILTIN_PREFIX):
        name = model[len(builtin.BUILTIN_PREFIX):]
        if name not in builtin.BUILTIN_MODELS:
            known = ", ".join(builtin.BUILTIN_PREFIX + n for n in builtin.BUILTIN_MODELS)
            raise ValueError(f"unknown built-in model {model!r}; built-in models: {known}")
        return ModelConfig.from_hf_dict(_builtin_configs()[name])
    return ResolvedModel.resolve(model).config  # ValueError: not a checkpoint directory


def _builtin_configs() -> dict[str, dict[str, Any]]:
    from megaserve.models.builtin import TINY_MOE_CONFIG

    return {"tiny-moe": TINY_MOE_CONFIG}


# dtypes each device type's kernels run (the CPU attention kernel has no float16 path; the
# CUDA matmul runs bfloat16 and float16 only).
SUPPORTED_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16")}


def _check_dtype(dtype: str, device: str, model) -> None:
    """ValueError for a dtype the device's kernels do not run (``auto``: the checkpoint's)."""
    from megaserve.engine.config import resolve_device
    from megaserve.models.resolved import resolve_dtype

    device_type = str(resolve_device(device)).partition(":")[0]
    resolved = str(resolve_dtype(dtype, model)).removeprefix("torch.")
    supported = SUPPORTED_DTYPES.get(device_type)
    if supported is not None and resolved not in supported:
        what = f"dtype {dtype!r}" if dtype != "auto" else \
            f"dtype 'auto' (the checkpoint's {resolved})"
        raise ValueError(f"{what} does not run on {device_type.upper()}: use --dtype "
                         f"{' or --dtype '.join(supported)}")


def max_supported_len(model) -> int:
    """The longest context the model's positions support: ``max_position_embeddings``, or
    with YaRN rope scaling ``original_max_position_embeddings * factor`` (vLLM's rule)."""
    scaling = model.rope_scaling
    if scaling is None:
        return model.max_position_embeddings
    return max(model.max_position_embeddings,
               int(scaling.original_max_position_embeddings * scaling.factor))


def _check_max_model_len(max_model_len: Any, model) -> None:
    """ValueError for a ``--max-model-len`` beyond the positions the model supports."""
    if max_model_len is None:
        return
    limit = max_supported_len(model)
    if int(max_model_len) > limit:
        source = "max_position_embeddings" if model.rope_scaling is None else \
            "its rope scaling (original_max_position_embeddings x factor)"
        raise ValueError(f"max_model_len {max_model_len} is longer than the model supports: "
                         f"{limit} positions ({source}); use --max-model-len {limit} or less")


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
