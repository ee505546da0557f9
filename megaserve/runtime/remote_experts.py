"""RemoteExperts: the attention side's ExpertClient over a comm endpoint.

Shape legend: T = tokens of the micro-batch, k = top-k, D = hidden, P = (token, rank)
pairs routed to one expert worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comm import Endpoint
from megaserve.runtime.frames import TAG_COMBINE, TAG_DISPATCH, decode_combine, encode_dispatch
from megaserve.runtime.placement import ExpertPlacement


@dataclass
class _Dispatch:
    layer: int
    microbatch: int
    shape: tuple[int, int, int]  # (T, k, D)
    dtype: torch.dtype
    device: torch.device
    # Per destination worker rank: (token index `[P]`, rank index `[P]`) of its pairs.
    routes: dict[int, tuple[torch.Tensor, torch.Tensor]]


class RemoteExperts:
    """Send routed rows to the expert workers and collect their outputs.

    ``expert_ranks[w]`` is the comm rank of expert worker ``w``. Completions that belong
    to another (layer, micro-batch) than the one being combined are kept until asked for:
    completions are counted, not ordered.
    """

    def __init__(self, endpoint: Endpoint, placement: ExpertPlacement, expert_ranks: list[int]):
        self.endpoint = endpoint
        self.expert_ranks = expert_ranks
        self._owner = placement.owner_table()  # [E] worker index
        self._early: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, mb, src) → out
        # Host providers move bytes; cuda_ipc copies GPU memory peer to peer.
        self._host = endpoint.provider != "cuda_ipc"

    def dispatch(self, layer: int, microbatch: int, x: torch.Tensor, topk_ids: torch.Tensor) -> _Dispatch:
        num_tokens, top_k = topk_ids.shape
        owners = self._owner.to(topk_ids.device)[topk_ids]  # [T, k]
        routes = {}
        for worker, rank in enumerate(self.expert_ranks):
            tokens, ranks = (owners == worker).nonzero(as_tuple=True)  # row-major: by token
            if tokens.numel() == 0:
                continue
            unique_tokens, row_of_pair = torch.unique_consecutive(tokens, return_inverse=True)
            pairs = torch.stack([row_of_pair, topk_ids[tokens, ranks]], dim=1)  # [P, 2]
            self.endpoint.send(rank, encode_dispatch(x[unique_tokens], pairs, self._host),
                               layer=layer, microbatch=microbatch, tag=TAG_DISPATCH)
            routes[rank] = (tokens, ranks)
        return _Dispatch(layer, microbatch, (num_tokens, top_k, x.shape[1]), x.dtype, x.device, routes)

    def combine(self, handle: _Dispatch) -> torch.Tensor:
        """Wait for every worker's answer; returns `[T, k, D]` in rank order."""
        out = torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        for rank, (tokens, ranks) in handle.routes.items():
            rows = self._receive(handle.layer, handle.microbatch, rank)
            out[tokens, ranks] = rows.to(handle.device)
        return out

    def _receive(self, layer: int, microbatch: int, src: int) -> torch.Tensor:
        key = (layer, microbatch, src)
        while key not in self._early:
            completion = self.endpoint.poll()
            try:
                if completion.tag != TAG_COMBINE:
                    raise RuntimeError(f"attention worker got a frame with tag {completion.tag}")
                got = (completion.layer, completion.microbatch, completion.src)
                self._early[got] = decode_combine(completion.data)
            finally:
                self.endpoint.release(completion)
        return self._early.pop(key)
