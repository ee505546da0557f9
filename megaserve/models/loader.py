"""Load an HF MoE checkpoint into an AttentionPart and/or an ExpertPart.

Tensor names follow the Hub's per-expert layout (what ``save_pretrained`` writes):
Mixtral ``block_sparse_moe.experts.{e}.w1|w3|w2``, Qwen ``mlp.experts.{e}.gate_proj|up_proj|down_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megaserve.kernels.fp8 import BlockFp8
from megaserve.models.attention_part import AttentionPart, LayerWeights
from megaserve.models.checkpoint import CheckpointReader
from megaserve.models.config import ModelConfig
from megaserve.models.expert_part import ExpertPart
from megaserve.models.mla import MLAWeights, split_kv_b
from megaserve.models.quantization import (QUANTIZATION_METHODS, QuantConfig, dequantize,
                                           is_fp8, quantize, scale_shape)
from megaserve.models.random_weights import RandomWeights, open_checkpoint
from megaserve.models.resolved import ResolvedModel, resolve_dtype

Linear = torch.Tensor | BlockFp8  # a linear weight: float, or block-FP8 kept for the FP8 GEMMs



@dataclass
class LoadedModel:
    config: ModelConfig
    attention: AttentionPart | None
    experts: ExpertPart | None


# Linear weights that block-FP8 checkpoints store in e4m3 and ``quantization="fp8"``
# quantizes; embeddings, the LM head, router gates, norms and biases stay as they are.
_QUANTIZED_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight",
                       ".w3.weight")


def keeps_fp8(device: torch.device, block: tuple[int, int]) -> bool:
    """Whether FP8 linear weights stay FP8 on ``device``: CUDA (the FP8 GEMMs) with the
    128 x 128 blocks they take; elsewhere they are dequantized at load."""
    return device.type == "cuda" and tuple(block) == (128, 128)


class _Weights:
    """Typed access to checkpoint tensors: converted, placed and shape-checked.

    Block-FP8 tensors (the checkpoint's ``quantization_config``) are dequantized with their
    ``weight_scale_inv`` into the compute dtype; with ``quantize`` set, the linear weights
    of a higher-precision checkpoint are rounded through the same block-FP8 format first.
    On CUDA, with 128 x 128 blocks, :meth:`linear` keeps them in FP8 instead
    (:class:`BlockFp8`, for the batch-invariant FP8 GEMMs).
    """

    def __init__(self, reader: CheckpointReader | RandomWeights, dtype: torch.dtype,
                 device: torch.device, checkpoint_quant: QuantConfig | None = None,
                 quantize: QuantConfig | None = None):
        self.reader, self.dtype, self.device = reader, dtype, device
        self.checkpoint_quant, self.quantize = checkpoint_quant, quantize
        quant = quantize or checkpoint_quant
        self.keep_fp8 = quant is not None and keeps_fp8(device, quant.weight_block_size)

    def linear(self, name: str, shape: tuple[int, int]) -> Linear:
        """A linear weight: :class:`BlockFp8` where this load keeps FP8 (CUDA) and the
        tensor is (or is to be) quantized, else :meth:`get`'s float tensor."""
        if not self.keep_fp8:
            return self.get(name, shape)
        t = self.reader.get(name)
        if tuple(t.shape) != shape:
            raise ValueError(f"model: tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        if is_fp8(t):
            scale = self._scale_of(name, t)
            return BlockFp8(t.to(self.device).contiguous(), scale.to(self.device, torch.float32).contiguous())
        if self.quantize is not None and name.endswith(_QUANTIZED_SUFFIXES):
            self._no_scale(name, t)
            q, scale = quantize(t.to(self.device), self.quantize.weight_block_size)
            return BlockFp8(q, scale)
        return self.get(name, shape)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` of ``shape`` in the compute dtype (or ``dtype``) on the device."""
        t = self.reader.get(name)
        if tuple(t.shape) != shape:
            raise ValueError(
                f"model: tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}"
            )
        if is_fp8(t):
            return self._dequantized(name, t)
        self._no_scale(name, t)
        if self.quantize is not None and name.endswith(_QUANTIZED_SUFFIXES):
            block = self.quantize.weight_block_size
            q, scale = quantize(t.to(self.device), block)
            return dequantize(q, scale, block, self.dtype)
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def _no_scale(self, name: str, t: torch.Tensor) -> None:
        """ValueError where a tensor that is not FP8 comes with a block scale (a format
        this loader does not know: its values would be read unscaled)."""
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        if name.endswith(".weight") and self.reader.has(scale_name):
            raise ValueError(f"model: tensor {name!r} is {t.dtype} but has {scale_name!r}; "
                             "only float8_e4m3fn weights carry block scales")

    def _dequantized(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """An FP8 tensor with its block scales, in the compute dtype."""
        scale = self._scale_of(name, t)
        block = self.checkpoint_quant.weight_block_size
        return dequantize(t.to(self.device), scale.to(self.device), block, self.dtype)

    def _scale_of(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The ``weight_scale_inv`` of FP8 tensor ``name``; ValueError naming the field or
        tensor where the checkpoint does not describe it fully."""
        quant = self.checkpoint_quant
        if quant is None:
            raise ValueError(f"model: tensor {name!r} is {t.dtype} but config.json has no "
                             "quantization_config")
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"model: tensor {name!r} is {t.dtype}; quantization_config.fmt "
                             "e4m3 needs float8_e4m3fn")
        if t.dim() != 2:
            raise ValueError(f"model: FP8 tensor {name!r} is not a matrix")
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        if not self.reader.has(scale_name):
            raise ValueError(f"model: FP8 tensor {name!r} has no {scale_name!r} "
                             "(quantization_config.weight_block_size needs one scale per block)")
        scale = self.reader.get(scale_name)
        block = quant.weight_block_size
        expected = scale_shape(tuple(t.shape), block)
        if tuple(scale.shape) != expected:
            raise ValueError(f"model: tensor {scale_name!r} has shape {tuple(scale.shape)}; "
                             f"{list(t.shape)} in quantization_config.weight_block_size "
                             f"{list(block)} needs {list(expected)}")
        return scale

    def optional(self, name: str, shape: tuple[int, ...],
                 dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.get(name, shape, dtype) if self.reader.has(name) else None


def _cat(parts: list[Linear], dtype: torch.dtype) -> Linear:
    """Linear weights stacked along N: FP8 kept where the blocks line up, else float."""
    if all(isinstance(p, BlockFp8) for p in parts) and all(
            p.shape[0] % 128 == 0 for p in parts[:-1]):
        return BlockFp8.cat(parts)
    return torch.cat([p.dequantize(dtype) if isinstance(p, BlockFp8) else p for p in parts])


def _stack(parts: list[Linear], dtype: torch.dtype) -> Linear:
    """Expert weights stacked `[E, N, K]`: FP8 where every part is, else float."""
    if all(isinstance(p, BlockFp8) for p in parts):
        return BlockFp8.stack(parts)
    return torch.stack([p.dequantize(dtype) if isinstance(p, BlockFp8) else p for p in parts])


def load_model(
    model: ResolvedModel | str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    *,
    attention: bool = True,
    expert_ids: list[int] | None = None,
    max_positions: int | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load the parts of a checkpoint that one worker needs.

    ``attention``: build the AttentionPart. ``expert_ids``: the routed experts to hold
    (None = all, [] = none). ``max_positions``: rotary table length (default: the
    model's max_position_embeddings). ``model``: the resolved model, or a name or
    checkpoint directory to resolve (megaserve.models.resolved). ``quantization``: "fp8"
    rounds the linear weights of a bf16/fp32 checkpoint through block-FP8 (128 x 128
    blocks) at load; None keeps the checkpoint's weights (a block-FP8 checkpoint is always read with its scales). Weights are computed
    with in the resolved ``dtype`` (FP8 ones dequantized into it). A random checkpoint
    (megaserve.models.random_weights) is drawn on ``device`` instead of read. Raises
    ``ValueError`` naming the file, tensor or config field for anything missing, corrupt,
    inconsistent or not understood.
    """
    if not isinstance(model, ResolvedModel):
        model = ResolvedModel.resolve(model)
    path, config = model.path, model.config
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, "
                         f"got {quantization!r}")
    torch_dtype, torch_device = resolve_dtype(dtype, config), torch.device(device)
    weights = _Weights(open_checkpoint(path, torch_dtype, torch_device), torch_dtype, torch_device,
                       config.quantization,
                       QuantConfig() if quantization and config.quantization is None else None)
    if expert_ids is None:
        expert_ids = list(range(config.num_experts))
    bad = [e for e in expert_ids if not 0 <= e < config.num_experts]
    if bad:
        raise ValueError(f"expert ids {bad} out of range [0, {config.num_experts})")
    attn = None
    if attention:
        attn = _load_attention(config, weights, max_positions or config.max_position_embeddings)
    experts = _load_experts(config, weights, expert_ids) if expert_ids else None
    return LoadedModel(config=config, attention=attn, experts=experts)


def _load_attention(config: ModelConfig, w: _Weights, max_positions: int) -> AttentionPart:
    d, v = config.hidden_size, config.vocab_size
    embed = w.get("model.embed_tokens.weight", (v, d))
    if w.reader.has("lm_head.weight") and not config.tie_word_embeddings:
        lm_head = w.get("lm_head.weight", (v, d))
    else:
        lm_head = embed
    layers = [_load_layer(config, w, i) for i in range(config.num_layers)]
    return AttentionPart(
        config, embed, layers, w.get("model.norm.weight", (d,)), lm_head, max_positions
    )


def _moe_prefix(config: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if config.family == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}."


def _load_mla(config: ModelConfig, w: _Weights, a: str) -> MLAWeights:
    """One layer's MLA projections (prefix ``a`` = ``model.layers.{i}.self_attn.``)."""
    d, mla, heads = config.hidden_size, config.mla, config.num_heads
    q_width = heads * mla.qk_head_dim
    kv_a = w.linear(a + "kv_a_proj_with_mqa.weight", (mla.cache_dim, d))
    if mla.q_lora_rank:
        q_a = w.linear(a + "q_a_proj.weight", (mla.q_lora_rank, d))
        a_proj = _cat([q_a, kv_a], w.dtype)
        q_a_norm = w.get(a + "q_a_layernorm.weight", (mla.q_lora_rank,))
        q_b = w.linear(a + "q_b_proj.weight", (q_width, mla.q_lora_rank))
    else:
        a_proj, q_a_norm = kv_a, None
        q_b = w.linear(a + "q_proj.weight", (q_width, d))
    kv_b = w.get(a + "kv_b_proj.weight",
                 (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
    w_uk, w_uv = split_kv_b(kv_b, config)
    return MLAWeights(
        a_proj=a_proj, q_a_norm=q_a_norm, q_b_proj=q_b,
        kv_a_norm=w.get(a + "kv_a_layernorm.weight", (mla.kv_lora_rank,)),
        w_uk=w_uk, w_uv=w_uv,
        o_proj=w.linear(a + "o_proj.weight", (d, heads * mla.v_head_dim)),
    )


def _load_layer(config: ModelConfig, w: _Weights, i: int) -> LayerWeights:
    d, dh = config.hidden_size, config.head_dim
    p = f"model.layers.{i}."
    a = p + "self_attn."
    if config.mla is not None:
        mla = _load_mla(config, w, a)
        qkv, qkv_bias, o_proj = None, None, mla.o_proj
    else:
        mla = None
        sizes = {"q": config.q_size, "k": config.kv_size, "v": config.kv_size}
        qkv = _cat([w.linear(f"{a}{n}_proj.weight", (s, d)) for n, s in sizes.items()], w.dtype)
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([w.get(f"{a}{n}_proj.bias", (s,)) for n, s in sizes.items()])
        o_proj = w.linear(a + "o_proj.weight", (d, config.q_size))
    layer = LayerWeights(
        input_norm=w.get(p + "input_layernorm.weight", (d,)),
        qkv=qkv,
        qkv_bias=qkv_bias,
        o_proj=o_proj,
        q_norm=w.get(a + "q_norm.weight", (dh,)) if config.qk_norm else None,
        k_norm=w.get(a + "k_norm.weight", (dh,)) if config.qk_norm else None,
        post_norm=w.get(p + "post_attention_layernorm.weight", (d,)),
        router=None, dense_gate_up=None, dense_down=None,
        shared_gate_up=None, shared_down=None, shared_gate=None,
        mla=mla,
    )
    if not config.moe_layers[i]:
        inter = config.dense_intermediate_size
        layer.dense_gate_up = _cat(
            [w.linear(f"{p}mlp.{n}_proj.weight", (inter, d)) for n in ("gate", "up")], w.dtype
        )
        layer.dense_down = w.linear(p + "mlp.down_proj.weight", (d, inter))
        return layer
    m = _moe_prefix(config, i)
    if config.scoring == "sigmoid":
        # Kept in float32, as HF keeps them: the choice compares sigmoid scores + bias.
        layer.router = w.get(m + "gate.weight", (config.num_experts, d), torch.float32)
        layer.router_bias = w.optional(m + "gate.e_score_correction_bias", (config.num_experts,),
                                       torch.float32)
    else:
        layer.router = w.get(m + "gate.weight", (config.num_experts, d))
    if config.shared_expert_intermediate_size:
        s = config.shared_expert_intermediate_size
        shared = "shared_expert." if config.shared_expert_gated else "shared_experts."
        layer.shared_gate_up = _cat(
            [w.linear(f"{m}{shared}{n}_proj.weight", (s, d)) for n in ("gate", "up")], w.dtype
        )
        layer.shared_down = w.linear(f"{m}{shared}down_proj.weight", (d, s))
        if config.shared_expert_gated:
            layer.shared_gate = w.get(m + "shared_expert_gate.weight", (1, d))
    return layer


def _load_experts(config: ModelConfig, w: _Weights, expert_ids: list[int]) -> ExpertPart:
    d, inter = config.hidden_size, config.moe_intermediate_size
    names = ("w1", "w3", "w2") if config.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    gate_up: dict[int, Linear] = {}
    down: dict[int, Linear] = {}
    for i, is_moe in enumerate(config.moe_layers):
        if not is_moe:
            continue
        base = _moe_prefix(config, i) + "experts."
        gate_up[i] = _stack([
            _cat([
                w.linear(f"{base}{e}.{names[0]}.weight", (inter, d)),
                w.linear(f"{base}{e}.{names[1]}.weight", (inter, d)),
            ], w.dtype)
            for e in expert_ids
        ], w.dtype)  # [E_local, 2I, D]
        down[i] = _stack(
            [w.linear(f"{base}{e}.{names[2]}.weight", (d, inter)) for e in expert_ids], w.dtype
        )  # [E_local, D, I]
        if isinstance(gate_up[i], BlockFp8) != isinstance(down[i], BlockFp8):
            # The FP8 expert GEMMs take both projections in FP8 or neither.
            gate_up[i], down[i] = (t.dequantize(w.dtype) if isinstance(t, BlockFp8) else t
                                   for t in (gate_up[i], down[i]))
    return ExpertPart(expert_ids, config.num_experts, gate_up, down)
