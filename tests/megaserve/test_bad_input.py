"""Bad input → ValueError naming the field or file; nothing else is disturbed."""

from __future__ import annotations

import json
import shutil

import pytest

from megaserve import LLM, SamplingParams
from megaserve.engine.config import EngineConfig
from megaserve.models.builtin import resolve_model


@pytest.fixture(scope="module")
def llm():
    with LLM(dtype="float32", max_model_len=64) as llm:
        yield llm


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=-1), "logprobs"),
])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, field", [
    ("", "prompt"),
    ({"prompt_token_ids": []}, "prompt"),
    ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids"),
    ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
    ({"prompt_token_ids": list(range(64))}, "max_model_len"),
    (42, "prompt"),
])
def test_bad_prompts_raise_and_queue_nothing(llm, prompt, field):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=field):
        llm.generate([good, prompt], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_other_requests_keep_running_after_a_rejected_one(llm):
    params = SamplingParams(max_tokens=6, temperature=0)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0]
    engine = llm.engine
    engine.add_request("good", [5, 6, 7], params)
    engine.step()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("bad", [10**6], params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good", [1], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_sampling_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM(model="/no/such/model")
    with pytest.raises(ValueError, match="builtin:nope"):
        LLM(model="builtin:nope")


@pytest.fixture()
def builtin_copy(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(resolve_model("builtin:tiny-moe"), path)
    return path


def test_corrupt_safetensors_names_the_file(builtin_copy):
    weights = builtin_copy / "model.safetensors"
    weights.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(model=str(builtin_copy))


def test_truncated_safetensors_names_the_file(builtin_copy):
    weights = builtin_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(model=str(builtin_copy))


def test_unsupported_architecture_is_named(builtin_copy):
    config = json.loads((builtin_copy / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (builtin_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(model=str(builtin_copy))


def test_malformed_config_names_the_file(builtin_copy):
    (builtin_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(builtin_copy))


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=-16), "block_size"),
    (dict(transport="carrier-pigeon"), "transport"),
    (dict(dtype="float8"), "dtype"),
])
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        if "dtype" in kwargs:
            LLM(**kwargs)
        else:
            EngineConfig(**kwargs)
