"""The router's own HTTP/1.1 door: a plain asyncio server on the router replica's event loop,
parsing with httptools (llhttp, the parser uvicorn uses).

Why its own door: a request through Serve's HTTP path (its HAProxy ingress, the replica's uvicorn +
ASGI wrapper) cost two thirds of what the whole uvicorn + FAISS baseline spends on a query (`make
bench` records both); through it a sharded query cannot cost less than the monolith. Serve still
owns the router deployment (replicas, placement, health checks, restarts); each replica also
listens here, and the edge HAProxy sends requests straight to it. Every replica on a node binds the
same port with SO_REUSEPORT, so the kernel spreads connections over them.

Why httptools and not a hand parser: llhttp refuses ambiguous framing (Content-Length with
Transfer-Encoding, duplicate or signed lengths, bad chunk syntax, obs-fold, bare LF) that a
lenient parser lets through as a second, smuggled request. Every refusal is a 400 and a closed
connection. What this module adds around the parser is bounded: the head (bytes and header count,
counted while it arrives), the body (413 from its declared length before a byte of it is read, or
as soon as chunks pass the limit), connections per door, and pipelined requests (reading pauses
while one is answered, and while the client does not read its answers). HEAD is answered as GET
without a body; `Expect: 100-continue` gets its interim answer.

Why a deadline in every state (transport.flow, shared with the shard links): a connection with no
timer armed is one a client can hold forever. Each state has one, fixed when the state begins:
idle between requests (closed), a request begun, even one pipelined behind another (408 from its
first byte), an answer being computed (closed: a stuck handler frees its client), answers the
client does not read (cut off), and a close whose answer has not been flushed yet (cut off).
Plain asyncio, no Ray: tested in-process.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import httptools
import orjson

from shardserve.transport.flow import Action, Deadline, FlowControl, PeerPaced

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line + headers; more is not a client of this API
MAX_HEADERS = 64
MAX_PIPELINED = 16  # complete requests waiting behind the one being answered; more: the client is hostile
MAX_CONNECTIONS = 4096
KEEP_ALIVE_IDLE_S = 75.0  # an idle keep-alive connection closes after this
SEND_TIMEOUT_S = 60.0  # a client reading none of its answers this long is cut off (nginx: send_timeout)
# A connection's last request: its answer says `Connection: close`. Router replicas on a node share
# the door's port (SO_REUSEPORT), and an edge keeps its connections alive: without an end, a replica
# started later (autoscaling) would get none of them. The close is announced in the answer, so the
# client never sends on a connection the door is closing. 1,000: a reconnect per 1,000 requests.
MAX_REQUESTS_PER_CONNECTION = 1000
LINGER_IDLE_S, LINGER_MAX_S = 2.0, 10.0  # after a refusal: read and drop what the client still sends
JSON = "application/json"


@dataclass
class Reply:
    """What a handler answers: status, body, its content type, extra headers."""

    status: int
    body: bytes
    content_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


def json_reply(payload: object, status: int = 200) -> Reply:
    """A JSON answer (numpy arrays in it written by orjson as they are)."""
    return Reply(status, orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY))


@dataclass(frozen=True)
class Request:
    """One complete request, as a handler sees it (the route without its query string)."""

    method: str
    path: str
    body: bytes = b""
    query: str = ""
    content_type: str = ""
    lane: str = ""  # X-Shardserve-Lane as the edge set it ("text" or "vector"; "" without an edge)
    traceparent: str = ""  # the caller's W3C trace context (shardserve.tracing checks it), or ""


Handler = Callable[[Request], Awaitable[Reply]]


class _Refused(Exception):
    """A request this door will not read further: answered with `status`, then the connection closes."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> Reply:
    return Reply(status, orjson.dumps({"error": message, "field": "body" if status in (408, 413)
                                       else None}))


_PLAIN_HEADS: dict[tuple[int, str], bytes] = {}  # (status, content type) -> head up to Content-Length


def _head(reply: Reply, keep_alive: bool) -> bytes:
    if keep_alive and not reply.headers:  # the common answer: its head is cached but for the length
        prefix = _PLAIN_HEADS.get((reply.status, reply.content_type))
        if prefix is None:
            empty = Reply(reply.status, b"", reply.content_type)
            prefix = _full_head(empty, True).split(b"Content-Length")[0]
            _PLAIN_HEADS[(reply.status, reply.content_type)] = prefix
        return b"%sContent-Length: %d\r\n\r\n" % (prefix, len(reply.body))
    return _full_head(reply, keep_alive)


def _full_head(reply: Reply, keep_alive: bool) -> bytes:
    try:
        phrase = HTTPStatus(reply.status).phrase
    except ValueError:
        phrase = ""
    lines = [f"HTTP/1.1 {reply.status} {phrase}", f"Content-Type: {reply.content_type}",
             f"Content-Length: {len(reply.body)}"]
    lines += [f"{name}: {value}" for name, value in reply.headers.items()]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Connection(PeerPaced):
    """One client connection: llhttp parses, requests are answered one at a time, in order."""

    def __init__(self, front: FrontDoor):
        self.front = front
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.ready: deque[tuple[Request, bool, bool]] = deque()  # (request, keep-alive, head only)
        self.busy = False  # a request of this connection is being answered
        self.flow: FlowControl | None = None
        self.loop = front.loop
        self.deadline = Deadline(self.loop, self._due)
        # loop times each state began (transport.flow: a state's deadline never moves)
        self.idle_since = self.busy_since = self.message_began = self.closing_since = 0.0
        self.lingering_until = 0.0  # > 0: refused, answered, write side shut; dropping what arrives
        self.last_read = 0.0  # while lingering: when the client last sent something
        self.requests = 0  # complete requests read on this connection
        self._reset()

    def _reset(self) -> None:
        self.in_message = False
        self.url, self.headers_done, self.head_bytes, self.header_count = b"", False, 0, 0
        self.content_type, self.expect_continue, self.declared, self.lane = "", False, -1, ""
        self.traceparent = ""
        self.body: list[bytes] = []
        self.body_bytes = 0

    # -- connection ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.front.connections) >= self.front.max_connections:
            transport.abort()  # type: ignore[attr-defined]
            return
        self.front.connections.add(self)
        self.flow = FlowControl(self.transport, self.loop)  # type: ignore[arg-type]
        self.idle_since = self.loop.time()
        self.deadline.update()

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.cancel()
        self.transport = None
        self.front.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.lingering_until:
            self.last_read = self.loop.time()
            return self.deadline.update()
        in_head = self.in_message and not self.headers_done
        try:
            self.parser.feed_data(data)
            # llhttp would buffer an unfinished head without limit: bound it, counting a read that
            # ends inside a head as head from its first byte (an upper bound, exact unless the same
            # read also finished a pipelined request before it)
            if self.in_message and not self.headers_done:
                self.head_bytes = (self.head_bytes if in_head else 0) + len(data)
                if self.head_bytes > MAX_HEAD_BYTES:
                    raise _Refused(431, f"request head over {MAX_HEAD_BYTES} bytes")
        except _Refused as refused:
            return self._refuse(refused.status, str(refused))
        except httptools.HttpParserUpgrade:
            return self._refuse(400, "protocol upgrades are not served here")
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                return self._refuse(cause.status, str(cause))
            return self._refuse(400, f"malformed request: {str(exc)[:120]}")
        if len(self.ready) > MAX_PIPELINED:
            return self._refuse(400, f"more than {MAX_PIPELINED} pipelined requests")
        self._flow()

    # -- llhttp callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_message = True
        self.message_began = self.loop.time()  # it must arrive whole by body_timeout_s from now

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_HEAD_BYTES:
            raise _Refused(414, f"request target over {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        if self.header_count > MAX_HEADERS:
            raise _Refused(431, f"more than {MAX_HEADERS} headers")
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1")
        elif name == b"x-shardserve-lane":
            self.lane = value[:16].decode("latin-1")
        elif name == b"traceparent":
            self.traceparent = value[:64].decode("latin-1")
        elif name == b"content-length":
            self.declared = int(value)  # llhttp checked its digits and that it is the only one
            if self.declared > self.front.max_body_bytes:
                raise _Refused(413, f"body of {self.declared} bytes exceeds {self.front.max_body_bytes}")
        elif name == b"transfer-encoding" and value.lower() != b"chunked":
            raise _Refused(501, f"unsupported Transfer-Encoding {value[:40].decode('latin-1')!r}")
        elif name == b"expect":
            if value.lower() != b"100-continue":
                raise _Refused(417, "only Expect: 100-continue is understood")
            self.expect_continue = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.expect_continue and not self.busy and not self.ready and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.front.max_body_bytes:
            raise _Refused(413, f"body exceeds {self.front.max_body_bytes} bytes (stopped reading at "
                                f"{self.body_bytes})")
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("ascii")
        head_only = method == "HEAD"
        target = self.url.decode("latin-1")
        path, _, query = target.partition("?")
        request = Request("GET" if head_only else method, path, b"".join(self.body), query,
                          self.content_type, self.lane, self.traceparent)
        self.requests += 1
        last = self.requests >= self.front.max_requests_per_connection
        self.ready.append((request, self.parser.should_keep_alive() and not last, head_only))
        self._reset()

    # -- answering ----------------------------------------------------------------------------
    def _flow(self) -> None:
        """Answer the next ready request, or read on; reading pauses while requests wait."""
        if self.transport is None or self.flow is None or self.lingering_until or self.closing_since:
            return
        if not self.busy and self.ready and not self.flow.write_paused:
            self.busy, self.busy_since = True, self.loop.time()
            request, keep_alive, head_only = self.ready.popleft()
            self.loop.create_task(self._answer(request, keep_alive, head_only))
        self.flow.want_reading(not self.busy and not self.ready)
        self.deadline.update()

    async def _answer(self, request: Request, keep_alive: bool, head_only: bool) -> None:
        try:
            reply = await self.front.handler(request)
        except Exception:  # a bug in a handler is a 500 on this request, not a dead connection
            logger.exception("front door handler failed on %s %s", request.method, request.path)
            reply = _error(500, "internal error")
        if self.transport is None:
            return
        head = _head(reply, keep_alive)
        self.transport.write(head if head_only else head + reply.body)
        self.busy = False
        if not keep_alive:
            return self._close()
        if not self.ready:
            self.idle_since = self.loop.time()
        self._flow()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that will not be read, then close: the rest of its bytes are unknown.
        A lingering close (as web servers do): the write side is shut at once, and what the client
        still sends is read and dropped for a while, so a client busy uploading gets to read this
        answer instead of a connection reset."""
        self.ready.clear()
        if self.transport is None or self.flow is None:
            return
        reply = _error(status, message)
        self.transport.write(_head(reply, keep_alive=False) + reply.body)
        self.flow.resume_reading()
        if not self.transport.can_write_eof():
            return self._close()
        self.transport.write_eof()
        self.last_read = self.loop.time()
        self.lingering_until = self.last_read + LINGER_MAX_S
        self.deadline.update()

    def _close(self) -> None:
        """Close once what was written is flushed; a client that does not read it is cut off at
        the send timeout (asyncio's close alone would wait for it forever)."""
        if self.transport is None:
            return
        self.closing_since = self.loop.time()
        self.transport.close()
        self.deadline.update()

    # -- the one deadline of each state (transport.flow) ---------------------------------------
    def _due(self) -> tuple[float, Action] | None:
        if self.transport is None or self.flow is None:
            return None
        front = self.front
        if self.flow.write_paused:
            return self.flow.write_paused_at + front.send_timeout_s, self._unread
        if self.closing_since:
            return self.closing_since + front.send_timeout_s, self._unread
        if self.lingering_until:  # quiet for LINGER_IDLE_S, or LINGER_MAX_S after the refusal
            return min(self.last_read + LINGER_IDLE_S, self.lingering_until), self._close
        if self.busy:
            return self.busy_since + front.idle_timeout_s, self._stuck
        if self.in_message:
            return self.message_began + front.body_timeout_s, self._late
        return self.idle_since + front.idle_timeout_s, self._close

    def _late(self) -> None:
        self._refuse(408, f"request not received within {self.front.body_timeout_s} s")

    def _stuck(self) -> None:
        logger.warning("front door: no answer within %s s, connection closed", self.front.idle_timeout_s)
        self._abort()

    def _unread(self) -> None:
        logger.info("front door: the client read none of its answers for %s s, connection cut off",
                    self.front.send_timeout_s)
        self._abort()

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class FrontDoor:
    """A listening HTTP server: `handler(request)` answers every complete request."""

    def __init__(self, handler: Handler, max_body_bytes: int, body_timeout_s: float,
                 max_connections: int = MAX_CONNECTIONS,
                 max_requests_per_connection: int = MAX_REQUESTS_PER_CONNECTION,
                 idle_timeout_s: float = KEEP_ALIVE_IDLE_S, send_timeout_s: float = SEND_TIMEOUT_S):
        """`body_timeout_s`: a request must arrive whole this long after its first byte (else 408).
        `idle_timeout_s`: a connection with no request for this long closes, and so does one whose
        answer takes this long. `send_timeout_s`: a client that reads none of its answers for this
        long is cut off."""
        self.handler, self.max_body_bytes, self.body_timeout_s = handler, max_body_bytes, body_timeout_s
        self.idle_timeout_s, self.send_timeout_s = idle_timeout_s, send_timeout_s
        self.max_connections = max_connections
        self.max_requests_per_connection = max_requests_per_connection
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.server: asyncio.Server | None = None

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Bind (SO_REUSEPORT: every router replica on this node shares the port) and serve."""
        self.server = await self.loop.create_server(lambda: _Connection(self), host, port,
                                                    reuse_port=True, backlog=1024)
        return self.server.sockets[0].getsockname()[:2]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()
