"""``megaserve deploy``: write deployment manifests for a plan (``deploy k8s``)."""

from __future__ import annotations

import argparse
import sys

from megaserve.deploy.k8s import DeployConfig, build_manifests, render

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    d = DeployConfig(plan="")
    p = argparse.ArgumentParser(prog="megaserve deploy",
                                description="Write deployment manifests for a megaserve plan.")
    sub = p.add_subparsers(dest="target", required=True)
    k = sub.add_parser("k8s", help="KubeRay RayCluster (or RayService) + Service for a plan",
                       description="Write a KubeRay RayCluster per deployment of the plan (one "
                                   "per copy of each unit): a head running `megaserve serve "
                                   "--launcher ray`, a worker group per GPU type, and a Service "
                                   "for gRPC and HTTP.")
    k.add_argument("--plan", required=True, help="a `megaserve plan` file")
    k.add_argument("--image", default=d.image, help="container image with megaserve and Ray "
                   "(default: %(default)s)")
    k.add_argument("--model-uri", default=d.model,
                   help="the checkpoint: a path in the image, builtin:NAME, or pvc://CLAIM/PATH "
                        "(default: %(default)s)")
    k.add_argument("--name", default=d.name, help="object name prefix (default: %(default)s)")
    k.add_argument("--namespace", default=None)
    k.add_argument("--service", action="store_true",
                   help="write a RayService (KubeRay upgrades) instead of a bare RayCluster")
    k.add_argument("--gpu-product-label", default=d.gpu_product_label,
                   help="node label selecting the GPU model (default: %(default)s)")
    k.add_argument("--gpu-product", action="append", default=[], metavar="TYPE=VALUE",
                   help="the label value for a plan GPU type, e.g. H100=NVIDIA-H100-80GB-HBM3 "
                        "(repeatable; built-in values for common types)")
    k.add_argument("--gpus-per-pod", type=int, default=d.gpus_per_pod,
                   help="most GPUs one worker pod asks for (default: %(default)s)")
    k.add_argument("--cpu-per-gpu", default=d.cpu_per_gpu)
    k.add_argument("--memory-per-gpu", default=d.memory_per_gpu)
    k.add_argument("--dtype", default=d.dtype)
    k.add_argument("--max-model-len", type=int, default=None)
    k.add_argument("--grace-period", type=float, default=d.grace_period,
                   help="the server's --grace-period, seconds from SIGTERM to exit; the pod's "
                        "terminationGracePeriodSeconds is this plus a margin "
                        "(default: %(default)s)")
    k.add_argument("--startup-timeout", type=int, default=d.startup_timeout_s,
                   help="seconds the first model load may take before the head is restarted "
                        "(the startup probe; size it for the checkpoint) (default: %(default)s)")
    k.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``megaserve deploy``; returns the exit code (2 for bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        products = {}
        for item in args.gpu_product:
            gpu, sep, value = item.partition("=")
            if not sep or not gpu or not value:
                raise ValueError(f"--gpu-product {item!r}: expected TYPE=VALUE")
            products[gpu] = value
        config = DeployConfig(plan=args.plan, image=args.image, model=args.model_uri,
                              name=args.name, namespace=args.namespace, service=args.service,
                              gpu_product_label=args.gpu_product_label, gpu_products=products,
                              gpus_per_pod=args.gpus_per_pod, cpu_per_gpu=args.cpu_per_gpu,
                              memory_per_gpu=args.memory_per_gpu, dtype=args.dtype,
                              max_model_len=args.max_model_len,
                              grace_period=args.grace_period,
                              startup_timeout_s=args.startup_timeout)
        text = render(build_manifests(config))
    except (ValueError, OSError) as e:
        print(f"megaserve deploy k8s: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
