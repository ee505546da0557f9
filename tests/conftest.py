"""Shared pytest configuration.

* GPU tests (``@pytest.mark.gpu``) are skipped where no CUDA device exists.
* ``MEGASERVE_CACHE`` points at one temporary directory for the whole session (inherited
  by server and worker subprocesses), so the built-in model is generated once per run and
  never into the user's home.
* The Triton-interpreter checks' child processes (one per test module) run one at a time
  in the background from the end of collection, so they overlap the tests before theirs.
* Before anything runs, the interpreter's fixed-order dot (tests/kernels/interp_support.py)
  must give its committed bits here; on a machine where it does not, the Triton-interpreter
  bitwise tests would test the host rather than the kernels, so the session stops at once
  with a message saying so (``.ci/run`` fails loudly instead of passing or failing on luck).
"""

from __future__ import annotations

import os
import tempfile

import pytest

if "MEGASERVE_CACHE" not in os.environ:
    os.environ["MEGASERVE_CACHE"] = tempfile.mkdtemp(prefix="megaserve-test-cache-")


def pytest_sessionstart(session):
    from tests.kernels import interp_support

    got = interp_support.probe_digest()
    if got != interp_support.PROBE_SHA256:
        pytest.exit(f"tests/kernels/interp_support.py: the fixed-order interpreter dot gives "
                    f"other bits on this machine ({got}); the interpreter's bitwise kernel "
                    f"tests cannot hold here", returncode=3)


def pytest_collection_finish(session):
    """The Triton-interpreter children of the selected tests start now, one at a time in the
    background (tests/kernels/interp_support.py: _Children), instead of each when its
    module is reached."""
    from tests.kernels import interp_support

    files = sorted({str(item.path) for item in session.items
                    if set(interp_support.CHILD_FIXTURES) & set(getattr(item, "fixturenames", ()))})
    if files and not session.config.option.collectonly:
        interp_support.start_children(files)


def pytest_sessionfinish(session):
    from tests.kernels import interp_support

    interp_support.stop_children()


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
