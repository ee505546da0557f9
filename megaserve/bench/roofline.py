"""What a decode step must move and a prefill must compute: the roofline's arithmetic.

Pure arithmetic on a :class:`~megaserve.models.config.ModelConfig` (no torch), used by
``megaserve bench decode`` and tested on CPU. Shape legend: B = sequences in the step,
C = mean context (KV tokens read per sequence), D = hidden, E = experts, k = experts per
token, I = expert width, V = vocab, Hq/Hkv = query/KV heads, d = head dim, L = layers.

A decode step (one new token for each of B sequences) must at least read, once:

* the attention weights of every layer: q/k/v/o projections, router, norms;
* the weights of every expert some token routes to: E * (1 - (1 - k/E)^B) experts per
  layer in expectation when routing is uniform (skewed routing hits fewer, so this is an
  upper bound on the bytes and the achieved fraction derived from it is, if anything,
  generous);
* the K/V of every context token of every sequence (B * C * 2 * Hkv * d per layer), and
  write the new token's K/V;
* the LM head (V * D) and the final norm.

Activations (B * D per layer) are ignored: at B <= 256 they are < 1% of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaserve.models.config import ModelConfig


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step must move, by kind (all layers summed)."""

    attention_weights: float
    expert_weights: float
    active_experts_per_layer: float  # expected distinct experts hit, per MoE layer
    kv_read: float
    kv_write: float
    lm_head: float

    @property
    def total(self) -> float:
        return (self.attention_weights + self.expert_weights + self.kv_read + self.kv_write
                + self.lm_head)


def expected_active_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts that ``num_tokens`` tokens hit, each choosing ``top_k`` of
    ``num_experts`` uniformly: E * (1 - (1 - k/E)^T)."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def _mla_params(cfg: ModelConfig) -> int:
    """One MLA layer's projections and norms (q_a/q_b or q_proj, kv_a, kv_b, o_proj)."""
    d, mla, h = cfg.hidden_size, cfg.mla, cfg.num_heads
    q = (d * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * h * mla.qk_head_dim
         if mla.q_lora_rank else d * h * mla.qk_head_dim)
    kv = d * mla.cache_dim + mla.kv_lora_rank + mla.kv_lora_rank * h * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + h * mla.v_head_dim * d + 2 * d


def attention_params_per_layer(cfg: ModelConfig) -> int:
    """Weights the attention worker reads per layer and step: q/k/v/o (or MLA's), norms,
    router; and, averaged over the layers, dense MLPs and shared experts."""
    d = cfg.hidden_size
    dense = sum(not m for m in cfg.moe_layers) * 3 * d * cfg.dense_intermediate_size
    shared = sum(cfg.moe_layers) * 3 * d * cfg.shared_expert_intermediate_size
    mlps = (dense + shared) // cfg.num_layers
    if cfg.mla is not None:
        return _mla_params(cfg) + mlps + cfg.num_experts * d
    params = (cfg.q_size + 2 * cfg.kv_size) * d + d * cfg.q_size + 2 * d + mlps
    if cfg.qk_norm:
        params += 2 * cfg.head_dim
    if cfg.qkv_bias:
        params += cfg.q_size + 2 * cfg.kv_size
    return params + cfg.num_experts * d  # router (every layer of the supported presets is MoE)


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of one routed expert: gate, up and down projections."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def decode_bytes(cfg: ModelConfig, batch: int, context: float, elt_bytes: int,
                 weight_elt_bytes: int | None = None) -> DecodeBytes:
    """Bytes a decode step of ``batch`` sequences with mean ``context`` KV tokens moves.

    ``elt_bytes``: bytes per weight and per KV element (2 for bf16); ``weight_elt_bytes``:
    bytes per attention-side and expert weight where they differ (1 for block-FP8
    weights, whose 128 x 128 scales are < 0.01% more; the router and norms are counted at
    it too, an undercount below 2% of the attention weights; KV and the LM head stay at
    ``elt_bytes``). Raises ValueError for a non-positive batch.
    """
    welt = elt_bytes if weight_elt_bytes is None else weight_elt_bytes
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    num_moe = sum(cfg.moe_layers)
    active = expected_active_experts(cfg.num_experts, cfg.top_k, batch)
    # MLA: one latent row per token (keys are values)
    kv_per_token_layer = ((1 if cfg.cache_shares_kv else 2) * cfg.cache_kv_heads
                          * cfg.cache_head_dim * elt_bytes)
    return DecodeBytes(
        attention_weights=cfg.num_layers * attention_params_per_layer(cfg) * welt,
        expert_weights=num_moe * active * expert_params(cfg) * welt,
        active_experts_per_layer=active,
        kv_read=cfg.num_layers * batch * context * kv_per_token_layer,
        kv_write=cfg.num_layers * batch * kv_per_token_layer,
        lm_head=(cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * elt_bytes,
    )


def weight_bytes(cfg: ModelConfig, elt_bytes: int, weight_elt_bytes: int | None = None) -> float:
    """Bytes of all weights held (embedding and LM head included; ``weight_elt_bytes`` as
    :func:`decode_bytes`' for the layers' weights)."""
    layers = cfg.num_layers * attention_params_per_layer(cfg) + sum(cfg.moe_layers) * cfg.num_experts * expert_params(cfg)
    welt = elt_bytes if weight_elt_bytes is None else weight_elt_bytes
    return layers * welt + (2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * elt_bytes


def prefill_flops_per_token(cfg: ModelConfig, prompt_len: int) -> float:
    """Mean FLOPs per prompt token of a causal prefill of ``prompt_len`` tokens.

    2 * (active weights per token: attention projections, router, k experts) per layer,
    plus attention scores and values: 2 * 2 * (mean attended length (S+1)/2) * Hq * d per
    layer; the LM head runs once per prompt (spread over its tokens).
    """
    per_layer = 2 * (attention_params_per_layer(cfg) + cfg.top_k * expert_params(cfg))
    attn = 4 * (prompt_len + 1) / 2 * cfg.q_size
    head = 2 * cfg.vocab_size * cfg.hidden_size / prompt_len
    return cfg.num_layers * (per_layer + attn) + head


def layers_that_fit(cfg: ModelConfig, budget_bytes: float, elt_bytes: int) -> int:
    """Most layers of ``cfg``'s shape whose weights fit in ``budget_bytes`` (0 if none)."""
    per_layer = (attention_params_per_layer(cfg) + cfg.num_experts * expert_params(cfg)) * elt_bytes
    fixed = (2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * elt_bytes
    return max(0, int((budget_bytes - fixed) // per_layer))
