"""Built-in models, generated deterministically on first use: ``builtin:tiny-moe``.

``resolve_model`` turns a model name into a checkpoint directory. ``builtin:tiny-moe`` is a
random Qwen3-MoE checkpoint (HF layout: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json; about 2 MB) written once into a cache
directory (``$MEGASERVE_CACHE``, else ``~/.cache/megaserve``) and then loaded like any other.

Determinism: every byte follows from the code. The tokenizer's merges are learnt from a
corpus hard-coded below by a byte-pair-encoding training loop with fixed tie-breaking; the
weights come from the raw 64-bit stream of numpy's PCG64 (a stream numpy keeps stable
across versions) turned into approximately normal floats with IEEE arithmetic only (sum of
4 uniforms; no transcendental functions that could differ between libms).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
# Bump the version when anything generated changes: the cache dir name carries it.
BUILTIN_MODELS = {"tiny-moe": "v1"}
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_MOE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # deliberately != hidden_size / num_attention_heads
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "eos_token_id": 509,  # <|endoftext|>
}
WEIGHT_SEED = 20240601
EMBED_STD = 1.0
# Projections get std = PROJ_GAIN / sqrt(fan_in), so activations keep unit scale through the
# residual stream; a flat 0.02 made the router and the logits nearly uniform (every expert
# and token almost tied), which makes greedy decoding a chain of near ties.
PROJ_GAIN = 1.0
ROUTER_GAIN = 2.0

# Merges are learnt from this text; ChatML words are in it so chat prompts tokenize short.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model sends every token
to a few of its experts, chosen by a router, and adds their outputs weighted by the router's
probabilities. Attention workers keep the key and value cache of every request; expert
workers hold the experts of every layer. The server streams the generated text back to the
client token by token, and it never sends half of a character.
Hello, world! How are you today? I am fine, thank you. What is the weather like in the city?
It is sunny and warm, with a light wind from the west. Tomorrow there will be rain.
Once upon a time there was a little robot that wanted to learn how to write stories. Every
morning it read a book, and every evening it wrote a page of its own. The other robots
laughed at first, but after a year the little robot had written a whole book.
system user assistant <|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Tell me a story about the sea.<|im_end|>
<|im_start|>assistant
The sea was calm and the sun was setting when the ship came into the harbour.
def generate(prompt, max_tokens=16, temperature=0.0):
    tokens = tokenizer.encode(prompt)
    for step in range(max_tokens):
        logits = model(tokens)
        tokens.append(int(logits.argmax()))
    return tokenizer.decode(tokens)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2048 4096 2024 2025.
The scheduler admits new requests while free blocks remain, runs prefills and decodes in
one step, and preempts the newest request when the cache is full. Results are the same
whatever else is running, because every kernel reduces in a fixed order.
"""
_PRETOKENIZE = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level map: every byte to a printable character (as ByteLevel expects)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _learn_merges(num_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE training on _CORPUS until the vocabulary has ``num_tokens`` entries.

    Ties between equally frequent pairs go to the lexicographically smallest pair, so the
    result is a pure function of the corpus.
    """
    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    words = Counter(
        tuple(byte_map[b] for b in piece.encode("utf-8")) for piece in _PRETOKENIZE.findall(_CORPUS)
    )
    merges: list[tuple[str, str]] = []
    while len(vocab) < num_tokens:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            raise RuntimeError("BPE corpus too small for the requested vocabulary")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(best)
        vocab.setdefault(merged, len(vocab))
        new_words: Counter[tuple[str, ...]] = Counter()
        for word, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += freq
        words = new_words
    return vocab, merges


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    """A byte-level BPE ``tokenizer.json`` (as a dict) whose last ids are SPECIAL_TOKENS."""
    vocab, merges = _learn_merges(vocab_size - len(SPECIAL_TOKENS))
    added = [
        {
            "id": len(vocab) + n,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for n, content in enumerate(SPECIAL_TOKENS)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """float32 ``shape`` array, mean 0 and std ``std``, from the raw PCG64 stream.

    Irwin-Hall with 4 uniforms (bounded at ±3.46 std): only integer ops, exact scaling by
    powers of two and IEEE additions, so the bits are the same on every platform.
    """
    n = int(np.prod(shape))
    raw = rng.bit_generator.random_raw(4 * n).reshape(4, n)
    u = (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53  # uniform [0, 1), exact
    z = ((u[0] + u[1]) + (u[2] + u[3]) - 2.0) * np.sqrt(3.0)  # var(sum of 4) = 1/3
    return (z * std).astype(np.float32).reshape(shape)


def tiny_moe_weights(config: dict[str, Any], seed: int = WEIGHT_SEED) -> dict[str, np.ndarray]:
    """Qwen3-MoE tensors in the Hub's per-expert layout, drawn in a fixed order.

    Shapes (D = hidden, H/K = query/KV heads, d = head_dim, E = experts, F = expert width,
    V = vocab): embed/lm_head [V, D]; q_proj [H*d, D]; k/v_proj [K*d, D]; o_proj [D, H*d];
    q/k_norm [d]; gate [E, D]; experts.{e}.gate/up_proj [F, D], down_proj [D, F]. float32.
    """
    rng = np.random.default_rng(seed)
    D, V = config["hidden_size"], config["vocab_size"]
    H, K, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E, F = config["num_experts"], config["moe_intermediate_size"]

    def proj(out_dim: int, in_dim: int, gain: float = PROJ_GAIN) -> np.ndarray:
        return _normal(rng, (out_dim, in_dim), gain / np.sqrt(in_dim))

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": _normal(rng, (V, D), EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(D)
        w[p + "self_attn.q_proj.weight"] = proj(H * d, D)
        w[p + "self_attn.k_proj.weight"] = proj(K * d, D)
        w[p + "self_attn.v_proj.weight"] = proj(K * d, D)
        w[p + "self_attn.o_proj.weight"] = proj(D, H * d)
        w[p + "self_attn.q_norm.weight"] = ones(d)
        w[p + "self_attn.k_norm.weight"] = ones(d)
        w[p + "post_attention_layernorm.weight"] = ones(D)
        w[p + "mlp.gate.weight"] = proj(E, D, ROUTER_GAIN)
        for e in range(E):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = proj(F, D)
            w[p + f"mlp.experts.{e}.up_proj.weight"] = proj(F, D)
            w[p + f"mlp.experts.{e}.down_proj.weight"] = proj(D, F)
    w["model.norm.weight"] = ones(D)
    w["lm_head.weight"] = proj(V, D)
    return w


def write_tiny_moe(directory: Path) -> None:
    """Write the complete ``builtin:tiny-moe`` checkpoint into existing ``directory``."""
    from safetensors.numpy import save_file

    config = TINY_MOE_CONFIG
    tok = tokenizer_json(config["vocab_size"])
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    if ids["<|endoftext|>"] != config["eos_token_id"] or len(tok["model"]["vocab"]) + len(ids) != config["vocab_size"]:
        raise RuntimeError("tiny-moe tokenizer and config disagree on the vocabulary")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }
    gen_config = {"eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]], "do_sample": False}

    def dump(name: str, obj: dict[str, Any]) -> None:
        (directory / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    dump("config.json", config)
    dump("tokenizer.json", tok)
    dump("tokenizer_config.json", tok_config)
    dump("generation_config.json", gen_config)
    save_file(tiny_moe_weights(config), str(directory / "model.safetensors"), metadata={"format": "pt"})


_GENERATORS = {"tiny-moe": write_tiny_moe}


def cache_root() -> Path:
    """``$MEGASERVE_CACHE`` if set, else ``~/.cache/megaserve``."""
    env = os.environ.get("MEGASERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megaserve"


def _builtin_names() -> str:
    return ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_MODELS)


def _materialize(name: str) -> Path:
    """The cached checkpoint directory of built-in ``name``, generating it if absent.

    NOTE: safe with concurrent callers: each writes a private temp dir next to the target and
    renames it into place; a loser of the race drops its copy and uses the winner's.
    """
    target = cache_root() / "builtin" / f"{name}-{BUILTIN_MODELS[name]}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _GENERATORS[name](tmp)
            try:
                os.rename(tmp, target)
                logger.info("generated %s%s into %s", BUILTIN_PREFIX, name, target)
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    missing = [f for f in CHECKPOINT_FILES if not (target / f).is_file()]
    if missing:
        raise ValueError(f"{target}: cached {BUILTIN_PREFIX}{name} lacks {missing}; delete the directory to regenerate it")
    return target


def resolve_model(name_or_path: str) -> Path:
    """Checkpoint directory for a model name: ``builtin:<name>`` or a local directory path.

    Raises ValueError naming the input and listing the built-in names for an unknown
    built-in or a path that is not an existing directory. Never downloads anything.
    """
    if name_or_path.startswith(BUILTIN_PREFIX):
        name = name_or_path[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {name_or_path!r}; built-in models: {_builtin_names()}")
        return _materialize(name)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {name_or_path!r} is not an existing directory (no downloads: give a local HF "
            f"checkpoint directory or a built-in model: {_builtin_names()})"
        )
    return path
