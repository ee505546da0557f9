"""Process bodies of the relay tests (importable under spawn): an expert worker that
serves the device data plane's ticks through host-proxied mailboxes over a real endpoint."""

from __future__ import annotations

import traceback

import torch

from megaserve.comm import create_endpoint, exchange
from megaserve.comm.relay import Mailboxes, Relay, Route, put, take

E, D, INTER, K, C, M = 8, 32, 16, 2, 16, 2  # experts, hidden, intermediate, top-k, rows, m


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(E, 2 * INTER, D, generator=g) / D ** 0.5
    w_down = torch.randn(E, D, INTER, generator=g) / INTER ** 0.5
    return w_gate_up, w_down


def layouts():
    from megaserve.comm.relay import MailboxLayout, Section

    dispatch = MailboxLayout(C, (Section((D,), torch.float32), Section((K,), torch.int32)))
    combine = MailboxLayout(C, (Section((K, D), torch.float32),))
    return dispatch, combine


def plane_shape(workers: int):
    from megaserve.runtime.device_plane import PlaneShape

    return PlaneShape(num_workers=workers, microbatches=M, capacity=C, hidden=D, top_k=K,
                      num_experts=E, dtype=torch.float32)


def expert_worker(index: int, expert_ids: list[int], workers: int, ticks: list[tuple[int, int]],
                  rdv: str, results, stop, provider: str = "tcp") -> None:
    """Expert worker ``index`` (rank 1 + index; the replica is rank 0): for each
    (layer, micro-batch) of ``ticks``, take the dispatch, compute, put the combine; then
    stay up until ``stop`` is set."""
    from megaserve.models.expert_part import ExpertPart
    from megaserve.runtime.device_plane import ExpertInbox, ExpertServer, ReplicaInbox

    relay = endpoint = None
    try:
        w_gate_up, w_down = weights()
        shape = plane_shape(workers)
        part = ExpertPart(expert_ids, E, {3: w_gate_up[expert_ids]}, {3: w_down[expert_ids]})
        inbox, staging = ExpertInbox(shape, "cpu"), ReplicaInbox(shape, "cpu")
        server = ExpertServer(part, index, shape, inbox, [staging], [3], "cpu")
        dispatch, combine = layouts()
        incoming, outgoing = Mailboxes(dispatch, M), Mailboxes(combine, M)
        endpoint = create_endpoint(provider, 1 + index, 1 + workers)
        endpoint.connect(exchange(rdv, 1 + index, 1 + workers, endpoint.address), send_to=[0])
        Relay.warm_up(endpoint, [0], timeout_s=240)  # what the device plane does first
        routes = [Route(local=i, dst=0, remote=index * M + i) for i in range(M)]
        relay = Relay(endpoint, outgoing, routes, incoming)
        for layer, i in ticks:
            take(incoming, i, inbox.counts[0, i: i + 1], [inbox.rows[0, i], inbox.ids[0, i]], C)
            server._tick(layer, i, C, use_flags=False)
            put(outgoing, i, inbox.counts[0, i: i + 1], [staging.out[i, index]], C)
        relay.wait_sent(len(ticks), timeout_s=240)
        results.put({"index": index, "ok": True, "sent": relay.frames_sent,
                     "received": relay.frames_received})
        stop.wait(60)
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put({"index": index, "ok": False, "error": traceback.format_exc()})
    finally:
        if relay is not None:
            relay.close()
        if endpoint is not None:
            endpoint.close()
