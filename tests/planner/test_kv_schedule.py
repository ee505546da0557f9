"""Whole runs whose KV pool cannot hold every sequence: the scheduler's preemption replayed
(planner/kv_schedule.py) and its effect on the prediction of a measured run."""

from __future__ import annotations

import dataclasses

import pytest

from megaserve.planner import measurements
from megaserve.planner.catalog import DEFAULT_GPUS
from megaserve.planner.kv_schedule import schedule
from megaserve.planner.profile import load_profile

POOL_16GIB_48L = (16 << 30) // 98304  # KV slots of 16 GiB for Qwen3-30B-A3B at 48 layers (96 KiB a token)


def test_a_pool_that_holds_every_sequence_decodes_the_whole_batch():
    """256 sequences x 320 tokens fit 16 GiB: one prefill of all prompts, then 255 steps of 256."""
    plan = schedule(256, 256, 64, 256, 16384, POOL_16GIB_48L)
    assert plan.preemptions == 0
    assert plan.decode == ((256, 255),) and plan.prefill == ((16384, 1),)


def test_a_full_pool_preempts_and_recomputes():
    """1,024 sequences x 320 tokens need 1.9x the pool: the newest are preempted and their
    tokens prefilled again, so more steps decode fewer sequences and more tokens are prefilled."""
    plan = schedule(1024, 1024, 64, 256, 16384, POOL_16GIB_48L)
    steps = sum(n for _, n in plan.decode)
    decoded = sum(b * n for b, n in plan.decode)
    prefilled = sum(t * n for t, n in plan.prefill)
    assert plan.preemptions > 0 and steps > 255 and prefilled > 1024 * 64
    assert max(b for b, _ in plan.decode) == 1024
    assert decoded / steps < 0.7 * 1024  # mean decode batch
    assert 1024 * 255 - plan.preemptions <= decoded <= 1024 * 255  # each preemption's next token comes from a prefill
    with pytest.raises(ValueError, match="cannot hold one"):
        schedule(1, 1, 64, 256, 16384, 300)


def test_the_measured_pool_slows_the_predicted_whole_run():
    """The synchronous 1,024-prompt co-located run (16 GiB pool) is predicted slower than the
    same run with an unbounded pool, and within 15 % of its measurement only with the pool."""
    path = measurements.MEASUREMENTS_DIR / "h200-qwen3-30b-a3b-48l-disaggregation.json"
    run = next(r for r in measurements.load_runs([path])
               if r.step_ms is None and r.layout == "colocated" and r.num_prompts == 1024)
    assert run.kv_cache_memory_bytes == 16 << 30
    eff = load_profile("hopper").for_gpu("H200")
    pooled = measurements.predict(run, DEFAULT_GPUS["H200"], eff)
    unbounded = measurements.predict(dataclasses.replace(run, kv_cache_memory_bytes=None), DEFAULT_GPUS["H200"], eff)
    assert pooled.tok_s < 0.85 * unbounded.tok_s
    assert abs(pooled.tok_s / run.tok_s - 1) <= 0.15 < abs(unbounded.tok_s / run.tok_s - 1)
