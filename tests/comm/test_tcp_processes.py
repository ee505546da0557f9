"""The protocol with real worker processes on 127.0.0.1 (spawn): over tcp, and over nccl
on its gloo backend (torch.distributed P2P data plane, same control plane)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from megaserve.comm import ChannelConfig, RendezvousServer
from megaserve.comm.bench import reap
from tests.comm import workers

MiB = 1 << 20
CTX = mp.get_context("spawn")
PROVIDERS = ["tcp", "nccl"]


def _collect(results, n, timeout):
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < n:
        r = results.get(timeout=max(0.1, deadline - time.monotonic()))
        assert r["ok"], r.get("error")
        out[r["rank"]] = r
    return out


def _reap(procs):
    reap(procs)
    assert all(p.exitcode is not None for p in procs)
    assert not [p for p in CTX.active_children() if p in procs]


# Spawned workers import torch: on a loaded 2-core machine, starting five takes tens of
# seconds. Waits are bounded by that start-up, generously; what is asserted is the outcome.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_many_senders_many_receivers_random_sizes(provider):
    senders, receivers, messages = [0, 1, 2], [3, 4], 12
    cfg = ChannelConfig(slot_bytes=MiB, slots_per_peer=3, timeout_s=120)
    rdv = RendezvousServer(5)
    results = CTX.Queue()
    procs = [CTX.Process(target=workers.many_to_many,
                         args=(r, senders, receivers, messages, rdv.address, cfg, results, provider))
             for r in range(5)]
    try:
        for p in procs:
            p.start()
        out = _collect(results, 5, timeout=240)
    finally:
        _reap(procs)
        rdv.close()
    for r in receivers:
        assert out[r]["bad"] == 0, "payload bytes or immediate fields corrupted"
        # counted, per sender: every sequence number exactly once, in that sender's order
        assert out[r]["seen"] == {s: list(range(messages)) for s in senders}
    for r in range(5):
        assert out[r]["threads_after_close"] == 0, "comm threads leaked after close()"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_credit_exhaustion_blocks_until_release(provider):
    hold_s = 1.0
    cfg = ChannelConfig(slot_bytes=4096, slots_per_peer=3, timeout_s=120)
    rdv = RendezvousServer(2)
    results = CTX.Queue()
    procs = [CTX.Process(target=workers.credit_blocking, args=(r, rdv.address, cfg, hold_s, results, provider))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        out = _collect(results, 2, timeout=240)
    finally:
        _reap(procs)
        rdv.close()
    assert out[0]["credits_when_full"] == 0
    assert hold_s * 0.8 <= out[0]["blocked"] < hold_s + 60, "sender did not block on credits"
    assert out[1]["last_layer"] == 3
    assert out[1]["last_slot"] == 1, "the first credit back (slot 1) must be the slot reused"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_peer_killed_mid_step_is_a_typed_error_within_timeout(provider):
    timeout_s = 8.0
    cfg = ChannelConfig(slot_bytes=4096, slots_per_peer=2, timeout_s=timeout_s)
    rdv = RendezvousServer(3)
    results, ready = CTX.Queue(), CTX.Queue()
    procs = [CTX.Process(target=workers.victim_scenario, args=(r, rdv.address, cfg, ready, results, provider))
             for r in range(3)]
    try:
        for p in procs:
            p.start()
        assert sorted(ready.get(timeout=180) for _ in range(3)) == [0, 1, 2]
        time.sleep(0.3)  # ranks 1 and 2 are now inside their blocking call
        os.kill(procs[0].pid, signal.SIGKILL)
        out = _collect(results, 2, timeout=timeout_s + 10)
    finally:
        _reap(procs)
        rdv.close()
    assert procs[0].exitcode == -signal.SIGKILL
    for r in (1, 2):
        assert out[r]["outcome"] == "PeerLostError", out[r]
        assert out[r]["peer"] == 0
        assert out[r]["elapsed"] < timeout_s, "loss surfaced only after the timeout"
        assert out[r]["threads_after_close"] == 0
