"""Typed errors of the transport.

Every failure a caller can act on is a :class:`CommError`. A peer that went away without
saying goodbye (process killed, connection reset) is a :class:`PeerLostError`; a wait that
ran past its configured timeout (no credit, no completion) is a :class:`CommTimeoutError`;
a peer that broke the protocol (bad slot, oversize payload, bad handshake) is a
:class:`ProtocolError`.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class of every transport error."""


class PeerLostError(CommError):
    """A peer disappeared (its process died or its connection broke).

    ``peer`` is the lost peer's rank. The endpoint stays closed-able; other peers may still
    work, but the caller should treat the step as failed.
    """

    def __init__(self, peer: int, detail: str = "") -> None:
        self.peer = peer
        msg = f"peer rank {peer} was lost"
        if detail:
            msg += f": {detail}"
        super().__init__(msg + " (check that worker's log; restart the step or the deployment)")


class CommTimeoutError(CommError, TimeoutError):
    """A blocking call (credit wait, completion poll, connect) ran past its timeout."""


class ProtocolError(CommError):
    """A peer violated the protocol (unknown slot, payload over the slot size, bad handshake)."""


class EndpointClosedError(CommError):
    """The endpoint was used after :meth:`close`."""
