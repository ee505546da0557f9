"""make_engine: the engine a config asks for, from the layer that composes engines.

The engine package knows nothing of the cluster (it never imports the runtime); this
function picks the co-located :class:`~megaserve.engine.engine.LLMEngine`, the device data
plane's front-end or the host data plane's front-end, importing the latter two lazily so
that a co-located engine never loads them.
"""

from __future__ import annotations

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.runtime.layout import device_plane_reason, runs_device_roles


def uses_device_plane(config: EngineConfig) -> bool:
    """True where :func:`make_engine` should build a ``DevicePlaneEngine`` (False where
    every role is a device-plane process: ``DisaggregatedEngine`` runs those)."""
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
