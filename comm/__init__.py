"""M:N transport: one-sided write-with-immediate channels over five providers.

One primitive: a sender writes a payload into a slot that the receiver registered in
advance, together with a 32-bit immediate (layer, micro-batch, slot, tag — see
:mod:`megaserve.comm.imm`); the receiver gets a :class:`Completion` (sender rank, immediate, a view
of the slot's bytes, the length) and releases the slot explicitly, which returns one
credit to the sender. A sender without credit blocks (up to ``timeout_s``); it never
retries. Completions are counted, not ordered. A peer that dies surfaces as
:class:`PeerLostError` (a :class:`CommError`) within the timeout. Protocol details:
docs/comm.md.

Providers (``create_endpoint(name, ...)``; ``PROVIDERS`` lists them): ``inproc`` (threads),
``tcp`` (processes/hosts), ``cuda_ipc`` (CUDA tensors between GPUs of one host), ``rdma``
(pyverbs RC QPs, needs a device), ``nccl`` (torch.distributed P2P, one group per
direction; gloo on CPU).

Usage (one endpoint per worker; M attention workers and N expert workers are all both
senders and receivers; the names are this package's exports)::

    cfg = ChannelConfig(slot_bytes=8 << 20, slots_per_peer=4, timeout_s=30)
    ep = create_endpoint("tcp", rank, world_size, cfg)       # binds host:0
    addresses = exchange(rendezvous_addr, rank, world_size, ep.address)
    ep.connect(addresses, send_to=expert_ranks)             # attention worker side

    # dispatch(layer, i): one frame per expert worker, header + rows in one slot
    for e in expert_ranks:
        ep.send(e, [header_bytes, rows[e]], layer=layer, microbatch=i, tag=DISPATCH)

    # combine(layer, i): count len(expert_ranks) completions, whatever their order
    for c in ep.poll_many(len(expert_ranks)):
        assert (c.layer, c.microbatch) == (layer, i)
        out[c.src] = c.numpy("float32").copy()             # view valid until release
        ep.release(c)                                      # credit back to c.src
    ep.close()                                             # idempotent

Nothing here imports torch or megaserve at import time.
"""

from __future__ import annotations

from .endpoint import PROVIDERS, Endpoint, create_endpoint
from .errors import CommError, CommTimeoutError, EndpointClosedError, PeerLostError, ProtocolError
from .imm import Imm, decode_imm, encode_imm
from .protocol import ChannelConfig, Completion
from .rendezvous import RendezvousServer, exchange

__all__ = [
    "PROVIDERS", "ChannelConfig", "CommError", "CommTimeoutError", "Completion", "Endpoint",
    "EndpointClosedError", "Imm", "PeerLostError", "ProtocolError", "RendezvousServer",
    "create_endpoint", "decode_imm", "encode_imm", "exchange",
]
