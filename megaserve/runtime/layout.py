"""Where a layout's workers run: which device each role gets, and one WorkerSpec per worker.

Three kinds of layout, all served by :class:`~megaserve.runtime.cluster.DisaggregatedEngine`::

    disaggregated     R attention workers + E expert workers   ranks 0..R-1 | R..R+E-1
                      (attention_replicas, expert_workers)     one worker each
    co-located EP     N workers, worker i = attention replica i + expert worker i
                      (data_parallel_size=N,                   ranks i and N+i in worker i
                       enable_expert_parallel=True)
    data parallel     N workers, each a whole engine (all experts in it), no comm ranks
                      (data_parallel_size=N)

Comm ranks are the same in the first two: attention replicas first, then expert workers,
so co-located EP runs the disaggregated dispatch/combine unchanged, each worker's expert
rank serving every replica (its own included) from a thread of the same process.

On GPUs over ``cuda_ipc`` the first two run on the device data plane instead
(:func:`runs_device_roles`; megaserve.runtime.device_workers): the same processes, one
per worker and on the same GPUs, exchanging through buffers mapped over CUDA IPC (a
co-located worker's own expert role through the local tensors), in lockstep; a
rendezvous rank per process (co-located worker i: rank i).
"""

from __future__ import annotations

import os

from megaserve.comm import ChannelConfig
from megaserve.engine.config import EngineConfig
from megaserve.models.resolved import ResolvedModel
from megaserve.runtime.placement import ExpertPlacement
from megaserve.runtime.worker_spec import WorkerSpec


def visible_gpus() -> int:
    """How many GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_devices(config: EngineConfig, num_gpus: int | None = None) -> tuple[list[str], list[str]]:
    """(device of each attention replica, device of each expert worker).

    ``device="cuda"``: ``attention_gpus`` / ``expert_gpus`` where given, else round-robin
    over the ``num_gpus`` visible GPUs (default: :func:`visible_gpus`), attention replicas
    first; co-located EP puts expert worker i on attention replica i's GPU. ``cpu`` and
    ``cuda:N`` are shared by every worker. Raises ``ValueError`` for a GPU index that is not
    visible."""
    replicas, experts = config.attention_replicas, config.expert_workers
    if config.device != "cuda":
        return [config.device] * replicas, [config.device] * experts
    count = max(1, visible_gpus() if num_gpus is None else num_gpus)
    attention = list(config.attention_gpus or [r % count for r in range(replicas)])
    if config.colocated:
        expert = list(attention)
    else:
        expert = list(config.expert_gpus or [(replicas + e) % count for e in range(experts)])
    bad = sorted({g for g in attention + expert if g >= count})
    if bad and (config.attention_gpus or config.expert_gpus):
        raise ValueError(f"attention_gpus / expert_gpus: GPU(s) {bad} are not visible "
                         f"(this process sees {count}; CUDA_VISIBLE_DEVICES renumbers them)")
    return [f"cuda:{g}" for g in attention], [f"cuda:{g}" for g in expert]


def nccl_gpu_clash(config: EngineConfig, num_gpus: int | None = None) -> str | None:
    """Why the ``nccl`` transport cannot connect this layout, or None.

    NCCL refuses a communicator with two ranks on one GPU ("invalid usage"), and every
    attention replica exchanges with every expert worker, so no replica may share a GPU
    with an expert worker (expert workers may share one: they never exchange). Co-located
    EP shares every GPU by definition. On the CPU the data plane is gloo, which has no
    such limit."""
    if not config.device.startswith("cuda") or config.data_parallel:
        return None
    attention, experts = worker_devices(config, num_gpus)
    for a, a_device in enumerate(attention):
        for e, e_device in enumerate(experts):
            if a_device == e_device:
                return (f"attention replica {a} and expert worker {e} would both run on "
                        f"{a_device}, and NCCL does not connect two processes on one GPU")
    return None


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


def runs_device_roles(config: EngineConfig) -> bool:
    """Whether ``config``'s workers are device-plane processes (module docstring): CUDA,
    ``transport="cuda_ipc"``, not ``data_plane="host"``, and co-located expert
    parallelism, several attention replicas, or workers placed by ``attention_gpus`` /
    ``expert_gpus`` (one replica without them: the device plane's one-process front-end,
    megaserve.runtime.device_engine). Speculative decoding stays on the host plane."""
    if (config.data_plane == "host" or not config.device.startswith("cuda")
            or config.transport != "cuda_ipc" or config.data_parallel
            or config.launcher != "local" or config.speculative_config is not None):
        return False
    return (config.colocated or config.attention_replicas > 1
            or config.attention_gpus is not None or config.expert_gpus is not None)


def transport_refusal(config: EngineConfig, num_gpus: int | None = None) -> str | None:
    """Why ``config.transport`` cannot connect this layout's workers, as the message of a
    ``ValueError`` (with what to do instead), or None.

    * ``nccl``: :func:`nccl_gpu_clash`.
    * ``cuda_ipc`` with co-located expert parallelism: worker i's attention rank would map
      the ring of its own expert rank, a buffer of the same process, and CUDA opens no IPC
      handle in the process that exported it ("invalid device context"; torch's
      ``rebuild_cuda_tensor`` does not find its own storage in its cache either). On the
      device plane (:func:`runs_device_roles`) a worker's own buffers are local tensors,
      never IPC mappings, so co-located workers connect over ``cuda_ipc`` there."""
    if config.transport == "nccl":
        clash = nccl_gpu_clash(config, num_gpus)
        if clash is None:
            return None
        instead = ("use tcp" if config.colocated else
                   "use cuda_ipc, or give the attention replicas and expert workers separate GPUs")
        return f"transport 'nccl': {clash}; {instead}"
    if config.transport == "cuda_ipc" and config.colocated and not runs_device_roles(config):
        return ("transport 'cuda_ipc': each co-located worker would map a CUDA IPC buffer of "
                "its own process (its expert rank's), which CUDA refuses; use tcp")
    return None


def comm_world(config: EngineConfig) -> int:
    """Comm ranks of the layout: attention replicas + expert workers (0: data parallel;
    device-plane co-located EP: one per worker)."""
    if config.data_parallel:
        return 0
    if config.colocated and runs_device_roles(config):
        return config.attention_replicas
    return config.attention_replicas + config.expert_workers


def ready_messages(config: EngineConfig) -> int:
    """WorkerReady messages a started layout sends: one per role of each worker (a
    co-located worker sends two, one per role it runs)."""
    if config.data_parallel or (config.colocated and runs_device_roles(config)):
        return config.attention_replicas  # one process, one message
    return config.attention_replicas + config.expert_workers


def worker_specs(config: EngineConfig, model: ResolvedModel, placement: ExpertPlacement,
                 rendezvous: str, channel: ChannelConfig) -> list[WorkerSpec]:
    """One WorkerSpec per worker of ``config``'s layout (see the module docstring), in
    start order: attention-bearing workers first. ``config`` is the front-end's (model path
    resolved), ``model`` the front-end's resolution of it (workers never resolve again)."""
    replicas = config.attention_replicas
    attention_devices, expert_devices = worker_devices(config)
    world = comm_world(config)
    parent = os.getpid()
    plane = "device" if runs_device_roles(config) else "host"
    secret = os.urandom(16) if plane == "device" else b""

    def spec(role: str, index: int, rank: int, device: str) -> WorkerSpec:
        return WorkerSpec(role, index, rank, world, rendezvous, config.transport, channel,
                          config, model, placement, replicas, parent, device, plane=plane,
                          secret=secret)

    if config.data_parallel:
        return [spec("engine", r, r, attention_devices[r]) for r in range(replicas)]
    if config.colocated:
        return [spec("colocated", r, r, attention_devices[r]) for r in range(replicas)]
    return ([spec("attention", r, r, attention_devices[r]) for r in range(replicas)]
            + [spec("expert", e, replicas + e, expert_devices[e])
               for e in range(placement.num_workers)])
