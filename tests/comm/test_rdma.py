"""rdma provider: its pure parts on CPU; a real pyverbs exchange only where a device exists."""

from __future__ import annotations

import enum
import types

import pytest

from megaserve.comm import ChannelConfig, CommError, create_endpoint
from megaserve.comm.rdma import SignalPolicy, bytes_to_gid, gid_to_bytes, rdma_unavailable, verbs_enum


def test_verbs_enum_resolves_old_and_new_pyverbs_layouts():
    class ibv_wr_opcode(enum.IntEnum):  # noqa: N801 - pyverbs' own spelling
        IBV_WR_RDMA_WRITE_WITH_IMM = 1

    new_style = types.SimpleNamespace(ibv_wr_opcode=ibv_wr_opcode)  # pyverbs.libibverbs_enums
    old_style = types.SimpleNamespace(IBV_WR_RDMA_WRITE_WITH_IMM=1)  # pyverbs.enums
    for module in (new_style, old_style):
        assert verbs_enum(module, "ibv_wr_opcode", "IBV_WR_RDMA_WRITE_WITH_IMM") == 1
    with pytest.raises(CommError, match="IBV_WR_SEND"):
        verbs_enum(new_style, "ibv_wr_opcode", "IBV_WR_SEND")


def test_gid_text_bytes_roundtrip():
    text = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    raw = gid_to_bytes(text)
    assert len(raw) == 16 and raw[:2] == b"\xfe\x80"
    assert bytes_to_gid(raw) == text


def test_selective_signalling_never_overflows_the_send_queue():
    policy = SignalPolicy(every=4, sq_depth=10)
    signalled, drains = [], 0
    for _ in range(100):
        while policy.must_drain():
            policy.on_signalled_completion()  # what reaping a signalled completion does
            drains += 1
        signalled.append(policy.on_post())
        assert policy.outstanding <= policy.sq_depth
    assert sum(signalled) == 25  # one in four
    assert drains > 0 and policy.outstanding <= policy.sq_depth
    assert signalled[:8] == [False, False, False, True] * 2
    with pytest.raises(ValueError):
        SignalPolicy(every=10, sq_depth=10)


def _rdma_device_or_skip() -> None:
    reason = rdma_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.timeout(60)
def test_rdma_write_with_imm_between_two_endpoints():
    _rdma_device_or_skip()
    cfg = ChannelConfig(slot_bytes=1 << 16, slots_per_peer=2, timeout_s=10)
    eps = [create_endpoint("rdma", r, 2, cfg) for r in range(2)]
    try:
        addresses = [e.address for e in eps]
        for e in eps:
            e.connect(addresses)
        for i in range(8):
            data = bytes([i]) * (i * 1000)
            eps[0].send(1, data, layer=i, microbatch=1)
            c = eps[1].poll()
            assert (c.src, c.layer, c.microbatch, bytes(c.data)) == (0, i, 1, data)
            eps[1].release(c)
    finally:
        for e in eps:
            e.close()
