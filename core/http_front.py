"""The router's own HTTP/1.1 door: a plain asyncio server on the router replica's event loop.

Why: a Serve no-op request costs ~0.47 ms of server CPU here (its HAProxy ingress, the replica's
uvicorn + ASGI wrapper + request-id middleware; `serve-noop` in loadtests/records/bench.json), two
thirds of what the whole uvicorn + FAISS baseline spends on a query. Going through Serve's HTTP
path, a sharded query cannot cost less than the monolith. This door is what the shard links are for
the shard hop: Serve still owns the router deployment (replicas, placement, health checks,
restarts); each replica also listens here, and the edge HAProxy sends requests straight to it.

Every replica on a node binds the same port with SO_REUSEPORT, so the kernel spreads connections
over them and a replica that starts or stops needs no reconfiguration anywhere.

Kept small on purpose: HTTP/1.1 keep-alive (or 1.0), one request at a time per connection, bodies
by Content-Length or chunked; a body over `max_body_bytes` is refused (413) from its declared length
before a byte of it is read, or, chunked, as soon as the chunks received pass the limit, so it is
never buffered beyond it; a request not fully received within `body_timeout_s` is answered 408.
Plain asyncio, no Ray: tested in-process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import orjson

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line + headers; more is not a client of this API
LINGER_IDLE_S, LINGER_MAX_S = 2.0, 10.0  # after a refusal: read and drop what the client still sends
JSON = "application/json"
CHUNKED = -1  # a body length that says: Transfer-Encoding: chunked


@dataclass
class Reply:
    """What a handler answers: status, body, its content type, extra headers."""

    status: int
    body: bytes
    content_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """One complete request, as a handler sees it (the route without its query string)."""

    method: str
    path: str
    body: bytes = b""
    query: str = ""
    content_type: str = ""


Handler = Callable[[Request], Awaitable[Reply]]


def dechunk(buffer: bytearray, start: int, limit: int) -> tuple[bytes, int] | None:
    """A chunked body starting at `start`: (body, end offset) once complete, None while incomplete.
    ValueError when malformed, or as soon as the chunks already received exceed `limit` bytes."""
    parts, size, pos = [], 0, start
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            chunk = int(bytes(buffer[pos:eol]).split(b";")[0], 16)
        except ValueError:
            raise ValueError("malformed chunk size line") from None
        size += chunk
        if chunk < 0 or size > limit:
            raise ValueError(f"body exceeds {limit} bytes (stopped reading at {size})")
        if chunk == 0:  # last chunk: skip trailer lines up to the empty one
            while True:
                line_end = buffer.find(b"\r\n", eol + 2)
                if line_end < 0:
                    return None
                if line_end == eol + 2:
                    return b"".join(parts), line_end + 2
                eol = line_end
        if len(buffer) < eol + 2 + chunk + 2:
            return None
        parts.append(bytes(buffer[eol + 2:eol + 2 + chunk]))
        pos = eol + 2 + chunk + 2


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


class _Connection(asyncio.Protocol):
    """One client connection: parse a request, answer it, then the next (no overlap per connection)."""

    def __init__(self, front: FrontDoor):
        self.front = front
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request of this connection is being answered
        self.timer: asyncio.TimerHandle | None = None
        self.lingering_until = 0.0  # > 0: refused, answered, write side shut; dropping what arrives

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.front.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.transport = None
        self.front.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.lingering_until:
            return self._linger()
        self.buffer += data
        if not self.busy:
            self._next()
        elif len(self.buffer) > self.front.max_body_bytes + MAX_HEAD_BYTES:
            self.transport.pause_reading()  # a pipelining client waits until this answer is out

    def _next(self) -> None:
        """Dispatch the next complete request in the buffer, or wait (bounded in time) for it."""
        if not self.buffer or self.transport is None:
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                return self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
            return self._arm()
        try:
            method, path, query, content_type, keep_alive, length = self._parse_head(
                bytes(self.buffer[:end]))
        except ValueError as exc:
            return self._refuse(400, str(exc))
        limit, start = self.front.max_body_bytes, end + 4
        if length == CHUNKED:
            try:
                found = dechunk(self.buffer, start, limit)
            except ValueError as exc:
                return self._refuse(413 if "exceeds" in str(exc) else 400, str(exc))
            if found is None:
                return self._arm()
            body, consumed = found
        else:
            if length > limit:
                return self._refuse(413, f"body of {length} bytes exceeds {limit}")
            if len(self.buffer) < start + length:
                return self._arm()
            body, consumed = bytes(self.buffer[start:start + length]), start + length
        del self.buffer[:consumed]
        self._disarm()
        self.busy = True
        request = Request(method, path, body, query, content_type)
        self.front.loop.create_task(self._answer(request, keep_alive))

    @staticmethod
    def _parse_head(head: bytes) -> tuple[str, str, str, str, bool, int]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ValueError(f"malformed request line {lines[0][:80]!r}")
        method, target, version = parts
        keep_alive, length, content_type = version == "HTTP/1.1", 0, ""
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"malformed header line {line[:80]!r}")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                if not value.isdigit():
                    raise ValueError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == "transfer-encoding" and value.lower() != "identity":
                if value.lower() != "chunked":
                    raise ValueError(f"unsupported Transfer-Encoding {value[:40]!r}")
                length = CHUNKED
            elif name == "content-type":
                content_type = value
            elif name == "connection":
                keep_alive = value.lower() == "keep-alive" or (keep_alive and value.lower() != "close")
        path, _, query = target.partition("?")
        return method, path, query, content_type, keep_alive, length

    async def _answer(self, request: Request, keep_alive: bool) -> None:
        try:
            reply = await self.front.handler(request)
        except Exception:  # a bug in a handler is a 500 on this request, not a dead connection
            logger.exception("front door handler failed on %s %s", request.method, request.path)
            reply = _error(500, "internal error")
        if self.transport is None:
            return
        self.transport.write(_head(reply, keep_alive) + reply.body)
        self.busy = False
        if not keep_alive:
            self.transport.close()
            return
        self.transport.resume_reading()
        self._next()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that will not be read, then close: the rest of its bytes are unknown.
        A lingering close (as web servers do): the write side is shut at once, and what the client
        still sends is read and dropped for a while, so a client busy uploading gets to read this
        answer instead of a connection reset."""
        self._disarm()
        self.buffer.clear()
        reply = _error(status, message)
        self.transport.write(_head(reply, keep_alive=False) + reply.body)
        if not self.transport.can_write_eof():
            return self.transport.close()
        self.transport.write_eof()
        self.lingering_until = self.front.loop.time() + LINGER_MAX_S
        self._linger()

    def _linger(self) -> None:
        """Data arrived after a refusal (or the refusal itself): close once the client has been
        quiet for LINGER_IDLE_S, or at the latest LINGER_MAX_S after the refusal."""
        self._disarm()
        wait = min(LINGER_IDLE_S, self.lingering_until - self.front.loop.time())
        if wait <= 0:
            self.transport.close()
        else:
            self.timer = self.front.loop.call_later(wait, self.transport.close)
    def _arm(self) -> None:
        if self.timer is None:
            self.timer = self.front.loop.call_later(self.front.body_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self) -> None:
        self.timer = None
        if self.transport is not None and not self.busy and not self.lingering_until:
            self._refuse(408, f"request not received within {self.front.body_timeout_s} s")


class FrontDoor:
    """A listening HTTP server: `handler(request)` answers every complete request."""

    def __init__(self, handler: Handler, max_body_bytes: int, body_timeout_s: float):
        self.handler, self.max_body_bytes, self.body_timeout_s = handler, max_body_bytes, body_timeout_s
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
