"""The expert placement table: expert id → the worker that holds it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """``workers[w]`` lists the expert ids held by expert worker ``w``.

    Every expert is held by at least one worker. Uneven splits are allowed. An expert held
    by several workers (a replicated hot expert) is served by the first worker listing it;
    spreading its load is left for later.
    """

    num_experts: int
    workers: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("expert placement: needs at least one expert worker")
        held = {e for w in self.workers for e in w}
        missing = sorted(set(range(self.num_experts)) - held)
        if missing:
            raise ValueError(f"expert placement: experts {missing} are held by no worker")
        extra = sorted(held - set(range(self.num_experts)))
        if extra:
            raise ValueError(f"expert placement: unknown expert ids {extra}")
        if any(not w for w in self.workers):
            raise ValueError("expert placement: every worker must hold at least one expert")

    @classmethod
    def even(cls, num_experts: int, num_workers: int) -> ExpertPlacement:
        """Contiguous ranges, the first ``num_experts % num_workers`` workers one larger."""
        if not 1 <= num_workers <= num_experts:
            raise ValueError(
                f"expert_workers must be in 1..{num_experts} (the model has {num_experts} "
                f"experts), got {num_workers}"
            )
        base, extra = divmod(num_experts, num_workers)
        workers, start = [], 0
        for w in range(num_workers):
            size = base + (1 if w < extra else 0)
            workers.append(tuple(range(start, start + size)))
            start += size
        return cls(num_experts, tuple(workers))

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def owner_table(self) -> torch.Tensor:
        """`[num_experts]` int64: the worker serving each expert."""
        owner = torch.empty(self.num_experts, dtype=torch.int64)
        for w in reversed(range(self.num_workers)):
            owner[list(self.workers[w])] = w
        return owner
