"""Typed messages between the front-end and its workers (picklable, frozen dataclasses).

    front-end → attention worker:  AddRequest, AbortRequest, RunStep (lockstep), Stop
    front-end → expert worker:     Stop
    worker → front-end:            WorkerReady, StepOutputs, WorkerStats (on the way out),
                                   WorkerFailure

The launchers (local queues, Ray actors) carry them unchanged; the device data plane's own
messages (``GraphStep``, ``Tick``) are in :mod:`megaserve.runtime.device_plane`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaserve.outputs import RequestOutput
from megaserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Start a request on the attention worker that receives it."""

    request_id: str
    token_ids: list[int]  # the validated prompt
    params: SamplingParams
    seed: int  # assigned by the front-end (arrival order), so the replica cannot matter


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class RunStep:
    """Lockstep: run exactly one engine step, shared by ``participants`` replicas."""

    participants: int


@dataclass(frozen=True)
class Stop:
    """Leave the serve loop (any worker)."""


@dataclass(frozen=True)
class WorkerReady:
    role: str  # "attention" | "expert"
    index: int


@dataclass(frozen=True)
class StepOutputs:
    """What an attention worker produced, with its engine's stats after it."""

    replica: int
    outputs: list[RequestOutput]
    stats: Any  # EngineStats
    stepped: bool = False  # True: the answer to a RunStep (lockstep)


@dataclass(frozen=True)
class WorkerStats:
    """An expert worker's counters, sent as it stops."""

    role: str
    index: int
    stats: Any  # ExpertWorkerStats


@dataclass(frozen=True)
class WorkerFailure:
    """A worker failed; ``detail`` starts with the exception's one-line summary."""

    role: str
    index: int
    detail: str
