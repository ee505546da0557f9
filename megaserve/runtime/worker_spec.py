"""WorkerSpec: what one worker of a layout is (role, ranks, device, data plane), picklable.

Its own module so that both data planes' worker entry points (megaserve.runtime.workers,
megaserve.runtime.device_workers) and the layout that builds the specs
(megaserve.runtime.layout) import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaserve.comm import ChannelConfig
from megaserve.engine.config import EngineConfig
from megaserve.models.resolved import ResolvedModel
from megaserve.runtime.placement import ExpertPlacement

ROLES = ("attention", "expert", "colocated", "engine")


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # one of ROLES (megaserve.runtime.workers describes each)
    index: int  # replica index, or expert worker index (both, for "colocated")
    rank: int  # comm rank: attention replicas first, then expert workers (colocated: its replica's)
    world_size: int
    rendezvous: str  # host:port of the front-end's rendezvous server
    transport: str
    channel: ChannelConfig
    engine: EngineConfig  # the front-end's config (model path resolved)
    model: ResolvedModel  # the front-end's resolution of engine.model (never re-resolved)
    placement: ExpertPlacement
    num_replicas: int
    parent_pid: int
    device: str  # this worker's device, e.g. "cpu" or "cuda:1"
    host: str = "127.0.0.1"  # where this worker's endpoint listens (its node's IP across hosts)
    # "host": frames over ``transport`` (this module); "device": the device data plane's
    # buffers over CUDA IPC, one process per role (megaserve.runtime.device_workers).
    plane: str = "host"
    # Device plane: the key of the local sockets between a layout's processes.
    secret: bytes = b""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {list(ROLES)}, got {self.role!r}")
        if self.plane not in ("host", "device"):
            raise ValueError(f"worker plane must be 'host' or 'device', got {self.plane!r}")

    @property
    def expert_ranks(self) -> list[int]:
        return [self.num_replicas + w for w in range(self.placement.num_workers)]

    @property
    def runs_attention(self) -> bool:
        """Whether this worker holds an attention replica (takes AddRequest etc.)."""
        return self.role != "expert"
