"""GPU providers between two processes: cuda_ipc and nccl (its gloo variant runs on CPU)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from megaserve.comm import RendezvousServer
from megaserve.comm.bench import reap
from tests.comm import workers

CTX = mp.get_context("spawn")


def _pair(provider: str, backend: str) -> dict:
    rdv = RendezvousServer(2)
    results = CTX.Queue()
    procs = [CTX.Process(target=workers.gpu_pair, args=(r, provider, backend, rdv.address, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(2):
            r = results.get(timeout=90)
            assert r["ok"], r.get("error")
            out[r["rank"]] = r
        return out
    finally:
        reap(procs)
        rdv.close()


def _two_gpus_or_skip() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_ipc_tensors_land_on_the_receivers_gpu():
    _two_gpus_or_skip()
    out = _pair("cuda_ipc", "nccl")
    for rank in (0, 1):
        assert out[rank]["bad"] == 0
        assert out[rank]["devices"] == [f"cuda:{rank}"]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_nccl_tensors_land_on_the_receivers_gpu():
    _two_gpus_or_skip()
    out = _pair("nccl", "nccl")
    for rank in (0, 1):
        assert out[rank]["bad"] == 0
        assert out[rank]["devices"] == [f"cuda:{rank}"]


@pytest.mark.timeout(60)
def test_nccl_endpoint_on_gloo_cpu_roundtrip():
    out = _pair("nccl", "gloo")
    assert out[0]["bad"] == out[1]["bad"] == 0
    assert out[0]["devices"] == ["cpu"]
