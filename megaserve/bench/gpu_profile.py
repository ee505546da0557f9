"""Where a step's time goes: a torch.profiler Chrome trace reduced to a few numbers.

:func:`summarize_trace` reads the trace ``torch.profiler`` exports (``export_chrome_trace``)
of steps each wrapped in ``record_function(STEP_LABEL)`` and returns, over the window from
the first step's start to the end of the last step's GPU work:

* ``gpu_busy_fraction``: union of GPU activity (kernels, memcpy, memset) / window;
* ``host_gaps``: the intervals inside the window where the GPU runs nothing (waiting for
  the host), their count and total per step, and the largest;
* ``top_kernels``: GPU time by kernel name (per step, share of GPU busy time);
* ``runtime_calls``: CUDA runtime/driver calls by name (count and host time per step):
  stream synchronisations and copies show up here.

Pure Python on the JSON, so it is tested on CPU with a synthetic trace.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

STEP_LABEL = "megaserve.decode_step"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
GAP_THRESHOLD_US = 10.0  # idle intervals shorter than this are launch latency, not counted as gaps


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for start, stop in sorted(intervals):
        start, stop = max(start, end), min(stop, hi)
        if stop > start:
            total += stop - start
            end = stop
    return total


def idle_gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[float]:
    """Lengths of the idle stretches in [lo, hi] not covered by ``intervals``, in order."""
    gaps, end = [], lo
    for start, stop in sorted(intervals):
        if start > end:
            gaps.append(min(start, hi) - end)
        end = max(end, stop)
        if end >= hi:
            break
    if end < hi:
        gaps.append(hi - end)
    return [g for g in gaps if g > 0]


def summarize_trace(trace: dict | str | Path, num_top: int = 12, max_steps: int | None = None) -> dict:
    """Summary of a Chrome trace (dict or path) of steps labelled :data:`STEP_LABEL`;
    ``max_steps``: only the first that many steps (the window ends where the next begins).

    Raises ValueError when the trace has no labelled step or no GPU activity inside one.
    """
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("name") == STEP_LABEL and e.get("cat") == "user_annotation")
    if not steps:
        raise ValueError(f"profile: no '{STEP_LABEL}' annotations in the trace")
    end = float("inf")
    if max_steps is not None and max_steps < len(steps):
        end, steps = steps[max_steps][0], steps[:max_steps]
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events
           if e.get("cat") in GPU_CATEGORIES and steps[0][0] <= float(e["ts"]) < end]
    if not gpu:
        raise ValueError("profile: no GPU activity after the first step started")
    lo, hi = steps[0][0], max(steps[-1][1], max(stop for _, stop, _ in gpu))
    spans = [(start, stop) for start, stop, _ in gpu]
    busy = union_length(spans, lo, hi)
    gaps = [g for g in idle_gaps(spans, lo, hi) if g >= GAP_THRESHOLD_US]
    n = len(steps)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for start, stop, e in gpu:
        entry = by_kernel[e.get("name", "?")[:100]]
        entry[0] += stop - start
        entry[1] += 1
    kernel_total = sum(v[0] for v in by_kernel.values())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:num_top]
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in RUNTIME_CATEGORIES and lo <= float(e["ts"]) <= hi:
            entry = runtime[e["name"]]
            entry[0] += float(e["dur"])
            entry[1] += 1
    return {
        "steps": n,
        "window_us_per_step": (hi - lo) / n,
        "step_wall_us": [stop - start for start, stop in steps],
        "gpu_busy_us_per_step": busy / n,
        "gpu_busy_fraction": busy / (hi - lo),
        "gpu_kernel_us_per_step": kernel_total / n,
        "host_gaps": {"threshold_us": GAP_THRESHOLD_US, "count_per_step": len(gaps) / n,
                      "total_us_per_step": sum(gaps) / n, "largest_us": max(gaps, default=0.0)},
        "top_kernels": [{"name": name, "us_per_step": t / n, "calls_per_step": c / n,
                         "share_of_gpu_time": t / kernel_total if kernel_total else 0.0}
                        for name, (t, c) in top],
        "runtime_calls": [{"name": name, "us_per_step": t / n, "calls_per_step": c / n}
                          for name, (t, c) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:8]],
    }
