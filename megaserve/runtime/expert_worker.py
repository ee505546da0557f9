"""ExpertWorker: serves the experts it holds to every attention replica.

Two aggregation modes, chosen by the replicas (the frame header says which):

* **per layer** (``participants == 0``): the worker blocks for a dispatch frame, then
  gathers every frame that arrives within ``aggregation_wait_s`` (any replica, any
  micro-batch) and runs one grouped pass per layer over all their rows. It never waits for
  a particular replica, so idle replicas stall nobody.
* **lockstep** (``participants > 0``): every participating replica sends one frame (maybe
  empty) per (layer, micro-batch) tick; the worker runs the tick once all ``participants``
  frames are in, so each GEMM holds the tick's tokens of every replica.

An idle worker sleeps in ``poll``. Batch-invariant kernels make each row's result
independent of the grouping.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from megaserve.comm import CommTimeoutError, Completion, Endpoint
from megaserve.models.expert_part import ExpertPart
from megaserve.runtime.frames import (
    TAG_COMBINE, TAG_DISPATCH, decode_dispatch, encode_combine, frames_on_host,
)

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.2


@dataclass
class ExpertWorkerStats:
    frames: int = 0
    passes: int = 0  # grouped expert passes (one per layer per aggregated batch)
    gemms: int = 0  # (layer, expert) GEMMs
    rows: int = 0  # (token, expert) rows computed

    @property
    def rows_per_gemm(self) -> float:
        return self.rows / self.gemms if self.gemms else 0.0


@dataclass
class _Frame:
    src: int
    layer: int
    microbatch: int
    rows: torch.Tensor  # [n, D]
    pairs: torch.Tensor  # [p, 2] (row, global expert id)
    participants: int  # 0: per-layer aggregation; else replicas in this lockstep tick


class ExpertWorker:
    def __init__(self, experts: ExpertPart, endpoint: Endpoint, device: torch.device,
                 aggregation_wait_s: float = 0.0005) -> None:
        self.experts = experts
        self.endpoint = endpoint
        self.device = device
        self.aggregation_wait_s = aggregation_wait_s
        self.stats = ExpertWorkerStats()
        self._host = frames_on_host(endpoint)
        self._ticks: dict[tuple[int, int], list[_Frame]] = defaultdict(list)  # lockstep

    def serve(self, should_stop: Callable[[], bool]) -> None:
        """Serve frames until ``should_stop()``; comm errors (a lost peer) propagate."""
        while not should_stop():
            try:
                first = self.endpoint.poll(timeout=IDLE_POLL_S)
            except CommTimeoutError:
                continue
            frame = self._take(first)
            if frame.participants:
                self._collect_tick(frame)
                continue
            frames = [frame]
            deadline = time.monotonic() + self.aggregation_wait_s
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    frames.append(self._take(self.endpoint.poll(timeout=remaining)))
                except CommTimeoutError:
                    break
            self._process(frames)

    def _take(self, completion: Completion) -> _Frame:
        try:
            if completion.tag != TAG_DISPATCH:
                raise RuntimeError(f"expert worker got a frame with tag {completion.tag}")
            rows, pairs, participants = decode_dispatch(completion.data)
            return _Frame(completion.src, completion.layer, completion.microbatch, rows, pairs,
                          participants)
        finally:
            self.endpoint.release(completion)

    def _collect_tick(self, frame: _Frame) -> None:
        """Lockstep: hold the frame until its tick has one from every participant."""
        key = (frame.layer, frame.microbatch)
        tick = self._ticks[key]
        tick.append(frame)
        if len(tick) < frame.participants:
            return
        del self._ticks[key]
        frames = [f for f in tick if f.pairs.shape[0]]  # empty frames get no answer
        if frames:
            self._process(frames)
        else:
            self.stats.frames += len(tick)

    def _process(self, frames: list[_Frame]) -> None:
        by_layer: dict[int, list[_Frame]] = defaultdict(list)
        for f in frames:
            by_layer[f.layer].append(f)
        self.stats.frames += len(frames)
        for layer, group in by_layer.items():
            # One pass over the rows of every frame of this layer: rows of frame j are
            # offset by the rows of the frames before it.
            offsets = torch.tensor([0] + [f.rows.shape[0] for f in group]).cumsum(0)
            rows = torch.cat([f.rows for f in group]).to(self.device)  # [N, D]
            row_index = torch.cat([f.pairs[:, 0] + offsets[j] for j, f in enumerate(group)])
            expert_ids = torch.cat([f.pairs[:, 1] for f in group]).to(self.device)
            out = self.experts.forward(layer, rows[row_index.to(self.device)], expert_ids)  # [P, D]
            self.stats.passes += 1
            self.stats.gemms += int(torch.unique(expert_ids).numel())
            self.stats.rows += int(expert_ids.numel())
            start = 0
            for f in group:
                count = f.pairs.shape[0]
                self.endpoint.send(f.src, encode_combine(out[start:start + count], self._host),
                                   layer=layer, microbatch=f.microbatch, tag=TAG_COMBINE)
                start += count
