"""A deployment's config is two: the layout (megaserve.runtime's) and what each attention
replica's engine runs (EngineConfig.replica()), never a config that a worker undoes field
by field."""

from __future__ import annotations

from dataclasses import fields

from megaserve.engine.config import EngineConfig, LayoutConfig
from megaserve.runtime.factory import uses_device_plane


def test_layout_and_replica_split_a_config_in_two() -> None:
    config = EngineConfig(model="builtin:tiny-moe", device="cuda", attention_replicas=2,
                          expert_workers=3, transport="cuda_ipc", microbatches=2,
                          expert_placement=((0,), (1,), (2, 3)), aggregation="lockstep",
                          disaggregate=True, data_plane="device", max_num_seqs=32)
    layout = config.layout
    assert layout == LayoutConfig(attention_replicas=2, expert_workers=3, transport="cuda_ipc",
                                  expert_placement=((0,), (1,), (2, 3)), aggregation="lockstep",
                                  disaggregate=True, data_plane="device")
    replica = config.replica(device="cuda:1")
    assert replica.layout == LayoutConfig()  # one process: no layout left to undo
    assert not uses_device_plane(replica)
    # Everything else is the replica's, micro-batches included (it splits its own steps).
    kept = {f.name for f in fields(EngineConfig)} - {f.name for f in fields(LayoutConfig)}
    assert all(getattr(replica, name) == getattr(config, name)
               for name in kept if name != "device")
    assert replica.microbatches == 2 and replica.device == "cuda:1"


def test_every_layout_field_is_an_engine_config_field_with_the_same_default() -> None:
    defaults = EngineConfig()
    for f in fields(LayoutConfig):
        assert getattr(defaults, f.name) == f.default, f.name
