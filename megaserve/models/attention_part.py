"""The attention part of a MoE model: everything except the routed experts.

It owns embeddings, attention (with the paged KV cache), norms, router gates, dense MLPs,
the shared expert, the final norm and the LM head: what an attention worker runs.

Shape legend: T = tokens of the (micro-)batch, S = sequences, D = hidden, Hq / Hkv = query /
kv heads, Dh = head dim, E = experts, k = top-k, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaserve import kernels
from megaserve.kernels.grouped_topk import sigmoid_rows
from megaserve.models.config import ModelConfig
from megaserve.models.mla import MLAWeights, mla_attention, rope_tables, softmax_scale


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the tokens of one (micro-)batch sit in their sequences and in the KV cache."""

    positions: torch.Tensor  # [T] int32/int64, position of each token in its sequence (rotary)
    slot_mapping: torch.Tensor  # [T] int32/int64, cache slot (block * block_size + offset)
    block_tables: torch.Tensor  # [S, max_blocks] int32, each sequence's blocks
    context_lens: torch.Tensor  # [S] int32, tokens in the cache after this step
    query_start_loc: torch.Tensor  # [S + 1] int32, row offsets of each sequence's tokens
    one_token_per_seq: bool = False  # query_start_loc is 0, 1, ..., S (a decode batch)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class LayerWeights:
    """One decoder layer's attention-side weights (None where the family has none)."""

    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor | None  # [Hq*Dh + 2*Hkv*Dh, D], q, k, v rows stacked; None with MLA
    qkv_bias: torch.Tensor | None  # [Hq*Dh + 2*Hkv*Dh]
    o_proj: torch.Tensor  # [D, Hq*Dh] (MLA: [D, Hq*Dv])
    q_norm: torch.Tensor | None  # [Dh] (Qwen3)
    k_norm: torch.Tensor | None  # [Dh] (Qwen3)
    post_norm: torch.Tensor  # [D]
    router: torch.Tensor | None  # [E, D]; None for a dense layer
    dense_gate_up: torch.Tensor | None  # [2I, D] for a dense layer
    dense_down: torch.Tensor | None  # [D, I]
    shared_gate_up: torch.Tensor | None  # [2Is, D] (Qwen2-MoE shared expert)
    shared_down: torch.Tensor | None  # [D, Is]
    shared_gate: torch.Tensor | None  # [1, D] sigmoid gate of the shared expert (Qwen2-MoE)
    mla: MLAWeights | None = None  # DeepSeek-V3's latent attention (then qkv is None)
    router_bias: torch.Tensor | None = None  # [E] float32 e_score_correction_bias


class AttentionPart:
    """Runs the attention side of every layer; stateless apart from its weights."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        max_positions: int,
    ) -> None:
        self.config = config
        self.embed_tokens = embed  # [V, D]
        self.layers = layers
        self.final_norm = final_norm  # [D]
        self.lm_head = lm_head  # [V, D]
        if config.mla is not None:
            self.scale = softmax_scale(config)
            self.cos, self.sin = rope_tables(config, max_positions, embed.device, embed.dtype)
        else:
            self.scale = config.head_dim**-0.5
            self.cos, self.sin = _rotary_tables(config, max_positions, embed.device, embed.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def embed(self, input_ids: torch.Tensor, sources: torch.Tensor | None = None,
              sampled: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids `[T]` int32/int64 → hidden states `[T, D]`; a row whose source (`[T]`
        int32) is >= 0 embeds ``sampled[source]`` instead (``kernels.embed_tokens``)."""
        return kernels.embed_tokens(self.embed_tokens, input_ids, sources, sampled)

    def input_norm(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The input RMSNorm of ``layer``: h `[T, D]` → x `[T, D]` (layer 0's, or where no
        fused finish computed it)."""
        return kernels.rms_norm(h, self.layers[layer].input_norm, self.config.rms_norm_eps)

    def attention(
        self,
        layer: int,
        h: torch.Tensor,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention block with its residual, then the post-attention norm.

        h: `[T, D]` residual stream; x: its input norm `[T, D]` (:meth:`input_norm`, or
        the previous layer's :meth:`finish_moe` / :meth:`dense_mlp`). Writes this batch's
        K/V into ``kv_cache`` (the layer's `[num_blocks, block_size, Hkv, Dh]` pair; MLA:
        one `[num_blocks, block_size, 1, Dc]` latent tensor twice, megaserve.models.mla)
        before attending. Returns ``(h + attn(x), post_norm(that))``, both `[T, D]`.
        """
        cfg, w = self.config, self.layers[layer]
        num_tokens = h.shape[0]
        if w.mla is not None:
            attn = mla_attention(cfg, w.mla, x, meta.positions, self.cos, self.sin, kv_cache[0],
                                 meta.slot_mapping, meta.block_tables, meta.context_lens,
                                 meta.query_start_loc, self.scale)
            x, h = kernels.linear_rms_norm(attn, w.o_proj, w.post_norm, cfg.rms_norm_eps, h)
            return h, x
        qkv = kernels.linear(x, w.qkv, w.qkv_bias)  # [T, (Hq + 2Hkv) * Dh]
        k_cache, v_cache = kv_cache
        # q/k norm, rotary, and the K/V write of this batch: one pass
        q = kernels.rotary_and_cache(
            qkv, meta.positions, self.cos, self.sin, w.q_norm, w.k_norm, cfg.rms_norm_eps,
            k_cache, v_cache, meta.slot_mapping, cfg.num_heads,
        )  # [T, Hq, Dh]
        attn = kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens,
            meta.query_start_loc, self.scale, one_token_per_seq=meta.one_token_per_seq,
        )  # [T, Hq, Dh]
        # o_proj, the residual add and the post-attention norm
        x, h = kernels.linear_rms_norm(attn.reshape(num_tokens, cfg.q_size), w.o_proj,
                                       w.post_norm, cfg.rms_norm_eps, h)
        return h, x

    def is_moe(self, layer: int) -> bool:
        return self.layers[layer].router is not None

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, D]` → (topk_ids `[T, k]` int64, topk_weights `[T, k]` float32).

        Sigmoid scoring (DeepSeek-V3): the router runs in float32 (its weight is kept in
        float32, as HF keeps it; ``kernels.router_logits``) and
        ``kernels.sigmoid_topk_route`` picks the experts."""
        cfg, w = self.config, self.layers[layer]
        if cfg.scoring == "sigmoid":
            logits = kernels.router_logits(x, w.router)  # [T, E] fp32
            return kernels.sigmoid_topk_route(logits, w.router_bias, cfg.top_k, cfg.num_groups,
                                              cfg.topk_groups, cfg.norm_topk_prob,
                                              cfg.routed_scaling_factor)
        return kernels.route(x, w.router, cfg.top_k, cfg.norm_topk_prob)

    def dense_mlp(
        self, layer: int, h: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A dense layer's MLP with its residual, and the next layer's input norm:
        returns ``(h + mlp(x), input_norm(that))``, `[T, D]` each; the norm is None after
        the last layer."""
        w = self.layers[layer]
        return self._add_and_norm(layer + 1, h, _swiglu(x, w.dense_gate_up, w.dense_down))

    def finish_moe(
        self,
        layer: int,
        h: torch.Tensor,
        x: torch.Tensor,
        expert_out: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Combine routed outputs (fixed rank order, fp32), add the shared expert and
        residual, then the next layer's input norm.

        h, x: `[T, D]`; expert_out: `[T, k, D]` in rank order; topk_weights: `[T, k]` fp32.
        Returns ``(h', input_norm(h'))``, `[T, D]` each; the norm is None after the last
        layer.
        """
        w = self.layers[layer]
        if w.shared_gate_up is None:
            norm = self._next_input_norm(layer + 1)
            if norm is None:
                return kernels.combine_residual(expert_out, topk_weights, h), None
            x_next, h = kernels.combine_residual(expert_out, topk_weights, h, norm,
                                                 self.config.rms_norm_eps)
            return h, x_next
        out = kernels.combine(expert_out, topk_weights)  # [T, D] fp32
        shared = _swiglu(x, w.shared_gate_up, w.shared_down)
        if w.shared_gate is not None:
            # sigmoid_rows: torch's CPU sigmoid of a [T, 1] tensor would round the last
            # T % 16 rows on another code path (their bits would depend on T)
            gate = sigmoid_rows(kernels.linear(x, w.shared_gate).float())  # [T, 1]
            out = out + gate * shared.float()
        else:
            out = out + shared.float()
        return self._add_and_norm(layer + 1, h, out.to(h.dtype))

    def _next_input_norm(self, layer: int) -> torch.Tensor | None:
        """``layer``'s input-norm weight, None past the last layer."""
        return self.layers[layer].input_norm if layer < self.config.num_layers else None

    def _add_and_norm(
        self, layer: int, h: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``h + delta`` and ``layer``'s input norm of it (None past the last layer)."""
        norm = self._next_input_norm(layer)
        if norm is None:
            return h + delta, None
        x, h = kernels.rms_norm(delta, norm, self.config.rms_norm_eps, residual=h)
        return h, x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h `[B, D]` → logits `[B, V]` in the model's dtype, as
        every path hands them to ``kernels.log_softmax`` (no float copy of a 152k-wide
        row; its bits follow the dtype)."""
        x = kernels.rms_norm(h, self.final_norm, self.config.rms_norm_eps)
        return kernels.linear(x, self.lm_head)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return kernels.linear(kernels.silu_and_mul(kernels.linear(x, gate_up)), down)


def _rotary_tables(
    config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_positions, Dh]`, computed in fp32 as HF does, stored in ``dtype``."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
