"""GPU, bf16, bitwise: async scheduling over captured decode CUDA graphs equals the
synchronous engine (greedy and seeded sampling, logprobs, stops, aborts, a cramped pool
that preempts), the next step's tokens really come from the device, and a greedy decode
step makes no stream synchronisation.

Run: ``pytest -m gpu tests/megaserve/test_async_scheduling_gpu.py``
"""

from __future__ import annotations

import random

import pytest
import torch

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.sampling_params import SamplingParams
from tests.megaserve.test_async_scheduling import (
    _count_device_fed_rows, _final, _run, _stop_arrivals)
from tests.megaserve.test_batch_invariance import crowd_arrivals

pytestmark = pytest.mark.gpu

MAX_MODEL_LEN = 160


def _engine(async_scheduling: bool, **overrides) -> LLMEngine:
    # An explicit pool: several engines share the GPU.
    overrides = {"num_kv_blocks": 400, **overrides}
    return LLMEngine(EngineConfig(dtype="bfloat16", device="cuda", max_model_len=MAX_MODEL_LEN,
                                  max_num_seqs=24, async_scheduling=async_scheduling,
                                  **overrides))


@pytest.mark.parametrize("scenario", range(4))
def test_cuda_async_equals_sync(scenario: int) -> None:
    """Random concurrent requests (greedy and seeded, top-k, logprobs; the last scenario
    on a cramped pool with chunked prefill and preemption): bitwise equal outputs with
    async scheduling on and off, decode steps on captured graphs fed from the device."""
    cramped = scenario == 3
    options = dict(max_num_batched_tokens=40, num_kv_blocks=14) if cramped else {}
    sync, overlapped = _engine(False, **options), _engine(True, **options)
    assert overlapped.async_scheduling
    fed = _count_device_fed_rows(overlapped)
    rng = random.Random(700 + scenario)
    target = [rng.randrange(sync.vocab_size) for _ in range(rng.randrange(10, 60))]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    arrivals = crowd_arrivals(rng, sync.vocab_size, target, params,
                              num_others=14 if cramped else rng.randrange(5, 20))
    want = _final(_run(sync, arrivals))
    got = _final(_run(overlapped, arrivals))
    assert got == want
    assert sum(fed) > 20, fed
    graphs = overlapped.runner.decode_graphs
    assert graphs.capture and graphs.num_steps >= 10 and graphs.captured_sizes


def test_cuda_async_stops_and_aborts() -> None:
    """EOS, stop token, stop strings and max_tokens end requests at the same token as
    the synchronous engine; an abort mid-decode frees its blocks."""
    sync, overlapped = _engine(False), _engine(True)
    prompt = [5, 17, 99, 3, 250, 41, 8]
    sync.add_request("ref", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    ref = _run(sync, [])["ref"][-1].outputs[0]
    eos = ref.token_ids[6]
    if eos in ref.token_ids[:6] or len(ref.text) <= 12 or not ref.text[8:11].strip():
        pytest.skip("the reference repeats its 7th token or its text is too short")
    for engine in (sync, overlapped):
        engine.outputs.eos_token_ids = frozenset({eos})
    arrivals = _stop_arrivals(sync, ref.token_ids, ref.text)
    assert _final(_run(overlapped, arrivals)) == _final(_run(sync, arrivals))
    got = _run(overlapped, arrivals, aborts={8: "long"})
    assert got["long"][-1].outputs[0].finish_reason == "abort"


def test_cuda_greedy_async_decode_step_does_not_synchronise() -> None:
    """Once the graphs are captured, greedy async decode steps run with CUDA's sync
    debug mode set to "error": no stream synchronisation (the token copy is waited for
    with an event, one step later)."""
    engine = _engine(True)
    for i in range(8):
        engine.add_request(f"r{i}", [3 + i] * (5 + i),
                           SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(6):  # prefill, then decode steps: the batch size's graph is captured
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            assert len(engine.step()) == 8
    finally:
        torch.cuda.set_sync_debug_mode("default")
