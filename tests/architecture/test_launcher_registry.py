"""Launchers beyond one host plug into the runtime through entry points, so the runtime
never imports deploy/ (.importlinter), and ``--launcher ray`` still finds Ray's."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from megaserve.runtime.launcher import (LAUNCHER_ENTRY_POINTS, LocalLauncher, make_launcher,
                                        registered_launchers)

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_registers_the_ray_launcher():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][LAUNCHER_ENTRY_POINTS] == {
        "ray": "megaserve.deploy.ray_launcher:make_ray_launcher"}


def test_the_installed_entry_point_is_found():
    entry = registered_launchers().get("ray")
    assert entry is not None, "reinstall megaserve (pip install -e .): its entry points are stale"
    assert entry.value == "megaserve.deploy.ray_launcher:make_ray_launcher"


def test_local_and_unknown_launchers():
    assert isinstance(make_launcher("local", use_processes=False), LocalLauncher)
    with pytest.raises(ValueError, match="launcher must be one of"):
        make_launcher("slurm", use_processes=True)


def test_ray_with_thread_workers_is_refused_before_ray_starts():
    with pytest.raises(ValueError, match="launcher 'ray'"):
        make_launcher("ray", use_processes=False)
    if importlib.util.find_spec("ray") is not None:
        import ray

        assert not ray.is_initialized()
