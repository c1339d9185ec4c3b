"""Mutual challenge-response authentication of a checkpoint peer connection, under the job's key.

Every agent of a job holds the job's checkpoint key (32 random bytes the controller derives for
the job and hands its agents in the `start` command; never in a worker's environment). Before
any operation of `peerxfer`, the two ends prove to each other that they hold it, without
sending it:

1. client -> server  ``{"op": "auth", "nonce": Nc}``
2. server -> client  ``{"ok": true, "nonce": Ns, "proof": HMAC(key, "server" | Nc | Ns)}``
3. client -> server  ``{"proof": HMAC(key, "client" | Nc | Ns)}``   (the client checked 2 first)
4. server -> client  ``{"ok": true}``, or ``{"ok": false, "error": ...}`` and the connection ends

The nonces are fresh random values of both ends, so a recorded exchange proves nothing later;
the proofs are compared in constant time (`hmac.compare_digest`). HMAC-SHA256 from the standard
library. A server without a key (a standalone one, for tests) takes no handshake.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Callable

from stalwart.errors import StalwartError

NONCE_BYTES = 32
AUTH_FRAME = 1024          # the most a frame may hold before the peer proved it has the key
AUTH_TIMEOUT_S = 10.0      # ...and how long it has to


class AuthError(StalwartError, RuntimeError):
    """The other end did not prove it holds the job's checkpoint key."""


def _proof(key: bytes, role: bytes, nc: bytes, ns: bytes) -> str:
    return hmac.new(key, b"stalwart-peer/1|" + role + b"|" + nc + b"|" + ns, hashlib.sha256).hexdigest()


def _nonce(obj: dict, what: str) -> bytes:
    raw = obj.get("nonce")
    try:
        nonce = bytes.fromhex(raw) if isinstance(raw, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise AuthError(f"{what} sent no valid nonce")
    return nonce


def client(key: bytes, send: Callable[[dict], None], recv: Callable[[], dict]) -> None:
    """Prove to the server that this end holds `key` and check that it does; AuthError if not."""
    nc = secrets.token_bytes(NONCE_BYTES)
    send({"op": "auth", "nonce": nc.hex()})
    reply = recv()
    if not reply.get("ok"):
        raise AuthError(f"the peer refused the handshake: {reply.get('error')}")
    ns = _nonce(reply, "the peer")
    if not hmac.compare_digest(str(reply.get("proof", "")).encode(), _proof(key, b"server", nc, ns).encode()):
        raise AuthError("the peer does not hold this job's checkpoint key")
    send({"proof": _proof(key, b"client", nc, ns)})
    done = recv()
    if not done.get("ok"):
        raise AuthError(f"the peer refused this machine's proof: {done.get('error')}")


def server(key: bytes, first: dict, send: Callable[[dict], None], recv: Callable[[], dict]) -> None:
    """Answer a client's `first` frame (its "auth"); AuthError (after telling it) unless it
    proves it holds `key`."""
    if first.get("op") != "auth":
        send({"ok": False, "error": "authentication required: the first message must be an auth handshake"})
        raise AuthError(f"unauthenticated {str(first.get('op'))[:32]!r} refused")
    nc = _nonce(first, "the client")
    ns = secrets.token_bytes(NONCE_BYTES)
    send({"ok": True, "nonce": ns.hex(), "proof": _proof(key, b"server", nc, ns)})
    answer = recv()
    if not hmac.compare_digest(str(answer.get("proof", "")).encode(), _proof(key, b"client", nc, ns).encode()):
        send({"ok": False, "error": "authentication failed"})
        raise AuthError("a client without this job's checkpoint key")
    send({"ok": True})
