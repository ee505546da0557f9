"""Random-weight models with the layer shapes of real MoE models, for benchmarks.

``random:<preset>:<layers>`` (e.g. ``random:qwen3-30b-a3b:48``) names a checkpoint with the
preset's per-layer dimensions and ``layers`` layers. Two materialisations:

* ``weights="device"`` (default): a directory with ``config.json`` and the random-weights
  marker only; the loader draws every tensor directly on the engine's device
  (megaserve.models.random_weights). Nothing large touches the disk: 48 layers of
  Qwen3-30B-A3B appear on a GPU in seconds.
* ``weights="file"``: a safetensors checkpoint written once into the cache directory (what
  tools that read the files themselves need; 16 layers took ~150 s to write).

Weights are small random numbers (norms 1, matrices N(0, 1/fan_in)): speed is realistic,
text is not. The preset dimensions come from the models' public config.json files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Per-layer dimensions from the models' public config.json files. "architecture" decides
# the tensor names (Mixtral: block_sparse_moe.experts.{e}.w1|w3|w2, no q/k norms).
PRESETS = {
    "qwen3-30b-a3b": dict(architecture="Qwen3MoeForCausalLM", hidden_size=2048, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, vocab_size=151936, rope_theta=1e6),
    "qwen3-235b-a22b": dict(architecture="Qwen3MoeForCausalLM", hidden_size=4096, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536, vocab_size=151936, rope_theta=1e6),
    # DeepSeek-V3 (Kimi-K2 shares the architecture): MLA, 256 routed experts + 1 shared,
    # group-limited sigmoid routing, 3 dense first layers, YaRN to 160k positions.
    "deepseek-v3": dict(architecture="DeepseekV3ForCausalLM", hidden_size=7168, num_attention_heads=128,
                        num_key_value_heads=128, num_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=2048, vocab_size=129280, rope_theta=10000.0,
                        intermediate_size=18432, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, n_shared_experts=1, n_group=8, topk_group=4,
                        first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "mixtral-8x7b": dict(architecture="MixtralForCausalLM", hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=14336, vocab_size=32000, rope_theta=1e6),
}
# Earlier name of the Mixtral shape (then in Qwen3-MoE's layout); same dimensions.
PRESETS["mixtral-8x7b-like"] = PRESETS["mixtral-8x7b"]
FULL_DEPTH = {"qwen3-30b-a3b": 48, "qwen3-235b-a22b": 94, "deepseek-v3": 61, "mixtral-8x7b": 32,
              "mixtral-8x7b-like": 32}
SEED = 0
WEIGHTS = ("device", "file")


def parse_random_name(name: str) -> tuple[str, int]:
    """(preset, layers) of ``random:<preset>:<layers>``; ValueError listing the presets."""
    try:
        kind, preset, layers = name.split(":")
        num_layers = int(layers)
        if kind != "random" or preset not in PRESETS or num_layers <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"model: expected random:<preset>:<layers> (layers > 0) with preset in "
                         f"{sorted(PRESETS)}, got {name!r}") from None
    return preset, num_layers


def hf_config(preset: str, num_layers: int) -> dict:
    """The ``config.json`` of ``random:<preset>:<num_layers>`` (bf16; every layer MoE but
    DeepSeek-V3's dense first layers)."""
    dims = dict(PRESETS[preset])
    arch = dims.pop("architecture")
    if arch == "DeepseekV3ForCausalLM":
        return dict(architectures=[arch], model_type="deepseek_v3", num_hidden_layers=num_layers,
                    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    torch_dtype="bfloat16", n_routed_experts=dims.pop("num_experts"), **dims)
    num_experts, inter = dims.pop("num_experts"), dims.pop("moe_intermediate_size")
    config = dict(architectures=[arch], num_hidden_layers=num_layers, max_position_embeddings=32768,
                  rms_norm_eps=1e-5 if arch == "MixtralForCausalLM" else 1e-6, tie_word_embeddings=False,
                  torch_dtype="bfloat16", **dims)
    if arch == "MixtralForCausalLM":
        return config | dict(model_type="mixtral", num_local_experts=num_experts, intermediate_size=inter)
    return config | dict(model_type="qwen3_moe", num_experts=num_experts, moe_intermediate_size=inter,
                         intermediate_size=4 * dims["hidden_size"], norm_topk_prob=True, mlp_only_layers=[],
                         decoder_sparse_step=1)


def cache_dir() -> Path:
    return Path(os.environ.get("MEGASERVE_CACHE", Path.home() / ".cache" / "megaserve")) / "random"


def resolve_random_model(name: str, weights: str = "device") -> Path:
    """Checkpoint directory of ``random:<preset>:<layers>``, created on first use.

    ``weights``: "device" (drawn by the loader on the engine's device; no weight files) or
    "file" (a safetensors checkpoint). ValueError for a bad name or ``weights``.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"random weights: expected one of {WEIGHTS}, got {weights!r}")
    preset, num_layers = parse_random_name(name)
    suffix = "-ondevice" if weights == "device" else ""
    path = cache_dir() / f"{preset}-{num_layers}l{suffix}"
    config = hf_config(preset, num_layers)
    if weights == "device":
        from megaserve.models.random_weights import MARKER

        _write_small(path, {"config.json": config, MARKER: {"seed": SEED, "init": "N(0, 1/fan_in), norms 1"}})
    elif not (path / "model.safetensors").is_file():
        _write_file(path, config)
    return path


def model_path(name: str, weights: str = "device") -> str:
    """What an engine's ``model`` should be for a benchmark's ``--model``: the checkpoint
    directory of a ``random:`` name (:func:`resolve_random_model`), else ``name`` itself."""
    return str(resolve_random_model(name, weights)) if name.startswith("random:") else name


def _write_small(path: Path, files: dict[str, dict]) -> None:
    """Write small JSON files (each atomically: concurrent callers write the same bytes)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, obj in files.items():
        tmp = path / f".{name}.{os.getpid()}"
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path / name)


def _write_file(path: Path, config: dict) -> None:
    """A safetensors checkpoint with the same tensors the device path draws (on CPU)."""
    import torch
    from safetensors.torch import save_file

    from megaserve.models.random_weights import draw, tensor_shapes

    path.mkdir(parents=True, exist_ok=True)
    cpu = torch.device("cpu")
    tensors = {name: draw(name, shape, SEED, torch.bfloat16, cpu)
               for name, shape in tensor_shapes(config).items()}
    save_file(tensors, str(path / "model.safetensors"))
    _write_small(path, {"config.json": config})
