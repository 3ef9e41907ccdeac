"""Shard links in-process (plain asyncio, no Ray): framing, multiplexing, errors, broken links,
the directory's expiry and the in-flight gauge autoscaling reads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardserve.query.fanout import search_batch
from shardserve.transport.shard_link import (
    ERROR_WORD,
    MAC_BYTES,
    NONCE_BYTES,
    EndpointDirectory,
    InFlight,
    LinkLimits,
    ShardLink,
    ShardLinkError,
    ShardLinks,
    link_mac,
    serve_link,
)
from shardserve.transport.shard_wire import ShardQuery, decode_answer, encode_answer
from tests.shared import shards

SECRET = bytes(range(32))


def _port(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]


def test_answers_match_in_process_search_through_links() -> None:
    data, searchers = shards(3)
    from shardserve.query.api import ParsedQuery

    async def run():
        servers = []
        for searcher in searchers:
            async def handler(blob: bytes, searcher=searcher) -> bytes:
                bounds = searcher.query_bounds(max_rows=64, max_k=10, params=frozenset({"nprobe"}))
                return encode_answer(*searcher.answer(ShardQuery.decode(blob, bounds)))
            servers.append(await serve_link(handler, "127.0.0.1", secret=SECRET))
        links = ShardLinks(3)
        links.update([[("127.0.0.1", _port(s))] for s in servers], SECRET)

        async def call(shard: int, query: ShardQuery):
            return decode_answer(await links.pick(shard).call(query.encode()))

        async def direct(shard: int, query: ShardQuery):
            return searchers[shard].answer(query)

        queries = [ParsedQuery(matrix=data.queries[:7], k=5, params=(("nprobe", 4),), single=False,
                               require_full=False)]
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
        server = await serve_link(handler, "127.0.0.1", secret=SECRET, in_flight=gauge)
        link = ShardLink("127.0.0.1", _port(server), SECRET)
        slow = asyncio.ensure_future(link.call(b"0.3"))
        await asyncio.sleep(0.05)
        assert gauge.now == 1  # counted from the frame's arrival
        fast = await link.call(b"0.0")  # not stuck behind the slow one
        assert fast == b"0.0" and not slow.done()
        with pytest.raises(ShardLinkError) as refused:
            await link.call(b"boom")
        assert str(refused.value) == ERROR_WORD.decode()  # the shard's exception text stays in its log
        assert await slow == b"0.3"
        assert link.in_flight == 0 and gauge.now == 0
        assert 0.0 < gauge.mean_and_reset() <= 2.0  # never more than 2 calls in flight at once
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
        server = await serve_link(handler, "127.0.0.1", secret=SECRET, in_flight=gauge, answer_now=answer_now)
        link = ShardLink("127.0.0.1", _port(server), SECRET)
        answers = await asyncio.gather(link.call(b"a"), link.call(b"big" + b"x" * 300_000), link.call(b"c"))
        with pytest.raises(ShardLinkError, match=ERROR_WORD.decode()):
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
    from shardserve.transport.shard_link import _frame, _FrameBuffer

    stream = b"".join(_frame(i, i % 2, bytes([i]) * i) for i in range(1, 40))
    for step in (1, 7, 64, len(stream)):
        buffer, got = _FrameBuffer(), []
        for offset in range(0, len(stream), step):
            got += buffer.frames(stream[offset:offset + step])
        assert got == [(i, i % 2, bytes([i]) * i) for i in range(1, 40)]
    assert _FrameBuffer().frames(b"\xff\xff\xff\xff" + bytes(9)) is None  # a length no frame has
    assert _FrameBuffer(100).frames(_frame(1, 0, bytes(101))) is None  # over this link's limit


def test_a_broken_link_fails_its_calls_fast_and_is_dropped() -> None:
    async def run():
        async def dies_mid_call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(bytes(NONCE_BYTES))
            await reader.readexactly(MAC_BYTES + 1)  # a call arrives, then the replica's process goes away
            writer.close()

        server = await asyncio.start_server(dies_mid_call, "127.0.0.1", 0)
        links = ShardLinks(1, retry_after_s=60)
        address = ("127.0.0.1", _port(server))
        links.update([[address]], SECRET)
        link = links.pick(0)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(link.call(b"x"), 2.0)
        with pytest.raises(ConnectionError):
            await link.call(b"y")  # broken stays broken: no hang on a dead socket
        links.drop(0, link)
        assert links.pick(0) is None  # the caller falls back to a Serve call
        links.update([[address]], SECRET)  # still announced, but failed recently: not retried yet
        assert links.pick(0) is None
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectionError):
            await ShardLink(*address, SECRET).call(b"x")  # nothing listens any more

    asyncio.run(run())


def test_directory_forgets_replicas_that_stop_announcing(monkeypatch) -> None:
    import shardserve.transport.shard_link as shard_link

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
    links.update([[("h", 1), ("h", 2)]], SECRET)
    busy, idle = links.by_shard[0][("h", 1)], links.by_shard[0][("h", 2)]
    busy.in_flight = 5
    assert all(links.pick(0) is idle for _ in range(20))
    links.update([[("h", 1)]], SECRET)  # replica 2 left
    assert links.pick(0) is busy and idle.broken


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return reader, writer, await reader.readexactly(NONCE_BYTES)


async def _closed(reader: asyncio.StreamReader) -> bool:
    """True once the shard closed the connection without a byte more (a reset counts as closed)."""
    try:
        return await asyncio.wait_for(reader.read(1), 5.0) == b""
    except ConnectionResetError:
        return True


def test_a_stranger_without_the_secret_gets_no_answer_and_others_are_served() -> None:
    from shardserve.transport.shard_link import _frame

    calls: list[bytes] = []

    async def run():
        async def handler(blob: bytes) -> bytes:
            calls.append(blob)
            return b"answer"

        gauge = InFlight()
        server = await serve_link(handler, "127.0.0.1", secret=SECRET, in_flight=gauge)
        port = _port(server)
        outcomes = []
        # 1. frames straight away, no proof: read as a (wrong) MAC, then cut off
        reader, writer, _ = await _raw(port)
        writer.write(_frame(1, 0, b"search me") * 4)
        outcomes.append(await _closed(reader))
        # 2. a MAC made with another secret
        reader, writer, nonce = await _raw(port)
        writer.write(link_mac(b"x" * 32, nonce) + _frame(1, 0, b"search me"))
        outcomes.append(await _closed(reader))
        # 3. a MAC replayed from another connection (the nonce differs each time)
        reader, writer, nonce = await _raw(port)
        old = link_mac(SECRET, nonce)
        writer.close()
        reader, writer, _ = await _raw(port)
        writer.write(old + _frame(1, 0, b"search me"))
        outcomes.append(await _closed(reader))
        # the holder of the secret is answered all along
        link = ShardLink("127.0.0.1", port, SECRET)
        answer = await link.call(b"mine")
        link.close()
        server.close()
        return outcomes, answer, gauge.now

    outcomes, answer, in_flight = asyncio.run(run())
    assert outcomes == [True, True, True]
    assert answer == b"answer" and calls == [b"mine"] and in_flight == 0  # strangers moved no gauge


def test_link_bounds_frames_time_and_connections() -> None:
    from shardserve.transport.shard_link import _frame

    async def run():
        async def handler(blob: bytes) -> bytes:
            return blob

        limits = LinkLimits(max_frame=1000, handshake_timeout_s=0.2, frame_timeout_s=0.2,
                            max_connections=3, max_handshakes=2)
        server = await serve_link(handler, "127.0.0.1", secret=SECRET, limits=limits)
        port = _port(server)

        async def authenticated():
            reader, writer, nonce = await _raw(port)
            writer.write(link_mac(SECRET, nonce))
            return reader, writer

        found = {}
        reader, writer = await authenticated()  # a frame over max_frame: closed, nothing answered
        writer.write(_frame(1, 0, bytes(1001)))
        found["oversized"] = await _closed(reader)
        reader, writer = await authenticated()  # a frame begun and never finished
        writer.write(_frame(1, 0, bytes(500))[:100])
        found["trickled"] = await _closed(reader)
        reader, _, _ = await _raw(port)  # never proves anything
        found["silent"] = await _closed(reader)
        # handshakes in progress are capped below connections
        pending = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        found["third handshake"] = await _closed(pending[2][0])
        for _, w in pending:
            w.close()
        await asyncio.sleep(0.1)
        link = ShardLink("127.0.0.1", port, SECRET)
        found["served"] = await link.call(b"ok") == b"ok"
        link.close()
        server.close()
        return found

    assert asyncio.run(run()) == {"oversized": True, "trickled": True, "silent": True,
                                  "third handshake": True, "served": True}


def test_frames_in_flight_per_connection_are_capped() -> None:
    """Beyond max_in_flight frames being answered, the shard stops reading that connection: the
    next frames wait in the socket, not in tasks."""
    async def run():
        release = asyncio.Event()
        started: list[bytes] = []

        async def handler(blob: bytes) -> bytes:
            started.append(blob)
            await release.wait()
            return blob

        server = await serve_link(handler, "127.0.0.1", secret=SECRET, limits=LinkLimits(max_in_flight=2))
        link = ShardLink("127.0.0.1", _port(server), SECRET)
        calls = [asyncio.ensure_future(link.call(bytes([i]))) for i in range(6)]
        await asyncio.sleep(0.3)
        at_most = len(started)
        release.set()
        answers = await asyncio.gather(*calls)
        link.close()
        server.close()
        return at_most, answers

    at_most, answers = asyncio.run(run())
    assert at_most <= 2 + 4  # the frames of one receive are dispatched together, then reading pauses
    assert answers == [bytes([i]) for i in range(6)]
