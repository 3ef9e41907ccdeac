"""The admission edge: a real HAProxy (Debian) in front of real Serve. Clients that wait for their
answers are queued, never refused; a request that finds the queue full gets 503 before the slow shard
it protects could have answered; the API key is checked before Python sees a byte."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import pytest

from serving.edge import (
    AccessLine,
    Admission,
    EdgeProcess,
    api_key_digest,
    edge_config,
    parse_access_line,
    write_edge,
)
from shardserve.data.datasets import load_dataset
from shardserve.errors import ShardserveError
from shardserve.runtime.ports import free_port
from tests.conftest import SERVE_PORT as PORT
from tests.faults import slow_shards

pytestmark = pytest.mark.haproxy
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
EDGE_PORT = free_port()  # one per test process: xdist's workers run this file's tests side by side
KEY = "test-key-0123456789abcdef"


def test_edge_config_is_valid_haproxy(tmp_path: Path) -> None:
    config = write_edge(tmp_path, "127.0.0.1:8000", "127.0.0.1:8080",
                        Admission(max_in_flight=64, max_burst=96, max_queue=24), api_key=KEY)
    checked = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = config.read_text()
    assert "maxconn 64" in text and KEY not in text and api_key_digest(KEY) in text  # its digest only
    assert "queue(shardserve) gt 96" in text and "queue(shardserve) gt 24" in text
    # while shedding, the requests inside are cut to the router's answer rate x the delay target
    assert "be_sess_rate(shardserve),mul(70),div(1000)" in text and "shedding crowded late" in text
    # while not shedding, B grows to the router's answer rate x D_B: a short stall is absorbed
    assert "table_gpc0_rate(answer_meter),mul(250),div(1000) if past_burst" in text
    assert "http-response sc-inc-gpc0(2) if { sc2_tracked }" in text  # the router's answers, counted
    counts = edge_config("127.0.0.1:8000", admission=Admission(delay_ms=0, burst_ms=0))
    assert "be_sess_rate" not in counts and "answer_meter" not in counts
    assert "queue(shardserve) gt 96\n" in edge_config("127.0.0.1:8000", admission=Admission(
        max_burst=96, burst_ms=0))
    assert "use_backend shardserve_health if health" in text  # health checks: not admitted, not shed
    # a collection within its share of the router's answers goes first and is not cut with a flood
    assert "set-priority-class int(-1) if light" in text and "!light overflow" in text
    assert "light light_full light_over" in text and "light light_full\n" in counts
    assert config.stat().st_mode & 0o077 == 0  # the key is readable by its owner only
    with pytest.raises(ValueError):
        Admission(max_in_flight=0)
    with pytest.raises(ValueError, match="max_burst"):
        Admission(max_burst=8, max_queue=16)
    with pytest.raises(ShardserveError, match="API key"):
        edge_config("127.0.0.1:8000", api_key="short")
    with pytest.raises(ShardserveError, match="API key"):
        edge_config("127.0.0.1:8000", api_key='x" if TRUE #' + "y" * 20)  # nothing to inject


@pytest.fixture(scope="module")
def slow_app(ray_cluster, small_index: Path):
    """A 2-shard app whose shard-000 takes 0.3 s per search call."""
    from deployments.run import deploy, undeploy

    deploy(str(small_index), port=PORT, app_name="edge", route_prefix="/edge",
           shard_class=slow_shards(search_s={"shard-000": 0.3}), shard_num_cpus=0.1, router_num_cpus=0.1)
    body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 5},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    yield body
    undeploy("edge")


def _search(client: httpx.AsyncClient, body: bytes, headers: dict | None = None):
    return client.post(f"http://127.0.0.1:{EDGE_PORT}/edge/v1/search", content=body, headers=headers)


@pytest.mark.slow
def test_edge_queues_closed_loop_clients_and_cuts_the_queue_of_an_overload(slow_app: bytes,
                                                                          tmp_path: Path) -> None:
    """K=2 in the router, B=6 may wait while nothing is shed; while shedding, Q=3 may wait and no
    more than Q may be inside (router + queue), since the slow shard answers ~3 a second: far fewer
    than the delay target's worth (70 ms). Every assertion is an order of events or a queue position
    from the edge's own log: no wall clock."""
    body = slow_app
    access_log = tmp_path / "access.log"
    edge = EdgeProcess(f"127.0.0.1:{PORT}", f"127.0.0.1:{EDGE_PORT}",
                       Admission(max_in_flight=2, max_burst=6, max_queue=3, queue_timeout_ms=30_000),
                       access_log=access_log, route_prefix="/edge").start()

    async def closed_loop(clients: int, each: int) -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one(who: int) -> list[int]:
                return [(await client.post(_url(f"closed-{who}-{i}"), content=body)).status_code
                        for i in range(each)]
            answers = await asyncio.gather(*[one(who) for who in range(clients)])
            return [status for statuses in answers for status in statuses]

    async def burst() -> list[tuple[int, str | None, dict]]:
        """30 requests at once: 2 admitted, up to 7 queued, the rest find the queue full. The order in
        which answers complete is the assertion: no wall clock."""
        done: list[tuple[int, str | None, dict]] = []
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:
            async def one(i: int) -> None:
                response = await client.post(_url(f"burst-{i}"), content=body)
                done.append((response.status_code, response.headers.get("retry-after"), response.json()))
            await asyncio.gather(*[one(i) for i in range(30)])
        return done

    async def open_loop(requests: int) -> tuple[dict[str, int], set[str], list[int]]:
        """An overload: a request every 20 ms, each sent without waiting for any answer (the slow
        shard answers ~3 a second, so the queue the overload finds drains to Q only seconds in).
        Returns each request's status, those sent after the client had read the first 503, and the
        statuses of the health checks sent among them once shedding (every 10th request's slot)."""
        statuses: dict[str, int] = {}
        after_shed: set[str] = set()
        health: list[int] = []
        shed = asyncio.Event()
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=128)) as client:
            async def one(tag: str) -> None:
                statuses[tag] = (await client.post(_url(tag), content=body)).status_code
                if statuses[tag] == 503:
                    shed.set()

            async def check() -> None:
                health.append((await client.get(f"http://127.0.0.1:{EDGE_PORT}/edge/v1/health")).status_code)
            sent = []
            for i in range(requests):
                tag = f"open-{i}"
                if shed.is_set():
                    after_shed.add(tag)
                    if i % 10 == 0:
                        sent.append(asyncio.create_task(check()))
                sent.append(asyncio.create_task(one(tag)))
                await asyncio.sleep(0.02)
            await asyncio.gather(*sent)
        return statuses, after_shed, health

    health: list[int] = []
    try:
        # 8 clients that each wait for their answer: a queue of 8 the server drains, never an overload
        assert asyncio.run(closed_loop(8, 3)) == [200] * 24
        outcomes = asyncio.run(burst())
        statuses = [status for status, _, _ in outcomes]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 8, statuses
        # the first answers were 503s: they did not wait for the 0.3 s shard, the edge decided them
        assert statuses[:10] == [503] * 10, statuses
        shed = [(retry, payload) for status, retry, payload in outcomes if status == 503]
        assert all(retry == "1" and payload["error"].startswith("overloaded") for retry, payload in shed)
        answered = [payload for status, _, payload in outcomes if status == 200]
        assert all(len(p["ids"]) == 5 and p["coverage"]["answered"] == 2 for p in answered)
        overload, after_shed, health = asyncio.run(open_loop(250))
    finally:
        # the edge logs a request as it ends it, after the client may have read the answer: wait
        # (bounded) for every search's line before stopping it, or the last ones may never be written
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (len(_logged_searches(access_log)) < 24 + 30 + 250
                                               or _logged(access_log, "/v1/health") < len(health)):
            time.sleep(0.1)
        edge.stop()
    assert edge.process.returncode is not None  # the edge this test started is gone
    # the access log has a line per request, with what the client saw; the edge's own 503s never
    # reached the queue or the router
    searches = _logged_searches(access_log)
    assert sorted(line.status for line in searches.values()) == sorted(
        [200] * 24 + statuses + list(overload.values()))
    assert all(line.queue_ms == -1 and line.router_ms == -1 for line in searches.values()
               if line.status == 503)
    assert all(line.router_ms >= 0 and line.total_ms >= line.router_ms for line in searches.values()
               if line.status == 200)
    # waiting clients queued beyond Q, unrefused: nothing was being shed
    assert max(line.queued_before for tag, line in searches.items() if tag.startswith("closed")) > 3
    # the overload was shed, and once shedding, what the edge admitted found at most Q=3 inside: K=2
    # in the router and at most 1 ahead of it in the queue (the counts alone would have let 3 wait)
    admitted_while_shedding = [searches[tag] for tag in after_shed if overload[tag] == 200]
    assert 503 in overload.values() and admitted_while_shedding, overload
    assert all(line.queued_before <= 1 for line in admitted_while_shedding), admitted_while_shedding
    # health checks sent while the edge shed searches: answered, on their own backend, never queued
    # behind the searches (a load balancer would otherwise take the overloaded node out)
    assert health and health == [200] * len(health), health
    checks = [line for line in access_log.read_text().splitlines() if "/v1/health" in line]
    assert len(checks) == len(health) and all(" shardserve_health/router " in line for line in checks)


@pytest.mark.slow
def test_edge_lets_a_burst_wait_up_to_the_routers_answers_in_burst_ms(slow_app: bytes,
                                                                     tmp_path: Path) -> None:
    """K=2, B=2, and D_B long enough that the slow shard's few answers a second cover a burst of 16:
    every one of them is queued and answered, more than B of them waited (the edge's own log),
    where B alone would have shed 12 of them (the first test's burst)."""
    access_log = tmp_path / "access.log"
    edge = EdgeProcess(f"127.0.0.1:{PORT}", f"127.0.0.1:{EDGE_PORT}",
                       Admission(max_in_flight=2, max_burst=2, max_queue=2, queue_timeout_ms=30_000,
                                 burst_ms=30_000), access_log=access_log, route_prefix="/edge").start()

    async def at_once(tags: list[str]) -> list[int]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            answers = await asyncio.gather(*[client.post(_url(tag), content=slow_app) for tag in tags])
            return [answer.status_code for answer in answers]
    try:
        assert asyncio.run(at_once(["rate-0", "rate-1"])) == [200, 200]  # the router's rate is > 0
        assert asyncio.run(at_once([f"wave-{i}" for i in range(16)])) == [200] * 16
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_logged_searches(access_log)) < 18:
            time.sleep(0.1)
        edge.stop()
    waited = [line.queued_before for tag, line in _logged_searches(access_log).items()
              if tag.startswith("wave")]
    assert len(waited) == 16 and max(waited) > 2, waited


def _url(tag: str) -> str:
    return f"http://127.0.0.1:{EDGE_PORT}/edge/v1/search?tag={tag}"


def _logged(access_log: Path, path: str) -> int:
    return sum(path in line for line in access_log.read_text().splitlines()) if access_log.exists() else 0


def _logged_searches(access_log: Path) -> dict[str, AccessLine]:
    """Each logged search by the tag in its URL."""
    lines = access_log.read_text().splitlines() if access_log.exists() else []
    return {line.split("?tag=")[1].split()[0]: parsed for line in lines
            if "/v1/search?tag=" in line and (parsed := parse_access_line(line))}


def test_access_line_parses_haproxy_http_log_format() -> None:
    line = ("127.0.0.1:40112 [25/Nov/2026:14:14:53.722] shardserve_edge shardserve/router 0/23/0/25/48 "
            '200 512 - - ---- 3/3/2/2/0 0/64 "POST /v1/search HTTP/1.1"')
    assert parse_access_line(line) == AccessLine(200, 23, 25, 48, queued_before=63)
    shed = ('127.0.0.1:40113 [25/Nov/2026:14:14:53.723] shardserve_edge shardserve_edge/<NOSRV> '
            '0/-1/-1/-1/0 503 160 - - PR-- 3/3/2/0/0 0/0 "POST /v1/search HTTP/1.1"')
    assert parse_access_line(shed) == AccessLine(503, -1, -1, 0)
    assert parse_access_line("[NOTICE] (1) : haproxy version is 2.6.12") is None


@pytest.mark.slow
def test_edge_wants_the_api_key_before_python(slow_app: bytes) -> None:
    edge = EdgeProcess(f"127.0.0.1:{PORT}", f"127.0.0.1:{EDGE_PORT}", api_key=KEY,
                       route_prefix="/edge").start()

    async def calls() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return [await _search(client, slow_app),
                    await _search(client, slow_app, {"api-key": KEY[:-1] + "x"}),
                    await _search(client, slow_app, {"Authorization": f"Bearer {KEY}"}),
                    await _search(client, slow_app, {"api-key": KEY}),
                    await _search(client, slow_app, {"Authorization": f"bEARER {KEY}"}),
                    await client.get(f"http://127.0.0.1:{EDGE_PORT}/edge/v1/health")]

    try:
        missing, wrong, bearer, header, any_case, health = asyncio.run(calls())
    finally:
        edge.stop()
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"] == "missing or wrong API key"
    assert bearer.status_code == header.status_code == any_case.status_code == 200
    assert len(bearer.json()["ids"]) == 5
    assert health.status_code == 200  # load balancers' health checks carry no key


def test_edge_that_cannot_listen_fails_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        edge = EdgeProcess("127.0.0.1:9", f"127.0.0.1:{port}", Admission(max_in_flight=4))
        with pytest.raises(ShardserveError, match=f"edge haproxy on 127.0.0.1:{port} exited"):
            edge.start()
    assert edge.process.poll() is not None and edge._work is None


def test_smuggling_forms_through_the_edge_never_get_a_second_answer_and_a_trickle_stalls_no_one() -> None:
    """The edge (real HAProxy) in front of the router's door (transport.http_front, in-process): edge and
    door never disagree on where a request ends. Each form the edge refuses reaches the door not at
    all; each it accepts (HAProxy reads a bare LF as a line end, as RFC 9112 allows) reaches the door
    as exactly the requests the edge answered, re-framed. A client trickling a chunked body does not
    hold up other clients (HAProxy buffers it, the door sees it whole or not at all)."""
    from shardserve.transport.http_front import FrontDoor, Reply, Request
    from tests.shared import SMUGGLED, SMUGGLING

    seen: list[str] = []

    async def handler(request: Request) -> Reply:
        seen.append(request.path)
        return Reply(200, orjson.dumps({"path": request.path, "bytes": len(request.body)}))

    async def raw(port: int, data: bytes) -> bytes:
        """Everything the edge sends back until it closes or stays quiet for 2 s (a kept-alive
        connection that answered once and waits for more)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        answer = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 2.0):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        writer.close()
        return answer

    async def run() -> tuple[dict[str, bytes], list[int], bytes]:
        door = FrontDoor(handler, 1024 * 1024, 30.0)
        _, door_port = await door.listen("127.0.0.1", 0)
        edge = EdgeProcess(f"127.0.0.1:{door_port}", f"127.0.0.1:{EDGE_PORT}").start()
        try:
            answers = {}
            for form, request in SMUGGLING.items():
                seen.clear()
                answers[form] = (await raw(EDGE_PORT, request + SMUGGLED), list(seen))
            seen.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", EDGE_PORT)
            writer.write(b"POST /trickle HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
            others = []
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{EDGE_PORT}") as client:
                for part in range(20):
                    writer.write(b"1\r\nx\r\n")
                    await writer.drain()
                    others.append((await client.get(f"/other/{part}")).status_code)
            writer.write(b"0\r\n\r\n")
            trickled = await asyncio.wait_for(reader.readuntil(b"}"), 30)
            writer.close()
        finally:
            edge.stop()
            door.close()
        return answers, others, trickled

    answers, others, trickled = asyncio.run(run())
    for form, (answer, reached) in answers.items():
        responses = answer.count(b"HTTP/1.1 ")
        if not reached:  # refused at the edge (one 4xx/5xx), or still waiting for a body it was promised
            assert responses == 0 or (responses == 1 and answer[9:10] in (b"4", b"5")), (form, answer)
        else:  # forwarded: each answer is one the door gave, to a request it handled or refused
            refused = sum(answer.count(b"HTTP/1.1 %d " % status) for status in (400, 413, 431, 501))
            assert responses == len(reached) + refused, (form, answer, reached)
            assert all(path in ("/v1/search", "/smuggled") for path in reached), (form, reached)
    assert others == [200] * 20  # each answered while the trickled upload was unfinished
    assert trickled.startswith(b"HTTP/1.1 200") and b'"bytes":20' in trickled
    assert seen.index("/trickle") > seen.index("/other/19")  # the door saw the upload only whole


@pytest.mark.parametrize("per_connection", [10, 1000])
def test_router_replicas_sharing_the_door_share_the_edges_traffic(per_connection: int) -> None:
    """Two doors on one port (SO_REUSEPORT, as two router replicas on a node) behind the edge, one
    client on one kept-alive connection: the edge keeps its connection to a door alive until that
    door ends it (`Connection: close` on its `per_connection`th answer), then opens another, which
    the kernel may hand to either door. So a replica started later gets traffic; while the
    connection lasts, every request goes to one door."""
    from shardserve.transport.http_front import FrontDoor, Reply, Request

    served: dict[str, int] = {"a": 0, "b": 0}

    def handler(name: str):
        async def answer(request: Request) -> Reply:
            served[name] += 1
            return Reply(200, b"{}")
        return answer

    async def run() -> None:
        first = FrontDoor(handler("a"), 1024, 30.0, max_requests_per_connection=per_connection)
        _, port = await first.listen("127.0.0.1", 0)
        second = FrontDoor(handler("b"), 1024, 30.0, max_requests_per_connection=per_connection)
        await second.listen("127.0.0.1", port)
        edge = EdgeProcess(f"127.0.0.1:{port}", f"127.0.0.1:{EDGE_PORT}").start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{EDGE_PORT}") as client:
                for _ in range(400):
                    assert (await client.get("/x")).status_code == 200
        finally:
            edge.stop()
            first.close()
            second.close()

    asyncio.run(run())
    assert served["a"] + served["b"] == 400
    if per_connection == 1000:  # one connection to the door, never ended: one door served all
        assert sorted(served.values()) == [0, 400], served
    else:  # 40 connections, each to either door
        assert min(served.values()) > 0, served


def test_edge_config_cli_sizes_the_burst_and_refuses_a_queue_above_it(tmp_path: Path) -> None:
    """`--edge-queue` alone raises the burst with it (an older one-length command keeps working);
    a burst below the queue is one line and exit 2, with nothing written."""
    import sys

    exe = Path(sys.executable).parent / "shardserve"
    wide = subprocess.run([str(exe), "edge-config", "--edge-queue", "96", "--dir", str(tmp_path / "a")],
                          capture_output=True, text=True)
    assert wide.returncode == 0, wide.stderr
    text = (tmp_path / "a" / "edge-haproxy.cfg").read_text()
    assert "queue(shardserve) gt 96" in text and "queue(shardserve) gt 64" not in text
    assert "mul(70)" in text  # the default delay target while shedding
    assert "mul(250)" in text  # the default burst time while shedding nothing
    counts = subprocess.run([str(exe), "edge-config", "--edge-delay-ms", "0", "--edge-burst-ms", "0",
                             "--dir", str(tmp_path / "c")], capture_output=True, text=True)
    assert counts.returncode == 0, counts.stderr
    assert "be_sess_rate" not in (tmp_path / "c" / "edge-haproxy.cfg").read_text()  # the counts alone
    bad = subprocess.run([str(exe), "edge-config", "--edge-burst", "8", "--edge-queue", "16",
                          "--dir", str(tmp_path / "b")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "shardserve: error: edge admission: max_burst (8) must be >= max_queue (16)"]
    assert not (tmp_path / "b").exists()


class _RawBackend:
    """A router stand-in that records each request's head as it arrived (headers included) and
    answers 200 with the body's length: what the edge forwarded, byte for byte. `answer_s`: how long
    it takes over each request (a router at a known capacity: K / answer_s a second)."""

    def __init__(self, answer_s: float = 0.0) -> None:
        self.heads: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.answer_s = answer_s

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                self.heads.append(head)
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                if self.answer_s:
                    await asyncio.sleep(self.answer_s)
                answer = orjson.dumps({"bytes": len(body)})
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _edge_in_front_of(backend_port: int, **kwargs) -> EdgeProcess:
    return EdgeProcess(f"127.0.0.1:{backend_port}", f"127.0.0.1:{EDGE_PORT}", **kwargs).start()


def test_edge_answers_a_collection_within_its_share_beside_a_flooded_one() -> None:
    """A router answering 2 at a time, 50 ms each (40 a second); collection `large` flooded at
    ~200 a second, holding K + the overflowing queue; collection `small` at ~5 a second, one
    request inside at a time, within its share ((K + B) / 2 owners). Every one of small's requests
    is answered while the flood is shed. The control: the same requests sent as `large`'s (one
    owner, the flood's) are shed with it: the share, not luck, kept them."""
    backend = _RawBackend(answer_s=0.05)

    async def run(steady_as: str) -> tuple[list[int], list[int]]:
        port = await backend.start()
        edge = _edge_in_front_of(port, admission=Admission(max_in_flight=2, max_burst=4, max_queue=2))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{EDGE_PORT}", timeout=30,
                                         limits=httpx.Limits(max_connections=256)) as client:
                async def flood() -> list[int]:
                    sent = []
                    for _ in range(600):
                        sent.append(asyncio.create_task(
                            client.post("/v1/collections/large/search", content=b"{}")))
                        await asyncio.sleep(0.005)
                    return [answer.status_code for answer in await asyncio.gather(*sent)]

                async def steady() -> list[int]:
                    await asyncio.sleep(0.5)  # the flood under way
                    sent = []
                    for _ in range(12):
                        sent.append(asyncio.create_task(
                            client.post(f"/v1/collections/{steady_as}/search", content=b"{}")))
                        await asyncio.sleep(0.2)
                    return [answer.status_code for answer in await asyncio.gather(*sent)]
                flooded, steadied = await asyncio.gather(flood(), steady())
                return flooded, steadied
        finally:
            edge.stop()
            backend.close()

    flooded, steadied = asyncio.run(run("small"))
    assert 503 in flooded and steadied == [200] * 12, (flooded.count(503), steadied)
    flooded, steadied = asyncio.run(run("large"))
    assert 503 in flooded and 503 in steadied, (flooded.count(503), steadied)


def test_edge_reads_a_requests_owner_from_the_path_as_the_router_reads_it() -> None:
    """The owner a share is counted for: the collection after `/collections/`, percent-decoded and
    with repeated slashes joined (the router decodes Chroma's segments and drops empty ones), `/`
    for every other route. Read from the real HAProxy's own variable (a header the test's copy of
    the config adds), so one collection spelled several ways is one owner."""
    backend = _RawBackend()

    async def run() -> dict[str, str | None]:
        port = await backend.start()
        directory = Path(tempfile.mkdtemp(prefix="edge-owner-"))
        config = write_edge(directory, f"127.0.0.1:{port}", f"127.0.0.1:{EDGE_PORT}")
        config.write_text(config.read_text().replace(
            "    default_backend shardserve\n",
            "    http-after-response set-header x-owner %[var(txn.owner)]\n    default_backend shardserve\n"))
        edge = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            owners = {}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{EDGE_PORT}", timeout=30) as client:
                for _attempt in range(50):  # until the edge listens
                    try:
                        await client.get("/v1/index")
                        break
                    except httpx.ConnectError:
                        await asyncio.sleep(0.1)
                for path in ("/v1/collections/small/search", "/v1/collections/%73mall/search",
                             "/v1//collections///small/search", "/api/v2/tenants/t/databases/d/collections/"
                             "6f1e2d3c-0000-4000-8000-000000000001/query", "/v1/search", "/v1/collections",
                             "/v1/collections/"):
                    owners[path] = (await client.post(path, content=b"{}")).headers.get("x-owner")
            return owners
        finally:
            edge.terminate()
            edge.wait(timeout=30)
            backend.close()
            shutil.rmtree(directory, ignore_errors=True)

    owners = asyncio.run(run())
    assert owners == {
        "/v1/collections/small/search": "small", "/v1/collections/%73mall/search": "small",
        "/v1//collections///small/search": "small",
        "/api/v2/tenants/t/databases/d/collections/6f1e2d3c-0000-4000-8000-000000000001/query":
            "6f1e2d3c-0000-4000-8000-000000000001",
        "/v1/search": "/", "/v1/collections": "/", "/v1/collections/": "/"}, owners


def test_edge_health_rule_is_the_exact_path_with_its_own_rate_limit_per_source() -> None:
    """The health rule matches /v1/health exactly: `/anything/v1/health` needs the key like any
    other route. A flood of health checks from one address gets 429 (JSON) at the edge past the
    per-source rate, while the checks a load balancer sends from another address meanwhile are all
    answered by the router."""
    backend = _RawBackend()

    async def run() -> tuple[list[int], list[int], list[int], dict, httpx.Response]:
        port = await backend.start()
        edge = _edge_in_front_of(port, api_key=KEY)
        base = f"http://127.0.0.1:{EDGE_PORT}"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=30) as flooder, httpx.AsyncClient(
                    base_url=base, timeout=30,
                    transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")) as balancer:
                suffixed = [(await flooder.get(path)).status_code
                            for path in ("/x/v1/health", "/v1/health/", "/v1/healthz")]
                flood: list[int] = []
                checks: list[int] = []
                refused = None
                for _ in range(10):  # each round: 20 checks from the flooder, then one from the balancer
                    answers = await asyncio.gather(*[flooder.get("/v1/health") for _ in range(20)])
                    flood += [a.status_code for a in answers]
                    refused = next((a for a in answers if a.status_code == 429), refused)
                    checks.append((await balancer.get("/v1/health")).status_code)
                seen = {"heads": len(backend.heads)}
                return suffixed, flood, checks, seen, refused
        finally:
            edge.stop()
            backend.close()

    suffixed, flood, checks, seen, refused = asyncio.run(run())
    assert suffixed == [401, 401, 401]  # not the health check: no key, no entry
    assert flood.count(429) > 0 and set(flood) == {200, 429}, flood
    assert checks == [200] * 10  # the load balancer's address has its own rate: never refused
    assert refused is not None and refused.json() == {"error": "too many health checks from this address",
                                                      "field": None}
    assert refused.headers["retry-after"] == "1"
    assert seen["heads"] == flood.count(200) + len(checks)  # a refused check never reached the router


def test_edge_compares_the_key_by_digest_takes_bearer_in_any_case_and_never_forwards_it() -> None:
    backend = _RawBackend()

    async def run() -> list[httpx.Response]:
        port = await backend.start()
        edge = _edge_in_front_of(port, api_key=KEY)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{EDGE_PORT}", timeout=30) as client:
                answers = []
                for headers in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": f"bearer {KEY}"},
                                {"Authorization": f"BEARER {KEY}"}, {"api-key": KEY},
                                {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                                {"api-key": KEY.upper()}, {}):
                    answers.append(await client.post("/v1/search", content=b"{}", headers=headers))
                return answers
        finally:
            edge.stop()
            backend.close()

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 4 + [401] * 4
    assert all(a.json() == {"error": "missing or wrong API key", "field": None} for a in answers[4:])
    assert len(backend.heads) == 4  # only the keyed requests reached the router
    for head in backend.heads:  # and without the key, in either header
        assert KEY.encode() not in head
        assert b"authorization" not in head.lower() and b"api-key" not in head.lower()


def test_edge_answers_413_from_the_declared_length_to_a_client_that_writes_its_whole_body_first() -> None:
    """Python's urllib sends all of a 20 MB body before reading: the edge answers 413 from the
    Content-Length at once and drains the body, so urllib reads the JSON 413 (it used to get a
    broken pipe); the router never sees the request. A 10 MB upload without the key gets its 401
    the same way. Errors the edge makes itself (here a 502 from a router answering garbage) are
    JSON too, not HAProxy's HTML page."""
    import threading
    import urllib.error
    import urllib.request

    backend = _RawBackend()
    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(backend.start())
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()

    def post(body: bytes, headers: dict) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{EDGE_PORT}/v1/search", data=body,
                                         headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status, orjson.loads(answer.read())
        except urllib.error.HTTPError as refused:
            assert refused.headers["content-type"] == "application/json"
            return refused.code, orjson.loads(refused.read())

    big = b"0" * 20_000_000
    edge = _edge_in_front_of(port, api_key=KEY)
    try:
        too_large = post(big, {"api-key": KEY})
        unkeyed = post(big[:10_000_000], {})  # within the limit, but more than the edge reads first
        fine = post(b"0" * 1_000_000, {"api-key": KEY})
    finally:
        edge.stop()
    assert too_large == (413, {"error": "body of 20000000 bytes exceeds 16777216", "field": "body"})
    assert unkeyed == (401, {"error": "missing or wrong API key", "field": None})
    assert fine == (200, {"bytes": 1_000_000})
    assert len(backend.heads) == 1  # only the request within the limit reached the router

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    broken = asyncio.run_coroutine_threadsafe(asyncio.start_server(garbage, "127.0.0.1", 0), loop).result()
    edge = _edge_in_front_of(broken.sockets[0].getsockname()[1])
    try:
        bad_gateway = httpx.get(f"http://127.0.0.1:{EDGE_PORT}/v1/index", timeout=30)
    finally:
        edge.stop()
        loop.call_soon_threadsafe(loop.stop)
        serving.join(timeout=10)
        backend.close()
        broken.close()
    assert bad_gateway.status_code == 502 and bad_gateway.headers["content-type"] == "application/json"
    assert bad_gateway.json() == {"error": "bad gateway: no valid answer from the router", "field": None}


def test_a_second_edge_on_the_same_port_fails_instead_of_sharing_it() -> None:
    """HAProxy binds with SO_REUSEPORT by default: a second edge on a port the first holds would
    start and take some of its connections. `noreuseport`: it exits in one line instead."""
    first = EdgeProcess("127.0.0.1:9", f"127.0.0.1:{EDGE_PORT}").start()
    try:
        second = EdgeProcess("127.0.0.1:9", f"127.0.0.1:{EDGE_PORT}")
        with pytest.raises(ShardserveError, match=f"edge haproxy on 127.0.0.1:{EDGE_PORT} exited"):
            second.start()
        assert first.process is not None and first.process.poll() is None  # the first keeps its port
    finally:
        first.stop()
