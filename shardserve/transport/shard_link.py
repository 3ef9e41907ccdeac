"""The router -> shard hop as a plain TCP link: authenticated, bounded, length-prefixed frames.

Why not a Serve handle call: one handle call cost more CPU than the FAISS scan it carries (`python
-m lab.hop` records it), and a query makes one per shard; a frame on a long-lived socket costs tens
of microseconds. Serve still owns the shard deployments (replicas, placement, health checks,
autoscaling, restarts); each replica also listens on a port, and the router keeps one link per
replica (found through the index version's directory, deployments.index_version). When no link is
known or a link breaks, the router falls back to the Serve handle call, so a link is an
optimisation, never a single point of failure.

Why it authenticates: the port is reachable from the node (and the network, on a cluster), and Ray's
token authentication does not cover it. The shard speaks first: a random 32-byte nonce. The caller
answers HMAC-SHA256(secret, "shardserve-link-v1" + nonce), the secret being the index version's
(made by its app builder, handed to shards and routers inside Ray). Until that MAC checks, not one
byte is framed: a stranger gets no answer and is cut off after `handshake_timeout_s`.

Bounded: frames up to `max_frame` bytes, a started frame must complete within `frame_timeout_s`,
an idle connection closes after `idle_timeout_s`, at most `max_connections` connections (and
`max_handshakes` of them not yet authenticated), at most `max_in_flight` frames being answered per
connection (reading pauses beyond), and reading pauses while the transport's write buffer is full.
The caller gets a fixed error word, never the shard's exception text (that goes to the log).

Frame: `<IQB` header (payload bytes, request id, status 0 = answer / 1 = error), then the payload:
transport.shard_wire bytes, unchanged. Plain asyncio, no Ray: tested in-process (tests/test_shard_link.py).
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

_HEADER = struct.Struct("<IQB")
_OK, _ERROR = 0, 1
NONCE_BYTES = MAC_BYTES = 32
_DOMAIN = b"shardserve-link-v1"
ERROR_WORD = b"shard could not answer this frame"
logger = logging.getLogger(__name__)


def link_mac(secret: bytes, nonce: bytes) -> bytes:
    """What a caller proves it holds the secret with."""
    return hmac.new(secret, _DOMAIN + nonce, hashlib.sha256).digest()


def new_secret() -> str:
    """A fresh link secret (hex), one per index version app."""
    return os.urandom(32).hex()


@dataclass(frozen=True, kw_only=True)
class LinkLimits:
    """Bounds of one shard's link server. Arguments:
    max_frame: payload bytes of one frame (the router's HTTP body limit is a good value).
    handshake_timeout_s: a connection not authenticated by then is closed.
    frame_timeout_s: a frame whose first bytes arrived must be complete by then.
    idle_timeout_s: a connection with nothing in flight and nothing received for this long is closed.
    max_connections: open connections at once; more are closed as they arrive.
    max_handshakes: of those, not yet authenticated.
    max_in_flight: frames of one connection being answered; reading pauses beyond.
    """

    max_frame: int = 16 * 1024 * 1024 + 4096
    handshake_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0
    max_connections: int = 256
    max_handshakes: int = 16
    max_in_flight: int = 64


class ShardLinkError(RuntimeError):
    """The shard answered with an error (its message is the shard's exception)."""


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


class _FrameBuffer:
    """Bytes received so far on one connection, cut into frames (header, payload) as they complete."""

    def __init__(self, max_frame: int = LinkLimits.max_frame) -> None:
        self.buffer = bytearray()
        self.max_frame = max_frame

    def frames(self, data: bytes) -> list[tuple[int, int, bytes]] | None:
        """(request id, status, payload) of every frame completed by `data`; None: a corrupt stream
        (a frame longer than `max_frame`). Each payload is copied once; when nothing was pending,
        straight out of `data`."""
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
                    return None
                end = offset + _HEADER.size + length
                if len(view) < end:
                    break
                found.append((request_id, status, bytes(view[offset + _HEADER.size:end])))
                offset = end
            rest = bytes(view[offset:]) if source is data and offset < len(view) else None
        if source is data:
            if rest:
                self.buffer += rest
        elif offset:
            del self.buffer[:offset]
        return found


def _frame(request_id: int, status: int, body: bytes) -> bytes:
    return _HEADER.pack(len(body), request_id, status) + body


class _LinkServer:
    """What the connections of one listening link share: handler, secret, limits, counts."""

    def __init__(self, handler: Callable[[bytes], Awaitable[bytes]],
                 answer_now: Callable[[bytes], bytes | None] | None, gauge: InFlight, secret: bytes,
                 limits: LinkLimits):
        self.handler, self.answer_now, self.gauge = handler, answer_now, gauge
        self.secret, self.limits = secret, limits
        self.connections: set[_ServerConnection] = set()
        self.handshakes = 0


class _ServerConnection(asyncio.Protocol):
    """One caller's connection to a shard replica. A plain Protocol, not streams: a frame costs one
    callback, and one the handler can answer at once (`answer_now`) needs no task at all."""

    def __init__(self, server: _LinkServer):
        self.server, self.limits = server, server.limits
        self.frames = _FrameBuffer(self.limits.max_frame)
        self.transport: asyncio.Transport | None = None
        self.tasks: set[asyncio.Task] = set()
        self.nonce = os.urandom(NONCE_BYTES)
        self.proof = bytearray()  # the MAC received so far; None once authenticated
        self.authenticated = False
        self.timer: asyncio.TimerHandle | None = None
        self.reading, self.writable = True, True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if len(server.connections) >= self.limits.max_connections or \
                server.handshakes >= self.limits.max_handshakes:
            transport.abort()  # type: ignore[attr-defined]
            return
        server.connections.add(self)
        server.handshakes += 1
        transport.write(self.nonce)  # type: ignore[attr-defined]
        self._arm(self.limits.handshake_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.server.connections:
            self.server.connections.discard(self)
            if not self.authenticated:
                self.server.handshakes -= 1
        self._disarm()
        self.transport = None  # the caller went away: answers still being computed are dropped

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if not self.authenticated:
            need = MAC_BYTES - len(self.proof)
            self.proof += data[:need]
            data = data[need:]
            if len(self.proof) < MAC_BYTES:
                return
            if not hmac.compare_digest(bytes(self.proof), link_mac(self.server.secret, self.nonce)):
                logger.warning("shard link: a caller without the secret was cut off")
                self.transport.abort()
                return
            self.authenticated = True
            self.server.handshakes -= 1
        frames = self.frames.frames(data)
        if frames is None:  # a frame over the limit: nothing after it can be framed
            logger.warning("shard link: frame over %d bytes, connection closed", self.limits.max_frame)
            self.transport.abort()
            return
        for request_id, _, payload in frames:
            self._dispatch(request_id, payload)
        # a frame begun must complete in time; otherwise the connection may idle
        self._arm(self.limits.frame_timeout_s if self.frames.buffer else self.limits.idle_timeout_s)
        self._flow()

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
                self._write(_frame(request_id, status, body))
                return
        task = asyncio.get_running_loop().create_task(self._answer(request_id, payload))
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
        self._write(_frame(request_id, status, body))

    def _write(self, frame: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self._flow()

    def _flow(self) -> None:
        """Read while frames in flight are under the cap and the write buffer drains."""
        if self.transport is None or self.transport.is_closing():
            return
        want = self.writable and len(self.tasks) < self.limits.max_in_flight
        if want != self.reading:
            self.reading = want
            (self.transport.resume_reading if want else self.transport.pause_reading)()

    def pause_writing(self) -> None:
        self.writable = False
        self._flow()

    def resume_writing(self) -> None:
        self.writable = True
        self._flow()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self) -> None:
        self.timer = None
        if self.transport is None:
            return
        if self.authenticated and self.tasks and not self.frames.buffer:  # busy, not idle
            return self._arm(self.limits.idle_timeout_s)
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
    """The router's end of a link: proves the secret, then matches answers to calls by request id."""

    def __init__(self, link: ShardLink):
        self.link = link
        self.frames = _FrameBuffer()
        self.nonce = bytearray()
        self.ready = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.ready.done():
            need = NONCE_BYTES - len(self.nonce)
            self.nonce += data[:need]
            data = data[need:]
            if len(self.nonce) < NONCE_BYTES:
                return
            assert self.transport is not None  # data arrives only on a made connection
            self.transport.write(link_mac(self.link.secret, bytes(self.nonce)))
            self.ready.set_result(None)
            if not data:
                return
        frames = self.frames.frames(data)
        if frames is None:
            self.link._fail(ConnectionError(f"link to {self.link.address}: corrupt frame"))
            return
        for request_id, status, body in frames:
            future = self.link._pending.get(request_id)
            if future is None or future.done():
                continue  # the caller gave up (deadline)
            if status == _OK:
                future.set_result(body)
            else:
                future.set_exception(ShardLinkError(body.decode(errors="replace")))

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
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Future | None = None

    async def call(self, payload: bytes) -> bytes:
        """Send one frame, await its answer. Raises ConnectionError if the link breaks (the caller
        falls back), ShardLinkError if the shard could not answer it."""
        if self.broken:
            raise ConnectionError(f"link to {self.address} is broken")
        transport = self._transport or await self._connect()
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self.in_flight += 1
        try:
            transport.write(_frame(request_id, _OK, payload))
            return await future
        finally:
            self.in_flight -= 1
            self._pending.pop(request_id, None)

    async def _connect(self) -> asyncio.Transport:
        if self.broken:
            raise ConnectionError(f"link to {self.address} is broken")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(self._connecting)
        except Exception:
            self.broken = True
            raise

    async def _open(self) -> asyncio.Transport:
        loop = asyncio.get_running_loop()
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(lambda: _ClientConnection(self), *self.address), 2.0)
        try:
            await asyncio.wait_for(protocol.ready, 2.0)  # the nonce came, our MAC is on its way
        except TimeoutError:
            transport.abort()
            raise ConnectionError(f"link to {self.address}: no handshake") from None
        except BaseException:
            transport.abort()
            raise
        if self.broken:  # closed while connecting
            transport.close()
            raise ConnectionError(f"link to {self.address} closed")
        self._transport = transport
        return transport

    def _fail(self, error: ConnectionError) -> None:
        self.broken = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        if self._transport is not None:
            self._transport.close()

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
                    links[address] = ShardLink(*address, self.secret)

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
    an entry not renewed within `ttl_s` is gone (its replica died or moved)."""

    def __init__(self, num_shards: int, ttl_s: float = 6.0):
        self.ttl_s = ttl_s
        self._entries: list[dict[str, tuple[str, int, float]]] = [{} for _ in range(num_shards)]

    def announce(self, shard: int, replica: str, host: str, port: int) -> None:
        self._entries[shard][replica] = (host, port, time.monotonic())

    def withdraw(self, shard: int, replica: str) -> None:
        self._entries[shard].pop(replica, None)

    def endpoints(self) -> list[list[tuple[str, int]]]:
        """Per shard, the live (host, port) of each replica."""
        deadline = time.monotonic() - self.ttl_s
        for entries in self._entries:
            for replica in [r for r, (_, _, seen) in entries.items() if seen < deadline]:
                del entries[replica]
        return [sorted((host, port) for host, port, _ in entries.values()) for entries in self._entries]
