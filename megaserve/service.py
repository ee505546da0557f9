"""Names the server and the deployments of it share, importable without the server.

``deploy/`` writes manifests whose probes name the gRPC service; the server registers it.
Both read it here, so deploy never imports the server (``.importlinter``).
"""

from __future__ import annotations

#: The gRPC service of ``megaserve/server/generation.proto`` (package ``megaserve.v1``),
#: also the name its readiness health check answers for.
SERVICE_NAME = "megaserve.v1.Generation"
