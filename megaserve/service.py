"""Names the server and the deployments of it share, importable without the server.

``deploy/`` writes manifests whose probes name the gRPC service; the server registers it.
Both read it here, so deploy never imports the server (``.importlinter``).
"""

from __future__ import annotations

#: The gRPC service of ``megaserve/server/generation.proto`` (package ``megaserve.v1``),
#: also the name its readiness health check answers for.
SERVICE_NAME = "megaserve.v1.Generation"

#: The grpc.health.v1 name a liveness probe checks: SERVING while the process can still
#: serve or recover (loading, serving, replacing a lost worker, draining), NOT_SERVING
#: once the server has FAILED (its engine gave up). An event loop that no longer answers
#: fails the probe by its timeout. Readiness checks SERVICE_NAME, which is NOT_SERVING in
#: all of those states but serving.
LIVENESS_NAME = "megaserve.liveness"
