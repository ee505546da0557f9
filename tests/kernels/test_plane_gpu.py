"""The device data plane's exchange kernels on a CUDA GPU: the interpreter checks of
tests/kernels/test_plane_interp.py (the torch path they replace, a float64 reference,
poisoned slots, row invariance with torch.equal) in bfloat16, float16 and float32 at
Qwen3-30B-A3B's decode shapes (256 and 1,024 tokens x 2048, top-8) and odd ones. The
kernels across two processes on two GPUs (the data plane's IPC mappings) are covered by
tests/megaserve/test_device_plane_gpu.py's across-GPU layouts, bitwise to one GPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import test_plane_interp as checks

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_rows_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    checks.check_pack_rows(torch, ti, "cuda", [dtype],
                           [(256, 2048, 8, 256), (1024, 2048, 8, 1024), (7, 4096, 8, 64),
                            (1, 40, 2, 1), (13, 1500, 3, 16)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_route_rows_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    checks.check_route_rows(torch, ti, "cuda", [dtype],
                            [(256, 2048, 8, 128, 2), (1024, 2048, 8, 128, 2),
                             (1023, 2048, 8, 128, 3), (1, 40, 2, 4, 2), (37, 600, 8, 128, 3)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_routed_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    checks.check_copy_routed(torch, ti, "cuda", [dtype],
                             [(256, 8, 2048), (1024, 8, 2048), (9, 3, 1100), (1, 2, 4096)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_routed_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    checks.check_gather_routed(torch, ti, "cuda", [dtype],
                               [(256, 2, 257, 8, 2048), (1024, 2, 1025, 8, 2048),
                                (23, 3, 30, 3, 1100), (1, 2, 2, 2, 64)])


def test_local_ids_gpu() -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    checks.check_local_ids(torch, ti, "cuda",
                           [(1, 257, 8, 128, 128), (1, 1025, 8, 128, 64), (3, 300, 8, 128, 40),
                            (2, 5, 1, 4, 4)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_into_gpu(dtype: torch.dtype) -> None:
    import megaserve.kernels.triton_impl as ti

    torch.manual_seed(0)
    checks.check_combine_into(torch, ti, "cuda", [dtype],
                              [(256, 8, 2048), (1024, 8, 2048), (9, 3, 1100), (1, 2, 4096)])


def test_bad_input_gpu() -> None:
    import megaserve.kernels.triton_impl as ti

    checks.check_bad_input(torch, ti, "cuda")
