"""The shedding edge: a real HAProxy (Debian) in front of real Serve answers overload with a fast 503."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import orjson
import pytest

from core.datasets import load_dataset
from core.errors import ShardserveError
from index_build.job import build_index
from serving.edge import EdgeProcess, edge_config, write_edge
from tests.faults import slow_shards

pytestmark = pytest.mark.haproxy
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
PORT = 18321
EDGE_PORT = 18081


def test_edge_config_is_valid_haproxy(tmp_path: Path) -> None:
    config = write_edge(tmp_path, "127.0.0.1:8000", "127.0.0.1:8080", max_in_flight=64)
    checked = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "maxconn 64" in config.read_text() and "timeout queue 5ms" in config.read_text()
    with pytest.raises(ValueError):
        edge_config("127.0.0.1:8000", max_in_flight=0)


@pytest.mark.slow
def test_edge_sheds_a_burst_with_fast_503(ray_cluster, tmp_path: Path) -> None:
    from deployments.run import deploy, undeploy

    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
    deploy(str(index), port=PORT, app_name="edge", route_prefix="/edge",
           shard_class=slow_shards(search_s={"shard-000": 0.3}), shard_num_cpus=0.1, router_num_cpus=0.1)
    edge = EdgeProcess(f"127.0.0.1:{PORT}", f"127.0.0.1:{EDGE_PORT}", max_in_flight=2).start()
    body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 5},
                        option=orjson.OPT_SERIALIZE_NUMPY)

    async def burst() -> list[tuple[int, float, str, dict]]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one():
                start = time.perf_counter()
                response = await client.post(f"http://127.0.0.1:{EDGE_PORT}/edge/v1/search", content=body)
                return (response.status_code, time.perf_counter() - start,
                        response.headers.get("retry-after"), response.json())
            return await asyncio.gather(*[one() for _ in range(20)])

    try:
        outcomes = asyncio.run(burst())
        statuses = [status for status, *_ in outcomes]
        assert set(statuses) == {200, 503}, statuses
        assert statuses.count(200) >= 2
        shed = [(seconds, retry, payload) for status, seconds, retry, payload in outcomes if status == 503]
        assert all(retry == "1" and payload["error"].startswith("overloaded") for _, retry, payload in shed)
        assert max(seconds for seconds, _, _ in shed) < 0.25  # before the 0.3 s shard could answer
        answered = [payload for status, _, _, payload in outcomes if status == 200]
        assert all(len(p["ids"]) == 5 and p["coverage"]["answered"] == 2 for p in answered)
    finally:
        edge.stop()
        undeploy("edge")
    assert edge.process.returncode is not None  # the edge this test started is gone


def test_edge_that_cannot_listen_fails_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        edge = EdgeProcess("127.0.0.1:9", f"127.0.0.1:{port}", max_in_flight=4)
        with pytest.raises(ShardserveError, match=f"edge haproxy on 127.0.0.1:{port} exited"):
            edge.start()
    assert edge.process.poll() is not None and edge._work is None
