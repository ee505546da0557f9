"""DeepSeek-V3 family (MLA, sigmoid group-limited routing, shared experts, dense first
layers, YaRN) against HF transformers on CPU, float32, and its batch invariance.

MLA runs in the weight-absorbed form for prefill and decode alike (megaserve.models.mla),
HF in the expanded form: the two differ by float32 rounding only, within LOGPROB_TOL.
"""

from __future__ import annotations

import json

import pytest
import torch

from megaserve import LLM, SamplingParams
from megaserve.models.config import ModelConfig
from tests.megaserve.hf_models import DEEPSEEK_VARIANTS, make_deepseek_checkpoint

STEPS = 24
LOGPROB_TOL = 1e-4
TIE_MARGIN = 1e-4


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_deepseek_checkpoint(path, **DEEPSEEK_VARIANTS[request.param])
    return path, model


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 9, 33)]


def test_greedy_and_logprobs_match_transformers(checkpoint):
    path, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    with LLM(model=str(path), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    compared = 0
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == STEPS
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].double(), -1)
        for i in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[i][prompt[i]] - ref[i - 1, prompt[i]].item()) < LOGPROB_TOL
        for step, token in enumerate(tokens):
            row = ref[len(prompt) - 1 + step]
            assert abs(out.outputs[0].logprobs[step][token] - row[token].item()) < LOGPROB_TOL
            top2 = torch.topk(row, 2)
            if (top2.values[0] - top2.values[1]).item() < TIE_MARGIN:
                break
            assert token == top2.indices[0].item(), f"step {step}: greedy token differs"
            compared += 1
    assert compared >= 16, "too few steps compared: the test model is degenerate"


# Batch invariance, bitwise: a request's tokens and logprobs are the same alone, in a crowd
# that arrives at random steps, in prefill chunks of another size, and on a prefix-cache hit.

def _engine(path, **overrides):
    from megaserve.engine.config import EngineConfig
    from megaserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), dtype="float32", max_model_len=160,
                                  max_num_seqs=16, **overrides))


def _run(engine, arrivals):
    pending, done, step = sorted(arrivals, key=lambda a: a[0]), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert engine.pool.num_free == engine.pool.num_blocks
    return done


def _crowd(rng, vocab: int, target: list[int], params: SamplingParams) -> list[tuple]:
    """``target`` arriving at a random early step among nine other requests (random prompts,
    lengths, arrival steps, greedy or seeded sampling), as ``_run``'s arrivals."""
    arrivals = [(rng.randrange(4), "target", target, params)]
    for i in range(9):
        other = SamplingParams(max_tokens=rng.randrange(1, 10), temperature=rng.choice([0.0, 0.9]),
                               seed=rng.randrange(100), ignore_eos=True)
        arrivals.append((rng.randrange(6), f"other-{i}",
                         [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))], other))
    return arrivals


def _signature(out):
    c = out.outputs[0]
    return c.token_ids, [sorted(d.items()) for d in c.logprobs]


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-invariance")
    make_deepseek_checkpoint(path, **DEEPSEEK_VARIANTS["deepseek-qlora-yarn-groups"])
    return path


def test_latent_cache_is_one_tensor_per_layer(deepseek_path):
    engine = _engine(deepseek_path, enable_prefix_caching=False)
    config = ModelConfig.from_dir(deepseek_path)
    k, v = engine.runner.kv_caches[0]
    assert k is v
    assert k.shape[2:] == (1, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim)


def test_alone_crowded_chunked_and_cached_are_bitwise_equal(deepseek_path):
    import random

    rng = random.Random(5)
    vocab = json.loads((deepseek_path / "config.json").read_text())["vocab_size"]
    target = [rng.randrange(vocab) for _ in range(45)]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    alone = _run(_engine(deepseek_path, enable_prefix_caching=False),
                 [(0, "target", target, params)])["target"]
    arrivals = _crowd(rng, vocab, target, params)
    for budget in (23, 64):
        engine = _engine(deepseek_path, max_num_batched_tokens=budget)
        crowded = _run(engine, arrivals)["target"]
        assert _signature(crowded) == _signature(alone), f"budget {budget}"
        # The same prompt again: its first full blocks come from the prefix cache.
        again = _run(engine, [(0, "again", target, params)])["again"]
        assert again.num_cached_tokens >= 32
        assert _signature(again) == _signature(alone)


@pytest.mark.parametrize("change, field", [
    (dict(kv_lora_rank=None), "kv_lora_rank"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(num_experts_per_tok=7), "num_experts_per_tok"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "rope_type"),
    (dict(v_head_dim=20), "kv_b_proj"),  # the config no longer matches the tensors
])
def test_inconsistent_config_is_refused_naming_the_field(deepseek_path, tmp_path, change, field):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(deepseek_path, path)
    config = json.loads((path / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field) as info:
        LLM(model=str(path), dtype="float32")
    assert "\n" not in str(info.value)


def test_fp8_deepseek_checkpoint_matches_dequantized_transformers(tmp_path):
    """DeepSeek's own block-FP8 layout (e4m3 projections incl. kv_a_proj_with_mqa and the
    experts, float32 router) against HF on the dequantized weights."""
    import shutil

    from safetensors.torch import save_file

    from tests.megaserve.hf_models import write_fp8_checkpoint

    src, dst, deq = tmp_path / "bf", tmp_path / "fp8", tmp_path / "deq"
    model = make_deepseek_checkpoint(src, seed=2, **DEEPSEEK_VARIANTS["deepseek-qlora-yarn-groups"])
    reference = write_fp8_checkpoint(src, dst, (16, 16))
    deq.mkdir()
    save_file(reference, str(deq / "model.safetensors"))
    shutil.copy(src / "config.json", deq / "config.json")
    hf = type(model).from_pretrained(deq, dtype=torch.float32).eval()
    prompt = _prompts(hf.config.vocab_size)[2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(model=str(dst), dtype="float32") as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].double(), -1)
    for step, token in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + step]
        assert abs(out.logprobs[step][token] - row[token].item()) < LOGPROB_TOL
        top2 = torch.topk(row, 2)
        if (top2.values[0] - top2.values[1]).item() < TIE_MARGIN:
            break
        assert token == top2.indices[0].item()


def test_speculative_decoding_and_disaggregated_layouts_are_bitwise_equal(deepseek_path):
    """Greedy with n-gram speculation (multi-token verification steps through MLA) and a
    disaggregated layout (2 attention replicas, 2 expert workers): the single engine's bits."""
    prompts = [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 2, [11] * 20]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model=str(deepseek_path), dtype="float32", enable_prefix_caching=False) as llm:
        ref = [_signature(o) for o in llm.generate(inputs, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with LLM(model=str(deepseek_path), dtype="float32", speculative_config=spec) as llm:
        assert [_signature(o) for o in llm.generate(inputs, params)] == ref
    with LLM(model=str(deepseek_path), dtype="float32", attention_replicas=2, expert_workers=2,
             transport="inproc") as llm:
        assert [_signature(o) for o in llm.generate(inputs, params)] == ref


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_colocated_ep_and_disaggregated_layouts_equal_one_engine(deepseek_path, quantization):
    """The family through the runtime's layouts, in bf16-class float32 weights and block-FP8
    (``quantization="fp8"``, dequantized on CPU): co-located EP over 2 ranks and 2 attention
    replicas : 3 expert workers at m = 2 give the one engine's token ids and logprobs bitwise
    (greedy and seeded); the shared experts and dense layers stay on the attention side."""
    prompts = [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 2, [11] * 20, [2, 7]]
    params = [SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, seed=4, logprobs=1, ignore_eos=True)] * 2
    inputs = [{"prompt_token_ids": p} for p in prompts]
    common = dict(model=str(deepseek_path), dtype="float32", quantization=quantization)
    with LLM(**common) as llm:
        ref = [_signature(o) for o in llm.generate(inputs, params)]
    layouts = [dict(data_parallel_size=2, enable_expert_parallel=True, transport="inproc"),
               dict(attention_replicas=2, expert_workers=3, microbatches=2, transport="inproc")]
    for layout in layouts:
        with LLM(**common, **layout) as llm:
            assert [_signature(o) for o in llm.generate(inputs, params)] == ref, layout


def test_sigmoid_group_routing_is_row_invariant_and_matches_reference():
    from megaserve import kernels

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(301, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.1
    ids, weights = kernels.sigmoid_topk_route(logits, bias, 3, 4, 2, True, 2.5)
    for start, n in ((0, 1), (3, 2), (10, 17), (100, 201)):
        sub_ids, sub_w = kernels.sigmoid_topk_route(logits[start:start + n], bias, 3, 4, 2, True, 2.5)
        assert torch.equal(sub_ids, ids[start:start + n]) and torch.equal(sub_w, weights[start:start + n])
    # float64 reference of the rule (HF's DeepseekV3TopkRouter)
    scores = logits.double().sigmoid()
    choice = scores + bias.double()
    group = choice.view(-1, 4, 4).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(2, dim=-1).indices, 1).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(4, 1), float("-inf"))
    ref_ids = choice.topk(3, dim=-1).indices
    ref_w = scores.gather(1, ref_ids)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * 2.5
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(weights.double(), ref_w, rtol=1e-6, atol=0)
    # ties go to the lower expert id
    tie_ids, _ = kernels.sigmoid_topk_route(torch.zeros(2, 16), None, 3, 4, 2, False, 1.0)
    assert tie_ids.tolist() == [[0, 1, 2]] * 2


@pytest.mark.parametrize("width", [1, 8, 256])
def test_sigmoid_rows_bits_do_not_depend_on_the_batch(width):
    """DeepSeek's router scores and Qwen2-MoE's shared-expert gate ([T, 1]): torch's CPU
    sigmoid of the whole batch differs from the row alone in the last bit for tail rows."""
    from megaserve.kernels.grouped_topk import sigmoid_rows

    x = torch.randn(1000, width, generator=torch.Generator().manual_seed(width))
    full = sigmoid_rows(x)
    assert torch.allclose(full, x.sigmoid(), rtol=1e-6, atol=0)
    for i in range(0, 1000, 7):
        assert torch.equal(sigmoid_rows(x[i:i + 1]), full[i:i + 1]), f"row {i}"
