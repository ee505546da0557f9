"""Python's cyclic garbage collector in a serving process.

A full (generation 2) collection scans every object the collector tracks. After an
engine is built that is ~170k objects on the built-in tiny model (more with a real one),
and a full pass paused a CPU decode loop of 256 sequences for 74 ms (a 110 ms gap between
two decode steps at batch 256 on an H100): once every ~100 steps, an
outlier in every inter-token-latency tail and ~2-5 ms of every back-to-back step on
average. ``gc.freeze()`` (vLLM and SGLang freeze after start-up too) moves the objects
alive at that point into a permanent generation the collector does not scan; the same
full pass then took 1.3 ms.

NOTE: frozen objects are never collected, so a process that builds and drops engines (the
tests, an offline ``LLM`` used as a library) would keep the dropped engines' reference
cycles. Only the code that owns a process's lifetime freezes: the server and the
benchmarks inside :func:`frozen_heap`, which unfreezes on exit, and a worker process that
serves until it exits with :func:`freeze_for_life`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


def _collect_and_freeze() -> int:
    """Collect, then freeze every object alive now; the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def frozen_heap() -> Iterator[int]:
    """Collect, then freeze every object alive now for the body; unfreeze after it.
    Yields the number of objects frozen."""
    frozen = _collect_and_freeze()
    try:
        yield frozen
    finally:
        gc.unfreeze()


def freeze_for_life() -> int:
    """Collect, then freeze every object alive now, for good: for a process that serves
    until it exits (a spawned worker), never for a thread in someone else's process.
    Returns the number of objects frozen."""
    return _collect_and_freeze()


@dataclass
class Collections:
    """The collector's passes in this process while :func:`collections_during` ran:
    ``count[g]`` passes of generation g, ``seconds`` their time together."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: float = 0.0


@contextmanager
def collections_during() -> Iterator[Collections]:
    """Counts and times the collector's passes in this process for the body (a bench's
    timed steps: a pass falls inside one step and lengthens it)."""
    seen = Collections()
    started: list[float] = []

    def on_pass(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            seen.seconds += time.perf_counter() - started.pop()
            seen.count[info["generation"]] += 1

    gc.callbacks.append(on_pass)
    try:
        yield seen
    finally:
        gc.callbacks.remove(on_pass)
