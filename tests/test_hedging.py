"""Hedged shard calls on real Serve: with one slow replica of a shard, hedging answers from the other.

Asserted by cause, not by a clock: without hedging, calls to the slow replica (0.6 s) make answers
at least that slow; with hedging, the slow replica sleeps longer than the client waits, so every
answer to a call it received (it logs each) came from the hedge."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import orjson
import pytest

from shardserve.data.datasets import load_dataset
from tests.conftest import SERVE_PORT as PORT
from tests.faults import slow_shards

pytestmark = pytest.mark.slow


def test_hedging_routes_around_a_slow_replica(ray_cluster, small_index: Path, tmp_path: Path) -> None:
    from deployments.run import deploy, undeploy

    index = small_index
    queries = load_dataset("fashion-mnist", num_queries=30).queries
    slow_log = tmp_path / "slow-calls.log"
    common = {"replicas_per_shard": 2, "shard_num_cpus": 0.1, "router_num_cpus": 0.1}
    client_timeout_s = 10.0

    def latencies(url: str) -> list[float]:
        seconds = []
        with httpx.Client(timeout=client_timeout_s) as client:
            for vector in queries:
                start = time.perf_counter()
                response = client.post(f"{url}/v1/search", content=orjson.dumps(
                    {"vector": vector, "k": 5}, option=orjson.OPT_SERIALIZE_NUMPY))
                seconds.append(time.perf_counter() - start)
                assert response.status_code == 200, response.text
                assert response.json()["coverage"] == {"shards": 2, "answered": 2}
        return seconds

    results = {}
    for name, hedge_ms, slow_s in (("plain", 0.0, 0.6), ("hedged", 50.0, 6 * client_timeout_s)):
        shard_class = slow_shards(rank0_search_s={"shard-000": slow_s},
                                  slow_calls_log=str(slow_log) if hedge_ms else None)
        url = deploy(str(index), port=PORT, app_name=name, route_prefix=f"/{name}",
                     hedge_after_ms=hedge_ms, shard_class=shard_class, **common)
        try:
            results[name] = latencies(url)
        finally:
            undeploy(name)
    # a lower bound the sleep itself causes: the slow replica did get requests, and was awaited
    assert sum(s >= 0.6 for s in results["plain"]) >= 3, results["plain"]
    # the slow replica got calls it could not answer before the client gave up, yet every request
    # was answered by both shards: those answers came from the hedge to the other replica
    assert slow_log.exists() and slow_log.read_text().count("called") >= 1
