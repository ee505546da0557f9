"""Random weights generated where they are used: a checkpoint without weight files.

A directory holding ``config.json`` and :data:`MARKER` (``random_weights.json``: seed and
init) and no ``*.safetensors`` is a *random checkpoint*: :func:`open_checkpoint` returns a
:class:`RandomWeights` reader for it, which draws every tensor the loader asks for directly
on the loader's device, in the loader's dtype. A 48-layer Qwen3-30B-A3B-shaped model
(~61 GB in bf16) then appears on a GPU in seconds instead of being written to disk and
read back (minutes).

Init (same as the file checkpoints of ``megaserve.bench.random_model``): norm weights are
ones; every other matrix is N(0, 1/fan_in) (fan_in = last dimension; 0.022 for hidden
2048), which keeps activations at unit scale through the residual stream and spreads the
router's choices. Each tensor is drawn from its own generator seeded by
(seed, crc32(name)), so a tensor's values do not depend on which other tensors a worker
loads. Values are a pure function of (seed, name, device type, torch version): CPU and
CUDA draw different numbers.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from megaserve.models.checkpoint import CheckpointReader

MARKER = "random_weights.json"
_NORM_SUFFIXES = ("layernorm.weight", "norm.weight")


def is_random_checkpoint(path: str | Path) -> bool:
    """True where ``path`` holds the random-weights marker and no weight files."""
    path = Path(path)
    return (path / MARKER).is_file() and not any(path.glob("*.safetensors"))


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of an HF MoE checkpoint with this ``config.json``.

    Supports ``MixtralForCausalLM`` (``block_sparse_moe.experts.{e}.w1|w3|w2``, expert
    width ``intermediate_size``) and ``Qwen3MoeForCausalLM`` (``mlp.experts.{e}.gate|up|
    down_proj``, width ``moe_intermediate_size``, q/k norms), every layer a MoE layer, and
    ``DeepseekV3ForCausalLM`` (:func:`_deepseek_shapes`). Raises ValueError for another
    architecture.
    """
    arch = (config.get("architectures") or [None])[0]
    if arch == "DeepseekV3ForCausalLM":
        return _deepseek_shapes(config)
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        raise ValueError(f"random weights: architecture {arch!r} not supported "
                         "(MixtralForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM)")
    mixtral = arch == "MixtralForCausalLM"
    d, v = config["hidden_size"], config["vocab_size"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    dh = config.get("head_dim") or d // hq
    e = config["num_local_experts"] if mixtral else config["num_experts"]
    inter = config["intermediate_size"] if mixtral else config["moe_intermediate_size"]
    moe, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
                                          "lm_head.weight": (v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (hq * dh, d), p + "self_attn.k_proj.weight": (hkv * dh, d),
                   p + "self_attn.v_proj.weight": (hkv * dh, d), p + "self_attn.o_proj.weight": (d, hq * dh),
                   f"{p}{moe}.gate.weight": (e, d)}
        if not mixtral:
            shapes |= {p + "self_attn.q_norm.weight": (dh,), p + "self_attn.k_norm.weight": (dh,)}
        for x in range(e):
            q = f"{p}{moe}.experts.{x}."
            shapes |= {q + f"{names[0]}.weight": (inter, d), q + f"{names[1]}.weight": (inter, d),
                       q + f"{names[2]}.weight": (d, inter)}
    return shapes


def _deepseek_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a DeepseekV3ForCausalLM checkpoint (MLA, dense first layers,
    shared experts, router correction bias; no MTP layers)."""
    from megaserve.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(config)
    mla, d, h = cfg.mla, cfg.hidden_size, cfg.num_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d),
                                          "model.norm.weight": (d,), "lm_head.weight": (cfg.vocab_size, d)}
    for i, is_moe in enumerate(cfg.moe_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   a + "kv_a_proj_with_mqa.weight": (mla.cache_dim, d),
                   a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
                   a + "kv_b_proj.weight": (h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
                   a + "o_proj.weight": (d, h * mla.v_head_dim)}
        if mla.q_lora_rank:
            shapes |= {a + "q_a_proj.weight": (mla.q_lora_rank, d), a + "q_a_layernorm.weight": (mla.q_lora_rank,),
                       a + "q_b_proj.weight": (h * mla.qk_head_dim, mla.q_lora_rank)}
        else:
            shapes[a + "q_proj.weight"] = (h * mla.qk_head_dim, d)
        width = cfg.moe_intermediate_size if is_moe else cfg.dense_intermediate_size
        mlps = [f"{p}mlp.experts.{e}." for e in range(cfg.num_experts)] if is_moe else [p + "mlp."]
        if is_moe:
            shapes |= {p + "mlp.gate.weight": (cfg.num_experts, d),
                       p + "mlp.gate.e_score_correction_bias": (cfg.num_experts,)}
            if cfg.shared_expert_intermediate_size:
                s = cfg.shared_expert_intermediate_size
                q = p + "mlp.shared_experts."
                shapes |= {q + "gate_proj.weight": (s, d), q + "up_proj.weight": (s, d),
                           q + "down_proj.weight": (d, s)}
        for q in mlps:
            shapes |= {q + "gate_proj.weight": (width, d), q + "up_proj.weight": (width, d),
                       q + "down_proj.weight": (d, width)}
    return shapes


def draw(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """Tensor ``name``: ones for norm weights, else N(0, 1/shape[-1]), drawn on ``device``."""
    if name.endswith(_NORM_SUFFIXES):
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
    t = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    return t.mul_(shape[-1] ** -0.5).to(dtype)


class RandomWeights:
    """Checkpoint reader (``has`` / ``get`` / ``names``) that draws tensors on demand.

    ``get`` returns the tensor already in ``dtype`` on ``device`` (the loader's ``.to`` is
    then a no-op). Raises ValueError for a name the config does not imply.
    """

    def __init__(self, path: str | Path, dtype: torch.dtype, device: torch.device) -> None:
        path = Path(path)
        self.path, self.dtype, self.device = path, dtype, torch.device(device)
        try:
            self.seed = int(json.loads((path / MARKER).read_text())["seed"])
            self._shapes = tensor_shapes(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"model: {path} is not a valid random checkpoint ({MARKER} + config.json): {e}") from e

    def names(self) -> set[str]:
        return set(self._shapes)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def get(self, name: str) -> torch.Tensor:
        shape = self._shapes.get(name)
        if shape is None:
            raise ValueError(f"model: tensor {name!r} missing from the random checkpoint in {self.path}")
        return draw(name, shape, self.seed, self.dtype, self.device)


def open_checkpoint(path: str | Path, dtype: torch.dtype,
                    device: torch.device) -> CheckpointReader | RandomWeights:
    """The reader for checkpoint directory ``path``: random (drawn on ``device`` in
    ``dtype``) where :func:`is_random_checkpoint`, else the safetensors files."""
    if is_random_checkpoint(path):
        return RandomWeights(path, dtype, device)
    return CheckpointReader(path)
