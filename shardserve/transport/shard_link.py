"""The router -> shard hop as a plain TCP link: mutually authenticated, MAC'd, bounded frames.

Why not a Serve handle call: one handle call costs more CPU than the FAISS scan it carries
(docs/experiments.md), and a query makes one per shard; a frame on a long-lived socket costs a small
fraction of that. Serve still owns the shard deployments (replicas, placement, health checks,
autoscaling, restarts); each replica also listens on a port, and the router keeps one link per
replica (found through the index version's directory, deployments.index_version; a replica withdraws
its entry when it stops). When no link is known or a link breaks, the router falls back to the
Serve handle call, so a link is an optimisation, never a single point of failure.

The link is four modules, each with its reasons: transport.link_auth (both ends prove the index
version's secret, and the session keys that follow), transport.link_frames (the frame format and
every frame's MAC), transport.link_server (the shard's end, and its bounds) and this one: the
router's end (ShardLink, ShardLinks, EndpointDirectory), and the one place callers import the link
from (it re-exports the shard's end, `__all__`). Imports run one way: link_frames <- link_auth <-
link_server <- shard_link. Plain asyncio, no Ray: tested in-process (tests/test_shard_link.py).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import random
import time

from shardserve.errors import ShardserveError
from shardserve.transport.link_auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    _Session,
    link_proof,
    new_secret,
    shard_secret,
)
from shardserve.transport.link_frames import _OK, TAG_BYTES, _Corrupt, _FrameBuffer
from shardserve.transport.link_server import ERROR_WORD, InFlight, LinkLimits, serve_link

__all__ = [
    "ERROR_WORD", "NONCE_BYTES", "PROOF_BYTES", "TAG_BYTES", "EndpointDirectory", "InFlight", "LinkLimits",
    "ShardLink", "ShardLinkError", "ShardLinks", "link_proof", "new_secret", "serve_link", "shard_secret",
]
logger = logging.getLogger(__name__)


class ShardLinkError(ShardserveError, RuntimeError):
    """The shard answered with an error (its message is the shard's exception). Still a RuntimeError,
    as it was before the family had a base."""


class _ClientConnection(asyncio.Protocol):
    """The router's end of a link: proves the secret, checks the shard's proof, then matches
    answers to calls by request id."""

    def __init__(self, link: ShardLink):
        self.link = link
        self.shard_nonce = bytearray()
        self.router_nonce = os.urandom(NONCE_BYTES)
        self.proof = bytearray()  # the shard's, as it arrives
        self.session: _Session | None = None
        self.frames: _FrameBuffer | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request_id: int, payload: bytes) -> None:
        assert self.transport is not None and self.session is not None  # only once ready
        self.transport.write(self.session.outgoing.frame(request_id, _OK, payload))

    def data_received(self, data: bytes) -> None:
        if self.session is None:
            data = self._handshake(data)
            if self.session is None or not data:
                return
        assert self.frames is not None  # made with the session
        try:
            frames = self.frames.frames(data)
        except _Corrupt as corrupt:
            return self._broken(f"link to {self.link.address}: {corrupt}")
        for request_id, status, body in frames:
            future = self.link._pending.get(request_id)
            if future is None or future.done():
                continue  # the caller gave up (deadline)
            if status == _OK:
                future.set_result(body)
            else:
                future.set_exception(ShardLinkError(body.decode(errors="replace")))

    def _handshake(self, data: bytes) -> bytes:
        """Take the shard's nonce (answered with this router's nonce and proof), then the shard's
        proof. Returns what follows it."""
        assert self.transport is not None  # data arrives only on a made connection
        secret = self.link.secret
        if len(self.shard_nonce) < NONCE_BYTES:
            need = NONCE_BYTES - len(self.shard_nonce)
            self.shard_nonce += data[:need]
            data = data[need:]
            if len(self.shard_nonce) < NONCE_BYTES:
                return b""
            proof = link_proof(secret, "router", bytes(self.shard_nonce), self.router_nonce)
            self.transport.write(self.router_nonce + proof)
        need = PROOF_BYTES - len(self.proof)
        self.proof += data[:need]
        if len(self.proof) < PROOF_BYTES:
            return b""
        shard_nonce = bytes(self.shard_nonce)
        if not hmac.compare_digest(bytes(self.proof),
                                   link_proof(secret, "shard", shard_nonce, self.router_nonce)):
            self._broken(f"link to {self.link.address}: the shard did not prove the secret")
            return b""
        self.session = _Session(secret, shard_nonce, self.router_nonce, "router")
        self.frames = _FrameBuffer(self.session.incoming)
        self.ready.set_result(None)
        return data[need:]

    def _broken(self, why: str) -> None:
        logger.warning("shard link: %s", why)
        error = ConnectionError(why)
        if not self.ready.done():
            self.ready.set_exception(error)
        self.link._fail(error)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        reason = type(exc).__name__ if exc is not None else "closed by the shard"
        error = ConnectionError(f"link to {self.link.address} lost: {reason}")
        if not self.ready.done():
            self.ready.set_exception(error)
        self.link._fail(error)


class ShardLink:
    """One client connection to one shard replica; calls are multiplexed by request id."""

    def __init__(self, host: str, port: int, secret: bytes):
        self.address = (host, port)
        self.secret = secret
        self.in_flight = 0
        self.broken = False
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._connection: _ClientConnection | None = None
        self._connecting: asyncio.Future | None = None

    async def call(self, payload: bytes) -> bytes:
        """Send one frame, await its answer. Raises ConnectionError if the link breaks or the shard
        does not prove the secret (the caller falls back), ShardLinkError if the shard could not
        answer it."""
        if self.broken:
            raise ConnectionError(f"link to {self.address} is broken")
        connection = self._connection or await self._connect()
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self.in_flight += 1
        try:
            connection.send(request_id, payload)
            return await future
        finally:
            self.in_flight -= 1
            self._pending.pop(request_id, None)

    async def _connect(self) -> _ClientConnection:
        if self.broken:
            raise ConnectionError(f"link to {self.address} is broken")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(self._connecting)
        except Exception:
            self.broken = True
            raise

    async def _open(self) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(lambda: _ClientConnection(self), *self.address), 2.0)
        try:
            await asyncio.wait_for(protocol.ready, 2.0)  # both proofs checked
        except TimeoutError:
            transport.abort()
            raise ConnectionError(f"link to {self.address}: no handshake") from None
        except BaseException:
            transport.abort()
            raise
        if self.broken:  # closed while connecting
            transport.close()
            raise ConnectionError(f"link to {self.address} closed")
        self._connection = protocol
        return protocol

    def _fail(self, error: ConnectionError) -> None:
        self.broken = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        if self._connection is not None and self._connection.transport is not None:
            self._connection.transport.close()

    def close(self) -> None:
        self._fail(ConnectionError(f"link to {self.address} closed"))


class ShardLinks:
    """The links of one index version: per shard, one per replica that announced itself.

    A call goes to the less busy of two random links (Serve's own rule); a broken link is dropped
    and not retried until the directory announces its replica again after `retry_after_s`.
    """

    def __init__(self, num_shards: int, retry_after_s: float = 5.0):
        self.secret = b""
        self.by_shard: list[dict[tuple[str, int], ShardLink]] = [{} for _ in range(num_shards)]
        self.retry_after_s = retry_after_s
        self._failed: dict[tuple[str, int], float] = {}

    def update(self, endpoints: list[list[tuple[str, int]]], secret: bytes) -> None:
        """Follow the directory: open links to new replicas, close those that left (all of them
        when the version's secret changed: its app was deployed again)."""
        if secret != self.secret:
            self.close()
            self.secret = secret
        clock = time.monotonic()
        self._failed = {a: t for a, t in self._failed.items() if clock - t < self.retry_after_s}
        for shard, wanted in enumerate(endpoints[:len(self.by_shard)]):
            links = self.by_shard[shard]
            wanted_set = {(str(host), int(port)) for host, port in wanted}
            for address in list(links):
                if address not in wanted_set or links[address].broken:
                    links.pop(address).close()
            for address in wanted_set - links.keys():
                if address not in self._failed:
                    links[address] = ShardLink(*address, shard_secret(self.secret, shard))

    def pick(self, shard: int) -> ShardLink | None:
        links = [link for link in self.by_shard[shard].values() if not link.broken]
        if not links:
            return None
        if len(links) == 1:
            return links[0]
        first, second = random.sample(links, 2)
        return first if first.in_flight <= second.in_flight else second

    def drop(self, shard: int, link: ShardLink) -> None:
        self._failed[link.address] = time.monotonic()
        if self.by_shard[shard].get(link.address) is link:
            del self.by_shard[shard][link.address]
        link.close()

    def count(self) -> list[int]:
        return [len(links) for links in self.by_shard]

    def close(self) -> None:
        for links in self.by_shard:
            for link in links.values():
                link.close()
            links.clear()


class EndpointDirectory:
    """Which replica of which shard listens where: replicas announce themselves every few seconds,
    an entry not renewed within `ttl_s` is gone (its replica died or moved), and a replica that stops
    withdraws its entry at once, so no router dials its port after it (a port another process may
    take). A withdrawn replica stays withdrawn: an announcement of it still on its way is ignored."""

    def __init__(self, num_shards: int, ttl_s: float = 6.0):
        self.ttl_s = ttl_s
        self._entries: list[dict[str, tuple[str, int, float]]] = [{} for _ in range(num_shards)]
        self._withdrawn: dict[str, float] = {}  # replica -> when (replica ids are never reused)

    def announce(self, shard: int, replica: str, host: str, port: int) -> None:
        if replica not in self._withdrawn:
            self._entries[shard][replica] = (host, port, time.monotonic())

    def withdraw(self, shard: int, replica: str) -> None:
        self._entries[shard].pop(replica, None)
        self._withdrawn[replica] = time.monotonic()

    def endpoints(self) -> list[list[tuple[str, int]]]:
        """Per shard, the live (host, port) of each replica."""
        clock = time.monotonic()
        deadline = clock - self.ttl_s
        for entries in self._entries:
            for replica in [r for r, (_, _, seen) in entries.items() if seen < deadline]:
                del entries[replica]
        # an announcement in flight lands within seconds; forget withdrawals long after that
        self._withdrawn = {r: at for r, at in self._withdrawn.items() if at > clock - 10 * self.ttl_s}
        return [sorted((host, port) for host, port, _ in entries.values()) for entries in self._entries]
