"""megaserve.engine.gc_heap: a serving process's start-up heap out of the collector's scans
(the server and benches inside frozen_heap, spawned workers for good)."""

from __future__ import annotations

import gc
import subprocess
import sys

from megaserve import LLM, SamplingParams
from megaserve.engine.gc_heap import collections_during, frozen_heap


def _scanned(obj: object) -> bool:
    """Whether the cyclic collector's generations hold ``obj`` (frozen objects are in none)."""
    return any(o is obj for o in gc.get_objects())


def test_frozen_heap_keeps_the_engine_out_of_collections_until_exit() -> None:
    llm = LLM(model="builtin:tiny-moe", device="cpu", max_num_seqs=4, max_model_len=64)
    try:
        scheduler = llm.engine.scheduler
        assert _scanned(scheduler)
        with frozen_heap() as frozen:
            assert frozen > 0
            assert not _scanned(scheduler)
            # the engine keeps serving; what it allocates now is collected as usual
            out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                               SamplingParams(max_tokens=4, temperature=0.0))
            assert len(out[0].outputs[0].token_ids) == 4
            gc.collect()
            assert not _scanned(scheduler)
        assert gc.get_freeze_count() == 0 and _scanned(scheduler)
    finally:
        llm.shutdown()


def test_spawned_workers_freeze_their_heap_thread_workers_do_not() -> None:
    from megaserve.runtime.workers import settle_heap

    settle_heap("inproc")  # a thread in this process: nothing frozen here
    assert gc.get_freeze_count() == 0
    code = ("import gc; from megaserve.runtime.workers import settle_heap; "
            "settle_heap('tcp'); print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert int(out.stdout.split()[-1]) > 1000


def test_collections_during_counts_and_times_each_generations_passes() -> None:
    before = len(gc.callbacks)
    with collections_during() as passes:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect(1)  # after the body: not counted
    assert passes.count == [1, 0, 2]
    assert passes.seconds > 0
    assert len(gc.callbacks) == before  # its callback is gone
