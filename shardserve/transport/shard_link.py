"""The router -> shard hop as a plain TCP link: mutually authenticated, MAC'd, bounded frames.

Why not a Serve handle call: one handle call cost more CPU than the FAISS scan it carries (`python
-m lab.hop` records it), and a query makes one per shard; a frame on a long-lived socket costs tens
of microseconds. Serve still owns the shard deployments (replicas, placement, health checks,
autoscaling, restarts); each replica also listens on a port, and the router keeps one link per
replica (found through the index version's directory, deployments.index_version; a replica withdraws
its entry when it stops). When no link is known or a link breaks, the router falls back to the
Serve handle call, so a link is an optimisation, never a single point of failure.

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

Why every frame carries a MAC: the handshake alone proves who opened the connection, not who
writes on it afterwards. Each direction has its own key, HMAC(secret, domain + label + Ns + Nr),
and each frame ends in HMAC-SHA256(key, sequence number + header + payload) truncated to 16 bytes;
the sequence number counts that direction's frames (TCP keeps their order), so a frame altered,
replayed, reordered or reflected back fails to check, and the connection closes. Frames are
authenticated, not encrypted: a batch is query vectors and ids, and the link stays on the node or
the cluster's private network.

Bounded: frames up to `max_frame` bytes, every state of a connection has one absolute deadline
(transport.flow: the handshake, a frame once its first byte arrived, answers the caller does not
read, idle time), at most `max_connections` connections (and `max_handshakes` of them not yet
authenticated, `max_handshakes_per_source` from one address), at most `max_in_flight` frames
being answered per connection (reading pauses beyond), and reading pauses while the transport's
write buffer is full. The caller gets a fixed error word, never the shard's exception text (that
goes to the log).

Frame: `<IQB` header (payload bytes, request id, status 0 = answer / 1 = error), the payload
(transport.shard_wire bytes, unchanged), the 16-byte MAC. Plain asyncio, no Ray: tested
in-process (tests/test_shard_link.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import os
import random
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shardserve.errors import ShardserveError
from shardserve.transport.flow import Deadline, FlowControl

_HEADER = struct.Struct("<IQB")
_SEQUENCE = struct.Struct("<Q")
_OK, _ERROR = 0, 1
NONCE_BYTES = PROOF_BYTES = 32
TAG_BYTES = 16  # a frame's truncated MAC
_DOMAIN = b"shardserve-link-v2"
# Labels of what is derived from the secret and both nonces. The nonces that follow a label have a
# fixed length, so no two labels can yield the same MAC input.
_PROOFS = {"router": b"router proof", "shard": b"shard proof"}
_TO_SHARD, _TO_ROUTER = b"router frames", b"shard frames"
ERROR_WORD = b"shard could not answer this frame"
logger = logging.getLogger(__name__)


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


@dataclass(frozen=True, kw_only=True)
class LinkLimits:
    """Bounds of one shard's link server. Arguments:
    max_frame: payload bytes of one frame (the router's HTTP body limit is a good value).
    handshake_timeout_s: a connection not authenticated by then (from its start) is closed.
    frame_timeout_s: a frame must be complete this long after its first byte arrived.
    send_timeout_s: a caller that reads none of its answers for this long is cut off.
    idle_timeout_s: a connection that received nothing for this long is closed.
    max_connections: open connections at once; more are closed as they arrive.
    max_handshakes: of those, not yet authenticated.
    max_handshakes_per_source: of those, from one address.
    max_in_flight: frames of one connection being answered; reading pauses beyond.
    """

    max_frame: int = 16 * 1024 * 1024 + 4096
    handshake_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0
    send_timeout_s: float = 60.0
    idle_timeout_s: float = 600.0
    max_connections: int = 256
    max_handshakes: int = 16
    max_handshakes_per_source: int = 8
    max_in_flight: int = 64


class ShardLinkError(ShardserveError, RuntimeError):
    """The shard answered with an error (its message is the shard's exception). Still a RuntimeError,
    as it was before the family had a base."""


class _Corrupt(Exception):
    """A stream nothing more can be read from: a frame over the limit, or one whose MAC fails."""


class InFlight:
    """Requests being answered, and their time-weighted mean since it was last read: what a
    replica reports to Serve's autoscaler for traffic that does not pass through Serve."""

    def __init__(self) -> None:
        self.now = 0
        self._area = 0.0
        self._since = self._mark = time.monotonic()

    def change(self, delta: int) -> None:
        clock = time.monotonic()
        self._area += self.now * (clock - self._mark)
        self._mark = clock
        self.now += delta

    def mean_and_reset(self) -> float:
        self.change(0)
        span = self._mark - self._since
        mean = self._area / span if span > 0 else float(self.now)
        self._area, self._since = 0.0, self._mark
        return mean


class _Seal:
    """One direction's frame MACs: HMAC-SHA256(key, sequence number + header + payload), truncated.
    Both ends count the direction's frames, so the sequence number is never sent."""

    def __init__(self, key: bytes):
        self._keyed = hmac.new(key, digestmod="sha256")  # copied per frame: the key is absorbed once
        self.sequence = 0

    def _mac(self, *parts: bytes | memoryview) -> bytes:
        mac = self._keyed.copy()
        mac.update(_SEQUENCE.pack(self.sequence))
        for part in parts:
            mac.update(part)
        self.sequence += 1
        return mac.digest()[:TAG_BYTES]

    def frame(self, request_id: int, status: int, body: bytes) -> bytes:
        """The next frame of this direction, its MAC appended."""
        head = _HEADER.pack(len(body), request_id, status)
        return b"".join((head, body, self._mac(head, body)))

    def check(self, framed: memoryview, tag: memoryview) -> bool:
        """Whether `tag` is the MAC of `framed` (header + payload) as the next frame of this direction."""
        return hmac.compare_digest(self._mac(framed), tag)


class _Session:
    """The two directions of one authenticated connection, as `side` ("router" or "shard") sees them."""

    def __init__(self, secret: bytes, shard_nonce: bytes, router_nonce: bytes, side: str):
        to_shard = _Seal(_derive(secret, _TO_SHARD, shard_nonce, router_nonce))
        to_router = _Seal(_derive(secret, _TO_ROUTER, shard_nonce, router_nonce))
        self.outgoing, self.incoming = (to_shard, to_router) if side == "router" else (to_router, to_shard)


class _FrameBuffer:
    """Bytes received so far on one connection, cut into frames (header, payload, MAC) as they
    complete; each frame's MAC is checked against `incoming` before it is handed on."""

    def __init__(self, incoming: _Seal, max_frame: int = LinkLimits.max_frame) -> None:
        self.buffer = bytearray()
        self.incoming = incoming
        self.max_frame = max_frame

    def frames(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """(request id, status, payload) of every frame completed by `data`. Raises _Corrupt on a
        frame longer than `max_frame` or one whose MAC fails (nothing after it can be trusted). Each
        payload is copied once; when nothing was pending, straight out of `data`."""
        source: bytes | bytearray
        if self.buffer:
            self.buffer += data
            source = self.buffer
        else:  # the common case: a receive holds whole frames, parse it without buffering it
            source = data
        found, offset = [], 0
        with memoryview(source) as view:
            while len(view) - offset >= _HEADER.size:
                length, request_id, status = _HEADER.unpack_from(view, offset)
                if length > self.max_frame:
                    raise _Corrupt(f"frame of {length} bytes, over {self.max_frame}")
                payload_end = offset + _HEADER.size + length
                end = payload_end + TAG_BYTES
                if len(view) < end:
                    break
                if not self.incoming.check(view[offset:payload_end], view[payload_end:end]):
                    raise _Corrupt("frame MAC did not check")
                found.append((request_id, status, bytes(view[offset + _HEADER.size:payload_end])))
                offset = end
            rest = bytes(view[offset:]) if source is data and offset < len(view) else None
        if source is data:
            if rest:
                self.buffer += rest
        elif offset:
            del self.buffer[:offset]
        return found


class _LinkServer:
    """What the connections of one listening link share: handler, secret, limits, counts."""

    def __init__(self, handler: Callable[[bytes], Awaitable[bytes]],
                 answer_now: Callable[[bytes], bytes | None] | None, gauge: InFlight, secret: bytes,
                 limits: LinkLimits):
        self.handler, self.answer_now, self.gauge = handler, answer_now, gauge
        self.secret, self.limits = secret, limits
        self.connections: set[_ServerConnection] = set()
        self.handshakes: Counter[str] = Counter()  # per source address, not yet authenticated

    def admit(self, source: str) -> bool:
        """Whether one more connection from `source` may start a handshake (counted if so)."""
        limits = self.limits
        if len(self.connections) >= limits.max_connections or \
                self.handshakes.total() >= limits.max_handshakes or \
                self.handshakes[source] >= limits.max_handshakes_per_source:
            return False
        self.handshakes[source] += 1
        return True

    def handshake_over(self, source: str) -> None:
        self.handshakes[source] -= 1
        if self.handshakes[source] <= 0:
            del self.handshakes[source]


class _ServerConnection(asyncio.Protocol):
    """One caller's connection to a shard replica. A plain Protocol, not streams: a frame costs one
    callback, and one the handler can answer at once (`answer_now`) needs no task at all."""

    def __init__(self, server: _LinkServer):
        self.server, self.limits = server, server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.source = ""
        self.tasks: set[asyncio.Task] = set()
        self.nonce = os.urandom(NONCE_BYTES)
        self.hello = bytearray()  # the router's nonce and proof, as they arrive
        self.session: _Session | None = None
        self.frames: _FrameBuffer | None = None
        self.flow: FlowControl | None = None
        self.deadline = Deadline(self.loop, self._due)
        # loop times (0: not so): started, last received, the pending frame's first byte, and since
        # when this side stopped reading for its cap of frames in flight
        self.started = self.received = self.frame_began = self.held_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.flow = FlowControl(self.transport, self.loop)  # type: ignore[arg-type]
        self.source = str((transport.get_extra_info("peername") or ("?",))[0])
        if not self.server.admit(self.source):
            self.transport = None
            transport.abort()  # type: ignore[attr-defined]
            return
        self.server.connections.add(self)
        self.started = self.received = self.loop.time()
        transport.write(self.nonce)  # type: ignore[attr-defined]
        self.deadline.update()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.server.connections:
            self.server.connections.discard(self)
            if self.session is None:
                self.server.handshake_over(self.source)
        self.deadline.cancel()
        self.transport = None  # the caller went away: answers still being computed are dropped

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.received = self.loop.time()
        if self.session is None:
            data = self._handshake(data)
            if self.session is None:
                return
        assert self.frames is not None  # made with the session
        try:
            frames = self.frames.frames(data)
        except _Corrupt as corrupt:  # nothing after it can be framed, or trusted
            return self._cut(f"{corrupt}, connection closed")
        for request_id, _, payload in frames:
            self._dispatch(request_id, payload)
        if not self.frames.buffer:
            self.frame_began = 0.0
        elif frames or not self.frame_began:  # a frame began in this receive: its deadline starts now
            self.frame_began = self.received
        self._flow()

    def _handshake(self, data: bytes) -> bytes:
        """Take the router's nonce and proof; once they check, prove this shard and start the
        session. Returns what follows them (frames)."""
        need = NONCE_BYTES + PROOF_BYTES - len(self.hello)
        self.hello += data[:need]
        if len(self.hello) < NONCE_BYTES + PROOF_BYTES:
            return b""
        router_nonce, proof = bytes(self.hello[:NONCE_BYTES]), bytes(self.hello[NONCE_BYTES:])
        secret = self.server.secret
        if not hmac.compare_digest(proof, link_proof(secret, "router", self.nonce, router_nonce)):
            self._cut("a caller without the secret was cut off")
            return b""
        assert self.transport is not None
        self.transport.write(link_proof(secret, "shard", self.nonce, router_nonce))
        self.session = _Session(secret, self.nonce, router_nonce, "shard")
        self.frames = _FrameBuffer(self.session.incoming, self.limits.max_frame)
        self.server.handshake_over(self.source)
        return data[need:]

    def _dispatch(self, request_id: int, payload: bytes) -> None:
        server = self.server
        server.gauge.change(+1)
        if server.answer_now is not None:
            try:
                body, status = server.answer_now(payload), _OK
            except Exception:  # the caller gets a fixed word; the link stays up
                logger.exception("shard link: frame %d refused", request_id)
                body, status = ERROR_WORD, _ERROR
            if body is not None:
                server.gauge.change(-1)
                self._write(request_id, status, body)
                return
        task = self.loop.create_task(self._answer(request_id, payload))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    async def _answer(self, request_id: int, payload: bytes) -> None:
        try:
            body, status = await self.server.handler(payload), _OK
        except Exception:
            logger.exception("shard link: frame %d failed", request_id)
            body, status = ERROR_WORD, _ERROR
        finally:
            self.server.gauge.change(-1)
        self._write(request_id, status, body)

    def _write(self, request_id: int, status: int, body: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing() and self.session is not None:
            self.transport.write(self.session.outgoing.frame(request_id, status, body))

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self._flow()

    def _flow(self) -> None:
        """Read while frames in flight are under the cap and the write buffer drains. The time this
        side held a pending frame up (its cap) does not count against the frame's deadline; the
        time the caller did (not reading its answers) does."""
        if self.transport is None or self.flow is None:
            return
        held = len(self.tasks) >= self.limits.max_in_flight
        if held and not self.held_since:
            self.held_since = self.loop.time()
        elif not held and self.held_since:
            if self.frame_began:
                self.frame_began += self.loop.time() - self.held_since
            self.held_since = 0.0
        self.flow.want_reading(not held)
        self.deadline.update()

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()
            self.deadline.update()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()
            self._flow()

    # -- the one deadline of each state (transport.flow) -------------------------------------
    def _due(self) -> tuple[float, Callable[[], None]] | None:
        if self.transport is None or self.flow is None:
            return None
        limits = self.limits
        if self.session is None:
            return self.started + limits.handshake_timeout_s, self._handshake_expired
        if self.flow.write_paused:
            return self.flow.write_paused_at + limits.send_timeout_s, self._send_expired
        if self.frame_began and not self.held_since:
            return self.frame_began + limits.frame_timeout_s, self._frame_expired
        return self.received + limits.idle_timeout_s, self._idle_expired

    def _handshake_expired(self) -> None:
        self._cut(f"no handshake within {self.limits.handshake_timeout_s} s", logging.INFO)

    def _send_expired(self) -> None:
        self._cut(f"the caller read no answer for {self.limits.send_timeout_s} s")

    def _frame_expired(self) -> None:
        self._cut(f"a frame was not complete {self.limits.frame_timeout_s} s after its first byte")

    def _idle_expired(self) -> None:
        self._cut(f"idle for {self.limits.idle_timeout_s} s", logging.DEBUG)

    def _cut(self, why: str, level: int = logging.WARNING) -> None:
        logger.log(level, "shard link from %s: %s", self.source, why)
        if self.transport is not None:
            self.transport.abort()


async def serve_link(handler: Callable[[bytes], Awaitable[bytes]], host: str, port: int = 0, *,
                     secret: bytes, in_flight: InFlight | None = None,
                     answer_now: Callable[[bytes], bytes | None] | None = None,
                     limits: LinkLimits | None = None) -> asyncio.Server:
    """Listen on (host, port) for callers holding `secret`; every frame is answered by
    `answer_now(payload)` when that returns bytes (small work done right in the receive callback),
    else by `handler(payload)` in a task of its own, so a long search does not hold up the frames
    behind it on the same link. Both must validate the payload before any C call."""
    if len(secret) < 16:
        raise ValueError("a link secret has at least 16 bytes")
    server = _LinkServer(handler, answer_now, in_flight or InFlight(), secret, limits or LinkLimits())
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _ServerConnection(server), host, port)


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
