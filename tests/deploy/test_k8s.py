"""``megaserve deploy k8s``: KubeRay manifests for plans with one and two GPU types, validated
strictly (unknown fields rejected) against KubeRay's CRD schemas."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megaserve.cli import main as cli_main

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO.parent / "shared" / "kuberay-crds"

TWO_TYPES = """\
version: 1
model: tiny-moe
objective: throughput
units:
  - copies: 2
    layout: disaggregated
    attention: {gpu: H100, tp: 1, replicas: 3, max_batch_per_replica: 64}
    experts: {gpu: L40S, tp: 1, workers: 8, placement: [[0], [1], [2], [3], [4], [5], [6], [7]]}
    microbatches: 2
"""
ONE_TYPE = """\
version: 1
model: tiny-moe
objective: throughput
units:
  - copies: 1
    layout: disaggregated
    attention: {gpu: H200, tp: 1, replicas: 2, max_batch_per_replica: 32}
    experts: {gpu: H200, tp: 1, workers: 2, placement: [[0, 1, 2, 3], [4, 5, 6, 7]]}
    microbatches: 1
"""


def _strict(schema):
    """The CRD schema with unknown properties rejected wherever the schema lists them
    (nodes marked x-kubernetes-preserve-unknown-fields stay open)."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if ("properties" in node and not node.get("x-kubernetes-preserve-unknown-fields")
                    and "additionalProperties" not in node):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


def _validator(kind: str):
    if not CRDS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {CRDS} (they live in ../shared/kuberay-crds "
                    "next to the repository; a clone elsewhere has no copy)")
    return _load_validator(kind)


@functools.lru_cache(maxsize=None)
def _load_validator(kind: str):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _deploy(tmp_path, plan_text: str, *args: str) -> list[dict]:
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text)
    out = tmp_path / "manifests.yaml"
    code = cli_main(["deploy", "k8s", "--plan", str(plan), "--image", "registry.example/megaserve:1",
                     "--model-uri", "pvc://models/tiny", "-o", str(out), *args])
    assert code == 0
    return [d for d in yaml.safe_load_all(out.read_text()) if d]


def _validate(docs: list[dict]) -> None:
    for doc in docs:
        if doc["apiVersion"] == "ray.io/v1":
            errors = sorted(_validator(doc["kind"]).iter_errors(doc), key=str)
            assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]]


def test_two_gpu_types_worker_groups_limits_selectors_probes(tmp_path):
    docs = _deploy(tmp_path, TWO_TYPES, "--gpus-per-pod", "4")
    _validate(docs)
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "RayCluster", "RayCluster", "Service"]  # copies: 2
    assert [d["metadata"]["name"] for d in docs[1:3]] == ["megaserve-u0-0", "megaserve-u0-1"]
    spec = docs[1]["spec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"gpu-h100", "gpu-l40s"}
    h100, l40s = groups["gpu-h100"], groups["gpu-l40s"]
    assert (h100["replicas"], l40s["replicas"]) == (1, 2)  # 3 GPUs in 1 pod; 8 GPUs in 2 pods of 4
    for group, gpus, gpu_type, product in ((h100, "3", "H100", "NVIDIA-H100-80GB-HBM3"),
                                           (l40s, "4", "L40S", "NVIDIA-L40S")):
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": product}
        assert group["template"]["metadata"]["labels"]["ray.io/accelerator-type"] == gpu_type
        assert f"accelerator_type:{gpu_type}" in group["rayStartParams"]["resources"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    command = head["args"][0]
    assert "megaserve serve --plan /etc/megaserve/plan.yaml --plan-unit 0 --launcher ray" in command
    assert "--model /models/tiny" in command and "--transport tcp" in command
    assert "--grace-period 30 " in command + " "
    # Probes: readiness = serving; liveness fails only once FAILED (a separate health name,
    # SERVING while a lost worker is replaced); startup sized for a big checkpoint.
    assert head["readinessProbe"] == {"grpc": {"port": 50051, "service": "megaserve.v1.Generation"},
                                      "periodSeconds": 5, "timeoutSeconds": 5,
                                      "failureThreshold": 1}
    assert head["livenessProbe"] == {"grpc": {"port": 50051, "service": "megaserve.liveness"},
                                     "periodSeconds": 10, "timeoutSeconds": 5,
                                     "failureThreshold": 3}
    startup = head["startupProbe"]
    assert startup["grpc"] == {"port": 50051}
    assert startup["periodSeconds"] * startup["failureThreshold"] == 3600  # the default, 1 h
    pod = spec["headGroupSpec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 60  # > the server's 30 s grace period
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert docs[1]["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    service = docs[-1]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    assert service["spec"]["selector"]["megaserve.io/role"] == "front-end"
    assert docs[0]["data"]["plan.yaml"] == TWO_TYPES


def test_one_gpu_type_as_rayservice_with_label_overrides(tmp_path):
    docs = _deploy(tmp_path, ONE_TYPE, "--service", "--gpu-product-label", "gpu.example/model",
                   "--gpu-product", "H200=H200-141GB")
    _validate(docs)
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayService", "Service"]
    spec = docs[1]["spec"]["rayClusterConfig"]
    (group,) = spec["workerGroupSpecs"]
    assert group["groupName"] == "gpu-h200" and group["replicas"] == 1
    pod = group["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"  # 2 + 2 workers
    assert pod["nodeSelector"] == {"gpu.example/model": "H200-141GB"}


def test_grace_period_and_startup_timeout_flags_size_the_head_pod(tmp_path, capsys):
    docs = _deploy(tmp_path, ONE_TYPE, "--grace-period", "90", "--startup-timeout", "7200")
    _validate(docs)
    head_pod = docs[1]["spec"]["headGroupSpec"]["template"]["spec"]
    (head,) = head_pod["containers"]
    assert "--grace-period 90" in head["args"][0]
    assert head_pod["terminationGracePeriodSeconds"] > 90
    startup = head["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 7200
    plan = tmp_path / "plan.yaml"
    for bad in (["--grace-period", "-1"], ["--startup-timeout", "0"]):
        assert cli_main(["deploy", "k8s", "--plan", str(plan), *bad]) == 2
        assert bad[0].removeprefix("--").replace("-", "_") in capsys.readouterr().err


def test_probe_health_names_follow_the_server_states():
    """The names the probes check, answered by the server's real gRPC health service: the
    liveness name stays SERVING while loading, serving, recovering and draining (states in
    which readiness is NOT_SERVING) and turns NOT_SERVING only once the server FAILED."""
    import asyncio
    import socket

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from megaserve.deploy.k8s import DeployConfig, _probes
    from megaserve.server.core import ServerState, ServingCore
    from megaserve.server.grpc_service import GenerationService, build_grpc_server, set_health

    probes = _probes(DeployConfig(plan=""))
    liveness = probes["livenessProbe"]["grpc"]["service"]
    readiness = probes["readinessProbe"]["grpc"]["service"]

    async def run() -> list[tuple[str, str, str]]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        core = ServingCore("m", max_num_seqs=4, max_waiting=4)
        server, health = build_grpc_server(GenerationService(core, "float32", "cpu"),
                                           f"127.0.0.1:{port}")
        await server.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def check(name: str) -> str:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=name),
                                             timeout=30)
                    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

                async def record(step: str) -> None:
                    seen.append((step, await check(readiness), await check(liveness)))

                await set_health(health, serving=False)
                await record("loading")
                core.state = ServerState.SERVING
                await set_health(health, serving=True)
                await record("serving")
                await set_health(health, serving=False)  # a lost worker: app._watch_engine
                await record("recovering")
                await set_health(health, serving=True)
                core.state = ServerState.DRAINING
                await set_health(health, serving=False)
                await record("draining")
                core.state = ServerState.SERVING
                core.mark_failed("gave up after 3 restarts")
                await set_health(health, serving=False)
                await record("failed")
        finally:
            await server.stop(0)
        return seen

    assert asyncio.run(run()) == [
        ("loading", "NOT_SERVING", "SERVING"), ("serving", "SERVING", "SERVING"),
        ("recovering", "NOT_SERVING", "SERVING"), ("draining", "NOT_SERVING", "SERVING"),
        ("failed", "NOT_SERVING", "NOT_SERVING")]


def test_strict_validation_rejects_unknown_fields_and_bad_inputs(tmp_path, capsys):
    docs = _deploy(tmp_path, ONE_TYPE)
    cluster = copy.deepcopy(docs[1])
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 1  # misspelled
    assert list(_validator("RayCluster").iter_errors(cluster))
    plan = tmp_path / "p.yaml"
    plan.write_text(ONE_TYPE.replace("H200", "MI300X"))
    assert cli_main(["deploy", "k8s", "--plan", str(plan)]) == 2
    assert "--gpu-product MI300X=" in capsys.readouterr().err
    assert cli_main(["deploy", "k8s", "--plan", str(plan), "--gpu-product", "MI300X=AMD",
                     "--model-uri", "hf://org/model"]) == 2
    assert "pvc://" in capsys.readouterr().err


def test_the_megaserve_command_writes_manifests(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(ONE_TYPE)
    proc = subprocess.run([sys.executable, "-m", "megaserve.cli", "deploy", "k8s", "--plan", str(plan)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert [d["kind"] for d in yaml.safe_load_all(proc.stdout)] == ["ConfigMap", "RayCluster", "Service"]
