"""API keys and caller identity, shared by the HTTP and gRPC front ends.

A server may have several API keys (``--api-key k1 k2``, vLLM's flag); each key is one
caller identity. Request ids a caller chooses are scoped by that identity (two tenants
with different keys never collide or abort each other's requests, whichever connections
or gateway they come through); without API keys a caller's identity is its connection.
Ids the server assigns (the default) are random and never collide.
"""

from __future__ import annotations

import hashlib
import hmac


def normalize_keys(api_key: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """The configured keys as a tuple (empty: no authentication)."""
    if api_key is None:
        return ()
    return (api_key,) if isinstance(api_key, str) else tuple(api_key)


def matching_key(header: str, keys: tuple[str, ...]) -> str | None:
    """The key an ``Authorization`` value ``Bearer <key>`` presents, if it is one of
    ``keys``; None otherwise. The scheme matches in any case (RFC 7235); every key is
    compared in constant time, so the time taken tells nothing about which one is close."""
    scheme, _, token = header.strip().partition(" ")
    token_bytes = token.strip().encode("utf-8", "surrogateescape")
    found = None
    for key in keys:
        if hmac.compare_digest(token_bytes, key.encode()) and scheme.lower() == "bearer":
            found = key
    return found


def identity(key: str) -> str:
    """The caller identity of an API key: a fingerprint (the key itself is never kept in
    ids or logs)."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
