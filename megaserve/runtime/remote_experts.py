"""RemoteExperts: the attention side's ExpertClient over a comm endpoint.

Shape legend: T = tokens of the micro-batch, k = top-k, D = hidden, P = (token, rank)
pairs routed to one expert worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaserve.comm import Endpoint
from megaserve.runtime.frames import (
    TAG_COMBINE, TAG_DISPATCH, decode_combine, encode_dispatch, frames_on_host,
)
from megaserve.runtime.placement import ExpertPlacement


@dataclass(frozen=True)
class LockstepShape:
    """What a replica needs to send empty lockstep frames."""

    moe_layers: tuple[int, ...]
    microbatches: int
    hidden_size: int
    dtype: torch.dtype


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

    def __init__(self, endpoint: Endpoint, placement: ExpertPlacement, expert_ranks: list[int],
                 lockstep: LockstepShape | None = None):
        self.endpoint = endpoint
        self.expert_ranks = expert_ranks
        self._owner = placement.owner_table()  # [E] worker index
        self._early: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, mb, src) → out
        self._host = frames_on_host(endpoint)
        self._lockstep = lockstep
        self._participants = 0  # replicas in the current lockstep step (0: per-layer mode)
        self._num_microbatches = 0  # micro-batches this replica runs in the current step
        self._sent: set[tuple[int, int]] = set()  # (layer, mb) ticks covered this step

    # -- lockstep ---------------------------------------------------------------------
    # NOTE: under lockstep every participating replica sends exactly one frame per expert
    # worker for every (MoE layer, micro-batch 0..m-1) tick of a step, empty where it has
    # no rows (no answer comes back for an empty frame). Expert workers then know when a
    # tick is complete: after ``participants`` frames.

    def set_participants(self, participants: int) -> None:
        """Start a lockstep step shared by ``participants`` replicas."""
        self._participants = participants
        self._sent.clear()

    def begin_step(self, num_microbatches: int) -> None:
        """How many micro-batches this replica runs in the step (called by the runner)."""
        self._num_microbatches = num_microbatches

    def end_step(self) -> None:
        """Send empty frames for every tick of the step this replica did not fill."""
        if self._lockstep is None:
            return
        for layer in self._lockstep.moe_layers:
            for microbatch in range(self._lockstep.microbatches):
                self._send_empty(layer, microbatch)
        self._num_microbatches = 0

    def _send_empty(self, layer: int, microbatch: int) -> None:
        if (layer, microbatch) in self._sent:
            return
        shape = self._lockstep
        rows = torch.empty(0, shape.hidden_size, dtype=shape.dtype)
        pairs = torch.empty(0, 2, dtype=torch.int64)
        for rank in self.expert_ranks:
            self.endpoint.send(rank, encode_dispatch(rows, pairs, True, self._participants),
                               layer=layer, microbatch=microbatch, tag=TAG_DISPATCH)
        self._sent.add((layer, microbatch))

    def dispatch(self, layer: int, microbatch: int, x: torch.Tensor, topk_ids: torch.Tensor) -> _Dispatch:
        num_tokens, top_k = topk_ids.shape
        if self._owner.device != topk_ids.device:
            self._owner = self._owner.to(topk_ids.device)  # once, not per dispatch
        owners = self._owner[topk_ids]  # [T, k]
        routes = {}
        lockstep = self._lockstep is not None
        for worker, rank in enumerate(self.expert_ranks):
            tokens, ranks = (owners == worker).nonzero(as_tuple=True)  # row-major: by token
            if tokens.numel() == 0 and not lockstep:
                continue
            unique_tokens, row_of_pair = torch.unique_consecutive(tokens, return_inverse=True)
            pairs = torch.stack([row_of_pair, topk_ids[tokens, ranks]], dim=1)  # [P, 2]
            frame = encode_dispatch(x[unique_tokens], pairs, self._host, self._participants)
            self.endpoint.send(rank, frame, layer=layer, microbatch=microbatch, tag=TAG_DISPATCH)
            if tokens.numel():
                routes[rank] = (tokens, ranks)
        if lockstep:
            self._sent.add((layer, microbatch))
            if microbatch == self._num_microbatches - 1:
                # This replica has no more micro-batches: release the others' ticks now.
                for missing in range(microbatch + 1, self._lockstep.microbatches):
                    self._send_empty(layer, missing)
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
