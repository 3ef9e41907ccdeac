"""How both ends of a shard link prove the index version's secret, and the session keys that follow.

Why both ends authenticate: the port is reachable from the node (and the network, on a cluster),
and Ray's token authentication does not cover it. A router must not search a stranger's shard (a
process that took a dead replica's port could answer with made-up ids), and a shard must not answer
a stranger. The secret is the index version's (made by its app builder, handed to shards and routers
inside Ray). The handshake:

1. the shard sends a random 32-byte nonce Ns;
2. the router sends its own nonce Nr and HMAC-SHA256(secret, domain + "router proof" + Ns + Nr);
3. the shard checks it, then answers HMAC-SHA256(secret, domain + "shard proof" + Ns + Nr);
4. the router checks that before it sends a frame.

Each side only ever computes the proof of its own role, over a nonce of its own, so neither can be
used as an oracle for the other's proof, and a proof replayed from another connection fails (the
other side's nonce differs). Until the router's proof checks, the shard frames nothing; a stranger
gets no answer and is cut off at `handshake_timeout_s`.

After the handshake each direction has its own key, HMAC(secret, domain + label + Ns + Nr), which
seals that direction's frames (transport.link_frames says why every frame carries a MAC). Both ends
derive the same keys here: the router's (transport.shard_link) and the shard's
(transport.link_server).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from shardserve.transport.link_frames import _Seal

NONCE_BYTES = PROOF_BYTES = 32
_DOMAIN = b"shardserve-link-v2"
# Labels of what is derived from the secret and both nonces. The nonces that follow a label have a
# fixed length, so no two labels can yield the same MAC input.
_PROOFS = {"router": b"router proof", "shard": b"shard proof"}
_TO_SHARD, _TO_ROUTER = b"router frames", b"shard frames"


def _derive(secret: bytes, label: bytes, shard_nonce: bytes, router_nonce: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + label + shard_nonce + router_nonce, hashlib.sha256).digest()


def link_proof(secret: bytes, role: str, shard_nonce: bytes, router_nonce: bytes) -> bytes:
    """What the side playing `role` ("router" or "shard") proves it holds the secret with."""
    return _derive(secret, _PROOFS[role], shard_nonce, router_nonce)


def shard_secret(secret: bytes, shard: int) -> bytes:
    """The key of one shard's links, derived from the version's secret: both ends prove the shard
    number too, so a replica of another shard of the same version (one that took a dead replica's
    port before the directory forgot it) fails the handshake instead of answering for it."""
    return hmac.new(secret, _DOMAIN + b"shard key" + shard.to_bytes(4, "big"), hashlib.sha256).digest()


def new_secret() -> str:
    """A fresh link secret (hex), one per index version app."""
    return os.urandom(32).hex()


class _Session:
    """The two directions of one authenticated connection, as `side` ("router" or "shard") sees them."""

    def __init__(self, secret: bytes, shard_nonce: bytes, router_nonce: bytes, side: str):
        to_shard = _Seal(_derive(secret, _TO_SHARD, shard_nonce, router_nonce))
        to_router = _Seal(_derive(secret, _TO_ROUTER, shard_nonce, router_nonce))
        self.outgoing, self.incoming = (to_shard, to_router) if side == "router" else (to_router, to_shard)
