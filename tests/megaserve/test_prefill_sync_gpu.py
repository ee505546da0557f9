"""GPU, bf16: engine steps of chunked prefills mixed with decodes make no stream
synchronisation (CUDA's sync debug mode set to "error" raises on any), with and without
async scheduling, and give the same outputs as an engine run without the debug mode.

The eager steps' inputs go through pinned staging with one non-blocking copy, the sampler
reads its parameters from host tensors, and the host waits for tokens on events only
(an event wait is not a stream synchronisation: with async scheduling that wait is for
the step before, without it for the step itself). A pageable copy, a ``.tolist()`` or
``.item()`` of a device tensor anywhere in a step makes these tests fail.

Run: ``pytest -m gpu tests/megaserve/test_prefill_sync_gpu.py``
"""

from __future__ import annotations

import random

import pytest
import torch

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.engine.model_runner import EagerStep
from megaserve.sampling_params import SamplingParams
from tests.megaserve.test_async_scheduling import _final, _run

pytestmark = pytest.mark.gpu


def _engine(async_scheduling: bool) -> LLMEngine:
    # Small token budget: prompts of up to 120 tokens prefill in chunks, several requests
    # share a step, and requests arriving later mix with others' decode rows. No prefix
    # caching, so the warm-up's steps have exactly the timed steps' shapes.
    return LLMEngine(EngineConfig(dtype="bfloat16", device="cuda", max_model_len=256,
                                  max_num_seqs=8, max_num_batched_tokens=48,
                                  num_kv_blocks=200, enable_prefix_caching=False,
                                  async_scheduling=async_scheduling))


def _arrivals(vocab: int, tag: str, seed: int) -> list:
    """Requests of fixed lengths and parameters (the schedule depends on those only),
    random tokens from ``seed``: greedy and seeded top-k / top-p sampling."""
    rng, shapes = random.Random(seed), random.Random(0)
    arrivals = []
    for i in range(6):
        sampled = i % 2 == 1
        params = SamplingParams(max_tokens=6, temperature=0.8 if sampled else 0.0,
                                top_k=5 if i == 1 else 0, top_p=0.9 if i == 3 else 1.0,
                                seed=i, ignore_eos=True)
        length = shapes.randrange(20, 120)
        arrivals.append((shapes.randrange(4), f"{tag}{i}",
                         [rng.randrange(vocab) for _ in range(length)], params))
    return arrivals


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefill_and_mixed_steps_do_not_synchronise(async_scheduling: bool) -> None:
    engine = _engine(async_scheduling)
    engine.runner.capture_decode_graphs()  # capture synchronises: not inside the window
    _run(engine, _arrivals(engine.vocab_size, "warm", 1))  # compiles the steps' shapes
    launch, stats = engine.runner.launch, {"eager": 0, "multi": 0, "chunk": 0, "ahead": 0}

    def counted(scheduled):
        stats["eager"] += 1
        stats["multi"] += len(scheduled) > 1
        stats["chunk"] += any(not s.samples for s in scheduled)
        return launch(scheduled)

    engine.runner.launch = counted
    step = engine.step

    def stepped():
        outputs = step()
        stats["ahead"] += isinstance(engine._inflight, EagerStep)
        return outputs

    engine.step = stepped
    arrivals = _arrivals(engine.vocab_size, "r", 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _final(_run(engine, arrivals))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _final(_run(_engine(False), arrivals))
    assert got == want
    assert stats["eager"] >= 5 and stats["multi"] >= 2 and stats["chunk"] >= 2, stats
    assert engine.runner.decode_graphs.num_steps > 0
    if async_scheduling:
        assert stats["ahead"] >= stats["eager"] - 1, stats
