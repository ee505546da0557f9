"""Deploying megaserve beyond one host (docs/deploy.md).

* :mod:`megaserve.deploy.ray_launcher`: the Ray launcher (``megaserve serve --launcher ray``), the
  same :class:`megaserve.runtime.launcher.WorkerLauncher` seam as the local launcher, with
  workers as Ray actors placed by GPU type (optional dependency: ``megaserve[ray]``).
* :mod:`megaserve.deploy.k8s` / :mod:`megaserve.deploy.cli`: KubeRay manifests for a plan
  (``megaserve deploy k8s``).
* :mod:`megaserve.deploy.plans`: what both need from a plan file.

Nothing here is imported by the runtime except lazily, when a launcher or command is chosen.
"""
