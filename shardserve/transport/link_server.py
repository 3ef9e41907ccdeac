"""The shard's end of a shard link: it listens, checks the router's proof, answers frames.

Bounded: frames up to `max_frame` bytes, every state of a connection has one absolute deadline
(transport.flow: the handshake, a frame once its first byte arrived, answers the caller does not
read, idle time), at most `max_connections` connections (and `max_handshakes` of them not yet
authenticated, `max_handshakes_per_source` from one address), at most `max_in_flight` frames
being answered per connection (reading pauses beyond), and reading pauses while the transport's
write buffer is full. The caller gets a fixed error word, never the shard's exception text (that
goes to the log).

The handshake and the frames are transport.link_auth's and transport.link_frames'; the router's
end, and why a link exists at all, are transport.shard_link's (which re-exports what this module
offers, so callers import the link from one place).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shardserve.errors import BadArgument
from shardserve.transport.flow import Deadline, FlowControl, PeerPaced
from shardserve.transport.link_auth import NONCE_BYTES, PROOF_BYTES, _Session, link_proof
from shardserve.transport.link_frames import _ERROR, _OK, MAX_FRAME, _Corrupt, _FrameBuffer

ERROR_WORD = b"shard could not answer this frame"
# The link's records keep the name they had when both ends were one module (shard_link), so a
# filter or level set on it still covers the shard's end.
logger = logging.getLogger("shardserve.transport.shard_link")


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

    max_frame: int = MAX_FRAME
    handshake_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0
    send_timeout_s: float = 60.0
    idle_timeout_s: float = 600.0
    max_connections: int = 256
    max_handshakes: int = 16
    max_handshakes_per_source: int = 8
    max_in_flight: int = 64



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


class _ServerConnection(PeerPaced):
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
        raise BadArgument("a link secret has at least 16 bytes")
    server = _LinkServer(handler, answer_now, in_flight or InFlight(), secret, limits or LinkLimits())
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _ServerConnection(server), host, port)
