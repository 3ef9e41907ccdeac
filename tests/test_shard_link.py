"""Shard links in-process (plain asyncio, no Ray, real sockets on loopback): framing, multiplexing,
errors, broken links, both ends' authentication, frame MACs, deadlines, the directory's expiry and
withdrawal, and the in-flight gauge autoscaling reads."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from shardserve.query.fanout import search_batch
from shardserve.transport.link_auth import _Session
from shardserve.transport.link_frames import _Seal
from shardserve.transport.shard_link import (
    ERROR_WORD,
    NONCE_BYTES,
    PROOF_BYTES,
    EndpointDirectory,
    InFlight,
    LinkLimits,
    ShardLink,
    ShardLinkError,
    ShardLinks,
    link_proof,
    serve_link,
    shard_secret,
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
            servers.append(await serve_link(handler, "127.0.0.1",
                                            secret=shard_secret(SECRET, len(servers))))
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
    from shardserve.transport.link_frames import _Corrupt, _FrameBuffer

    key = bytes(32)
    sender = _Seal(key)
    stream = b"".join(sender.frame(i, i % 2, bytes([i]) * i) for i in range(1, 40))
    for step in (1, 7, 64, len(stream)):
        buffer, got = _FrameBuffer(_Seal(key)), []
        for offset in range(0, len(stream), step):
            got += buffer.frames(stream[offset:offset + step])
        assert got == [(i, i % 2, bytes([i]) * i) for i in range(1, 40)]
    with pytest.raises(_Corrupt, match="over"):
        _FrameBuffer(_Seal(key)).frames(b"\xff\xff\xff\xff" + bytes(9))  # a length no frame has
    with pytest.raises(_Corrupt, match="over 100"):
        _FrameBuffer(_Seal(key), 100).frames(_Seal(key).frame(1, 0, bytes(101)))  # over this link's limit
    with pytest.raises(_Corrupt, match="MAC"):
        _FrameBuffer(_Seal(bytes(31) + b"x")).frames(_Seal(key).frame(1, 0, b"abc"))  # another key


def test_a_broken_link_fails_its_calls_fast_and_is_dropped() -> None:
    async def run():
        async def dies_mid_call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _shard_handshake(reader, writer, shard_secret(SECRET, 0))
            await reader.readexactly(1)  # a call arrives, then the replica's process goes away
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


def test_a_withdrawn_replica_stays_withdrawn() -> None:
    """A replica that stops withdraws its entry; an announcement of it still on its way (sent just
    before it stopped) must not bring its address back for routers to dial."""
    directory = EndpointDirectory(1)
    directory.announce(0, "a", "127.0.0.1", 5000)
    directory.announce(0, "b", "127.0.0.1", 5001)
    directory.withdraw(0, "a")
    directory.announce(0, "a", "127.0.0.1", 5000)  # late
    assert directory.endpoints() == [[("127.0.0.1", 5001)]]


def test_two_choices_prefer_the_less_busy_replica() -> None:
    links = ShardLinks(1)
    links.update([[("h", 1), ("h", 2)]], SECRET)
    busy, idle = links.by_shard[0][("h", 1)], links.by_shard[0][("h", 2)]
    busy.in_flight = 5
    assert all(links.pick(0) is idle for _ in range(20))
    links.update([[("h", 1)]], SECRET)  # replica 2 left
    assert links.pick(0) is busy and idle.broken


async def _raw(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter,
                                                              bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    return reader, writer, await reader.readexactly(NONCE_BYTES)


def _hello(shard_nonce: bytes, secret: bytes = SECRET) -> tuple[bytes, bytes]:
    """A router's nonce and its half of the handshake."""
    router_nonce = os.urandom(NONCE_BYTES)
    return router_nonce, router_nonce + link_proof(secret, "router", shard_nonce, router_nonce)


async def _router(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, _Session]:
    """A raw connection that completes the router's half of the handshake (checking the shard's)."""
    reader, writer, shard_nonce = await _raw(port)
    router_nonce, hello = _hello(shard_nonce)
    writer.write(hello)
    assert await reader.readexactly(PROOF_BYTES) == link_proof(SECRET, "shard", shard_nonce, router_nonce)
    return reader, writer, _Session(SECRET, shard_nonce, router_nonce, "router")


async def _shard_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           secret: bytes = SECRET) -> _Session:
    """A raw shard's half of the handshake, done right."""
    shard_nonce = os.urandom(NONCE_BYTES)
    writer.write(shard_nonce)
    hello = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
    router_nonce = hello[:NONCE_BYTES]
    assert hello[NONCE_BYTES:] == link_proof(secret, "router", shard_nonce, router_nonce)
    writer.write(link_proof(secret, "shard", shard_nonce, router_nonce))
    return _Session(secret, shard_nonce, router_nonce, "shard")


async def _closed(reader: asyncio.StreamReader, within_s: float = 5.0) -> bool:
    """True once the peer closed the connection without a byte more (a reset counts as closed)."""
    try:
        return await asyncio.wait_for(reader.read(1), within_s) == b""
    except ConnectionResetError:
        return True


def test_a_stranger_without_the_secret_gets_no_answer_and_others_are_served() -> None:
    _frame = _Seal(os.urandom(32)).frame  # frames of a stranger, who has no session key

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
        # 2. a proof made with another secret
        reader, writer, nonce = await _raw(port)
        writer.write(_hello(nonce, b"x" * 32)[1] + _frame(1, 0, b"search me"))
        outcomes.append(await _closed(reader))
        # 3. a proof replayed from another connection (the shard's nonce differs each time)
        reader, writer, nonce = await _raw(port)
        old = _hello(nonce)[1]
        writer.close()
        reader, writer, _ = await _raw(port)
        writer.write(old + _frame(1, 0, b"search me"))
        outcomes.append(await _closed(reader))
        # 4. the shard's own proof as the router's: the shard does not prove itself first, and a
        # proof of the other role never checks
        reader, writer, nonce = await _raw(port)
        router_nonce = os.urandom(NONCE_BYTES)
        writer.write(router_nonce + link_proof(SECRET, "shard", nonce, router_nonce))
        outcomes.append(await _closed(reader))
        # the holder of the secret is answered all along
        link = ShardLink("127.0.0.1", port, SECRET)
        answer = await link.call(b"mine")
        link.close()
        server.close()
        return outcomes, answer, gauge.now

    outcomes, answer, in_flight = asyncio.run(run())
    assert outcomes == [True, True, True, True]
    assert answer == b"answer" and calls == [b"mine"] and in_flight == 0  # strangers moved no gauge


def test_link_bounds_frames_time_and_connections() -> None:
    async def run():
        async def handler(blob: bytes) -> bytes:
            return blob

        limits = LinkLimits(max_frame=1000, handshake_timeout_s=0.2, frame_timeout_s=0.2,
                            max_connections=3, max_handshakes=2)
        server = await serve_link(handler, "127.0.0.1", secret=SECRET, limits=limits)
        port = _port(server)

        found = {}
        reader, writer, session = await _router(port)  # a frame over max_frame: closed, nothing answered
        writer.write(session.outgoing.frame(1, 0, bytes(1001)))
        found["oversized"] = await _closed(reader)
        reader, writer, session = await _router(port)  # a frame begun and never finished
        writer.write(session.outgoing.frame(1, 0, bytes(500))[:100])
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


def _logged(caplog, says: str) -> bool:
    return any(says in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("proof", ["reflected", "other secret", "random"])
def test_a_fake_shard_without_the_secret_is_refused_by_the_router(proof: str) -> None:
    """A process on a shard's address (a dead replica's port, taken) cannot pass as the shard: the
    router's own proof reflected back fails (it is labelled "router"), as does any other; the router
    sends it no frame, and the call fails over to Serve (a ConnectionError)."""
    received: list[bytes] = []

    async def fake_shard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        shard_nonce = os.urandom(NONCE_BYTES)
        writer.write(shard_nonce)
        hello = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        router_nonce = hello[:NONCE_BYTES]
        writer.write({"reflected": hello[NONCE_BYTES:],
                      "other secret": link_proof(b"y" * 32, "shard", shard_nonce, router_nonce),
                      "random": os.urandom(PROOF_BYTES)}[proof])
        received.append(await reader.read())  # whatever the router sends after the handshake

    async def run():
        server = await asyncio.start_server(fake_shard, "127.0.0.1", 0)
        link = ShardLink("127.0.0.1", _port(server), SECRET)
        with pytest.raises(ConnectionError, match="did not prove the secret"):
            await asyncio.wait_for(link.call(b"a query"), 5.0)
        assert link.broken
        while not received:
            await asyncio.sleep(0.01)
        server.close()

    asyncio.run(run())
    assert received == [b""]  # not a byte of the query


def test_a_frame_altered_replayed_or_reordered_after_the_handshake_is_refused(caplog) -> None:
    calls: list[bytes] = []

    async def handler(blob: bytes) -> bytes:
        calls.append(blob)
        return blob

    async def run():
        server = await serve_link(handler, "127.0.0.1", secret=SECRET)
        port = _port(server)
        found = {}
        # one bit of the payload flipped on the way
        reader, writer, session = await _router(port)
        frame = bytearray(session.outgoing.frame(1, 0, b"search me"))
        frame[20] ^= 1
        writer.write(bytes(frame))
        found["altered"] = await _closed(reader)
        # a frame answered, then sent again
        reader, writer, session = await _router(port)
        frame = session.outgoing.frame(1, 0, b"first")
        writer.write(frame)
        await reader.readexactly(len(session.incoming.frame(1, 0, b"first")))
        writer.write(frame)
        found["replayed"] = await _closed(reader)
        # two frames swapped
        reader, writer, session = await _router(port)
        one, two = session.outgoing.frame(1, 0, b"one"), session.outgoing.frame(2, 0, b"two")
        writer.write(two + one)
        found["reordered"] = await _closed(reader)
        # the shard's own answer sent back to it (reflected): the directions have their own keys
        reader, writer, session = await _router(port)
        writer.write(session.incoming.frame(1, 0, b"reflected"))
        found["reflected"] = await _closed(reader)
        server.close()
        return found

    found = asyncio.run(run())
    assert found == {"altered": True, "replayed": True, "reordered": True, "reflected": True}
    assert calls == [b"first"]  # nothing else reached the handler
    assert sum("frame MAC did not check" in r.getMessage() for r in caplog.records) == 4


def test_an_answer_altered_on_its_way_to_the_router_is_refused() -> None:
    """The shard's answers carry MACs too: a router does not take ids a middleman changed."""
    async def tampering_shard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = await _shard_handshake(reader, writer)
        await reader.readexactly(13 + len(b"a query") + 16)
        answer = bytearray(session.outgoing.frame(1, 0, b"ids 1 2 3"))
        answer[-20] ^= 1
        writer.write(bytes(answer))
        await reader.read()

    async def run():
        server = await asyncio.start_server(tampering_shard, "127.0.0.1", 0)
        link = ShardLink("127.0.0.1", _port(server), SECRET)
        with pytest.raises(ConnectionError, match="frame MAC did not check"):
            await asyncio.wait_for(link.call(b"a query"), 5.0)
        server.close()

    asyncio.run(run())


def test_a_trickled_frame_is_closed_at_its_deadline_however_often_bytes_come(caplog) -> None:
    """A byte every 50 ms, each well inside the 0.3 s frame deadline: the deadline is fixed at the
    frame's first byte, so the trickle cannot extend it (each byte re-armed the timer before)."""
    async def handler(blob: bytes) -> bytes:
        return blob

    async def run():
        limits = LinkLimits(frame_timeout_s=0.3)
        server = await serve_link(handler, "127.0.0.1", secret=SECRET, limits=limits)
        reader, writer, session = await _router(_port(server))
        frame = session.outgoing.frame(1, 0, bytes(200))
        closed = asyncio.ensure_future(_closed(reader, within_s=60.0))
        sent = 0
        while not closed.done() and sent < len(frame):
            writer.write(frame[sent:sent + 1])
            sent += 1
            await asyncio.sleep(0.05)
        assert await closed
        server.close()
        return sent, len(frame)

    sent, whole = asyncio.run(run())
    assert sent < whole  # cut off mid-frame
    assert _logged(caplog, "a frame was not complete 0.3 s after its first byte")


def test_unauthenticated_handshakes_are_capped_per_source_address() -> None:
    """One address cannot take every handshake slot: a third pending handshake from 127.0.0.1 is
    refused while one from 127.0.0.2 is still served."""
    async def handler(blob: bytes) -> bytes:
        return blob

    async def run():
        limits = LinkLimits(max_handshakes=16, max_handshakes_per_source=2)
        server = await serve_link(handler, "127.0.0.1", secret=SECRET, limits=limits)
        port = _port(server)
        pending = [await _raw(port) for _ in range(2)]  # each got its nonce
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        found = {"third from one address": await _closed(reader)}
        _, other, nonce = await _raw(port, source="127.0.0.2")
        found["another address"] = len(nonce) == NONCE_BYTES
        for _, w, _ in pending:
            w.close()
        other.close()
        await asyncio.sleep(0.1)  # their slots are free again
        link = ShardLink("127.0.0.1", port, SECRET)
        found["served after"] = await link.call(b"ok") == b"ok"
        link.close()
        server.close()
        return found

    assert asyncio.run(run()) == {"third from one address": True, "another address": True,
                                  "served after": True}


def test_a_replica_of_another_shard_at_a_shards_address_is_refused() -> None:
    """Shards of one version share its secret, but each link is keyed by its shard number: shard 1's
    replica on the port the directory still gives for shard 0 fails the handshake, so its answers
    are never taken as shard 0's."""
    async def run() -> None:
        async def handler(blob: bytes) -> bytes:
            return b"answers of shard 1"

        other = await serve_link(handler, "127.0.0.1", secret=shard_secret(SECRET, 1))
        links = ShardLinks(2)
        links.update([[("127.0.0.1", _port(other))], []], SECRET)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(links.pick(0).call(b"x"), 5.0)
        right = ShardLinks(2)
        right.update([[], [("127.0.0.1", _port(other))]], SECRET)
        assert await asyncio.wait_for(right.pick(1).call(b"x"), 5.0) == b"answers of shard 1"
        links.close()
        right.close()
        other.close()

    asyncio.run(run())
