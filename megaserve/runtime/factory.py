"""make_engine: the engine a config asks for, from the layer that composes engines.

The engine package knows nothing of the cluster (it never imports the runtime); this
function picks the co-located :class:`~megaserve.engine.engine.LLMEngine`, the device data
plane's front-end or the host data plane's front-end, importing the latter two lazily so
that a co-located engine never loads them.
"""

from __future__ import annotations

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine


def _experts_on_other_gpus(config: EngineConfig) -> bool:
    """True where the expert workers get GPUs of their own (device_engine.expert_device)."""
    import torch

    return config.device == "cuda" and torch.cuda.device_count() > 1


def device_plane_reason(config: EngineConfig) -> str | None:
    """Why ``config`` cannot run on the device data plane, or None if it can."""
    if not config.device.startswith("cuda"):
        return "the device data plane needs CUDA"
    if config.colocated or config.data_parallel:
        return ("data_parallel_size runs its workers on the host data plane (co-located "
                "expert parallelism, or whole engines)")
    if config.attention_gpus is not None or config.expert_gpus is not None:
        return "attention_gpus / expert_gpus place the workers of the host data plane"
    if config.transport == "nccl" and not _experts_on_other_gpus(config):
        return ("nccl connects no two processes on one GPU: the device data plane puts the "
                "expert workers on the other GPUs (device='cuda' with several visible)")
    if config.attention_replicas > 1 and config.transport == "inproc":
        # In one process, a replica loading a kernel module waits for every stream of the
        # context, including an expert worker's that waits on another replica's flag.
        return ("several attention replicas on the device data plane need expert workers "
                "in processes (transport cuda_ipc, tcp or rdma)")
    if config.speculative_config is not None:
        return "speculative decoding runs on the host data plane"
    return None


def uses_device_plane(config: EngineConfig) -> bool:
    """True where :func:`make_engine` should build a ``DevicePlaneEngine`` (False where
    every role is a device-plane process: ``DisaggregatedEngine`` runs those)."""
    from megaserve.runtime.layout import runs_device_roles

    if config.data_plane == "host" or runs_device_roles(config):
        return False
    split = config.disaggregate or (config.attention_replicas, config.expert_workers,
                                    config.transport) != (1, 1, "inproc")
    if not split:
        return False
    reason = device_plane_reason(config)
    if config.data_plane == "device" and reason is not None:
        raise ValueError(f"data_plane='device': {reason}")
    return reason is None


def make_engine(config: EngineConfig):
    """The engine for a config: everything in this process (``config.single_engine``, the
    defaults), or a front-end over attention and expert workers (R, E, the transport, an
    expert placement or ``disaggregate`` changed)."""
    if uses_device_plane(config):
        from megaserve.runtime.device_engine import DevicePlaneEngine

        return DevicePlaneEngine(config)
    if not config.single_engine:
        from megaserve.runtime.cluster import DisaggregatedEngine

        return DisaggregatedEngine(config)
    return LLMEngine(config)
