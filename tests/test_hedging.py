"""Hedged shard calls on real Serve: with one slow replica of a shard, hedging keeps answers fast."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import orjson
import pytest

from index_build.job import build_index
from shardserve.data.datasets import load_dataset
from tests.faults import slow_shards

pytestmark = pytest.mark.slow
PORT = 18321


def test_hedging_routes_around_a_slow_replica(ray_cluster, tmp_path: Path) -> None:
    from deployments.run import deploy, undeploy

    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
    queries = load_dataset("fashion-mnist", num_queries=30).queries
    common = {"replicas_per_shard": 2, "shard_class": slow_shards(rank0_search_s={"shard-000": 0.6}),
              "shard_num_cpus": 0.1, "router_num_cpus": 0.1}

    def latencies(url: str) -> list[float]:
        seconds = []
        with httpx.Client(timeout=10) as client:
            for vector in queries:
                start = time.perf_counter()
                response = client.post(f"{url}/v1/search", content=orjson.dumps(
                    {"vector": vector, "k": 5}, option=orjson.OPT_SERIALIZE_NUMPY))
                seconds.append(time.perf_counter() - start)
                assert response.status_code == 200, response.text
                assert response.json()["coverage"] == {"shards": 2, "answered": 2}
        return seconds

    results = {}
    for name, hedge_ms in (("plain", 0.0), ("hedged", 50.0)):
        url = deploy(str(index), port=PORT, app_name=name, route_prefix=f"/{name}",
                     hedge_after_ms=hedge_ms, **common)
        try:
            results[name] = latencies(url)
        finally:
            undeploy(name)
    slow_plain = sum(s >= 0.6 for s in results["plain"])
    slow_hedged = sum(s >= 0.6 for s in results["hedged"])
    assert slow_plain >= 3, results["plain"]  # the slow replica did get requests
    assert slow_hedged == 0, results["hedged"]  # hedges answered from the other replica
