"""The host-proxied link of the device data plane (megaserve.comm.relay) on CPU: the same
mailboxes, flags, proxy and completion threads the GPU path uses, over real tcp sockets
between real processes (and over the nccl provider's gloo backend: fixed-size frames). The replica (this process) packs routed rows per expert worker,
puts them in its outgoing mailboxes; each expert worker process takes them, runs the
expert tick, puts the combine back; the gathered result is bitwise what in-process
experts give. A worker that dies surfaces as a typed error within the timeout."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from megaserve.comm import CommTimeoutError, RendezvousServer, create_endpoint, exchange
from megaserve.comm.relay import Mailboxes, Relay, Route, put, take
from megaserve.models.expert_part import ExpertPart
from megaserve.models.forward import LocalExperts
from megaserve.runtime.device_plane import ExpertInbox, ReplicaInbox, gather, pack
from tests.comm.relay_workers import C, D, E, K, M, expert_worker, layouts, plane_shape, weights

PLACEMENTS = [[list(range(E))], [[0, 5, 6], [1, 2, 3, 4, 7]]]


def _start(placement, ticks, provider="tcp"):
    ctx = multiprocessing.get_context("spawn")
    workers = len(placement)
    server = RendezvousServer(1 + workers)
    results, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=expert_worker,
                         args=(e, placement[e], workers, ticks, server.address, results, stop,
                               provider),
                         daemon=True) for e in range(workers)]
    for proc in procs:
        proc.start()
    endpoint = create_endpoint(provider, 0, 1 + workers)
    endpoint.connect(exchange(server.address, 0, 1 + workers, endpoint.address),
                     send_to=range(1, 1 + workers))
    Relay.warm_up(endpoint, list(range(1, 1 + workers)), timeout_s=240)
    dispatch, combine = layouts()
    outgoing, incoming = Mailboxes(dispatch, workers * M), Mailboxes(combine, workers * M)
    routes = [Route(local=e * M + i, dst=1 + e, remote=i)
              for e in range(workers) for i in range(M)]
    relay = Relay(endpoint, outgoing, routes, incoming)
    return server, procs, results, stop, endpoint, relay, outgoing, incoming


@pytest.mark.timeout(600)  # spawned workers import torch: slow on a loaded box
@pytest.mark.parametrize("provider", ["tcp", "nccl"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=["E=1", "E=2"])
def test_ticks_through_the_relay_are_bitwise_local_experts(placement, provider) -> None:
    workers = len(placement)
    w_gate_up, w_down = weights()
    local = LocalExperts(ExpertPart(list(range(E)), E, {3: w_gate_up}, {3: w_down}))
    owner = torch.empty(E, dtype=torch.int64)
    for e, ids in enumerate(placement):
        owner[ids] = e
    token_counts = [1, 16, 5, 11, 16, 3]  # ticks alternate micro-batches 0, 1
    ticks = [(3, n % M) for n in range(len(token_counts))]
    started = _start(placement, ticks, provider)
    server, procs, results, stop, endpoint, relay, outgoing, incoming = started
    assert relay.fixed_size == (provider == "nccl")
    try:
        shape = plane_shape(workers)
        staging = [ExpertInbox(shape, "cpu") for _ in range(workers)]
        replica = ReplicaInbox(shape, "cpu")
        replica.out.fill_(float("nan"))  # rows that were not sent must never be read
        count = torch.zeros(1, dtype=torch.int32)
        g = torch.Generator().manual_seed(1)
        for (layer, i), num_tokens in zip(ticks, token_counts):
            x = torch.randn(num_tokens, D, generator=g)
            topk_ids = torch.rand(num_tokens, E, generator=g).argsort(dim=1)[:, :K]
            owners = owner[topk_ids]
            positions = []
            for e in range(workers):
                slot = staging[e].slot(0)
                pos = pack(slot, i, x, topk_ids, owners, e, workers == 1)
                if pos is not None:
                    positions.append(pos)
                put(outgoing, e * M + i, slot.counts[i: i + 1], [slot.rows[i], slot.ids[i]],
                    num_tokens)
            for e in range(workers):
                take(incoming, e * M + i, count, [replica.out[i, e]], num_tokens, timeout_s=240)
            got = gather(replica, i, owners, torch.stack(positions) if positions else None)
            assert torch.equal(got, local.dispatch(layer, i, x, topk_ids)), (num_tokens, i)
        reports = [results.get(timeout=240) for _ in range(workers)]
        assert all(r["ok"] for r in reports), reports
        assert all(r["sent"] == r["received"] == len(ticks) for r in reports)
        # The proxy counts a frame sent after its send returns: the reply can come first.
        relay.wait_sent(workers * len(ticks), timeout_s=240)
        assert relay.frames_sent == relay.frames_received == workers * len(ticks)
        assert relay.error is None
    finally:
        stop.set()
        relay.close()
        endpoint.close()
        for proc in procs:
            proc.join(10)
        server.close()


@pytest.mark.timeout(600)  # spawned workers import torch (warm-up waits up to 240 s)
def test_a_dead_expert_worker_is_a_typed_error_within_the_timeout() -> None:
    placement = [list(range(E))]
    started = _start(placement, [(3, 0)] * 50)
    server, procs, results, stop, endpoint, relay, outgoing, incoming = started
    try:
        procs[0].kill()
        procs[0].join(10)
        shape = plane_shape(1)
        slot, replica = ExpertInbox(shape, "cpu").slot(0), ReplicaInbox(shape, "cpu")
        ids = torch.zeros(4, K, dtype=torch.int64)
        pack(slot, 0, torch.randn(4, D), ids, ids, 0, True)
        put(outgoing, 0, slot.counts[0:1], [slot.rows[0], slot.ids[0]], 4)
        start = time.monotonic()
        with pytest.raises(CommTimeoutError):
            take(incoming, 0, torch.zeros(1, dtype=torch.int32), [replica.out[0, 0]], 4,
                 timeout_s=2.0)
        assert time.monotonic() - start < 60  # the 2 s timeout, not a hang
    finally:
        relay.close()
        endpoint.close()
        server.close()


def test_mailbox_layout_and_frames() -> None:
    dispatch, _ = layouts()
    box = Mailboxes(dispatch, 2)
    assert box.section(1, 0).shape == (C, D) and box.section(1, 1).shape == (C, K)
    starts = [box.section(0, j).data_ptr() - box.data.data_ptr() for j in range(2)]
    assert all(s % 64 == 0 for s in starts) and starts[0] >= 64
    box.count(1).fill_(3)
    box.section(1, 0)[:3] = torch.arange(3 * D, dtype=torch.float32).view(3, D)
    box.section(1, 1)[:3] = 7
    assert box.count_value(1) == 3
    frame = torch.cat(box.frame(1, box.count_value(1)))
    assert frame.numel() == dispatch.payload_bytes(3)
    other = Mailboxes(dispatch, 2)
    assert other.land(0, frame) == 3
    assert int(other.count(0)) == 3
    assert torch.equal(other.section(0, 0)[:3], box.section(1, 0)[:3])
    assert torch.equal(other.section(0, 1)[:3], box.section(1, 1)[:3])
    with pytest.raises(Exception, match="does not hold"):
        other.land(1, frame[:-4])
    # Fixed-size frames (nccl): the size is the rows put() noted, not the count.
    box.set_rows(1, 5)
    fixed = torch.cat(box.frame(1, box.rows_value(1)))
    assert fixed.numel() == dispatch.payload_bytes(5)
    assert other.land(1, fixed) == 5
    assert int(other.count(1)) == 3
    assert torch.equal(other.section(1, 0)[:5], box.section(1, 0)[:5])
    with pytest.raises(Exception, match="whole rows"):
        other.land(1, fixed[:-4])
