"""Wire formats: the control-frame header and the handshake messages (pure, no sockets).

Every control frame on a tcp connection starts with a 12-byte little-endian header::

    0      1      2             4                    8                    12
    +------+------+-------------+--------------------+--------------------+
    | kind | 0    | 0 (reserved)|  imm (u32)         |  nbytes (u32)      |
    +------+------+-------------+--------------------+--------------------+

``kind`` is one of :class:`Kind`. DATA is followed by ``nbytes`` payload bytes (tcp); NOTIFY
says the payload was already written into the slot by another path (cuda_ipc, rdma); CREDIT
returns slot ``imm``; HELLO / WELCOME carry ``nbytes`` of handshake body; BYE is a
graceful close (a connection that ends without BYE is a lost peer).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from .errors import ProtocolError

HEADER = struct.Struct("<BBHII")
MAGIC = 0x4D53434D  # "MSCM"
VERSION = 1


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    DATA = 3
    NOTIFY = 4
    CREDIT = 5
    BYE = 6


def pack_header(kind: Kind, imm: int = 0, nbytes: int = 0) -> bytes:
    return HEADER.pack(int(kind), 0, 0, imm, nbytes)


def unpack_header(buf: bytes) -> tuple[Kind, int, int]:
    """(kind, imm, nbytes); ProtocolError on an unknown kind."""
    kind, _, _, imm, nbytes = HEADER.unpack(buf)
    try:
        return Kind(kind), imm, nbytes
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}: peer speaks another protocol") from None


_HELLO = struct.Struct("<IHHiiIII")


@dataclass(frozen=True)
class Hello:
    """Handshake body, both directions.

    Sender → receiver (HELLO): ``rank`` is the sender, ring fields are 0.
    Receiver → sender (WELCOME): ``rank`` is the receiver and ``slot_bytes`` /
    ``slots_per_peer`` describe the ring it registered for that sender. ``extra`` is the
    provider's out-of-band blob (a CUDA IPC handle, an RDMA :class:`RdmaPeerInfo`).
    """

    rank: int
    world_size: int
    provider: str
    slot_bytes: int = 0
    slots_per_peer: int = 0
    extra: bytes = b""

    def pack(self) -> bytes:
        name = self.provider.encode()
        if len(name) > 255:
            raise ValueError("provider name too long")
        head = _HELLO.pack(
            MAGIC, VERSION, len(name), self.rank, self.world_size,
            self.slot_bytes, self.slots_per_peer, len(self.extra),
        )
        return head + name + self.extra

    @classmethod
    def unpack(cls, buf: bytes) -> "Hello":
        if len(buf) < _HELLO.size:
            raise ProtocolError(f"handshake of {len(buf)} bytes is too short")
        magic, version, name_len, rank, world, slot_bytes, slots, extra_len = _HELLO.unpack_from(buf)
        if magic != MAGIC:
            raise ProtocolError(f"bad handshake magic {magic:#x}: not a megaserve comm peer")
        if version != VERSION:
            raise ProtocolError(f"peer speaks protocol version {version}, this is {VERSION}")
        if len(buf) != _HELLO.size + name_len + extra_len:
            raise ProtocolError("handshake length does not match its fields")
        name = buf[_HELLO.size:_HELLO.size + name_len].decode()
        extra = bytes(buf[_HELLO.size + name_len:])
        return cls(rank, world, name, slot_bytes, slots, extra)


_RDMA = struct.Struct("<IIIHHQQ16s")


@dataclass(frozen=True)
class RdmaPeerInfo:
    """What one side of an RC queue pair tells the other out of band (``Hello.extra``).

    qpn: queue-pair number; psn: initial packet sequence number; lid / port: InfiniBand
    LID and port (0 on RoCE); gid: 16-byte GID (RoCE/IB global routing); rkey / addr:
    remote key and virtual address of the receiver's ring memory region (0 from senders).
    """

    qpn: int
    psn: int
    rkey: int
    lid: int
    port: int
    addr: int
    ring_bytes: int
    gid: bytes = bytes(16)

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError(f"gid must be 16 bytes, got {len(self.gid)}")
        if not 0 <= self.qpn < (1 << 24) or not 0 <= self.psn < (1 << 24):
            raise ValueError("qpn and psn are 24-bit values")

    def pack(self) -> bytes:
        return _RDMA.pack(self.qpn, self.psn, self.rkey, self.lid, self.port, self.addr,
                          self.ring_bytes, self.gid)

    @classmethod
    def unpack(cls, buf: bytes) -> "RdmaPeerInfo":
        if len(buf) != _RDMA.size:
            raise ProtocolError(f"rdma peer info is {len(buf)} bytes, expected {_RDMA.size}")
        qpn, psn, rkey, lid, port, addr, ring_bytes, gid = _RDMA.unpack(buf)
        return cls(qpn, psn, rkey, lid, port, addr, ring_bytes, gid)
