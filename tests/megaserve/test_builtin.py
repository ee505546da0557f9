"""builtin:tiny-moe: generation, determinism, concurrent first use, and loading by HF
transformers (the numerical reference) and by megaserve's Tokenizer."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from megaserve.models.builtin import CHECKPOINT_FILES, resolve_model
from megaserve.tokenizer import Tokenizer

# sha256 over (name, bytes) of every tensor in name order. A change here means every cached
# checkpoint and recorded result is stale: bump BUILTIN_MODELS' version with it.
WEIGHTS_SHA256 = "75715f1fe6a561bdc08b7ce162aaeb50912b0534af02c5fc222ff0fe0a5ef509"


def _generate(cache: Path, monkeypatch) -> Path:
    monkeypatch.setenv("MEGASERVE_CACHE", str(cache))
    return resolve_model("builtin:tiny-moe")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as m:
        return _generate(tmp_path_factory.mktemp("cache"), m)


def _tensor_digest(directory: Path) -> str:
    tensors = load_file(str(directory / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].tobytes())
    return h.hexdigest()


def test_checkpoint_files_config_and_size(tiny_dir):
    assert tiny_dir.name == "tiny-moe-v1" and tiny_dir.parent.name == "builtin"
    assert sorted(os.listdir(tiny_dir)) == sorted(CHECKPOINT_FILES)
    assert sum((tiny_dir / f).stat().st_size for f in CHECKPOINT_FILES) < 4 * 2**20
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (64, 4, 2, 32)
    assert (config["num_experts"], config["num_experts_per_tok"], config["num_hidden_layers"]) == (8, 2, 3)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    assert tensors["model.layers.2.self_attn.q_proj.weight"].shape == (128, 64)
    assert tensors["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert len(tensors) == 3 + 3 * (9 + 3 * 8)


def test_generation_is_deterministic_and_pinned(tiny_dir, tmp_path, monkeypatch):
    other = _generate(tmp_path / "second", monkeypatch)
    assert other != tiny_dir
    for name in CHECKPOINT_FILES:
        assert (other / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert _tensor_digest(tiny_dir) == WEIGHTS_SHA256


def test_existing_cache_is_reused_not_regenerated(tiny_dir, monkeypatch):
    monkeypatch.setenv("MEGASERVE_CACHE", str(tiny_dir.parent.parent))
    marker = tiny_dir / "generation_config.json"
    before = marker.stat().st_mtime_ns
    assert resolve_model("builtin:tiny-moe") == tiny_dir
    assert marker.stat().st_mtime_ns == before


def _resolve_in_child(cache: str, barrier, queue) -> None:
    os.environ["MEGASERVE_CACHE"] = cache
    barrier.wait()
    queue.put(str(resolve_model("builtin:tiny-moe")))


def test_concurrent_first_use_from_several_processes(tiny_dir, tmp_path):
    ctx = mp.get_context("spawn")
    n = 4
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_resolve_in_child, args=(str(tmp_path), barrier, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)  # spawned processes import torch: slow on a loaded box
    assert [p.exitcode for p in procs] == [0] * n
    paths = {queue.get(timeout=5) for _ in range(n)}
    assert len(paths) == 1
    result = Path(paths.pop())
    assert os.listdir(result.parent) == [result.name]  # no temp dirs left behind
    for name in CHECKPOINT_FILES:
        assert (result / name).read_bytes() == (tiny_dir / name).read_bytes()


def test_bad_names_raise_value_error_listing_builtins(tmp_path):
    with pytest.raises(ValueError, match=r"builtin:nope.*builtin:tiny-moe"):
        resolve_model("builtin:nope")
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=r"no-such-model.*builtin:tiny-moe"):
        resolve_model(str(missing))
    assert resolve_model(str(tmp_path)) == tmp_path


def test_megaserve_tokenizer_round_trips_and_matches_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_dir(tiny_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    for text in ["Hello, world!", "The sea was calm 😀 héllo", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return 42"]:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "Tell me a story."}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert hf.eos_token_id == ours.eos_token_ids[0]


def test_transformers_loads_checkpoint_and_output_is_not_degenerate(tiny_dir):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    state = model.state_dict()
    for name in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight", "model.layers.2.mlp.gate.weight"]:
        assert torch.equal(state[name], torch.from_numpy(tensors[name])), name
    # Expert weights: transformers fuses them on load; compare expert 5 of layer 1 either way.
    fused = [k for k in state if k.startswith("model.layers.1.mlp.experts.") and "gate_up" in k]
    if fused:
        g, u = (torch.from_numpy(tensors[f"model.layers.1.mlp.experts.5.{p}_proj.weight"]) for p in ("gate", "up"))
        assert torch.equal(state[fused[0]][5], torch.cat([g, u]))
    else:
        assert torch.equal(state["model.layers.1.mlp.experts.5.gate_proj.weight"], torch.from_numpy(tensors["model.layers.1.mlp.experts.5.gate_proj.weight"]))

    tok = Tokenizer.from_dir(tiny_dir)
    ids = torch.tensor([tok.encode("Once upon a time there was a robot that read a book every morning.")])
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    assert torch.isfinite(out.logits).all()
    for router_logits in out.router_logits:  # every layer spreads tokens over most experts
        assert len(set(router_logits.topk(2, dim=-1).indices.flatten().tolist())) >= 6
    continuations = set()
    for prompt in ["Hello, world", "The sea was", "def generate(", "1 2 3"]:
        prompt_ids = torch.tensor([tok.encode(prompt)])
        gen = model.generate(prompt_ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt_ids))
        continuations.add(tuple(gen[0, prompt_ids.shape[1] :].tolist()))
    assert len(continuations) == 4  # greedy text depends on the prompt


def test_losing_the_rename_race_keeps_the_winner(tmp_path, monkeypatch):
    """Force the interleaving: another writer finishes while this one is generating."""
    from megaserve.models import builtin

    real = builtin._GENERATORS["tiny-moe"]
    target = tmp_path / "builtin" / "tiny-moe-v1"

    def slow_writer(directory: Path) -> None:
        target.mkdir()
        real(target)
        (target / "winner").write_text("first")
        real(directory)

    monkeypatch.setitem(builtin._GENERATORS, "tiny-moe", slow_writer)
    assert _generate(tmp_path, monkeypatch) == target
    assert (target / "winner").read_text() == "first"
    assert os.listdir(target.parent) == [target.name]
