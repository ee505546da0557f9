"""Typed messages that cross a process (picklable, frozen dataclasses).

Between a disaggregated front-end (:mod:`megaserve.runtime.cluster`) and its workers::

    front-end → attention worker:  AddRequest, AbortRequest, RunStep (lockstep), Stop
    front-end → expert worker:     Stop
    worker → front-end:            WorkerReady, StepOutputs, WorkerStats (on the way out),
                                   WorkerFailure

Between the processes of a device-plane layout (:mod:`megaserve.runtime.device_workers`;
over a local socket per (replica process, expert process), the bytes themselves go over
CUDA IPC)::

    attention replica → expert worker:  StepReport (once per lockstep step), and the
                                        device plane's Tick (eager ticks)

Between ``AsyncLLMEngine`` and its engine process (:mod:`megaserve.runtime.async_engine`,
``engine_process=True``; each pipe message is a list of these)::

    front-end → engine process:    AddRequest (seed None), AbortRequest, Stop
    engine process → front-end:    EngineReady | EngineFailed (once, at start), then
                                   EngineOutputs (one a step), RequestRejected, EngineFailed

The launchers (local queues, Ray actors) carry them unchanged; the device data plane's own
messages (``GraphStep``, ``Tick``) are in :mod:`megaserve.runtime.device_plane`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaserve.outputs import CompletionOutput, RequestOutput
from megaserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Start a request on the engine (attention worker, engine process) that receives it."""

    request_id: str
    token_ids: list[int]  # the validated prompt
    params: SamplingParams
    # Assigned by a front-end over replicas (arrival order), so the replica cannot matter;
    # None: the receiving engine derives it (an engine alone sees the front-end's order).
    seed: int | None = None
    # The prompt's text where the receiver's outputs should carry it (None: ids only).
    prompt: str | None = None

    def engine_prompt(self) -> str | list[int]:
        """What ``LLMEngine.add_request`` takes as the prompt."""
        return self.prompt if self.prompt is not None else self.token_ids


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class RunStep:
    """Lockstep: run exactly one engine step, shared by ``participants`` replicas."""

    participants: int
    # The device plane's lockstep needs which replicas take part and which global step
    # this is (its expert workers gate their graph step on exactly these replicas).
    replicas: tuple[int, ...] = ()
    step: int = 0
    # torch.cuda.set_sync_debug_mode to run the step under (None: leave it; tests set
    # "error" to prove a steady decode step never synchronises with the host).
    sync_debug: str | None = None


@dataclass(frozen=True)
class StepReport:
    """A replica's word to an expert worker for global step ``step``: how it runs it.

    ``rows``: its decode graph's rows per micro-batch (None: an eager step, whose ticks
    are messages of their own, or nothing to run). ``participants``: every replica of the
    step, so the expert worker knows whom to wait for. ``sync_debug``: the step's
    ``RunStep.sync_debug``, which an expert-only process launches the step's graph under."""

    step: int
    replica: int
    rows: int | None
    participants: tuple[int, ...]
    sync_debug: str | None = None


@dataclass(frozen=True)
class Stop:
    """Leave the serve loop (any worker)."""


@dataclass(frozen=True)
class WorkerReady:
    role: str  # "attention" | "expert"
    index: int
    # An attention worker's EngineStats when it is ready: its KV pool counts in the
    # front-end's stats before the replica's first step.
    stats: Any = None


@dataclass(frozen=True)
class StepOutputs:
    """What an attention worker produced, with its engine's stats after it: each output
    packed by :func:`pack_output`, without its prompt (the front-end holds every in-flight
    prompt: a step at 1,024 sequences of 2,048 prompt tokens would otherwise pickle 2M
    token ids)."""

    replica: int
    outputs: list[tuple]
    stats: Any  # EngineStats
    stepped: bool = False  # True: the answer to a RunStep (lockstep)

    @classmethod
    def of(cls, replica: int, outputs: list[RequestOutput], stats: Any,
           stepped: bool = False) -> StepOutputs:
        return cls(replica, [pack_output(out) for out in outputs], stats, stepped)


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


# -- engine process (AsyncLLMEngine) ----------------------------------------------------------


@dataclass(frozen=True)
class EngineReady:
    """The engine process loaded its model and serves."""

    model_path: str  # the front-end loads its own tokenizer from it
    info: Any  # async_engine's _EngineInfo, tokenizer None
    stats: Any  # EngineStats


@dataclass(frozen=True)
class EngineOutputs:
    """One step's outputs, each packed by :func:`pack_output`, with the stats after it."""

    outputs: list[tuple]
    stats: Any  # EngineStats

    @classmethod
    def of(cls, outputs: list[RequestOutput], stats: Any) -> EngineOutputs:
        return cls([pack_output(out) for out in outputs], stats)


@dataclass(frozen=True)
class RequestRejected:
    """The engine refused an AddRequest (``message``: the ValueError's text)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class EngineFailed:
    """The engine process could not load (``loading``) or failed while serving; it logged
    the traceback. ``error_type``: the exception's class name."""

    error_type: str
    message: str
    loading: bool = False


def pack_output(out: RequestOutput) -> tuple:
    """A RequestOutput as plain tuples (cheap to pickle; one step at 1,024 sequences is one
    message), without the prompt: the receiver sent it and restores it
    (:func:`unpack_output`)."""
    return (out.request_id,
            [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
             for c in out.outputs],
            out.finished, out.prompt_logprobs, out.num_cached_tokens)


def unpack_output(packed: tuple, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    """The RequestOutput :func:`pack_output` packed, with its prompt restored."""
    request_id, completions, finished, prompt_logprobs, cached = packed
    return RequestOutput(request_id, prompt, prompt_token_ids,
                         [CompletionOutput(*c) for c in completions], finished,
                         prompt_logprobs, cached)
