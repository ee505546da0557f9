"""Surviving a lost worker: liveness watch, restart budget, and re-running in-flight requests.

A DisaggregatedEngine whose worker dies (crash, OOM kill, lost node) restarts its worker
group through the launcher and re-runs every request that was in flight from its prompt
plus the tokens it had already produced. The determinism contract (batch-invariant
kernels, sampling keyed by ``(seed, position)``) makes the re-run continue bitwise where
the lost run stopped, so clients see a pause, not an error.

How a re-run stays bitwise equal to an undisturbed run::

    before the loss:  worker output = cumulative RequestOutput     (passed through as is,
                                   or as the delta since the last one for a DELTA caller)
    re-run:           worker gets  prompt' = prompt + delivered tokens
                                   max_tokens' = max_tokens - len(delivered), same seed
                      front-end replays delivered + new tokens through its own
                      OutputProcessor over the *original* prompt

so text, stop strings, finish reasons and logprobs are computed exactly as the lost worker
would have computed them (the incremental detokenizer is not suffix-stable, which is why
the front-end detokenizes from the original prompt rather than stitching texts). Workers
therefore always produce cumulative outputs for a DELTA request (:func:`worker_params`);
the front-end cuts the deltas, and after a re-run its OutputProcessor does, told what the
caller had been sent.

:class:`LivenessWatch` polls the group from a thread (every ``POLL_S``), so a worker that
dies while the server is idle is noticed and replaced without waiting for a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from megaserve.engine.output_processor import OutputProcessor
from megaserve.engine.sequence import Sequence
from megaserve.outputs import CompletionOutput, RequestOutput
from megaserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 0.2  # liveness poll period; health reports a death well within 2 s


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` group restarts within any ``window_s`` seconds; past that
    the engine fails for good (a crash loop is not worth hiding)."""

    max_restarts: int = 3
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: {self.max_restarts} must be >= 0")
        if self.window_s <= 0:
            raise ValueError(f"window_s: {self.window_s} must be > 0")


class RestartBudget:
    """Counts restarts against a :class:`RestartPolicy`."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: deque[float] = deque()
        self.total = 0

    def take(self) -> bool:
        """Record one restart; False (nothing recorded) if the budget is spent."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.policy.window_s:
            self._times.popleft()
        if len(self._times) >= self.policy.max_restarts:
            return False
        self._times.append(now)
        self.total += 1
        return True


GAUGES = ("num_running", "num_waiting", "num_kv_blocks", "num_free_kv_blocks")


def add_counters(stats, extra):
    """``stats`` (an EngineStats) with the counters of ``extra`` (None: nothing) added:
    every field but the :data:`GAUGES`. Counters of a replaced worker group are kept this
    way, so a Prometheus counter never goes backwards across a restart."""
    if extra is None:
        return stats
    counters = [f.name for f in fields(stats) if f.name not in GAUGES]
    return replace(stats, **{name: getattr(stats, name) + getattr(extra, name) for name in counters})


def restarted(stats):
    """What a replica's stats read right after a restart: the same KV pool, all free,
    nothing running, counters at 0 (the old ones live on through :func:`add_counters`)."""
    counters = {f.name: 0 for f in fields(stats) if f.name not in GAUGES}
    return replace(stats, num_running=0, num_waiting=0,
                   num_free_kv_blocks=stats.num_kv_blocks, **counters)


@dataclass(frozen=True)
class WorkerHealth:
    """What health checks report. ``state``: "serving", "recovering" or "failed"."""

    state: str
    reason: str | None = None
    restarts: int = 0

    @property
    def serving(self) -> bool:
        return self.state == "serving"


@dataclass
class _Flight:
    """One in-flight request, as the front-end knows it."""

    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    last: RequestOutput | None = None  # the latest output delivered to the caller
    replay: Sequence | None = None  # set once the request has been re-run
    replay_seen: int = 0  # tokens of the current re-run already replayed
    aborted: bool = False
    prompt_logprobs: list | None = field(default=None)
    sent_tokens: int = 0  # what a DELTA caller has been sent (before a re-run)
    sent_chars: int = 0
    sent_prompt_logprobs: bool = False


def worker_params(params: SamplingParams) -> SamplingParams:
    """The params a worker runs a request with: a DELTA request's outputs come back
    cumulative (what a re-run is rebuilt from; the front-end cuts the deltas)."""
    if params.output_kind is RequestOutputKind.DELTA:
        return replace(params, output_kind=RequestOutputKind.CUMULATIVE)
    return params


class InFlightTable:
    """The requests a front-end must be able to re-run; see the module docstring."""

    def __init__(self, outputs: OutputProcessor) -> None:
        self._outputs = outputs
        self._flights: dict[str, _Flight] = {}

    def added(self, request_id: str, prompt: str | None, prompt_ids: list[int],
              params: SamplingParams, seed: int) -> None:
        self._flights[request_id] = _Flight(prompt, list(prompt_ids), params, seed)

    def aborting(self, request_id: str) -> None:
        """The caller asked to abort: a re-run would be wasted, so it ends as "abort"."""
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.aborted = True

    def forget(self, request_id: str) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is not None and flight.replay is not None:
            self._outputs.release(flight.replay)

    def prompt_ids(self, request_id: str) -> list[int]:
        """The prompt's token ids of an in-flight request (workers' outputs leave them out:
        messages.StepOutputs); [] for one the front-end no longer tracks."""
        flight = self._flights.get(request_id)
        return flight.prompt_ids if flight is not None else []

    def translate(self, out: RequestOutput) -> tuple[RequestOutput, bool]:
        """The output the caller sees for a worker's output, and whether the worker must
        be told to abort (the replay finished before the re-run did, e.g. a stop string
        that spans the restart point)."""
        flight = self._flights.get(out.request_id)
        if flight is None:
            return out, False
        if flight.replay is None:
            flight.last = out
            if out.prompt_logprobs is not None:
                flight.prompt_logprobs = out.prompt_logprobs
            if flight.params.output_kind is RequestOutputKind.DELTA:
                return _cut_delta(out, flight), False
            return out, False
        seq, comp = flight.replay, out.outputs[0]
        new_logprobs = comp.logprobs[flight.replay_seen:] if comp.logprobs is not None else None
        for i, token in enumerate(comp.token_ids[flight.replay_seen:]):
            if seq.finish_reason is not None:
                break
            self._outputs.append_token(seq, token, new_logprobs[i] if new_logprobs else None)
        flight.replay_seen = len(comp.token_ids)
        if flight.prompt_logprobs is None and out.prompt_logprobs is not None:
            flight.prompt_logprobs = out.prompt_logprobs[:len(flight.prompt_ids)]
        must_abort = seq.finish_reason is not None and not out.finished
        if out.finished and seq.finish_reason is None:
            # The worker stopped for a reason the replay did not see (an abort).
            seq.finish_reason = comp.finish_reason or "abort"
        mapped = self._snapshot(out.request_id, flight)
        mapped.num_cached_tokens, mapped.metrics = out.num_cached_tokens, out.metrics
        flight.last = mapped
        return mapped, must_abort

    def _snapshot(self, request_id: str, flight: _Flight) -> RequestOutput:
        """The replay's output for the caller: cumulative, or (DELTA) what it has not been
        sent."""
        if flight.params.output_kind is RequestOutputKind.DELTA:
            mapped = self._outputs.step_output(flight.replay)
            mapped.prompt_logprobs = (None if flight.sent_prompt_logprobs
                                      else flight.prompt_logprobs)
            flight.sent_prompt_logprobs = True
        else:
            mapped = self._outputs.make_output(flight.replay)
            mapped.prompt_logprobs = flight.prompt_logprobs
        mapped.prompt = flight.prompt
        return mapped

    def resume(self) -> tuple[list[tuple[str, list[int], SamplingParams, int]],
                              list[RequestOutput]]:
        """Prepare every in-flight request for a new worker group.

        Returns ``(reruns, ended)``: ``reruns`` are ``(request_id, token_ids, params,
        seed)`` to add again; ``ended`` are final outputs for requests that need no re-run
        (aborted by the caller meanwhile, or already complete)."""
        reruns, ended = [], []
        for request_id, flight in list(self._flights.items()):
            seq = self._rebuild(request_id, flight)
            done = len(seq.output_token_ids)
            if flight.aborted or seq.finish_reason is not None:
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
                ended.append(self._snapshot(request_id, flight))
                continue
            params = flight.params
            if done:
                params = replace(params, max_tokens=params.max_tokens - done,
                                 prompt_logprobs=None if flight.prompt_logprobs else
                                 params.prompt_logprobs)
            reruns.append((request_id, flight.prompt_ids + seq.output_token_ids, params,
                           flight.seed))
        return reruns, ended

    def _rebuild(self, request_id: str, flight: _Flight) -> Sequence:
        """A replay sequence holding exactly the tokens delivered so far."""
        if flight.replay is not None:
            flight.replay_seen = 0
            return flight.replay
        seq = Sequence(request_id, flight.prompt, flight.prompt_ids, flight.params,
                       flight.seed, arrival=0)
        if flight.last is not None:
            comp = flight.last.outputs[0]
            for i, token in enumerate(comp.token_ids):
                self._outputs.append_token(seq, token, comp.logprobs[i] if comp.logprobs else None)
        if flight.params.output_kind is RequestOutputKind.DELTA:
            self._outputs.mark_sent(seq, flight.sent_tokens, flight.sent_chars)
        flight.replay, flight.replay_seen = seq, 0
        return seq


def _cut_delta(out: RequestOutput, flight: _Flight) -> RequestOutput:
    """A worker's cumulative output as the delta since what ``flight``'s caller was sent
    (the worker's own DELTA output, as OutputProcessor.step_output makes it)."""
    comp = out.outputs[0]
    start, chars = flight.sent_tokens, flight.sent_chars
    flight.sent_tokens, flight.sent_chars = len(comp.token_ids), len(comp.text)
    flight.sent_prompt_logprobs = True  # (with the first output, if asked for)
    delta = CompletionOutput(comp.index, comp.text[chars:], comp.token_ids[start:],
                             comp.logprobs[start:] if comp.logprobs is not None else None,
                             comp.finish_reason, comp.stop_reason)
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, [delta],
                         out.finished, out.prompt_logprobs if start == 0 else None,
                         out.num_cached_tokens, out.metrics)


class LivenessWatch:
    """A daemon thread calling ``on_loss(names)`` when ``dead()`` names a lost worker.

    ``dead`` must be cheap and thread-safe; ``on_loss`` runs on the watch thread (it may
    take seconds: a restart). Stops when ``stop()`` is called."""

    def __init__(self, dead: Callable[[], list[str]], on_loss: Callable[[list[str]], None],
                 poll_s: float = POLL_S) -> None:
        self._dead = dead
        self._on_loss = on_loss
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaserve-liveness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                names = self._dead()
                if names:
                    self._on_loss(names)
            except Exception:  # noqa: BLE001 - the watch must outlive one bad poll
                logger.exception("liveness watch: poll failed")

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
