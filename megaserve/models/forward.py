"""The layer loop: attention part + expert part, over one or more micro-batches.

The loop is written for disaggregation from the start. The experts sit behind an
:class:`ExpertClient` whose ``dispatch`` may return before the experts have run; with
``m`` micro-batches the loop issues attention for micro-batch ``i + 1`` while the experts
of micro-batch ``i`` are busy (ping-pong)::

    for layer l:  for micro-batch i:
        wait combine(l-1, i) → finish layer l-1 on i → attention l on i → route → dispatch(l, i)

With ``m = 1`` and in-process experts this is the plain sequential forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megaserve.models.attention_part import AttentionMetadata, AttentionPart
from megaserve.models.expert_part import ExpertPart


class ExpertClient(Protocol):
    """Where routed tokens go. ``combine`` returns the k expert outputs per token."""

    def begin_step(self, num_microbatches: int) -> None:
        """A forward over ``num_microbatches`` micro-batches starts."""

    def dispatch(
        self, layer: int, microbatch: int, x: torch.Tensor, topk_ids: torch.Tensor
    ) -> Any:
        """Send x `[T, D]` with topk_ids `[T, k]` to the experts; returns a handle."""

    def combine(self, handle: Any) -> torch.Tensor:
        """Wait for a dispatch; returns `[T, k, D]`, row (t, r) = expert topk_ids[t, r] of x[t].

        A client whose ``reduces_on_workers`` is true gets ``topk_weights`` `[T, k]` as a
        fifth argument of ``dispatch`` and returns `[T, 1, D]` float32 instead: each
        token's ``kernels.combine`` row, computed where the experts ran (the loop adds it
        with unit weight, which is exact)."""


class LocalExperts:
    """ExpertClient running an in-process ExpertPart synchronously."""

    def __init__(self, experts: ExpertPart) -> None:
        self.experts = experts

    def begin_step(self, num_microbatches: int) -> None:
        pass

    def dispatch(
        self, layer: int, microbatch: int, x: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        # Routed row t*k + j reads token row t: no [T*k, D] copy of x.
        out = self.experts.forward(layer, x, topk_ids.reshape(-1), rows_per_token=top_k)
        return out.view(num_tokens, top_k, -1)  # [T, k, D]

    def combine(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [T] int32 or int64
    meta: AttentionMetadata
    # Async scheduling (decode graphs): [T] int32 row of ``sampled`` holding a row's
    # input token, or -1 (input_ids); sampled: [N] int64, the last step's samples.
    sources: torch.Tensor | None = None
    sampled: torch.Tensor | None = None


@dataclass
class _Pending:
    x: torch.Tensor  # [T, D] post-attention-norm input of the experts
    topk_weights: torch.Tensor  # [T, k] fp32 ([T, 1] ones: the client combined)
    handle: Any


def run_layers(
    attention: AttentionPart,
    experts: ExpertClient,
    micro_batches: list[MicroBatch],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[torch.Tensor]:
    """Run every decoder layer over the micro-batches; returns each one's final hidden
    states `[T_i, D]` (before the final norm).

    Each layer's end (expert combine or dense MLP, residual add) and the next layer's
    input norm are one step (:meth:`AttentionPart.finish_moe`), so ``inputs[i]`` carries
    the normed input of the layer about to run."""
    hidden = [attention.embed(mb.input_ids, mb.sources, mb.sampled)
              for mb in micro_batches]  # [T_i, D] each
    inputs = [attention.input_norm(0, h) for h in hidden]
    pending: list[_Pending | None] = [None] * len(micro_batches)
    num_layers = attention.config.num_layers
    reduced = getattr(experts, "reduces_on_workers", False)
    unit = ([torch.ones(h.shape[0], 1, dtype=torch.float32, device=h.device) for h in hidden]
            if reduced else None)  # [T_i, 1] weights of combined rows
    for layer in range(num_layers):
        for i, mb in enumerate(micro_batches):
            if pending[i] is not None:
                hidden[i], inputs[i] = _finish(attention, layer - 1, hidden[i], pending[i],
                                               experts)
                pending[i] = None
            h, x = attention.attention(layer, hidden[i], inputs[i], mb.meta, kv_caches[layer])
            if not attention.is_moe(layer):
                hidden[i], inputs[i] = attention.dense_mlp(layer, h, x)
                continue
            hidden[i] = h
            topk_ids, topk_weights = attention.route(layer, x)
            if reduced:
                handle = experts.dispatch(layer, i, x, topk_ids, topk_weights)
                pending[i] = _Pending(x, unit[i], handle)
            else:
                handle = experts.dispatch(layer, i, x, topk_ids)
                pending[i] = _Pending(x, topk_weights, handle)
    return [
        _finish(attention, num_layers - 1, hidden[i], pending[i], experts)[0]
        if pending[i] is not None else hidden[i]
        for i in range(len(micro_batches))
    ]


def _finish(
    attention: AttentionPart,
    layer: int,
    h: torch.Tensor,
    pending: _Pending,
    experts: ExpertClient,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Wait for ``layer``'s experts; returns (h after the layer, the next layer's input
    norm of it, None after the last layer)."""
    expert_out = experts.combine(pending.handle)  # [T, k, D]
    return attention.finish_moe(layer, h, pending.x, expert_out, pending.topk_weights)
