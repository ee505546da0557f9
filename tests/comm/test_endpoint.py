"""Endpoint behaviour shared by the host providers (inproc, tcp, nccl on gloo), workers as threads."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest
import torch

from megaserve.comm import (ChannelConfig, CommTimeoutError, EndpointClosedError, PeerLostError,
                  RendezvousServer, create_endpoint, exchange)
from megaserve.comm.errors import ProtocolError
from megaserve.comm.tcp import parse_address
from tests.comm.workers import payload

PROVIDERS = ["inproc", "tcp", "nccl"]  # nccl: its gloo (CPU) backend


def _comm_threads() -> int:
    return sum(t.name.startswith("comm-") for t in threading.enumerate())


def _group(provider, world, cfg, send_to=None):
    eps = [create_endpoint(provider, r, world, cfg) for r in range(world)]
    addresses = [e.address for e in eps]
    for e in eps:
        e.connect(addresses, None if send_to is None else send_to(e.rank))
    return eps


@pytest.mark.timeout(300)  # a hang fails; a loaded box may take minutes
@pytest.mark.parametrize("provider", PROVIDERS)
def test_threads_many_to_many_payload_types(provider):
    cfg = ChannelConfig(slot_bytes=1 << 20, slots_per_peer=2, timeout_s=20)
    senders, receivers, messages = [0, 1], [2, 3], 6
    eps = _group(provider, 4, cfg, lambda r: receivers if r in senders else [])
    errors = []

    def send(ep):
        try:
            for seq in range(messages):
                for dst in receivers:
                    data = payload(ep.rank, dst, seq, max_bytes=(1 << 20) - 64)
                    kind = seq % 3
                    if kind == 0:
                        obj = data
                    elif kind == 1:
                        obj = np.frombuffer(data, np.uint8)
                    else:  # header + CPU tensor parts, one slot
                        obj = [data[:64], torch.frombuffer(bytearray(data[64:]), dtype=torch.uint8)] if len(data) > 64 else data
                    ep.send(dst, obj, layer=seq, microbatch=ep.rank)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    checked = []

    def receive(ep):
        try:
            for _ in range(messages * len(senders)):  # fewer slots than messages: release as we go
                c = ep.poll()
                ok = bytes(c.data) == payload(c.src, ep.rank, c.layer, max_bytes=(1 << 20) - 64)
                checked.append(ok and c.microbatch == c.src)
                ep.release(c)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=send, args=(eps[s],)) for s in senders]
    threads += [threading.Thread(target=receive, args=(eps[r],)) for r in receivers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(checked) == messages * len(senders) * len(receivers) and all(checked)
    for e in eps:
        e.close()
    assert _comm_threads() == 0


@pytest.mark.timeout(300)  # a hang fails; a loaded box may take minutes
@pytest.mark.parametrize("provider", PROVIDERS)
def test_bf16_tensor_payload_roundtrip(provider):
    eps = _group(provider, 2, ChannelConfig(slot_bytes=4096, slots_per_peer=1, timeout_s=5))
    x = torch.randn(3, 5).to(torch.bfloat16)
    eps[0].send(1, x, layer=2, microbatch=1)
    c = eps[1].poll()
    got = torch.frombuffer(bytearray(c.data), dtype=torch.bfloat16).reshape(3, 5)
    assert torch.equal(got, x)
    assert c.numpy("uint8").nbytes == x.numel() * 2
    eps[1].release(c)
    for e in eps:
        e.close()


@pytest.mark.timeout(300)  # a hang fails; a loaded box may take minutes
@pytest.mark.parametrize("provider", PROVIDERS)
def test_errors_timeouts_and_idempotent_close(provider):
    cfg = ChannelConfig(slot_bytes=64, slots_per_peer=1, timeout_s=5)
    a, b = _group(provider, 2, cfg)
    with pytest.raises(ValueError, match="slot size 64"):
        a.send(1, b"x" * 65, layer=0, microbatch=0)
    with pytest.raises(ValueError, match="not connected"):
        a.send(0, b"x", layer=0, microbatch=0)
    with pytest.raises(ValueError, match="layer"):
        a.send(1, b"x", layer=5000, microbatch=0)
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError):
        b.poll(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 60  # the timeout, not a hang
    a.send(1, b"1", layer=0, microbatch=0)
    c = b.poll()
    b.release(c)
    with pytest.raises(ProtocolError, match="released twice"):
        b.release(c)
    a.send(1, b"2", layer=0, microbatch=0)
    with pytest.raises(CommTimeoutError, match="no credit"):
        a.send(1, b"3", layer=0, microbatch=0, timeout=0.2)

    # a sender blocked on credits learns at once that its receiver closed
    outcome = []

    def blocked_send():
        try:
            a.send(1, b"4", layer=0, microbatch=0, timeout=120)
        except Exception as e:  # noqa: BLE001
            outcome.append((type(e), time.monotonic()))

    t = threading.Thread(target=blocked_send)
    t.start()
    time.sleep(0.2)
    closed_at = time.monotonic()
    b.close()
    b.close()  # idempotent
    t.join(90)  # at once, not at the send's 120 s timeout (a loaded box may stall seconds)
    assert outcome and outcome[0][0] is PeerLostError and outcome[0][1] - closed_at < 60

    # close wakes a blocked poller with EndpointClosedError
    woke = []
    t = threading.Thread(target=lambda: woke.append(pytest.raises(EndpointClosedError, a.poll, 120)))
    t.start()
    time.sleep(0.1)
    a.close()
    t.join(90)  # woken by the close, not by the poll's 120 s timeout
    assert woke and not t.is_alive()
    with pytest.raises(EndpointClosedError):
        a.send(1, b"x", layer=0, microbatch=0)
    assert _comm_threads() == 0


@pytest.mark.timeout(300)  # a hang fails; a loaded box may take minutes
def test_rendezvous_exchange_and_duplicate_rank():
    server = RendezvousServer(3)
    eps = [create_endpoint("tcp", r, 3) for r in range(3)]
    out = [None] * 3
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, exchange(server.address, r, 3, eps[r].address)))
               for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # each exchange gives up after its own 60 s
    assert out == [[e.address for e in eps]] * 3
    for e in eps:
        e.close()
    server.close()

    # Rank 0 registered (by hand: its line sent before the duplicate connects, and the
    # server takes connections in the order they arrived), then rank 0 again.
    server = RendezvousServer(2)
    holder = socket.create_connection(parse_address(server.address), timeout=60)
    holder.sendall(json.dumps({"rank": 0, "address": "h:1"}).encode() + b"\n")
    with pytest.raises(ProtocolError, match="duplicate rank 0"):
        exchange(server.address, 0, 2, "h:2", timeout_s=60)
    holder.close()
    server.close()
