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


async def serve_link(handler: Callable[[bytes], Awaitable[bytes]], host: str, port: int = 0,
                     in_flight: InFlight | None = None) -> asyncio.Server:
    """Listen on (host, port); every frame is answered by `handler(payload)` (a task per frame, so
    a long search does not hold up the frames behind it on the same link)."""
    gauge = in_flight or InFlight()

    async def answer(request_id: int, payload: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            body, status = await handler(payload), _OK
        except Exception as exc:  # the caller gets the error; the link stays up
            body, status = f"{type(exc).__name__}: {exc}"[:2000].encode(), _ERROR
        finally:
            gauge.change(-1)
        if not writer.is_closing():
            writer.write(_HEADER.pack(len(body), request_id, status) + body)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                length, request_id, _ = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if length > MAX_FRAME:
                    break
                payload = await reader.readexactly(length)
                gauge.change(+1)
                task = asyncio.ensure_future(answer(request_id, payload, writer))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the router went away, or this server is shutting down
        finally:
            writer.close()

    return await asyncio.start_server(connection, host, port)


class ShardLink:
    """One client connection to one shard replica; calls are multiplexed by request id."""

    def __init__(self, host: str, port: int):
        self.address = (host, port)
        self.in_flight = 0
        self.broken = False
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Future | None = None
        self._reader_task: asyncio.Task | None = None

    async def call(self, payload: bytes) -> bytes:
        """Send one frame, await its answer. Raises ConnectionError if the link breaks (the caller
        falls back), ShardLinkError if the shard raised."""
        if self.broken:
            raise ConnectionError(f"link to {self.address} is broken")
        writer = self._writer or await self._connect()
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self.in_flight += 1
        try:
            writer.write(_HEADER.pack(len(payload), request_id, _OK) + payload)
            return await future
        finally:
            self.in_flight -= 1
            self._pending.pop(request_id, None)

    async def _connect(self) -> asyncio.StreamWriter:
        if self.broken:
            raise ConnectionError(f"link to {self.address} is broken")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(self._connecting)
        except Exception:
            self.broken = True
            raise

    async def _open(self) -> asyncio.StreamWriter:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.address), 2.0)
        self._reader_task = asyncio.ensure_future(self._read(reader))
        self._writer = writer
        return writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                length, request_id, status = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                body = await reader.readexactly(length)
                future = self._pending.get(request_id)
                if future is None or future.done():
                    continue  # the caller gave up (deadline)
                if status == _OK:
                    future.set_result(body)
                else:
                    future.set_exception(ShardLinkError(body.decode(errors="replace")))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._fail(ConnectionError(f"link to {self.address} lost: {type(exc).__name__}"))
        except asyncio.CancelledError:
            self._fail(ConnectionError(f"link to {self.address} closed"))
            raise

    def _fail(self, error: ConnectionError) -> None:
        self.broken = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        if self._writer is not None:
            self._writer.close()

    def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
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
