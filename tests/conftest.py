"""Shared pytest configuration.

* GPU tests (``@pytest.mark.gpu``) are skipped where no CUDA device exists.
* ``MEGASERVE_CACHE`` points at one temporary directory for the whole session (inherited
  by server and worker subprocesses), so the built-in model is generated once per run and
  never into the user's home.
"""

from __future__ import annotations

import os
import tempfile

import pytest

if "MEGASERVE_CACHE" not in os.environ:
    os.environ["MEGASERVE_CACHE"] = tempfile.mkdtemp(prefix="megaserve-test-cache-")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
