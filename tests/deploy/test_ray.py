"""The Ray launcher on a real local Ray cluster (ray.cluster_utils.Cluster): nodes carry fake
GPU-type resources (``accelerator_type:H100`` / ``accelerator_type:L40S``), CPU actors stand
in for GPUs, workers talk over tcp. Placement is read back from Ray's state API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'megaserve[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util import state as ray_state  # noqa: E402

from megaserve.engine.config import EngineConfig  # noqa: E402
from megaserve.sampling_params import SamplingParams  # noqa: E402
from tests.processes import alive  # noqa: E402
from tests.server.conftest import ServerProcess  # noqa: E402

from .serving import (REQUESTS, HealthPoller, Stream, built_model_cache,  # noqa: E402
                      kill_mid_stream, wait_for, wait_http_serving)

MODEL = "builtin:tiny-moe"
PLAN = """\
version: 1
model: tiny-moe
objective: throughput
units:
  - copies: 1
    layout: disaggregated
    attention: {gpu: H100, tp: 1, replicas: 2, max_batch_per_replica: 16}
    experts: {gpu: L40S, tp: 1, workers: 2, placement: [[0, 1, 2, 3], [4, 5, 6, 7]]}
    microbatches: 2
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head (state API, no CPUs for workers) and one node per GPU type, 2 CPUs each."""
    with built_model_cache(str(tmp_path_factory.mktemp("megaserve-cache")), MODEL) as cache:
        dashboard = _free_port()
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": True, "dashboard_port": dashboard})
        c.add_node(num_cpus=2, resources={"accelerator_type:H100": 1})
        c.add_node(num_cpus=2, resources={"accelerator_type:L40S": 1})
        c.wait_for_nodes()
        ray.init(address=c.address)
        c.dashboard_url = f"http://127.0.0.1:{dashboard}"
        c.cache = cache
        try:
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


def _worker_actors(c, state: str = "ALIVE") -> list:
    return [a for a in ray_state.list_actors(address=c.dashboard_url, limit=1000,
                                             filters=[("state", "=", state)])
            if a.class_name in ("RayWorker", "Mailbox")]


def _node_gpu_type(node_id: str) -> str | None:
    (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
    types = [k.split(":", 1)[1] for k in node["Resources"] if k.startswith("accelerator_type:")]
    return types[0] if types else None


def _reference():
    from megaserve import LLM

    with LLM(model=MODEL, dtype="float32", max_model_len=512, seed=0) as llm:
        return [llm.generate(p, SamplingParams(**s))[0].outputs[0] for p, s in REQUESTS]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two recoveries of Ray actors: 10 min under two CPU hogs here
def test_serve_plan_on_ray_places_by_gpu_type_survives_a_killed_actor(cluster, tmp_path):
    expected = _reference()
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    server = ServerProcess(tmp_path / "server.log", cluster.cache, "--dtype", "float32",
                           "--max-model-len", "512", "--plan", str(plan), "--transport", "tcp",
                           "--launcher", "ray", "--ray-address", cluster.address)
    poller = HealthPoller(server.grpc_address)
    pids: list[int] = []
    try:
        # Four Ray actors each import torch and load a shard: 240 s was not enough beside two
        # CPU hogs and a suite. The server fails by itself if they never start (its start-up
        # deadline); this bound only catches a hang.
        server.wait_ready(900)
        # Placement, from the state API: attention on the H100 node, experts on the L40S one.
        workers = [a for a in _worker_actors(cluster) if a.class_name == "RayWorker"]
        assert len(workers) == 4, workers
        placed = {a.name.split("-")[2] + a.name.split("-")[3]: _node_gpu_type(a.node_id)
                  for a in workers}
        assert placed == {"attention0": "H100", "attention1": "H100",
                          "expert0": "L40S", "expert1": "L40S"}, placed
        (pg,) = [g for g in ray_state.list_placement_groups(address=cluster.dashboard_url,
                                                            detail=True)
                 if g.state == "CREATED"]
        asks = sorted(k for b in pg.bundles for k in b["unit_resources"] if "accelerator" in k)
        assert asks == ["accelerator_type:H100"] * 2 + ["accelerator_type:L40S"] * 2, pg.bundles
        pids = [a.pid for a in workers]

        poller.start()
        wait_for(lambda: poller.history and poller.history[-1][1] == "SERVING", 300, "SERVING")
        (victim,) = [a for a in workers if "-expert-0-" in a.name]
        # The actor's process dies mid-stream: a lost worker.
        kill_mid_stream(server.grpc_address, poller, expected, victim.pid)
        workers = [a for a in _worker_actors(cluster) if a.class_name == "RayWorker"]
        assert len(workers) == 4 and victim.actor_id not in {a.actor_id for a in workers}
        pids += [a.pid for a in workers]
        wait_http_serving(server.url)

        # Idle: expert 1's actor dies with nothing in flight; health reports it, no request needed.
        (victim,) = [a for a in workers if "-expert-1-" in a.name]
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: poller.first("NOT_SERVING", killed) is not None, 300, "NOT_SERVING")
        wait_for(lambda: poller.first("SERVING", poller.first("NOT_SERVING", killed)) is not None,
                 600, "health back after the idle kill")
        again = Stream(server.grpc_address, *REQUESTS[1])
        again.run()
        assert again.error is None and list(again.complete.output_ids) == expected[1].token_ids
        pids += [a.pid for a in _worker_actors(cluster) if a.class_name == "RayWorker"]

        # SIGTERM after the recoveries, streams in flight: they drain (finish, or end with
        # finish reason "abort" at the end of the grace period), then the server exits 0.
        streams = [Stream(server.grpc_address, p, s) for p, s in REQUESTS]
        for s in streams:
            s.start()
        wait_for(lambda: all(len(s.chunk_ids) >= 3 or s.error for s in streams), 300,
                 "first tokens of every stream")
        server.proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(120)
        code = server.proc.wait(120)
        for s, exp in zip(streams, expected):
            assert s.error is None, s.error
            assert s.complete is not None and s.complete.finish_reason in ("length", "abort")
            ids = list(s.complete.output_ids)
            assert ids == exp.token_ids[:len(ids)] and s.chunk_ids == ids
            if s.complete.finish_reason == "length":
                assert ids == exp.token_ids
    finally:
        code = server.stop()  # first: nothing may leave the server running
        poller.stop()
    assert code == 0, server.log()
    assert "SIGTERM received" not in server.log()  # Ray's abort-on-SIGTERM handler stayed out
    # Shutdown leaves no actors, no placement group and no worker processes.
    wait_for(lambda: not _worker_actors(cluster), 60, "worker actors to die")
    assert not [g for g in ray_state.list_placement_groups(address=cluster.dashboard_url)
                if g.state != "REMOVED"]
    wait_for(lambda: not any(alive(p) for p in pids), 60, "worker processes to exit")


SIGNAL_SCRIPT = """
import asyncio, os, signal, sys, threading, time
from megaserve.deploy.ray_launcher import RayLauncher

async def main(in_thread):
    got = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, got.set)
    make = lambda: RayLauncher(address=sys.argv[1])
    launcher = await asyncio.to_thread(make) if in_thread else make()
    os.kill(os.getpid(), getattr(signal, sys.argv[3]))
    await asyncio.wait_for(got.wait(), 60)
    time.sleep(4.5)  # a drain longer than Abseil's 3 s abort alarm
    launcher.close()
    print("drained", flush=True)

asyncio.run(main(sys.argv[2] == "thread"))
"""


@pytest.mark.parametrize("where,signame", [("thread", "SIGTERM"), ("thread", "SIGINT"),
                                           ("main", "SIGTERM")])
def test_ray_init_leaves_the_servers_signal_handlers(cluster, where, signame):
    """The server's asyncio handlers still own SIGTERM/SIGINT once the launcher has joined
    Ray (from the loading thread, as ``megaserve serve`` does, or the main thread), and a
    shutdown may take longer than 3 s without Ray aborting the process."""
    out = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT, cluster.address, where, signame],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "drained" in out.stdout, out.stdout + out.stderr
    assert "SIGTERM received" not in out.stderr


def test_unplaceable_gpu_type_is_a_typed_error(cluster):
    from megaserve.deploy.ray_launcher import RayLauncher
    from megaserve.runtime.cluster import DisaggregatedEngine

    config = EngineConfig(dtype="float32", expert_workers=2, transport="tcp", launcher="ray",
                          attention_gpu_type="H100", expert_gpu_type="B200")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"cannot place .*accelerator_type:B200"):
        DisaggregatedEngine(config, launcher=RayLauncher(placement_timeout_s=3))
    assert time.monotonic() - start < 120  # a 3 s placement timeout, then clean-up
    assert not [g for g in ray_state.list_placement_groups(address=cluster.dashboard_url)
                if g.state not in ("REMOVED",)]
    assert not _worker_actors(cluster)
