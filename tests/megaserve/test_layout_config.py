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


def test_cpu_threads_default_to_the_cpus_of_an_engine_alone_in_its_layout() -> None:
    """cpu_threads unset: every CPU of this process's affinity mask for a one-engine CPU
    layout; 1 where worker processes or in-process workers share the cores (several
    replicas or expert workers, disaggregated) and on CUDA; a given value is kept."""
    import os

    cpus = len(os.sched_getaffinity(0))
    assert EngineConfig(device="cpu").single_engine
    assert EngineConfig(device="cpu").cpu_threads == cpus
    assert EngineConfig(device="cpu").replica().cpu_threads == cpus
    for layout in (dict(attention_replicas=2), dict(expert_workers=2), dict(transport="tcp")):
        config = EngineConfig(device="cpu", **layout)
        assert not config.single_engine, layout
        assert config.cpu_threads == 1 and config.replica().cpu_threads == 1, layout
    assert EngineConfig(device="cuda").cpu_threads == 1
    assert EngineConfig(device="cpu", cpu_threads=3).cpu_threads == 3
