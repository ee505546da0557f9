"""Kernel timelines of the runtime's processes, for benchmarks (never on in serving).

With ``$MEGASERVE_EXPERT_TRACE`` set to a folder, a benchmark opens a window by creating
``<folder>/start`` and closes it by removing the file. A process with a :class:`StepTrace`
checks for the file before each step: the steps it begins while the file exists run under
torch.profiler (every stream of the process: a co-located process's replica and expert
roles alike), and at its first step after the window the timeline goes to
``<folder>/<name>-<window>.json`` (chrome trace; ``lab/stream_busy.py`` summarises it).
"""

from __future__ import annotations

import os

TRACE_ENV = "MEGASERVE_EXPERT_TRACE"
START_FILE = "start"


class StepTrace:
    """One process's traced windows (module docstring); ``name`` names its files."""

    def __init__(self, trace_dir: str, name: str) -> None:
        self.trace_dir, self.name = trace_dir, name
        self._prof = None
        self.windows = 0

    @classmethod
    def from_env(cls, name: str) -> StepTrace | None:
        trace_dir = os.environ.get(TRACE_ENV)
        return cls(trace_dir, name) if trace_dir else None

    def before_step(self) -> None:
        """Open or close this process's window, as the start file says."""
        on = os.path.exists(os.path.join(self.trace_dir, START_FILE))
        if on and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.__enter__()
        elif not on and self._prof is not None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the window's last kernels are in the timeline
            self._prof.__exit__(None, None, None)
            self._prof.export_chrome_trace(
                os.path.join(self.trace_dir, f"{self.name}-{self.windows}.json"))
            self._prof = None
            self.windows += 1
