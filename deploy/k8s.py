"""KubeRay manifests for a plan: ``megaserve deploy k8s --plan plan.yaml``.

One deployment per copy of each plan unit (a unit is what one ``megaserve serve`` runs)::

    ConfigMap   <name>-plan          the plan file, mounted on every head at /etc/megaserve
    RayCluster  <name>[-u<i>-<j>]    (or a RayService around it, with service=True)
        head group     megaserve serve --plan ... --launcher ray (the gRPC + HTTP front-end;
                       num-cpus 0, so no worker lands there); gRPC health probes (below)
        worker groups  one per GPU type of the unit: nvidia.com/gpu requests = limits,
                       node selector <product label>=<product>, ray.io/accelerator-type
                       label and the accelerator_type:<T> Ray resource the Ray launcher's
                       placement group bundles ask for
    Service     <name>               gRPC + HTTP of every head of the plan

The head container starts Ray itself (annotation ``ray.io/overwrite-container-cmd``, the
generated command in ``$KUBERAY_GEN_RAY_START_CMD``), waits for it, then execs
``megaserve serve``. Everything here is pure data: no Kubernetes client is needed.

Probes of the head (grpc.health.v1 on the gRPC port), matched to the server's states::

    server state        startup ("")   readiness (Generation)   liveness (megaserve.liveness)
    LOADING             NOT_SERVING    NOT_SERVING              SERVING
    SERVING             SERVING        SERVING                  SERVING
    RECOVERING          NOT_SERVING    NOT_SERVING              SERVING   (a lost worker)
    DRAINING (SIGTERM)  NOT_SERVING    NOT_SERVING              SERVING
    FAILED              NOT_SERVING    NOT_SERVING              NOT_SERVING
    event loop wedged   (no answer: every probe times out)

so traffic stops while a worker group is replaced, and the pod is restarted only once the
engine gave up (or the loop hangs): never in the middle of a recovery, however long a big
checkpoint takes to reload. The startup probe allows ``startup_timeout_s`` for the first
load; ``terminationGracePeriodSeconds`` is the server's grace period plus
TERMINATION_MARGIN_S, so Kubernetes never kills a drain the server would finish.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from megaserve.deploy.plans import load_units, unit_gpus
from megaserve.service import LIVENESS_NAME, SERVICE_NAME

RAY_VERSION = "2.60.0"
PLAN_DIR = "/etc/megaserve"
MODEL_DIR = "/models"
# After the server's grace period (in-flight requests), what its shutdown still needs:
# stopping the worker actors, removing the placement group, the process exit.
TERMINATION_MARGIN_S = 30
STARTUP_PERIOD_S = 10  # the startup probe's period; its threshold covers startup_timeout_s
# GPU type (as the planner's catalog names it, planner/catalog.py) → the value of NVIDIA
# GPU feature discovery's nvidia.com/gpu.product node label (check yours with
# `kubectl get nodes -L nvidia.com/gpu.product`). DeployConfig.gpu_products overrides it.
GPU_PRODUCTS = {
    "H100-SXM": "NVIDIA-H100-80GB-HBM3",
    "H100": "NVIDIA-H100-80GB-HBM3",
    "H800": "NVIDIA-H800",
    "H200": "NVIDIA-H200",
    "H20": "NVIDIA-H20",
    "A100-80G": "NVIDIA-A100-SXM4-80GB",
    "A800": "NVIDIA-A800-SXM4-80GB",
    "L40S": "NVIDIA-L40S",
    "L20": "NVIDIA-L20",
    "B200": "NVIDIA-B200",
}


@dataclass(frozen=True)
class DeployConfig:
    """What ``megaserve deploy k8s`` writes; ValueError for a bad value.

    ``model``: a path inside the image, ``builtin:NAME``, or ``pvc://CLAIM/PATH`` (the claim
    is mounted read-only at /models on every pod). ``gpus_per_pod``: the most GPUs one
    worker pod asks for (a group needing fewer asks for what it needs). ``cpu_per_gpu`` /
    ``memory_per_gpu``: worker pod requests per GPU (Kubernetes quantities).
    ``grace_period``: the server's ``--grace-period`` (seconds from SIGTERM to exit).
    ``startup_timeout_s``: how long the first model load may take before Kubernetes
    restarts the head (the startup probe's budget; size it for the checkpoint)."""

    plan: str
    image: str = "megaserve:latest"
    model: str = "builtin:tiny-moe"
    name: str = "megaserve"
    namespace: str | None = None
    service: bool = False
    gpu_product_label: str = "nvidia.com/gpu.product"
    gpu_products: dict[str, str] = field(default_factory=dict)
    gpus_per_pod: int = 8
    cpu_per_gpu: str = "8"
    memory_per_gpu: str = "64Gi"
    head_cpu: str = "4"
    head_memory: str = "16Gi"
    grpc_port: int = 50051
    http_port: int = 8000
    dtype: str = "auto"
    max_model_len: int | None = None
    grace_period: float = 30.0
    startup_timeout_s: int = 3600

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", self.name):
            raise ValueError(f"name: {self.name!r} must be a DNS-1123 label of at most 40 "
                             "characters (lowercase letters, digits, '-')")
        if self.gpus_per_pod < 1:
            raise ValueError(f"gpus_per_pod: {self.gpus_per_pod} must be >= 1")
        if self.model.startswith(("hf://", "s3://", "gs://", "http://", "https://")):
            raise ValueError(f"model: {self.model!r}: megaserve loads local checkpoints; bake "
                             "it into the image (a path) or put it on a volume (pvc://CLAIM/PATH)")
        if self.model.startswith("pvc://") and not re.fullmatch(r"pvc://[a-z0-9][-a-z0-9.]*(/.*)?", self.model):
            raise ValueError(f"model: {self.model!r}: expected pvc://CLAIM/PATH")
        if self.grpc_port == self.http_port:
            raise ValueError("grpc_port and http_port must differ")
        if not 0 <= self.grace_period <= 3600:
            raise ValueError(f"grace_period: {self.grace_period!r} must be in [0, 3600] seconds")
        if isinstance(self.startup_timeout_s, bool) or not isinstance(self.startup_timeout_s, int) \
                or self.startup_timeout_s < STARTUP_PERIOD_S:
            raise ValueError(f"startup_timeout_s: {self.startup_timeout_s!r} must be an integer "
                             f">= {STARTUP_PERIOD_S} seconds")

    @property
    def termination_grace_period_s(self) -> int:
        """The pod's terminationGracePeriodSeconds: above the server's grace period."""
        return math.ceil(self.grace_period) + TERMINATION_MARGIN_S

    def product(self, gpu_type: str) -> str:
        products = {**GPU_PRODUCTS, **self.gpu_products}
        if gpu_type not in products:
            raise ValueError(f"GPU type {gpu_type!r}: no {self.gpu_product_label} value known; "
                             f"pass --gpu-product {gpu_type}=<label value> (known: {sorted(products)})")
        return products[gpu_type]


def _dns(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def _model_args(config: DeployConfig) -> tuple[str, list[dict], list[dict]]:
    """The --model value and the volumes / mounts it needs."""
    if not config.model.startswith("pvc://"):
        return config.model, [], []
    claim, _, path = config.model[len("pvc://"):].partition("/")
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    return f"{MODEL_DIR}/{path}".rstrip("/"), [volume], [mount]


def _serve_command(config: DeployConfig, unit_index: int, model: str) -> str:
    args = ["megaserve", "serve", "--plan", f"{PLAN_DIR}/plan.yaml", "--plan-unit", str(unit_index),
            "--launcher", "ray", "--ray-address", "auto", "--transport", "tcp",
            "--device", "cuda", "--dtype", config.dtype, "--model", model, "--host", "0.0.0.0",
            "--grpc-port", str(config.grpc_port), "--http-port", str(config.http_port),
            "--grace-period", f"{config.grace_period:g}"]
    if config.max_model_len:
        args += ["--max-model-len", str(config.max_model_len)]
    return " ".join(args)


def _probes(config: DeployConfig) -> dict[str, Any]:
    """The head's probes (module docstring): startup on overall health (SERVING once the
    model is loaded), readiness on the Generation service, liveness on LIVENESS_NAME.
    Timeouts leave room for a busy head; liveness restarts after 3 failures (30 s)."""
    port = config.grpc_port
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": STARTUP_PERIOD_S,
                         "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(config.startup_timeout_s
                                                       / STARTUP_PERIOD_S)},
        "readinessProbe": {"grpc": {"port": port, "service": SERVICE_NAME},
                           "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 1},
        "livenessProbe": {"grpc": {"port": port, "service": LIVENESS_NAME},
                          "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
    }


def _head_group(config: DeployConfig, unit_index: int, labels: dict[str, str]) -> dict[str, Any]:
    model, volumes, mounts = _model_args(config)
    volumes = volumes + [{"name": "plan", "configMap": {"name": f"{config.name}-plan"}}]
    mounts = mounts + [{"name": "plan", "mountPath": PLAN_DIR, "readOnly": True}]
    start = ("ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD & "
             "until ray health-check --address 127.0.0.1:6379 >/dev/null 2>&1; do sleep 1; done; "
             f"exec {_serve_command(config, unit_index, model)}")
    container = {
        "name": "ray-head",
        "image": config.image,
        "command": ["/bin/bash", "-lc", "--"],
        "args": [start],
        "ports": [{"name": "gcs-server", "containerPort": 6379},
                  {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001},
                  {"name": "grpc", "containerPort": config.grpc_port},
                  {"name": "http", "containerPort": config.http_port}],
        "resources": {"requests": {"cpu": config.head_cpu, "memory": config.head_memory},
                      "limits": {"cpu": config.head_cpu, "memory": config.head_memory}},
        "volumeMounts": mounts,
        **_probes(config),
    }
    return {
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {"metadata": {"labels": {**labels, "megaserve.io/role": "front-end"}},
                     "spec": {"containers": [container], "volumes": volumes,
                              "terminationGracePeriodSeconds":
                                  config.termination_grace_period_s}},
    }


def _worker_group(config: DeployConfig, gpu_type: str, num_gpus: int,
                  labels: dict[str, str]) -> dict[str, Any]:
    per_pod = min(config.gpus_per_pod, num_gpus)
    pods = math.ceil(num_gpus / per_pod)
    _, volumes, mounts = _model_args(config)
    requests = {"cpu": _times(config.cpu_per_gpu, per_pod),
                "memory": _times(config.memory_per_gpu, per_pod), "nvidia.com/gpu": str(per_pod)}
    container = {
        "name": "ray-worker",
        "image": config.image,
        "command": ["/bin/bash", "-lc", "--"],
        "args": ["ulimit -n 65536; exec $KUBERAY_GEN_RAY_START_CMD"],
        "resources": {"requests": requests, "limits": dict(requests)},
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": {config.gpu_product_label: config.product(gpu_type)},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    if volumes:
        spec["volumes"] = volumes
    return {
        "groupName": f"gpu-{_dns(gpu_type)}",
        "replicas": pods,
        "minReplicas": pods,
        "maxReplicas": pods,
        # The resource the Ray launcher's bundles ask for (Ray also detects it from the GPU,
        # but under its own spelling of the type name).
        "rayStartParams": {"resources": f'"{{\\"accelerator_type:{gpu_type}\\": 1}}"'},
        "template": {"metadata": {"labels": {**labels, "ray.io/accelerator-type": gpu_type}},
                     "spec": spec},
    }


def _times(quantity: str, n: int) -> str:
    """``n`` times a Kubernetes quantity such as "8", "0.5" or "64Gi"."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-zA-Z]*)", quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity such as '8' or '64Gi'")
    value = float(match.group(1)) * n
    return f"{int(value) if value.is_integer() else value}{match.group(2)}"


def build_manifests(config: DeployConfig) -> list[dict[str, Any]]:
    """Every object to ``kubectl apply`` (see the module docstring), in apply order.
    Raises ValueError for a bad plan or a GPU type without a known product label."""
    plan, units = load_units(config.plan)
    with open(config.plan) as f:
        plan_text = f.read()
    meta = {"namespace": config.namespace} if config.namespace else {}
    base_labels = {"app.kubernetes.io/name": "megaserve", "app.kubernetes.io/instance": config.name}
    objects: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{config.name}-plan", "labels": base_labels, **meta},
        "data": {"plan.yaml": plan_text},
    }]
    deployments = [(i, j) for i, unit in enumerate(units) for j in range(int(unit.get("copies", 1)))]
    for i, j in deployments:
        name = config.name if len(deployments) == 1 else f"{config.name}-u{i}-{j}"
        labels = {**base_labels, "megaserve.io/unit": str(i)}
        gpus = unit_gpus(units[i])
        cluster_spec = {
            "rayVersion": RAY_VERSION,
            "headGroupSpec": _head_group(config, i, labels),
            "workerGroupSpecs": [_worker_group(config, gpu_type, n, labels)
                                 for gpu_type, n in gpus.gpus_by_type().items()],
        }
        metadata = {"name": name, "labels": labels,
                    "annotations": {"ray.io/overwrite-container-cmd": "true"}, **meta}
        if config.service:
            objects.append({"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": metadata,
                            "spec": {"rayClusterConfig": cluster_spec}})
        else:
            objects.append({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": metadata,
                            "spec": cluster_spec})
    objects.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": config.name, "labels": base_labels, **meta},
        "spec": {"type": "ClusterIP",
                 "selector": {**base_labels, "megaserve.io/role": "front-end"},
                 "ports": [{"name": "grpc", "port": config.grpc_port, "targetPort": "grpc",
                            "appProtocol": "grpc"},
                           {"name": "http", "port": config.http_port, "targetPort": "http"}]},
    })
    return objects


def render(objects: list[dict[str, Any]]) -> str:
    """A multi-document YAML stream."""
    import yaml

    return yaml.safe_dump_all(objects, sort_keys=False, width=100)
