"""The expert part of a MoE model: the routed experts an expert worker holds.

A worker holds the same subset of expert ids in every MoE layer (the placement table maps
expert id → worker). Shape legend: R = routed rows (token, expert) pairs, D = hidden,
E_local = experts held here, I = expert intermediate size.
"""

from __future__ import annotations

import torch

from megaserve import kernels
class ExpertPart:
    """Routed experts ``expert_ids`` of every MoE layer.

    w_gate_up[layer]: `[E_local, 2I, D]`; w_down[layer]: `[E_local, D, I]`, in the order of
    ``expert_ids``; layers without experts (dense) are absent from the dicts.
    """

    def __init__(
        self,
        expert_ids: list[int],
        num_experts: int,
        w_gate_up: dict[int, torch.Tensor],
        w_down: dict[int, torch.Tensor],
    ) -> None:
        if len(set(expert_ids)) != len(expert_ids):
            raise ValueError(f"expert ids must be distinct, got {expert_ids}")
        self.expert_ids = list(expert_ids)
        self.w_gate_up = w_gate_up
        self.w_down = w_down
        # Global expert id → index in the local stacks; experts not held map to a value
        # that forward() rejects.
        lookup = torch.full((num_experts,), len(expert_ids), dtype=torch.int64)
        lookup[torch.tensor(expert_ids, dtype=torch.int64)] = torch.arange(len(expert_ids))
        device = next(iter(w_gate_up.values())).device if w_gate_up else lookup.device
        self._local_index = lookup.to(device)  # on the weights' device: no copy per call
        # Holding every expert in id order (one process): the lookup is the identity.
        self._identity = self.expert_ids == list(range(num_experts))

    @property
    def layers(self) -> list[int]:
        return sorted(self.w_gate_up)

    def forward(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                *, rows_per_token: int = 1) -> torch.Tensor:
        """Run each routed row through its expert.

        x: `[R / rows_per_token, D]`; expert_ids: `[R]` int64 global expert ids, all held
        here; routed row r reads x row ``r // rows_per_token``. Returns `[R, D]` in
        x.dtype. Each row's result is independent of the other rows.
        """
        local = expert_ids if self._identity else self._local_index[expert_ids]
        # Checked on CPU only: on CUDA it would be a host synchronisation per layer (and
        # break CUDA-graph capture); the placement table routes rows to their holders.
        if not local.is_cuda and local.numel() and int(local.max()) >= len(self.expert_ids):
            raise ValueError(
                f"layer {layer}: rows routed to experts not held by this worker "
                f"(holds {self.expert_ids})"
            )
        return kernels.expert_ffn(x, local, self.w_gate_up[layer], self.w_down[layer],
                                  rows_per_token=rows_per_token)
