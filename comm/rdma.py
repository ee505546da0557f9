"""``rdma``: the protocol mapped onto pyverbs (RC queue pairs, RDMA WRITE WITH IMM).

Mapping (per ordered pair sender s → receiver r, one RC QP on each side):

* out of band: the tcp control connection carries the HELLO (s's QP number, PSN, LID, GID)
  and the WELCOME (r's QP number, PSN, LID, GID, and the rkey / address of the ring MR that
  r registered for s) as :class:`megaserve.comm.wire.RdmaPeerInfo`; credits (CREDIT frames), BYE
  and liveness (EOF = lost peer) stay on that connection.
* data: s copies the payload into its staging MR at the slot's offset and posts
  ``IBV_WR_RDMA_WRITE_WITH_IMM`` to ``ring_addr + slot * slot_bytes`` with the immediate in
  network byte order. Only every ``signal_every``-th WR is signalled (selective
  signalling); the send CQ is drained before the send queue could overflow.
* completion: r's CQ polling thread turns each ``IBV_WC_RECV_RDMA_WITH_IMM`` into a
  :class:`Completion` and re-posts the consumed receive WR at once. r posts
  ``slots_per_peer`` receive WRs per QP up front, and a sender never has more writes in
  flight than credits, so the receive queue never runs dry: ``rnr_retry`` is 0 (an RNR is
  a protocol bug and fails loudly instead of being retried).
* memory: pinned host staging only (pyverbs-allocated MRs; the receiver copies the slot
  out with ``mr.read``). NOT implemented yet: dmabuf MRs (``pyverbs.mr.DmaBufMR``) for GPU
  buffers, which would remove both host copies.

pyverbs renamed its enum module (``pyverbs.enums`` constants → ``pyverbs.libibverbs_enums``
IntEnum classes); :func:`verbs_enum` resolves either. Nothing here was run against a real
device in this repository: no RDMA NIC exists on its machines (tests skip saying so).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .errors import CommError, PeerLostError, ProtocolError
from .imm import slot_of
from .protocol import ChannelConfig, Completion
from .tcp import TcpEndpoint
from .wire import Hello, RdmaPeerInfo

log = logging.getLogger(__name__)


# -- pure helpers (unit-tested without pyverbs) ------------------------------------------
def rdma_unavailable() -> str | None:
    """Why the rdma provider cannot run on this machine (no pyverbs, no device), or None."""
    try:
        import pyverbs.device as vd
    except ImportError:
        return ("pyverbs is not importable: it ships with rdma-core, not on PyPI (Debian/Ubuntu: "
                "apt install python3-pyverbs; Fedora/RHEL: dnf install python3-pyverbs; in a "
                "virtualenv, create it with --system-site-packages)")
    if not vd.get_device_list():
        return "pyverbs is installed but no RDMA device exists on this machine"
    return None


def verbs_enum(module: Any, enum_class: str, member: str) -> int:
    """Value of an ibverbs constant across pyverbs versions.

    New pyverbs: ``libibverbs_enums.<enum_class>.<member>``; old: ``enums.<member>``.
    Raises CommError naming the member if neither exists.
    """
    holder = getattr(module, enum_class, None)
    if holder is not None and hasattr(holder, member):
        return int(getattr(holder, member))
    if hasattr(module, member):
        return int(getattr(module, member))
    raise CommError(f"pyverbs has no {enum_class}.{member}: unsupported pyverbs version")


def import_verbs_enums() -> Any:
    """The pyverbs enum module of whichever version is installed."""
    try:
        from pyverbs import libibverbs_enums as enums  # rdma-core >= 47
    except ImportError:
        from pyverbs import enums  # older rdma-core
    return enums


def gid_to_bytes(gid: str) -> bytes:
    """``"fe80:0000:...:0001"`` (pyverbs GID text) → 16 bytes."""
    return ipaddress.IPv6Address(gid).packed


def bytes_to_gid(raw: bytes) -> str:
    """16 bytes → pyverbs GID text (8 groups of 4 hex digits)."""
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


@dataclass
class SignalPolicy:
    """Selective signalling: signal one WR in ``every``; never overflow the send queue.

    SQ entries of unsignalled WRs are freed only when a later signalled WR completes, so the
    policy tracks, per signalled WR, how many entries its completion frees. ``must_drain()``
    says the caller must reap a send completion (``on_signalled_completion``) before
    posting; ``on_post()`` says whether the WR about to be posted is signalled. With
    ``every < sq_depth`` a full queue always holds a signalled WR to reap.
    """

    every: int
    sq_depth: int
    posted: int = 0
    outstanding: int = 0  # SQ entries in use
    tail: int = 0  # unsignalled WRs posted since the last signalled one
    batches: deque = field(default_factory=deque)  # entries freed by each signalled WR in flight

    def __post_init__(self) -> None:
        if not 1 <= self.every < self.sq_depth:
            raise ValueError(f"signal every={self.every} must be in 1..sq_depth-1 ({self.sq_depth - 1})")

    def must_drain(self) -> bool:
        return self.outstanding >= self.sq_depth

    def on_post(self) -> bool:
        self.posted += 1
        self.outstanding += 1
        self.tail += 1
        if self.posted % self.every:
            return False
        self.batches.append(self.tail)
        self.tail = 0
        return True

    def on_signalled_completion(self) -> None:
        self.outstanding -= self.batches.popleft()


# -- the endpoint ----------------------------------------------------------------------
class RdmaEndpoint(TcpEndpoint):
    """Endpoint over an RDMA NIC. ``device_name``: e.g. "mlx5_0" (default: the first)."""

    provider = "rdma"

    def __init__(self, rank: int, world_size: int, config: ChannelConfig | None = None, *,
                 device_name: str | None = None, ib_port: int = 1, gid_index: int = 0,
                 signal_every: int = 16, host: str = "127.0.0.1", port: int = 0) -> None:
        try:
            import pyverbs.device as vd
            from pyverbs.cq import CQ
            from pyverbs.pd import PD
        except ImportError as e:
            raise ValueError(f"the rdma provider needs pyverbs: {rdma_unavailable()}") from e
        self._e = import_verbs_enums()
        names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in vd.get_device_list()]
        if not names:
            raise ValueError("no RDMA device found (ibv_devices is empty); use tcp")
        cfg = config or ChannelConfig()
        self._ctx = vd.Context(name=device_name or names[0])
        self._pd = PD(self._ctx)
        depth = max(64, 4 * cfg.slots_per_peer * world_size)
        self._recv_cq, self._send_cq = CQ(self._ctx, depth), CQ(self._ctx, depth)
        self._ib_port, self._gid_index, self._signal_every = ib_port, gid_index, signal_every
        self._lid = self._ctx.query_port(ib_port).lid
        self._gid = gid_to_bytes(self._ctx.query_gid(ib_port, gid_index).gid)
        self._pending_qps: dict[int, Any] = {}
        self._qp_src: dict[int, tuple[Any, Any, int]] = {}  # qpn -> (qp, ring MR, sender rank)
        self._send_lock = threading.Lock()
        super().__init__(rank, world_size, cfg, host=host, port=port)
        self._spawn(self._cq_loop, "cq")

    # -- verbs objects -------------------------------------------------------------------
    def _new_qp(self) -> Any:
        from pyverbs.qp import QP, QPCap, QPInitAttr

        e, n = self._e, self.config.slots_per_peer
        cap = QPCap(max_send_wr=4 * n + self._signal_every, max_recv_wr=n, max_send_sge=1, max_recv_sge=1)
        attr = QPInitAttr(qp_type=verbs_enum(e, "ibv_qp_type", "IBV_QPT_RC"), scq=self._send_cq,
                          rcq=self._recv_cq, cap=cap, sq_sig_all=0)
        return QP(self._pd, attr)

    def _new_mr(self, nbytes: int, remote_write: bool) -> Any:
        from pyverbs.mr import MR

        e = self._e
        access = verbs_enum(e, "ibv_access_flags", "IBV_ACCESS_LOCAL_WRITE")
        if remote_write:
            access |= verbs_enum(e, "ibv_access_flags", "IBV_ACCESS_REMOTE_WRITE")
        return MR(self._pd, nbytes, access)

    def _my_info(self, qp: Any, mr: Any = None) -> RdmaPeerInfo:
        return RdmaPeerInfo(qpn=qp.qp_num, psn=0, rkey=mr.rkey if mr else 0, lid=self._lid,
                            port=self._ib_port, addr=mr.buf if mr else 0,
                            ring_bytes=self.config.ring_bytes if mr else 0, gid=self._gid)

    def _connect_qp(self, qp: Any, remote: RdmaPeerInfo) -> None:
        """INIT → RTR → RTS against ``remote`` (rnr_retry 0: credits make RNR impossible)."""
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self._e
        attr = QPAttr(port_num=self._ib_port)
        attr.qp_access_flags = (verbs_enum(e, "ibv_access_flags", "IBV_ACCESS_LOCAL_WRITE")
                                | verbs_enum(e, "ibv_access_flags", "IBV_ACCESS_REMOTE_WRITE"))
        qp.to_init(attr)
        gr = GlobalRoute(sgid_index=self._gid_index)
        from pyverbs.addr import GID

        gid = GID()
        gid.gid = bytes_to_gid(remote.gid)
        gr.dgid = gid
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=self._ib_port, dlid=remote.lid)
        attr.path_mtu = verbs_enum(e, "ibv_mtu", "IBV_MTU_1024")
        attr.dest_qp_num, attr.rq_psn, attr.max_dest_rd_atomic, attr.min_rnr_timer = remote.qpn, remote.psn, 1, 12
        qp.to_rtr(attr)
        attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = 0, 14, 7, 0, 1
        qp.to_rts(attr)

    def _post_recv(self, qp: Any, wr_id: int) -> None:
        from pyverbs.wr import RecvWR

        qp.post_recv(RecvWR(wr_id=wr_id, num_sge=0))

    # -- handshake hooks (see TcpEndpoint) ------------------------------------------------
    def _hello_extra(self, dst: int) -> bytes:
        qp = self._new_qp()
        self._pending_qps[dst] = qp
        return self._my_info(qp).pack()

    def _ring_storage(self, hello: Hello) -> tuple[Any, bytes]:
        remote = RdmaPeerInfo.unpack(hello.extra)
        qp, mr = self._new_qp(), self._new_mr(self.config.ring_bytes, remote_write=True)
        self._connect_qp(qp, remote)
        for i in range(self.config.slots_per_peer):
            self._post_recv(qp, i)
        self._qp_src[qp.qp_num] = (qp, mr, hello.rank)
        return mr, self._my_info(qp, mr).pack()

    def _attach(self, welcome: Hello) -> Any:
        remote = RdmaPeerInfo.unpack(welcome.extra)
        qp = self._pending_qps.pop(welcome.rank)
        self._connect_qp(qp, remote)
        staging = self._new_mr(self.config.ring_bytes if remote.ring_bytes == 0 else remote.ring_bytes, False)
        sq_depth = 4 * self.config.slots_per_peer + self._signal_every  # = max_send_wr of _new_qp
        return {"qp": qp, "remote": remote, "staging": staging,
                "signal": SignalPolicy(self._signal_every, sq_depth)}

    # -- data path ---------------------------------------------------------------------
    def _write(self, dst: int, slot: int, imm: int, obj: Any, nbytes: int) -> None:
        from pyverbs.wr import SGE, SendWR

        e, peer = self._e, self._out[dst]
        r = peer.remote
        offset = slot * peer.welcome.slot_bytes
        pos = offset
        for view in obj:  # pinned-host staging (the slot is ours while we hold its credit)
            if view.nbytes:
                r["staging"].write(bytes(view), view.nbytes, pos)
            pos += view.nbytes
        with self._send_lock:
            policy: SignalPolicy = r["signal"]
            while policy.must_drain():
                self._reap_send(policy, dst)
            flags = verbs_enum(e, "ibv_send_flags", "IBV_SEND_SIGNALED") if policy.on_post() else 0
            sge = SGE(r["staging"].buf + offset, max(nbytes, 0), r["staging"].lkey)
            wr = SendWR(wr_id=imm, opcode=verbs_enum(e, "ibv_wr_opcode", "IBV_WR_RDMA_WRITE_WITH_IMM"),
                        num_sge=1 if nbytes else 0, sg=[sge] if nbytes else None,
                        send_flags=flags, imm_data=socket.htonl(imm))
            wr.set_wr_rdma(r["remote"].rkey, r["remote"].addr + offset)
            r["qp"].post_send(wr)

    def _reap_send(self, policy: SignalPolicy, dst: int) -> None:
        ok = verbs_enum(self._e, "ibv_wc_status", "IBV_WC_SUCCESS")
        deadline = time.monotonic() + self.config.timeout_s
        while time.monotonic() < deadline:
            npolled, wcs = self._send_cq.poll(1)
            if npolled:
                if wcs[0].status != ok:
                    raise PeerLostError(dst, f"RDMA write failed with wc status {wcs[0].status}")
                policy.on_signalled_completion()
                return
        raise PeerLostError(dst, "no send completion within the timeout")

    def _cq_loop(self) -> None:
        e = self._e
        ok = verbs_enum(e, "ibv_wc_status", "IBV_WC_SUCCESS")
        with_imm = verbs_enum(e, "ibv_wc_opcode", "IBV_WC_RECV_RDMA_WITH_IMM")
        idle = 0.0
        while not self._closing.is_set():
            npolled, wcs = self._recv_cq.poll(16)
            if not npolled:  # back off to 1 ms: an idle endpoint must not spin a core
                idle = min(1e-3, idle * 2 or 5e-5)
                time.sleep(idle)
                continue
            idle = 0.0
            for wc in wcs[:npolled]:
                qp, mr, src = self._qp_src.get(wc.qp_num, (None, None, -1))
                peer = self._in.get(src)  # registered before the WELCOME went out
                if wc.status != ok or wc.opcode != with_imm or peer is None:
                    self._cq.put_lost(src, f"RDMA completion status {wc.status} opcode {wc.opcode}")
                    continue
                imm = socket.ntohl(wc.imm_data)
                slot, nbytes = slot_of(imm), wc.byte_len
                try:
                    peer.ring.check_landing(slot, nbytes)
                except ProtocolError as err:
                    self._cq.put_lost(src, str(err))
                    continue
                data = memoryview(mr.read(nbytes, slot * self.config.slot_bytes)) if nbytes else memoryview(b"")
                self._post_recv(qp, wc.wr_id)  # before the credit can go back
                peer.ring.land(slot, nbytes)
                self._cq.put(Completion(src, imm, nbytes, data))

    def _release_storage(self) -> None:
        for obj in [*(q for q, _, _ in self._qp_src.values()), *(m for _, m, _ in self._qp_src.values())]:
            obj.close()
        for peer in self._out.values():
            if peer.remote:
                peer.remote["qp"].close()
                peer.remote["staging"].close()
        for obj in (self._send_cq, self._recv_cq, self._pd, self._ctx):
            obj.close()
