"""The router's front door in-process (plain asyncio, no Ray): real HTTP clients and raw sockets
against shardserve.transport.http_front, for keep-alive, pipelining, bad heads and bounded bodies."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import orjson
import pytest

from shardserve.transport.http_front import FrontDoor, Reply, Request
from tests.shared import SMUGGLED, SMUGGLING


async def _echo(request: Request) -> Reply:
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    if request.path == "/slow":
        await asyncio.sleep(0.05)
    echo = {"method": request.method, "path": request.path, "bytes": len(request.body),
            "query": request.query, "content_type": request.content_type}
    return Reply(200, orjson.dumps(echo), headers={"X-Echo": "1"})


async def _front(max_body_bytes: int = 1024, body_timeout_s: float = 5.0) -> tuple[FrontDoor, int]:
    front = FrontDoor(_echo, max_body_bytes, body_timeout_s)
    _, port = await front.listen("127.0.0.1", 0)
    return front, port


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    return answer


def test_keep_alive_client_gets_every_answer_on_one_connection() -> None:
    async def run():
        front, port = await _front()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            npy = {"Content-Type": "application/x-npy"}
            answers = [await client.post("/v1/search?x=1", content=b"x" * n, headers=npy)
                       for n in (0, 10, 1024)]
            got = await client.get("/v1/index")
        front.close()
        return answers, got

    answers, got = asyncio.run(run())
    assert [a.json()["bytes"] for a in answers] == [0, 10, 1024]
    assert all(a.status_code == 200 and a.headers["x-echo"] == "1" for a in answers)
    assert answers[0].json()["path"] == "/v1/search"  # the query string is not part of the route
    assert answers[0].json()["query"] == "x=1" and answers[0].json()["content_type"] == "application/x-npy"
    assert got.json() == {"method": "GET", "path": "/v1/index", "bytes": 0, "query": "", "content_type": ""}


def test_chunked_bodies_are_read_whole_with_extensions_and_trailers() -> None:
    async def run():
        front, port = await _front()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            async def parts():
                for piece in (b"a" * 100, b"b" * 200, b"c"):
                    yield piece
            streamed = await client.post("/v1/search", content=parts())  # httpx sends it chunked
        by_hand = await _raw(port, b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
                                   b"\r\n3;ext=1\r\nabc\r\n0\r\nTrailer: t\r\n\r\n")
        front.close()
        return streamed, by_hand

    streamed, by_hand = asyncio.run(run())
    assert streamed.status_code == 200 and streamed.json()["bytes"] == 301
    assert by_hand.startswith(b"HTTP/1.1 200 ") and b'"bytes":3' in by_hand


def test_pipelined_requests_are_answered_in_order() -> None:
    async def run():
        front, port = await _front()
        two = (b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
               b"GET /second HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await _raw(port, two)
        front.close()
        return answer

    answer = asyncio.run(run())
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert answer.index(b'"/slow"') < answer.index(b'"/second"')
    assert answer.rstrip().endswith(b'"bytes":0,"query":"","content_type":""}')


def test_a_connections_last_request_is_answered_with_connection_close_and_nothing_after_it() -> None:
    """The door ends a kept-alive connection after `max_requests_per_connection` requests, saying so
    in the last answer: a request pipelined behind it is not answered, and the connection closes."""
    async def run():
        front = FrontDoor(_echo, 1024, 5.0, max_requests_per_connection=2)
        _, port = await front.listen("127.0.0.1", 0)
        three = b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % n for n in range(3))
        answer = await _raw(port, three)  # reads until the door closes
        front.close()
        return answer

    answer = asyncio.run(run())
    assert answer.count(b"HTTP/1.1 200 OK") == 2 and b'"/2"' not in answer
    first, second = answer.split(b"HTTP/1.1 200 OK")[1:]
    assert b"Connection: close" not in first and b"Connection: close" in second


@pytest.mark.parametrize(("request_bytes", "status", "says"), [
    (b"POST /v1/search HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", 413, b"exceeds 1024"),
    (b"POST /v1/search HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n" + b"x" * 1024 + b"\r\n1\r\nx",
     413, b"exceeds 1024 bytes (stopped reading at 1025)"),
    (b"POST /v1/search HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, b"chunk size"),
    (b"POST /v1/search HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, b"unsupported Transfer"),
    (b"GARBAGE\r\n\r\n", 400, b"malformed request"),
    (b"POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n", 400, b"Content-Length"),
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400, b"malformed request"),
    (b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * 20000, 431, b"request head over"),
])
def test_bad_requests_get_a_4xx_naming_the_problem_and_the_connection_closes(
        request_bytes: bytes, status: int, says: bytes) -> None:
    async def run():
        front, port = await _front()
        answer = await _raw(port, request_bytes)
        front.close()
        return answer

    answer = asyncio.run(run())
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:80]
    assert says in answer and b"Connection: close" in answer


def test_a_body_over_the_limit_is_refused_from_its_declared_length_before_it_is_sent() -> None:
    """The client sends only the head: the 413 comes back without waiting for 1 GB of body."""
    async def run():
        front, port = await _front()
        answer = await _raw(port, b"POST /v1/search HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n")
        front.close()
        return answer

    assert asyncio.run(run()).startswith(b"HTTP/1.1 413 ")


def test_a_stalled_body_gets_408_and_other_connections_keep_being_answered() -> None:
    async def run():
        front, port = await _front(body_timeout_s=0.3)
        stalled = asyncio.ensure_future(_raw(port, b"POST /v1/search HTTP/1.1\r\nContent-Length: 100\r\n\r\n"
                                                   b"only part of it"))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            ok = await client.post("/v1/search", content=b"{}")
        answer = await stalled
        front.close()
        return ok, answer

    ok, answer = asyncio.run(run())
    assert ok.status_code == 200
    assert answer.startswith(b"HTTP/1.1 408 ") and b"not received within 0.3 s" in answer


def test_a_failing_handler_is_a_500_on_that_request_not_a_dead_connection() -> None:
    async def run():
        front, port = await _front()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            failed = await client.get("/boom")
            after = await client.get("/fine")
        front.close()
        return failed, after

    failed, after = asyncio.run(run())
    assert failed.status_code == 500 and failed.json()["error"] == "internal error"
    assert after.status_code == 200


def test_replicas_on_one_node_share_the_port() -> None:
    """SO_REUSEPORT: a second router replica binds the same port, and the kernel spreads new
    connections over both (40 connections all landing on one has odds of 2^-39)."""
    served = {"first": 0, "second": 0}

    def counting(name: str):
        async def handler(request: Request) -> Reply:
            served[name] += 1
            return Reply(200, b"{}")
        return handler

    async def run():
        first = FrontDoor(counting("first"), 1024, 5.0)
        _, port = await first.listen("127.0.0.1", 0)
        second = FrontDoor(counting("second"), 1024, 5.0)
        await second.listen("127.0.0.1", port)
        answers = [await _raw(port, b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n") for _ in range(40)]
        first.close()
        second.close()
        return answers

    answers = asyncio.run(run())
    assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
    assert served["first"] > 0 and served["second"] > 0 and sum(served.values()) == 40


def test_a_client_still_uploading_after_a_refusal_reads_the_answer_not_a_reset() -> None:
    """Lingering close: the 408 goes out, the write side shuts, and what the client sends after it
    is read and dropped, so the client (as httpx does) can finish its upload and read the 408."""
    async def run():
        front, port = await _front(max_body_bytes=10**6, body_timeout_s=0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/search HTTP/1.1\r\nContent-Length: 500000\r\n\r\n" + b"x" * 1000)
        await asyncio.sleep(0.5)  # past the body timeout
        for _ in range(20):  # the rest of the upload, after the answer is already out
            writer.write(b"x" * 10000)
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
        front.close()
        return answer

    assert asyncio.run(run()).startswith(b"HTTP/1.1 408 ")


def test_cached_heads_equal_the_full_heads() -> None:
    from shardserve.transport.http_front import _full_head, _head

    for reply in [Reply(200, b"abc"), Reply(404, b"x" * 100), Reply(200, b"", "text/html"),
                  Reply(200, b"abc"), Reply(503, b"{}", headers={"Retry-After": "1"})]:
        for keep_alive in (True, False):
            assert _head(reply, keep_alive) == _full_head(reply, keep_alive)


@pytest.mark.parametrize("form", list(SMUGGLING))
def test_ambiguous_framing_is_one_400_and_a_closed_connection_never_a_second_answer(form: str) -> None:
    async def run():
        front, port = await _front()
        answer = await _raw(port, SMUGGLING[form] + SMUGGLED)
        front.close()
        return answer

    answer = asyncio.run(run())
    assert answer.count(b"HTTP/1.1 ") == 1, answer
    assert answer.split(b" ")[1] in (b"400", b"501") and b"Connection: close" in answer
    assert b"smuggled" not in answer


def test_head_is_get_without_a_body_and_expect_continue_is_answered() -> None:
    async def run():
        front, port = await _front()
        head = await _raw(port, b"HEAD /v1/index HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/search HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nExpect: 100-continue\r\n"
                     b"Connection: close\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # before the body is sent
        writer.write(b"abc")
        final = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
        front.close()
        return head, interim, final

    head, interim, final = asyncio.run(run())
    status, _, body = head.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200 ") and body == b""
    assert b"Content-Length: " in status and b"Content-Length: 0" not in status  # GET's length
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert final.startswith(b"HTTP/1.1 200 ") and b'"bytes":3' in final


def test_many_tiny_chunks_cost_one_pass_and_a_trickled_body_does_not_stall_others() -> None:
    """300 KB of 1-byte chunks arrive while other clients are answered; then the chunked body is
    read whole (llhttp reads each byte once: the old hand parser re-read from the start)."""
    async def run():
        front = FrontDoor(_echo, 1024 * 1024, 30.0)
        _, port = await front.listen("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/search HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
        others = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for part in range(10):
                writer.write(b"1\r\nx\r\n" * 30_000)
                await writer.drain()
                others.append((await client.get(f"/other/{part}")).status_code)
        writer.write(b"0\r\n\r\n")
        answer = await asyncio.wait_for(reader.readuntil(b"}"), 60)
        writer.close()
        front.close()
        return others, answer

    others, answer = asyncio.run(run())
    assert others == [200] * 10  # each answered while the upload was still unfinished
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"bytes":300000' in answer


def test_connections_beyond_the_cap_are_closed_and_idle_ones_held_until_the_cap() -> None:
    async def run():
        front = FrontDoor(_echo, 1024, 5.0, max_connections=2)
        _, port = await front.listen("127.0.0.1", 0)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            third = await asyncio.wait_for(reader.read(-1), 5)
        except ConnectionResetError:
            third = b""
        for _, w in held:
            w.close()
        front.close()
        return third

    assert asyncio.run(run()) == b""


def _logged(caplog, says: str) -> bool:
    return any(says in record.getMessage() for record in caplog.records)


async def _door_closes(front: FrontDoor) -> None:
    """Until the door has taken a connection and dropped it again (the caller bounds the wait)."""
    while not front.connections:
        await asyncio.sleep(0.02)
    while front.connections:
        await asyncio.sleep(0.02)


def test_a_partial_request_pipelined_behind_a_full_one_gets_408_at_its_deadline() -> None:
    """One full request and the first bytes of a second in one write, then silence: the first is
    answered, and the second's deadline (from its first byte) still runs after that answer."""
    async def run():
        front, port = await _front(body_timeout_s=0.3)
        answer = await _raw(port, b"GET /first HTTP/1.1\r\nHost: x\r\n\r\nGET /sec")
        front.close()
        return answer

    answer = asyncio.run(run())
    first, _, second = answer.partition(b"HTTP/1.1 408 ")
    assert first.startswith(b"HTTP/1.1 200 ") and b'"/first"' in first
    assert b"not received within 0.3 s" in second and b"Connection: close" in second


@pytest.mark.parametrize("connection", [b"keep-alive", b"close"])
def test_a_client_that_stops_reading_is_cut_off_at_the_send_timeout(caplog, connection: bytes) -> None:
    """A client asks for a large answer and reads none of it: the door's writes pause, and the
    connection is cut off at the send timeout, kept alive or closing (asyncio's close would wait
    for the unread answer forever)."""
    caplog.set_level(logging.INFO, logger="shardserve.transport.http_front")
    big = b"x" * 48 * 1024 * 1024  # more than the kernel buffers on both ends hold

    async def large(request: Request) -> Reply:
        return Reply(200, big)

    async def run():
        front = FrontDoor(large, 1024, 5.0, send_timeout_s=0.3)
        _, port = await front.listen("127.0.0.1", 0)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: no window scaling
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        _, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: %s\r\n\r\n" % connection)
        await asyncio.wait_for(_door_closes(front), 30)
        writer.close()
        front.close()

    asyncio.run(run())
    assert _logged(caplog, "read none of its answers for 0.3 s")


def test_an_answer_that_never_comes_frees_its_connection(caplog) -> None:
    """A stuck handler does not hold its client forever: the answer's deadline is the idle timeout."""
    async def never(request: Request) -> Reply:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def run():
        front = FrontDoor(never, 1024, 5.0, idle_timeout_s=0.3)
        _, port = await front.listen("127.0.0.1", 0)
        answer = await _raw(port, b"GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
        front.close()
        return answer

    assert asyncio.run(run()) == b""
    assert _logged(caplog, "no answer within 0.3 s")
