"""Device-plane roles as processes (megaserve.runtime.device_workers), the parts that run
without a GPU: which layouts become device-plane processes and the specs they get, and
the lockstep across processes (a replica's one StepReport per expert worker per step, over
the same local sockets the processes use; an expert worker's gate starting the step's
graph once every participant has reported, with reports of consecutive steps
interleaved). The CUDA side is in test_colocated_ep_gpu.py and test_device_plane_gpu.py."""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Client, Listener

import pytest

from megaserve.engine.config import EngineConfig
from megaserve.runtime.device_plane import GraphStep
from megaserve.runtime.device_workers import (ProcessBarrier, StepGate, _SocketLink, _subsets,
                                              serve_replica_sockets)
from megaserve.runtime.factory import uses_device_plane
from megaserve.runtime.layout import (comm_world, ready_messages, runs_device_roles,
                                      worker_specs)
from megaserve.runtime.messages import StepReport
from megaserve.runtime.placement import ExpertPlacement

CUDA = dict(device="cuda", model="builtin:tiny-moe")


def test_which_layouts_run_as_device_plane_processes() -> None:
    ep = dict(**CUDA, data_parallel_size=2, enable_expert_parallel=True)
    assert runs_device_roles(EngineConfig(**ep, transport="cuda_ipc"))
    assert runs_device_roles(EngineConfig(**CUDA, attention_replicas=2, transport="cuda_ipc"))
    assert runs_device_roles(EngineConfig(**CUDA, transport="cuda_ipc", attention_gpus=(0,),
                                          expert_gpus=(1,)))
    # One replica without placement flags: the one-process front-end (device_engine).
    assert not runs_device_roles(EngineConfig(**CUDA, transport="cuda_ipc"))
    assert uses_device_plane(EngineConfig(**CUDA, transport="cuda_ipc"))
    assert not runs_device_roles(EngineConfig(**ep, transport="tcp"))
    assert not runs_device_roles(EngineConfig(**ep, transport="cuda_ipc", data_plane="host"))
    assert not runs_device_roles(EngineConfig(device="cpu", data_parallel_size=2,
                                              enable_expert_parallel=True))
    assert not runs_device_roles(EngineConfig(**CUDA, data_parallel_size=2, transport="cuda_ipc"))
    for config in (EngineConfig(**ep, transport="cuda_ipc"),
                   EngineConfig(**CUDA, attention_replicas=2, transport="cuda_ipc")):
        assert not uses_device_plane(config)  # DisaggregatedEngine drives the processes


@pytest.mark.parametrize("options, roles, world", [
    (dict(data_parallel_size=3, enable_expert_parallel=True), ["colocated"] * 3, 3),
    (dict(attention_replicas=2, expert_workers=1, attention_gpus=(0, 0), expert_gpus=(0,)),
     ["attention", "attention", "expert"], 3),
])
def test_device_plane_processes_get_one_rank_each(options, roles, world) -> None:
    config = EngineConfig(**CUDA, transport="cuda_ipc", **options)
    from megaserve.models.resolved import ResolvedModel

    model = ResolvedModel.resolve(config.model)
    placement = ExpertPlacement.even(model.config.num_experts, config.expert_workers)
    from megaserve.comm import ChannelConfig

    specs = worker_specs(config, model, placement, "127.0.0.1:1", ChannelConfig())
    assert [s.role for s in specs] == roles
    assert [s.rank for s in specs] == list(range(world))
    assert all(s.world_size == world == comm_world(config) for s in specs)
    assert ready_messages(config) == world  # one WorkerReady per process
    assert all(s.plane == "device" and len(s.secret) == 16 for s in specs)
    assert len({s.secret for s in specs}) == 1


def test_step_gate_starts_each_step_once_every_participant_reported() -> None:
    gate = StepGate()
    assert gate.add(StepReport(0, 1, 8, (0, 1, 2))) is None
    assert gate.add(StepReport(1, 0, 4, (0,))) == GraphStep(4, (0,))  # the next step, early
    assert gate.add(StepReport(0, 2, None, (0, 1, 2))) is None  # eager: not in the graph
    assert gate.add(StepReport(0, 1, 8, (0, 1, 2))) is None  # a second report: ignored
    assert gate.add(StepReport(0, 0, 16, (0, 1, 2))) == GraphStep(16, (0, 1))
    assert gate.add(StepReport(2, 0, None, (0, 1))) is None
    assert gate.add(StepReport(2, 1, None, (0, 1))) is None  # every one eager: no graph
    assert gate.open_steps == 0


def test_reports_cross_process_sockets_once_per_step_and_expert_worker() -> None:
    """Two replicas' ProcessBarriers, each with a socket per expert worker (the
    processes' multiprocessing.connection links, authenticated), and two expert workers'
    gates fed by a reader of their sockets: each global step starts one graph step at
    each expert worker, over the graph replicas' largest rows; the end-of-step report
    after a graph's adds no message."""
    secret = b"0123456789abcdef"
    listeners = [Listener(("127.0.0.1", 0), authkey=secret) for _ in range(2)]
    started: list[list[GraphStep]] = [[], []]

    def read(e: int) -> None:
        gate = StepGate()
        conns = [listeners[e].accept() for _ in range(2)]
        for _ in range(3):  # one report per step from each replica
            for conn in conns:
                step = gate.add(conn.recv())
                if step is not None:
                    started[e].append(step)

    readers = [threading.Thread(target=read, args=(e,), daemon=True) for e in range(2)]
    for t in readers:
        t.start()
    barriers = [ProcessBarrier(r, [_SocketLink(Client(lis.address, authkey=secret))
                                   for lis in listeners]) for r in range(2)]
    for step, (rows0, rows1) in enumerate([(8, 16), (None, 4), (None, None)]):
        for r, rows in ((1, rows1), (0, rows0)):
            barriers[r].begin(step, (0, 1))
            barriers[r].report(r, rows)
            barriers[r].report(r, None)  # the front-end's end of step: nothing more
    for t in readers:
        t.join(60)
    assert started == [[GraphStep(16, (0, 1)), GraphStep(4, (1,))]] * 2
    assert [b.host_messages for b in barriers] == [6, 6]  # 3 steps x 2 expert workers
    assert [b.graph_steps for b in barriers] == [1, 2]
    with pytest.raises(ValueError, match="without taking part"):
        barriers[0].begin(3, (1,))
    for lis in listeners:
        lis.close()


def test_a_step_report_carries_its_steps_sync_debug_mode() -> None:
    """An expert-only process launches a step's graph under the mode the front-end's
    RunStep set for the step's replicas (steady decode under "error" covers every role):
    the replica passes it on in each StepReport."""
    sent: queue.Queue = queue.Queue()
    barrier = ProcessBarrier(0, [sent])
    barrier.begin(5, (0, 1), "error")
    barrier.report(0, 8)
    barrier.begin(6, (0,))
    barrier.report(0, None)
    assert [sent.get_nowait(), sent.get_nowait()] == [
        StepReport(5, 0, 8, (0, 1), "error"), StepReport(6, 0, None, (0,), None)]
    assert sent.empty()


def test_an_expert_role_serves_the_first_replica_before_the_next_one_connects() -> None:
    """Replicas connect to an expert worker one at a time (each in its start-up turn),
    and the first one's warm-up ticks need the expert role before the second connects:
    serve_replica_sockets reads each socket as soon as it is accepted (accepting every
    socket first deadlocked 2 attention processes + 1 expert process on GPUs), keeps
    each socket's order, and hands a reader's exception to ``failed``."""
    secret = b"0123456789abcdef"
    listener = Listener(("127.0.0.1", 0), authkey=secret)
    got: queue.Queue = queue.Queue()
    errors: queue.Queue = queue.Queue()

    def receive(message) -> None:
        if message == "bad":
            raise ValueError("unexpected message 'bad'")
        got.put(message)

    acceptor = threading.Thread(target=serve_replica_sockets,
                                args=(listener, 2, receive, errors.put), daemon=True)
    acceptor.start()
    first = Client(listener.address, authkey=secret)
    first.send("replica 0: warm-up tick")
    assert got.get(timeout=120) == "replica 0: warm-up tick"  # the second is not there yet
    second = Client(listener.address, authkey=secret)
    for n in range(3):
        first.send(("replica 0", n))
        second.send(("replica 1", n))
    received = [got.get(timeout=120) for _ in range(6)]
    for replica in ("replica 0", "replica 1"):
        assert [n for r, n in received if r == replica] == [0, 1, 2]
    acceptor.join(120)
    assert not acceptor.is_alive() and errors.empty()
    second.send("bad")
    assert isinstance(errors.get(timeout=120), ValueError)
    first.close()
    second.close()
    listener.close()


def test_expert_graphs_captured_at_start_cover_every_participant_set() -> None:
    assert _subsets(2) == [(0, 1), (0,), (1,)]
    assert len(_subsets(3)) == 7
    assert _subsets(4) == [(0, 1, 2, 3)]
