"""The admission edge: a real HAProxy (Debian) in front of real Serve. Clients that wait for their
answers are queued, never refused; a request that finds the queue full gets 503 before the slow shard
it protects could have answered; the API key is checked before Python sees a byte."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import httpx
import orjson
import pytest

from core.datasets import load_dataset
from core.errors import ShardserveError
from index_build.job import build_index
from serving.edge import Admission, EdgeProcess, edge_config, write_edge
from tests.faults import slow_shards

pytestmark = pytest.mark.haproxy
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
PORT = 18321
EDGE_PORT = 18081
KEY = "test-key-0123456789abcdef"


def test_edge_config_is_valid_haproxy(tmp_path: Path) -> None:
    config = write_edge(tmp_path, "127.0.0.1:8000", "127.0.0.1:8080",
                        Admission(max_in_flight=64, max_queue=96), api_key=KEY)
    checked = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = config.read_text()
    assert "maxconn 64" in text and "queue(shardserve) gt 96" in text and KEY in text
    assert config.stat().st_mode & 0o077 == 0  # the key is readable by its owner only
    with pytest.raises(ValueError):
        Admission(max_in_flight=0)
    with pytest.raises(ShardserveError, match="API key"):
        edge_config("127.0.0.1:8000", api_key="short")
    with pytest.raises(ShardserveError, match="API key"):
        edge_config("127.0.0.1:8000", api_key='x" if TRUE #' + "y" * 20)  # nothing to inject


@pytest.fixture(scope="module")
def slow_app(ray_cluster, tmp_path_factory: pytest.TempPathFactory):
    """A 2-shard app whose shard-000 takes 0.3 s per search call."""
    from deployments.run import deploy, undeploy

    index = tmp_path_factory.mktemp("edge") / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
    deploy(str(index), port=PORT, app_name="edge", route_prefix="/edge",
           shard_class=slow_shards(search_s={"shard-000": 0.3}), shard_num_cpus=0.1, router_num_cpus=0.1)
    body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 5},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    yield body
    undeploy("edge")


def _search(client: httpx.AsyncClient, body: bytes, headers: dict | None = None):
    return client.post(f"http://127.0.0.1:{EDGE_PORT}/edge/v1/search", content=body, headers=headers)


@pytest.mark.slow
def test_edge_queues_closed_loop_clients_and_sheds_a_standing_queue_first(slow_app: bytes) -> None:
    body = slow_app
    edge = EdgeProcess(f"127.0.0.1:{PORT}", f"127.0.0.1:{EDGE_PORT}",
                       Admission(max_in_flight=2, max_queue=6, queue_timeout_ms=30_000)).start()

    async def closed_loop(clients: int, each: int) -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one() -> list[int]:
                return [(await _search(client, body)).status_code for _ in range(each)]
            answers = await asyncio.gather(*[one() for _ in range(clients)])
            return [status for statuses in answers for status in statuses]

    async def burst() -> list[tuple[int, str | None, dict]]:
        """30 requests at once: 2 admitted, up to 7 queued, the rest find the queue full. The order in
        which answers complete is the assertion: no wall clock."""
        done: list[tuple[int, str | None, dict]] = []
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:
            async def one() -> None:
                response = await _search(client, body)
                done.append((response.status_code, response.headers.get("retry-after"), response.json()))
            await asyncio.gather(*[one() for _ in range(30)])
        return done

    try:
        # 8 clients that each wait for their answer: a queue of 8 the server drains, never an overload
        assert asyncio.run(closed_loop(8, 3)) == [200] * 24
        outcomes = asyncio.run(burst())
        statuses = [status for status, _, _ in outcomes]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 8, statuses
        # every shed request was answered before the first admitted one: the 503 did not wait for
        # the 0.3 s shard, it was decided at the edge
        first_200 = statuses.index(200)
        assert all(status == 503 for status in statuses[:first_200])
        assert statuses[first_200:].count(503) == 0, statuses
        shed = [(retry, payload) for status, retry, payload in outcomes if status == 503]
        assert all(retry == "1" and payload["error"].startswith("overloaded") for retry, payload in shed)
        answered = [payload for status, _, payload in outcomes if status == 200]
        assert all(len(p["ids"]) == 5 and p["coverage"]["answered"] == 2 for p in answered)
    finally:
        edge.stop()
    assert edge.process.returncode is not None  # the edge this test started is gone


@pytest.mark.slow
def test_edge_wants_the_api_key_before_python(slow_app: bytes) -> None:
    edge = EdgeProcess(f"127.0.0.1:{PORT}", f"127.0.0.1:{EDGE_PORT}", api_key=KEY).start()

    async def calls() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return [await _search(client, slow_app),
                    await _search(client, slow_app, {"api-key": KEY[:-1] + "x"}),
                    await _search(client, slow_app, {"Authorization": f"Bearer {KEY}"}),
                    await _search(client, slow_app, {"api-key": KEY}),
                    await client.get(f"http://127.0.0.1:{EDGE_PORT}/edge/v1/health")]

    try:
        missing, wrong, bearer, header, health = asyncio.run(calls())
    finally:
        edge.stop()
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"] == "missing or wrong API key"
    assert bearer.status_code == header.status_code == 200 and len(bearer.json()["ids"]) == 5
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
