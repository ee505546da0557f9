"""Eager steps (prefill, mixed) split into launch and read (megaserve.engine.model_runner),
on CPU: the vectorised micro-batch arrays equal the per-token reference, and with async
scheduling eager steps run ahead of their tokens' read, take a token the host has not
read from the device, and give the synchronous engine's outputs bitwise.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.engine.model_runner import EagerStep, ModelRunner, PinnedStaging, micro_batch_arrays
from megaserve.sampling_params import SamplingParams
from tests.megaserve.test_async_scheduling import _final, _run


def _reference_arrays(inputs, block_size):
    """The per-token construction micro_batch_arrays replaces."""
    ids, positions, slots, context_lens, starts = [], [], [], [], [0]
    width = max(len(b) for _, _, b in inputs)
    for token_ids, begin, block_ids in inputs:
        end = begin + len(token_ids)
        ids += token_ids
        positions += range(begin, end)
        slots += [block_ids[p // block_size] * block_size + p % block_size for p in range(begin, end)]
        context_lens.append(end)
        starts.append(starts[-1] + len(token_ids))
    tables = [list(b) + [0] * (width - len(b)) for _, _, b in inputs]
    return [np.array(ids, np.int64), np.array(positions, np.int64), np.array(slots, np.int64),
            np.array(tables, np.int32).reshape(len(inputs), width),
            np.array(context_lens, np.int32), np.array(starts, np.int32)]


@pytest.mark.parametrize("seed", range(4))
def test_micro_batch_arrays_equal_the_per_token_reference(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    inputs = []
    for _ in range(rng.randrange(1, 9)):
        begin = rng.randrange(0, 70)
        num = rng.randrange(1, 40)
        blocks = rng.sample(range(1000), -(-(begin + num) // block_size) + rng.randrange(2))
        inputs.append(([rng.randrange(500) for _ in range(num)], begin, blocks))
    got = micro_batch_arrays(inputs, block_size)
    want = _reference_arrays(inputs, block_size)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(g, w)


def test_staging_on_cpu_is_the_arrays() -> None:
    arrays = [np.arange(5, dtype=np.int64), np.ones((2, 3), np.int32), np.zeros(0, np.float32)]
    tensors = PinnedStaging(torch.device("cpu")).to_device(arrays)
    for t, a in zip(tensors, arrays):
        assert t.shape == a.shape and np.array_equal(t.numpy(), a)


def _engine(async_scheduling: bool, **options) -> LLMEngine:
    config = dict(dtype="float32", device="cpu", max_model_len=160, max_num_seqs=8,
                  max_num_batched_tokens=24)
    return LLMEngine(EngineConfig(**config | options, async_scheduling=async_scheduling))


def _count_eager(engine: LLMEngine) -> dict[str, int]:
    """Wrap the runner: counts eager launches, those left in flight past their step, and
    eager input tokens taken from the device."""
    counts = {"launches": 0, "in_flight": 0, "fed": 0}
    runner, launch, group_inputs = engine.runner, engine.runner.launch, ModelRunner._group_inputs

    def counted_launch(scheduled):
        counts["launches"] += 1
        return launch(scheduled)

    def counted_inputs(group, rows):
        inputs, sources = group_inputs(group, rows)
        counts["fed"] += 0 if sources is None else int(np.sum(sources >= 0))
        return inputs, sources

    step = engine.step

    def counted_step():
        outputs = step()
        counts["in_flight"] += isinstance(engine._inflight, EagerStep)
        return outputs

    runner.launch, runner._group_inputs, engine.step = counted_launch, counted_inputs, counted_step
    return counts


def test_async_eager_steps_run_ahead_and_equal_sync() -> None:
    """Chunked prefills of several requests arriving while others decode (mixed steps):
    with async scheduling the eager steps stay in flight past their step, decode rows of
    mixed steps take their input from the device, and every output equals the
    synchronous engine's (greedy, seeded top-k, logprobs, prompt logprobs)."""
    rng = random.Random(3)
    sync, overlapped = _engine(False), _engine(True)
    counts = _count_eager(overlapped)
    arrivals = []
    for i in range(7):
        params = SamplingParams(max_tokens=rng.randrange(3, 12), temperature=rng.choice([0.0, 0.9]),
                                top_k=rng.choice([0, 5]), seed=i, ignore_eos=True,
                                logprobs=1 if i == 2 else None,
                                prompt_logprobs=1 if i == 4 else None)
        prompt = [rng.randrange(sync.vocab_size) for _ in range(rng.randrange(5, 60))]
        arrivals.append((rng.randrange(8), f"r{i}", prompt, params))
    want, got = _run(sync, arrivals), _run(overlapped, arrivals)
    assert _final(got) == _final(want)
    assert got["r4"][-1].prompt_logprobs == want["r4"][-1].prompt_logprobs
    assert len(want["r4"][-1].prompt_logprobs) == len(arrivals[4][2])
    assert counts["launches"] >= 8 and counts["in_flight"] >= 8, counts
    assert counts["fed"] >= 3, counts
    assert overlapped.stats().generation_tokens_total == sync.stats().generation_tokens_total
