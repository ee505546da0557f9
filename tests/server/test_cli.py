"""CLI exit codes: what cannot run exits with status 2 and one line on stderr, before any
port is bound or model loaded; no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from .conftest import free_port


def run_cli(*args: str, cache: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "megaserve.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MEGASERVE_CACHE": cache})


def assert_usage_error(result: subprocess.CompletedProcess, *words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def _rdma_missing() -> bool:
    from megaserve.comm.rdma import rdma_unavailable

    return rdma_unavailable() is not None


CASES = {
    "bad model path": (["--model", "/no/such/checkpoint"], ["/no/such/checkpoint"], None),
    "unknown builtin": (["--model", "builtin:no-such-model"], ["builtin:no-such-model",
                                                               "builtin:tiny-moe"], None),
    "cuda without a GPU": (["--device", "cuda"], ["cuda", "--device cpu"],
                           "a GPU is present" if torch.cuda.is_available() else None),
    "too many expert workers": (["--expert-workers", "1000"], ["expert_workers"], None),
    "too many workers": (["--attention-replicas", "5000"], ["worker processes"], None),
    "float16 on CPU": (["--device", "cpu", "--dtype", "float16"],
                       ["float16", "CPU", "--dtype bfloat16"], None),
    "max_model_len over the model's positions": (
        ["--max-model-len", "5000"], ["5000", "4096", "max_position_embeddings"], None),
    "unavailable transport": (["--transport", "rdma", "--attention-replicas", "2"],
                              ["rdma", "rdma-core"],
                              None if _rdma_missing() else "RDMA is available here"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_serve_refuses_what_cannot_run_with_status_2(model_cache, case):
    args, words, skip = CASES[case]
    if skip:
        pytest.skip(skip)
    result = run_cli("serve", "--grpc-port", str(free_port()), "--http-port", str(free_port()),
                     *args, cache=model_cache)
    assert_usage_error(result, *words)


@pytest.mark.parametrize("case", ["cuda without a GPU", "too many workers"])
def test_generate_refuses_what_cannot_run_with_status_2(model_cache, case):
    args, words, skip = CASES[case]
    if skip:
        pytest.skip(skip)
    assert_usage_error(run_cli("generate", "hello", *args, cache=model_cache), *words)


def test_plan_takes_builtin_names_hf_directories_and_config_json(model_cache, tmp_path):
    from megaserve.models.builtin import resolve_model

    checkpoint = resolve_model("builtin:tiny-moe")
    for model in ("builtin:tiny-moe", str(checkpoint), str(checkpoint / "config.json")):
        out = tmp_path / "plan.yaml"
        result = run_cli("plan", "--model", model, "--cluster", "examples/cluster.yaml",
                         "--tpot-ms", "150", "-o", str(out), cache=model_cache)
        assert result.returncode == 0, result.stderr[-2000:]
        assert out.is_file() and "units" in out.read_text()
    assert_usage_error(run_cli("plan", "--model", "builtin:nope", "--cluster",
                               "examples/cluster.yaml", cache=model_cache), "builtin:nope")


def test_serve_takes_vllm_port_flag_for_http() -> None:
    from megaserve.server.cli import build_parser

    args = build_parser().parse_args(["--port", "8123", "--grpc-port", "50123"])
    assert (args.http_port, args.grpc_port) == (8123, 50123)
    assert build_parser().parse_args([]).http_port == 8000
