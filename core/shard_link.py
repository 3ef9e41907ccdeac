"""The router → shard hop as a plain TCP link: length-prefixed frames, many calls in flight per link.

Why not a Serve handle call: on this project's machine one handle call cost ~2.5 ms of CPU (caller
plus callee, loadtests/records/hop.json), more than the FAISS scan it carries, and a query makes
one per shard. A frame on a long-lived socket costs tens of microseconds. Serve still owns the shard
deployments — replicas, placement, health checks, autoscaling, restarts; each replica just also
listens on a port, and the router keeps one link per replica (found through the index version's
directory, deployments.index_version). When no link is known or a link breaks, the router falls
back to the Serve handle call, so a link is an optimisation, never a single point of failure.

Frame: `<IQB` header (payload bytes, request id, status 0 = answer / 1 = error text), then the
payload: core.shard_wire bytes, unchanged. Plain asyncio, no Ray: tested in-process.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import struct
import time
from collections.abc import Awaitable, Callable

_HEADER = struct.Struct("<IQB")
_OK, _ERROR = 0, 1
MAX_FRAME = 1 << 30  # a frame this large is a corrupt stream, not a query


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

    def __init__(self) -> None:
        self.buffer = bytearray()

    def frames(self, data: bytes) -> list[tuple[int, int, bytes]] | None:
        """(request id, status, payload) of every frame completed by `data`; None: a corrupt stream.
        Each payload is copied once; when nothing was pending, straight out of `data`."""
        if self.buffer:
            self.buffer += data
            source = self.buffer
        else:  # the common case: a receive holds whole frames, parse it without buffering it
            source = data
        found, offset = [], 0
        with memoryview(source) as view:
            while len(view) - offset >= _HEADER.size:
                length, request_id, status = _HEADER.unpack_from(view, offset)
                if length > MAX_FRAME:
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


class _ServerConnection(asyncio.Protocol):
    """One router's connection to a shard replica. A plain Protocol, not streams: a frame costs one
    callback, and one the handler can answer at once (`answer_now`) needs no task at all."""

    def __init__(self, handler: Callable[[bytes], Awaitable[bytes]],
                 answer_now: Callable[[bytes], bytes | None] | None, gauge: InFlight):
        self.handler, self.answer_now, self.gauge = handler, answer_now, gauge
        self.frames = _FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self.tasks: set[asyncio.Task] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None  # the router went away: answers still being computed are dropped

    def data_received(self, data: bytes) -> None:
        frames = self.frames.frames(data)
        if frames is None:  # a corrupt stream: nothing after this can be framed
            self.transport.close()
            return
        for request_id, _, payload in frames:
            self.gauge.change(+1)
            if self.answer_now is not None:
                try:
                    body, status = self.answer_now(payload), _OK
                except Exception as exc:  # the caller gets the error; the link stays up
                    body, status = _error_text(exc), _ERROR
                if body is not None:
                    self.gauge.change(-1)
                    self.transport.write(_frame(request_id, status, body))
                    continue
            task = asyncio.get_running_loop().create_task(self._answer(request_id, payload))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _answer(self, request_id: int, payload: bytes) -> None:
        try:
            body, status = await self.handler(payload), _OK
        except Exception as exc:  # the caller gets the error; the link stays up
            body, status = _error_text(exc), _ERROR
        finally:
            self.gauge.change(-1)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_frame(request_id, status, body))


def _error_text(exc: Exception) -> bytes:
    return f"{type(exc).__name__}: {exc}"[:2000].encode()


async def serve_link(handler: Callable[[bytes], Awaitable[bytes]], host: str, port: int = 0,
                     in_flight: InFlight | None = None,
                     answer_now: Callable[[bytes], bytes | None] | None = None) -> asyncio.Server:
    """Listen on (host, port); every frame is answered by `answer_now(payload)` when that returns
    bytes (small work done right in the receive callback), else by `handler(payload)` in a task of
    its own, so a long search does not hold up the frames behind it on the same link."""
    gauge = in_flight or InFlight()
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _ServerConnection(handler, answer_now, gauge), host, port)


class _ClientConnection(asyncio.Protocol):
    """The router's end of a link: answers are matched to their calls by request id."""

    def __init__(self, link: ShardLink):
        self.link = link
        self.frames = _FrameBuffer()

    def data_received(self, data: bytes) -> None:
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
        self.link._fail(ConnectionError(f"link to {self.link.address} lost: {reason}"))


class ShardLink:
    """One client connection to one shard replica; calls are multiplexed by request id."""

    def __init__(self, host: str, port: int):
        self.address = (host, port)
        self.in_flight = 0
        self.broken = False
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Future | None = None

    async def call(self, payload: bytes) -> bytes:
        """Send one frame, await its answer. Raises ConnectionError if the link breaks (the caller
        falls back), ShardLinkError if the shard raised."""
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
        transport, _ = await asyncio.wait_for(
            loop.create_connection(lambda: _ClientConnection(self), *self.address), 2.0)
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
        self.by_shard: list[dict[tuple[str, int], ShardLink]] = [{} for _ in range(num_shards)]
        self.retry_after_s = retry_after_s
        self._failed: dict[tuple[str, int], float] = {}

    def update(self, endpoints: list[list[tuple[str, int]]]) -> None:
        """Follow the directory: open links to new replicas, close those that left."""
        clock = time.monotonic()
        self._failed = {a: t for a, t in self._failed.items() if clock - t < self.retry_after_s}
        for shard, wanted in enumerate(endpoints[:len(self.by_shard)]):
            links = self.by_shard[shard]
            wanted_set = {tuple(address) for address in wanted}
            for address in list(links):
                if address not in wanted_set or links[address].broken:
                    links.pop(address).close()
            for address in wanted_set - links.keys():
                if address not in self._failed:
                    links[address] = ShardLink(*address)

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
