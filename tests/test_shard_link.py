"""Shard links in-process (plain asyncio, no Ray): framing, multiplexing, errors, broken links,
the directory's expiry and the in-flight gauge autoscaling reads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from core.fanout import search_batch
from core.shard_link import EndpointDirectory, InFlight, ShardLink, ShardLinkError, ShardLinks, serve_link
from core.shard_wire import ShardQuery, decode_answer, encode_answer
from tests.test_fanout import _shards


def _port(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]


def test_answers_match_in_process_search_through_links() -> None:
    data, searchers = _shards(3)
    from core.api import ParsedQuery

    async def run():
        servers = []
        for searcher in searchers:
            async def handler(blob: bytes, searcher=searcher) -> bytes:
                return encode_answer(*searcher.answer(ShardQuery.decode(blob)))
            servers.append(await serve_link(handler, "127.0.0.1"))
        links = ShardLinks(3)
        links.update([[("127.0.0.1", _port(s))] for s in servers])

        async def call(shard: int, query: ShardQuery):
            return decode_answer(await links.pick(shard).call(query.encode()))

        async def direct(shard: int, query: ShardQuery):
            return searchers[shard].answer(query)

        queries = [ParsedQuery(data.queries[:7], 5, (("nprobe", 4),), False, False)]
        over_links = await search_batch(queries, call, 3, False, 5.0)
        in_process = await search_batch(queries, direct, 3, False, 5.0)
        links.close()
        for server in servers:
            server.close()
        return over_links[0], in_process[0]

    linked, local = asyncio.run(run())
    assert linked.answered == 3
    np.testing.assert_array_equal(linked.ids, local.ids)
    np.testing.assert_array_equal(linked.distances, local.distances)


def test_calls_are_multiplexed_answers_out_of_order_and_errors_stay_per_call() -> None:
    async def run():
        async def handler(blob: bytes) -> bytes:
            if blob == b"boom":
                raise ValueError("bad batch")
            await asyncio.sleep(float(blob.decode()))
            return blob

        gauge = InFlight()
        server = await serve_link(handler, "127.0.0.1", in_flight=gauge)
        link = ShardLink("127.0.0.1", _port(server))
        slow = asyncio.ensure_future(link.call(b"0.3"))
        await asyncio.sleep(0.05)
        assert gauge.now == 1  # counted from the frame's arrival
        fast = await link.call(b"0.0")  # not stuck behind the slow one
        assert fast == b"0.0" and not slow.done()
        with pytest.raises(ShardLinkError, match="ValueError: bad batch"):
            await link.call(b"boom")
        assert await slow == b"0.3"
        assert link.in_flight == 0 and gauge.now == 0
        assert 0.0 < gauge.mean_and_reset() <= 1.0
        link.close()
        server.close()

    asyncio.run(run())


def test_answer_now_answers_in_the_receive_callback_and_defers_what_it_declines() -> None:
    """Small batches are answered without a task; None hands the frame to the async handler;
    an error raised by answer_now is that call's error only."""
    handled: list[bytes] = []

    async def run():
        async def handler(blob: bytes) -> bytes:
            handled.append(blob)
            return b"async:" + blob

        def answer_now(blob: bytes) -> bytes | None:
            if blob == b"bad":
                raise ValueError("bad header")
            return None if blob.startswith(b"big") else b"now:" + blob

        gauge = InFlight()
        server = await serve_link(handler, "127.0.0.1", in_flight=gauge, answer_now=answer_now)
        link = ShardLink("127.0.0.1", _port(server))
        answers = await asyncio.gather(link.call(b"a"), link.call(b"big" + b"x" * 300_000), link.call(b"c"))
        with pytest.raises(ShardLinkError, match="ValueError: bad header"):
            await link.call(b"bad")
        assert await link.call(b"d") == b"now:d"  # the link survived the error
        assert gauge.now == 0
        link.close()
        server.close()
        return answers

    small, big, other = asyncio.run(run())
    assert small == b"now:a" and other == b"now:c"
    assert big == b"async:big" + b"x" * 300_000 and handled == [b"big" + b"x" * 300_000]


def test_frames_split_and_joined_arbitrarily_are_cut_right() -> None:
    from core.shard_link import _frame, _FrameBuffer

    stream = b"".join(_frame(i, i % 2, bytes([i]) * i) for i in range(1, 40))
    for step in (1, 7, 64, len(stream)):
        buffer, got = _FrameBuffer(), []
        for offset in range(0, len(stream), step):
            got += buffer.frames(stream[offset:offset + step])
        assert got == [(i, i % 2, bytes([i]) * i) for i in range(1, 40)]
    assert _FrameBuffer().frames(b"\xff\xff\xff\xff" + bytes(9)) is None  # a length no frame has


def test_a_broken_link_fails_its_calls_fast_and_is_dropped() -> None:
    async def run():
        async def dies_mid_call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1)  # a call arrives, then the replica's process goes away
            writer.close()

        server = await asyncio.start_server(dies_mid_call, "127.0.0.1", 0)
        links = ShardLinks(1, retry_after_s=60)
        address = ("127.0.0.1", _port(server))
        links.update([[address]])
        link = links.pick(0)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(link.call(b"x"), 2.0)
        with pytest.raises(ConnectionError):
            await link.call(b"y")  # broken stays broken: no hang on a dead socket
        links.drop(0, link)
        assert links.pick(0) is None  # the caller falls back to a Serve call
        links.update([[address]])  # still announced, but failed recently: not retried yet
        assert links.pick(0) is None
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectionError):
            await ShardLink(*address).call(b"x")  # nothing listens any more

    asyncio.run(run())


def test_directory_forgets_replicas_that_stop_announcing(monkeypatch) -> None:
    import core.shard_link as shard_link

    clock = [100.0]
    monkeypatch.setattr(shard_link.time, "monotonic", lambda: clock[0])
    directory = EndpointDirectory(2, ttl_s=6.0)
    directory.announce(0, "a", "10.0.0.1", 5000)
    directory.announce(0, "b", "10.0.0.2", 5001)
    directory.announce(1, "c", "10.0.0.1", 5002)
    assert directory.endpoints() == [[("10.0.0.1", 5000), ("10.0.0.2", 5001)], [("10.0.0.1", 5002)]]
    clock[0] += 4.0
    directory.announce(0, "a", "10.0.0.1", 5000)
    clock[0] += 4.0  # b and c were last seen 8 s ago
    assert directory.endpoints() == [[("10.0.0.1", 5000)], []]
    directory.withdraw(0, "a")
    assert directory.endpoints() == [[], []]


def test_two_choices_prefer_the_less_busy_replica() -> None:
    links = ShardLinks(1)
    links.update([[("h", 1), ("h", 2)]])
    busy, idle = links.by_shard[0][("h", 1)], links.by_shard[0][("h", 2)]
    busy.in_flight = 5
    assert all(links.pick(0) is idle for _ in range(20))
    links.update([[("h", 1)]])  # replica 2 left
    assert links.pick(0) is busy and idle.broken
