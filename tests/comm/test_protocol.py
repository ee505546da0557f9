"""Pure parts of the protocol: immediate encoding, credits, slot accounting, wire formats."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megaserve.comm import ChannelConfig, CommTimeoutError, PeerLostError, ProtocolError, create_endpoint
from megaserve.comm.imm import MAX_LAYER, MAX_MICROBATCH, MAX_SLOT, MAX_TAG, decode_imm, encode_imm
from megaserve.comm.protocol import CompletionQueue, CreditPool, SlotRing
from megaserve.comm.wire import Hello, Kind, RdmaPeerInfo, pack_header, unpack_header


@given(st.integers(0, MAX_LAYER), st.integers(0, MAX_MICROBATCH), st.integers(0, MAX_SLOT),
       st.integers(0, MAX_TAG))
def test_imm_roundtrip(layer, mb, slot, tag):
    imm = encode_imm(layer, mb, slot, tag)
    assert 0 <= imm < 2**32
    d = decode_imm(imm)
    assert (d.layer, d.microbatch, d.slot, d.tag) == (layer, mb, slot, tag)


def test_imm_bit_layout_is_the_documented_one():
    # tag 31..28 | layer 27..16 | micro-batch 15..8 | slot 7..0
    assert encode_imm(layer=0x123, microbatch=0x45, slot=0x67, tag=0x8) == 0x81234567
    assert encode_imm(0, 0, 1) == 1 and encode_imm(0, 1, 0) == 1 << 8
    assert encode_imm(1, 0, 0) == 1 << 16 and encode_imm(0, 0, 0, 1) == 1 << 28


@pytest.mark.parametrize("field", ["layer", "microbatch", "slot", "tag"])
def test_imm_rejects_out_of_range(field):
    args = dict(layer=0, microbatch=0, slot=0, tag=0)
    args[field] = {"layer": MAX_LAYER, "microbatch": MAX_MICROBATCH, "slot": MAX_SLOT, "tag": MAX_TAG}[field] + 1
    with pytest.raises(ValueError, match=field):
        encode_imm(**args)
    args[field] = -1
    with pytest.raises(ValueError):
        encode_imm(**args)
    with pytest.raises(ValueError):
        decode_imm(2**32)


def test_credit_pool_accounting_and_blocking():
    pool = CreditPool(peer=5, num_slots=2)
    assert [pool.acquire(1), pool.acquire(1)] == [0, 1] and pool.available == 0
    with pytest.raises(CommTimeoutError, match="rank 5"):
        pool.acquire(0.05)
    threading.Timer(0.2, pool.give, args=(1,)).start()
    t0 = time.monotonic()
    assert pool.acquire(5) == 1  # the credit that came back, not the next index
    assert time.monotonic() - t0 >= 0.15
    with pytest.raises(ProtocolError):
        pool.give(7)  # never in flight
    pool.give(0)
    with pytest.raises(ProtocolError):
        pool.give(0)  # returned twice
    assert pool.available == 1  # slot 1 is still in flight
    pool.fail(PeerLostError(5))
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        pool.acquire(120)  # credits in hand or not: a lost peer raises at once
    assert time.monotonic() - t0 < 60  # not at the timeout (a loaded box may stall seconds)


def test_slot_ring_rejects_overwrite_oversize_and_double_release():
    ring = SlotRing(peer=1, num_slots=2, slot_bytes=10)
    ring.land(0, 10)
    with pytest.raises(ProtocolError, match="before it was released"):
        ring.check_landing(0, 1)
    with pytest.raises(ProtocolError, match="11 bytes"):
        ring.check_landing(1, 11)
    with pytest.raises(ProtocolError, match="slot 2"):
        ring.check_landing(2, 0)
    ring.release(0)
    with pytest.raises(ProtocolError, match="released twice"):
        ring.release(0)
    assert ring.busy == 0


def test_completion_queue_loss_is_delivered_after_earlier_completions_and_sticks():
    q = CompletionQueue()
    q.put("c1")  # type: ignore[arg-type]
    q.put_lost(3, "killed")
    assert q.get(1) == "c1"
    for _ in range(2):
        with pytest.raises(PeerLostError) as e:
            q.get(5)
        assert e.value.peer == 3
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        q.get(120)
    assert time.monotonic() - t0 < 60  # at once, not at the timeout


def test_channel_config_validation():
    with pytest.raises(ValueError, match="slots_per_peer"):
        ChannelConfig(slots_per_peer=257)
    with pytest.raises(ValueError, match="slot_bytes"):
        ChannelConfig(slot_bytes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        ChannelConfig(timeout_s=0)


def test_wire_header_and_hello_roundtrip():
    assert unpack_header(pack_header(Kind.CREDIT, 7, 0)) == (Kind.CREDIT, 7, 0)
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        unpack_header(b"\x63" + bytes(11))
    h = Hello(rank=3, world_size=8, provider="cuda_ipc", slot_bytes=1 << 20, slots_per_peer=4, extra=b"\x01\x02")
    assert Hello.unpack(h.pack()) == h
    bad = bytearray(h.pack())
    bad[0] ^= 0xFF
    with pytest.raises(ProtocolError, match="magic"):
        Hello.unpack(bytes(bad))
    with pytest.raises(ProtocolError, match="length"):
        Hello.unpack(h.pack() + b"x")


def test_rdma_handshake_roundtrip_and_validation():
    info = RdmaPeerInfo(qpn=0x12345, psn=0xABCDE, rkey=0xDEADBEEF, lid=7, port=1,
                        addr=0x7F0000001000, ring_bytes=32 << 20, gid=bytes(range(16)))
    assert RdmaPeerInfo.unpack(info.pack()) == info
    with pytest.raises(ProtocolError):
        RdmaPeerInfo.unpack(info.pack()[:-1])
    with pytest.raises(ValueError, match="gid"):
        RdmaPeerInfo(1, 1, 1, 0, 1, 0, 0, gid=b"short")
    with pytest.raises(ValueError, match="24-bit"):
        RdmaPeerInfo(1 << 24, 1, 1, 0, 1, 0, 0)


def test_registry_unknown_provider_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown comm provider 'ucx'.*cuda_ipc.*inproc.*nccl.*rdma.*tcp"):
        create_endpoint("ucx", 0, 1)
