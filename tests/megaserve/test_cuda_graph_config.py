"""Decode CUDA graphs, the parts that run on CPU: the config flag, the captured batch
sizes, and the padded static-buffer decode forward (``DecodeGraphs(capture=False)``, the
exact function a graph captures) against the eager engine, bitwise, in float32."""

from __future__ import annotations

import random

import pytest

from megaserve.engine.config import EngineConfig
from megaserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from megaserve.engine.engine import LLMEngine
from megaserve.sampling_params import SamplingParams
from tests.megaserve.test_batch_invariance import _run, crowd_arrivals

MAX_MODEL_LEN = 160


def test_cuda_graphs_flag_is_validated() -> None:
    assert EngineConfig().cuda_graphs is True
    assert EngineConfig(cuda_graphs=False).cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]
    with pytest.raises(ValueError):
        capture_sizes(0)


def _padded_engine(max_batch: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32))
    runner = engine.runner
    runner.decode_graphs = DecodeGraphs(
        runner.attention, runner.experts.experts, runner.kv_caches, runner.block_size,
        max_batch, MAX_MODEL_LEN, capture=False,
    )
    return engine


@pytest.mark.parametrize("scenario", range(2))
def test_padded_decode_forward_equals_eager(scenario: int) -> None:
    """Random concurrent requests (greedy and seeded; prompts crossing KV blocks): every
    request's tokens and logprobs equal the eager engine's when decode steps of up to 8
    sequences run the padded forward (sizes 1, 2, 4, 8: most batches get padding rows)."""
    eager = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32))
    padded = _padded_engine(max_batch=8)
    rng = random.Random(77 + scenario)
    target = [rng.randrange(eager.vocab_size) for _ in range(rng.randrange(14, 40))]
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, logprobs=2, ignore_eos=True)
    arrivals = crowd_arrivals(rng, eager.vocab_size, target, params, num_others=7)
    want = _run(eager, arrivals)
    got = _run(padded, arrivals)
    assert padded.runner.decode_graphs.num_steps > 5
    assert sorted(got) == sorted(want)
    for request_id in want:
        assert _outputs(got[request_id]) == _outputs(want[request_id]), request_id


def _outputs(out):
    c = out.outputs[0]
    return c.token_ids, c.logprobs, c.finish_reason
