"""Worker-process bodies for the multi-process comm tests (importable under spawn)."""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np

from megaserve.comm import ChannelConfig, CommError, create_endpoint, exchange

MiB = 1 << 20


def payload(src: int, dst: int, seq: int, max_bytes: int = MiB) -> bytes:
    """Deterministic random payload of 0..max_bytes bytes for (src, dst, seq)."""
    rng = np.random.default_rng([src, dst, seq])
    size = int(rng.integers(0, max_bytes + 1))
    if seq % 7 == 0:
        size = (0, max_bytes)[seq % 2]  # always cover the empty and the full slot
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def _report(results, rank: int, **fields) -> None:
    fields["rank"] = rank
    fields["threads_after_close"] = sum(t.name.startswith("comm-") for t in threading.enumerate())
    results.put(fields)


def many_to_many(rank, senders, receivers, messages, rdv, cfg, results, provider="tcp") -> None:
    """Senders send ``messages`` random payloads to every receiver; receivers verify them,
    releasing in shuffled batches so credits come back out of order."""
    world = len(senders) + len(receivers)
    try:
        ep = create_endpoint(provider, rank, world, cfg)
        addresses = exchange(rdv, rank, world, ep.address)
        ep.connect(addresses, send_to=receivers if rank in senders else [])
        if rank in senders:
            for seq in range(messages):
                for dst in receivers:
                    ep.send(dst, payload(rank, dst, seq), layer=seq, microbatch=rank)
            # wait for every receiver's "done" (a 0-byte frame) before closing
            done = ep.poll_many(len(receivers))
            for c in done:
                ep.release(c)
            ep.close()
            _report(results, rank, ok=True)
            return
        rng = np.random.default_rng(rank)
        seen: dict[int, list[int]] = {s: [] for s in senders}
        arrival = []
        held = []
        bad = 0
        for _ in range(messages * len(senders)):
            c = ep.poll()
            arrival.append(c.src)
            seq = c.layer
            bad += c.microbatch != c.src or bytes(c.data) != payload(c.src, rank, seq)
            seen[c.src].append(seq)
            held.append(c)
            if len(held) >= int(rng.integers(1, 4)):
                for i in rng.permutation(len(held)):
                    ep.release(held[i])
                held = []
        for c in held:
            ep.release(c)
        ep.connect(addresses, send_to=senders)
        for s in senders:
            ep.send(s, b"", layer=0, microbatch=0)
        time.sleep(0.2)  # let the senders read "done" before our BYE
        ep.close()
        _report(results, rank, ok=True, bad=bad, seen=seen, arrival=arrival)
    except Exception:  # noqa: BLE001 - reported to the test
        results.put({"rank": rank, "ok": False, "error": traceback.format_exc()})


def credit_blocking(rank, rdv, cfg, hold_s, results, provider="tcp") -> None:
    """Rank 0 sends slots_per_peer+1 frames to rank 1, which releases only after ``hold_s``."""
    try:
        ep = create_endpoint(provider, rank, 2, cfg)
        ep.connect(exchange(rdv, rank, 2, ep.address), send_to=[1 - rank])
        n = cfg.slots_per_peer
        if rank == 0:
            for i in range(n):
                ep.send(1, b"x" * 100, layer=i, microbatch=0)
            credits_when_full = ep.credits(1)
            t0 = time.monotonic()
            ep.send(1, b"y" * 100, layer=n, microbatch=0)
            blocked = time.monotonic() - t0
            ep.release(ep.poll())  # receiver's "done"
            ep.close()
            _report(results, rank, ok=True, blocked=blocked, credits_when_full=credits_when_full)
        else:
            got = ep.poll_many(n)
            time.sleep(hold_s)
            ep.release(got[1])  # out of order: slot 1 comes back first
            last = ep.poll()
            for c in got[:1] + got[2:] + [last]:
                ep.release(c)
            ep.send(0, b"", layer=0, microbatch=0)
            time.sleep(0.2)
            ep.close()
            _report(results, rank, ok=True, last_layer=last.layer, last_slot=last.slot)
    except Exception:  # noqa: BLE001
        results.put({"rank": rank, "ok": False, "error": traceback.format_exc()})


def victim_scenario(rank, rdv, cfg, ready, results, provider="tcp") -> None:
    """Rank 0 is killed by the test. Rank 1 polls for a frame rank 0 never sends; rank 2
    is blocked sending to rank 0, which never releases. Both must get PeerLostError."""
    try:
        ep = create_endpoint(provider, rank, 3, cfg)
        addresses = exchange(rdv, rank, 3, ep.address)
        ep.connect(addresses, send_to={0: [1], 1: [], 2: [0]}[rank])
        if rank == 0:
            ep.send(1, b"first", layer=1, microbatch=0)
            ready.put(0)
            time.sleep(60)  # "mid-step": killed here
            return
        if rank == 1:
            first = ep.poll()
            ep.release(first)
        else:
            for i in range(cfg.slots_per_peer):
                ep.send(0, b"z", layer=i, microbatch=0)
        ready.put(rank)
        t0 = time.monotonic()
        try:
            if rank == 1:
                ep.poll()
            else:
                ep.send(0, b"blocked", layer=9, microbatch=0)
            outcome, peer = "no error", None
        except CommError as e:
            outcome, peer = type(e).__name__, getattr(e, "peer", None)
        elapsed = time.monotonic() - t0
        ep.close()
        _report(results, rank, ok=True, outcome=outcome, peer=peer, elapsed=elapsed, pid=os.getpid())
    except Exception:  # noqa: BLE001
        results.put({"rank": rank, "ok": False, "error": traceback.format_exc()})


def gpu_pair(rank, provider, backend, rdv, results) -> None:
    """Two ranks exchange tensors both ways over ``provider`` (cuda_ipc, or nccl on the
    nccl or gloo backend). Both ranks first send ``slots_per_peer`` messages, then receive
    them (both directions in flight at once: the ping-pong order that serialises a single
    NCCL communicator per rank pair).

    Each message i is a deterministic bf16 tensor of a varying shape (up to ~1 MiB); the
    receiver checks it bitwise and that it arrived on its own device."""
    try:
        import torch

        gpu = backend != "gloo"
        device = torch.device("cuda", rank) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(device)
        cfg = ChannelConfig(slot_bytes=1 << 20, slots_per_peer=2, timeout_s=60)
        options = {"device": device} if provider == "cuda_ipc" else {"backend": backend, "device": device}
        ep = create_endpoint(provider, rank, 2, cfg, **options)
        ep.connect(exchange(rdv, rank, 2, ep.address, timeout_s=60))
        peer = 1 - rank

        def expected(src: int, i: int):
            g = torch.Generator().manual_seed(1000 * src + i)
            return torch.randn(1 + 1400 * i, 64, generator=g).to(torch.bfloat16)

        bad, devices = 0, set()
        for first in range(0, 6, cfg.slots_per_peer):
            batch = range(first, first + cfg.slots_per_peer)
            for i in batch:
                ep.send(peer, expected(rank, i).to(device), layer=i, microbatch=rank)
            for c in sorted(ep.poll_many(len(batch)), key=lambda c: c.layer):
                got = c.tensor(torch.bfloat16, (-1, 64))
                devices.add(str(got.device))
                bad += c.microbatch != peer or not torch.equal(got.cpu(), expected(peer, c.layer))
                ep.release(c)
        ep.close()
        results.put({"rank": rank, "ok": True, "bad": bad, "devices": sorted(devices)})
    except Exception:  # noqa: BLE001
        results.put({"rank": rank, "ok": False, "error": traceback.format_exc()})
