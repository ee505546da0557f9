"""Which attention replica serves a request, for the front-ends over several replicas
(the host-plane DisaggregatedEngine and the device-plane DevicePlaneEngine)."""

from __future__ import annotations

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import cache_root
from megaserve.engine.prefix_cache import PrefixRouter
from megaserve.models.resolved import ResolvedModel


class ReplicaRouter:
    """Places requests on replicas and remembers where, with each replica's outstanding
    work (prompt + max_tokens of its requests) until :meth:`forget`.

    ``prefix``: cache-aware routing (requests sharing a prefix go where it is cached while
    that does not overload the replica); None: the least outstanding work, ties to the
    lower index. Routing never changes outputs; it saves prefill.
    """

    def __init__(self, num_replicas: int, prefix: PrefixRouter | None = None) -> None:
        self.loads = [0] * num_replicas
        self._prefix = prefix
        self._owner: dict[str, int] = {}
        self._work: dict[str, int] = {}

    def place(self, request_id: str, token_ids: list[int], max_tokens: int) -> int:
        """The replica for a new request (raises ValueError for a running id)."""
        if request_id in self._owner:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if self._prefix is not None:
            replica = self._prefix.route(token_ids, self.loads)
        else:
            replica = min(range(len(self.loads)), key=lambda r: (self.loads[r], r))
        work = len(token_ids) + max_tokens
        self._owner[request_id] = replica
        self._work[request_id] = work
        self.loads[replica] += work
        return replica

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def forget(self, request_id: str) -> int | None:
        """Drop a finished or aborted request; returns the replica it was on."""
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            self.loads[replica] -= self._work.pop(request_id)
        return replica

    def busy_replicas(self) -> list[int]:
        """Replicas with requests, in index order."""
        return sorted(set(self._owner.values()))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._owner

    def __len__(self) -> int:
        return len(self._owner)


def replica_router(config: EngineConfig, model: ResolvedModel) -> ReplicaRouter:
    """The router for ``config``'s replicas: cache-aware where prefix caching is on and
    there are several replicas (the prefix hashes of ``model``'s checkpoint)."""
    prefix = None
    if config.enable_prefix_caching and config.attention_replicas > 1:
        root = cache_root(model.path, model.dtype(config.dtype), config.block_size)
        prefix = PrefixRouter(config.attention_replicas, config.block_size, root)
    return ReplicaRouter(config.attention_replicas, prefix)
