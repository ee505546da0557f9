"""Worker entry points: one function runs a worker, as a thread (``inproc``) or as a
spawned process (``tcp``, ``cuda_ipc``, ``nccl``). A worker's role:

* ``attention``: one attention replica (an LLMEngine whose experts are remote);
* ``expert``: one expert worker serving every replica;
* ``colocated``: both, replica i and expert worker i (co-located expert parallelism): the
  expert role serves from a thread of the worker, with its own comm rank, so a replica
  waiting for its combine never blocks the experts other replicas wait for;
* ``engine``: a whole engine, every expert in it (data parallelism), no comm.

Messages both ways are the typed dataclasses of :mod:`megaserve.runtime.messages`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
from dataclasses import replace

import torch

from megaserve.comm import Endpoint, create_endpoint, exchange
from megaserve.engine.gc_heap import freeze_for_life
from megaserve.runtime.messages import (AbortRequest, AddRequest, RunStep, StepOutputs, Stop,
                                        WorkerFailure, WorkerReady, WorkerStats)
from megaserve.runtime.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

# How long an idle attention worker blocks on its inbox before checking its parent.
IDLE_WAIT_S = 0.2
# How long a co-located worker waits for its expert thread to stop.
EXPERT_THREAD_JOIN_S = 10.0


def run_worker(spec: WorkerSpec, inbox, outbox) -> None:
    """Entry point of a worker thread or process; reports failures to ``outbox``."""
    if spec.plane == "device":
        from megaserve.runtime.device_workers import run_device_worker

        run_device_worker(spec, inbox, outbox)
        return
    if spec.role == "colocated":
        _run_colocated(spec, inbox, outbox)
        return
    endpoint = None
    try:
        if spec.device == "cpu":
            torch.set_num_threads(spec.engine.cpu_threads)
        else:
            torch.cuda.set_device(torch.device(spec.device))
        if spec.role != "engine":
            endpoint = _connect(spec)
        if spec.role == "expert":
            _serve_experts(spec, endpoint, inbox, outbox)
        else:
            _serve_attention(spec, endpoint, inbox, outbox)
    except BaseException as e:  # noqa: BLE001 - forwarded to the front-end
        logger.exception("%s worker %d failed", spec.role, spec.index)
        outbox.put(WorkerFailure(spec.role, spec.index,
                                 f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
    finally:
        if endpoint is not None:
            endpoint.close()


def _run_colocated(spec: WorkerSpec, inbox, outbox) -> None:
    """Attention replica ``spec.index`` on this thread, expert worker ``spec.index`` (comm
    rank ``num_replicas + index``) on a thread of its own; both stop when the replica's
    loop ends (Stop, a failure, or the front-end gone)."""
    expert = replace(spec, role="expert", rank=spec.num_replicas + spec.index)
    expert_inbox: queue.Queue = queue.Queue()
    thread = threading.Thread(target=run_worker, args=(expert, expert_inbox, outbox),
                              name=f"megaserve-expert-{spec.index}", daemon=True)
    thread.start()
    try:
        run_worker(replace(spec, role="attention"), inbox, outbox)
    finally:
        expert_inbox.put(Stop())
        thread.join(EXPERT_THREAD_JOIN_S)


def settle_heap(transport: str) -> None:
    """A spawned worker, built and about to serve until it exits, takes its start-up heap
    out of the collector's scans (megaserve/engine/gc_heap.py); a thread worker
    (``inproc``) shares its process and leaves the heap alone."""
    if transport != "inproc":
        freeze_for_life()


def _connect(spec: WorkerSpec) -> Endpoint:
    options: dict = {}
    if spec.transport != "inproc":
        options["host"] = spec.host
    if spec.transport == "inproc":
        options["fabric"] = f"megaserve-{spec.parent_pid}-{spec.rendezvous}"
    elif spec.transport == "cuda_ipc":
        options["device"] = spec.device
    elif spec.transport == "nccl":
        # One torch.distributed group per direction: NCCL on GPUs, gloo on CPU.
        options["device"] = spec.device
        options["backend"] = "gloo" if spec.device == "cpu" else "nccl"
    endpoint = create_endpoint(spec.transport, spec.rank, spec.world_size, spec.channel, **options)
    # Every rank of the round waits for the slowest to start (a loaded host, Ray actors).
    addresses = exchange(spec.rendezvous, spec.rank, spec.world_size, endpoint.address,
                         timeout_s=spec.channel.connect_timeout_s)
    if spec.role == "attention":
        endpoint.connect(addresses, send_to=spec.expert_ranks)
    else:
        endpoint.connect(addresses, send_to=list(range(spec.num_replicas)))
    return endpoint


def _parent_gone(spec: WorkerSpec) -> bool:
    """True once the front-end process has died (worker processes then exit by themselves)."""
    if spec.transport == "inproc":
        return False
    try:
        os.kill(spec.parent_pid, 0)
    except ProcessLookupError:
        return True
    return False


def _serve_attention(spec: WorkerSpec, endpoint: Endpoint | None, inbox, outbox) -> None:
    from megaserve.engine.engine import LLMEngine
    from megaserve.runtime.remote_experts import RemoteExperts

    config = spec.engine.replica(device=spec.device)
    lockstep = experts = None
    if endpoint is not None:  # else: a whole engine (data parallelism), experts in it
        lockstep = _lockstep_shape(spec) if spec.engine.aggregation == "lockstep" else None
        experts = RemoteExperts(endpoint, spec.placement, spec.expert_ranks, lockstep)
    engine = LLMEngine(config, experts=experts, model=spec.model)
    settle_heap(spec.transport)
    outbox.put(WorkerReady(spec.role, spec.index, engine.stats()))
    if lockstep is not None:
        _serve_attention_lockstep(spec, engine, experts, inbox, outbox)
        return
    while True:
        busy = engine.has_unfinished_requests()
        try:
            message = inbox.get_nowait() if busy else inbox.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            message = None
        if message is not None:
            if isinstance(message, Stop):
                return
            _apply(spec, engine, message, outbox)
            continue  # drain every queued command before stepping
        if _parent_gone(spec):
            return
        if busy:
            outputs = engine.step()
            if outputs:
                outbox.put(StepOutputs.of(spec.index, outputs, engine.stats()))


def _apply(spec: WorkerSpec, engine, message, outbox) -> None:
    """An AddRequest or AbortRequest on the replica's engine (an abort's output goes out)."""
    if isinstance(message, AddRequest):
        engine.add_request(message.request_id, message.token_ids, message.params,
                           seed=message.seed)
    elif isinstance(message, AbortRequest):
        out = engine.abort_request(message.request_id)
        if out is not None:
            outbox.put(StepOutputs.of(spec.index, [out], engine.stats()))
    else:
        raise ValueError(f"attention worker {spec.index}: unexpected message {message!r}")


def _lockstep_shape(spec: WorkerSpec):
    from megaserve.runtime.remote_experts import LockstepShape

    cfg = spec.model.config
    return LockstepShape(
        moe_layers=tuple(i for i, moe in enumerate(cfg.moe_layers) if moe),
        microbatches=spec.engine.microbatches,
        hidden_size=cfg.hidden_size,
        dtype=spec.model.dtype(spec.engine.dtype),
    )


def _serve_attention_lockstep(spec: WorkerSpec, engine, experts, inbox, outbox) -> None:
    """Lockstep: run one engine step per RunStep command, no more."""
    while True:
        try:
            message = inbox.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            if _parent_gone(spec):
                return
            continue
        if isinstance(message, Stop):
            return
        if isinstance(message, RunStep):
            experts.set_participants(message.participants)
            outputs = engine.step()
            experts.end_step()
            outbox.put(StepOutputs.of(spec.index, outputs, engine.stats(), stepped=True))
        else:
            _apply(spec, engine, message, outbox)


def _serve_experts(spec: WorkerSpec, endpoint: Endpoint, inbox, outbox) -> None:
    from megaserve.models.loader import load_model
    from megaserve.runtime.expert_worker import ExpertWorker

    model = load_model(
        spec.model, spec.engine.dtype, spec.device,
        attention=False, expert_ids=list(spec.placement.workers[spec.index]),
        quantization=spec.engine.quantization,
    )
    worker = ExpertWorker(model.experts, endpoint, torch.device(spec.device),
                          aggregation_wait_s=spec.engine.expert_aggregation_wait_ms / 1000)
    settle_heap(spec.transport)
    outbox.put(WorkerReady(spec.role, spec.index))
    stop = False

    def should_stop() -> bool:
        nonlocal stop
        try:
            while not stop:
                stop = isinstance(inbox.get_nowait(), Stop)
        except queue.Empty:
            pass
        return stop or _parent_gone(spec)

    worker.serve(should_stop)
    outbox.put(WorkerStats(spec.role, spec.index, worker.stats))
