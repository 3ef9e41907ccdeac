"""The Grafana dashboard (configs/grafana/shardserve.json) queries only metrics a live cluster exports.

The metric names come from each panel's PromQL; the exported ones from the node's Prometheus
endpoint of a real local Ray serving real traffic, parsed with prometheus_client's parser. Traffic
is shaped so that every counter has fired (admission 503s, a late shard, partial answers): Ray
exports a counter only after its first increment.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import orjson
import pytest

from loadtests.served import wait_for
from shardserve.data.datasets import load_dataset
from tests.conftest import SERVE_PORT as PORT
from tests.faults import slow_shards

pytestmark = pytest.mark.slow
DASHBOARD = Path(__file__).resolve().parent.parent / "configs" / "grafana" / "shardserve.json"


def _queried_metrics(text: bool = False) -> set[str]:
    """The metrics the dashboard's panels query: those of text requests (the embedder's, exported
    only where an index built from text is served: tests/test_text_served.py) or the others."""
    dashboard = json.loads(DASHBOARD.read_text())
    names = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"\bray_[a-z_]+", target["expr"])}
    return {name for name in names if is_text_metric(name) == text}


def is_text_metric(name: str) -> bool:
    return name.startswith(("ray_shardserve_embed", "ray_shardserve_text_"))


def _exported_samples() -> list:
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    for node in ray.nodes():
        if node["Alive"]:
            text = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                             timeout=10).text
            samples += [sample for family in text_string_to_metric_families(text)
                        for sample in family.samples]
    return samples


def _exported_metrics() -> set[str]:
    return {sample.name for sample in _exported_samples()}


def _request_histogram(samples: list, app: str) -> tuple[float, list[tuple[float, float]]]:
    """(requests counted, [(le, cumulative count)] by le) of an app's request-latency series."""
    samples = [s for s in samples if s.labels.get("application") == app]
    count = sum(s.value for s in samples if s.name == "ray_shardserve_request_latency_ms_count")
    buckets: dict[float, float] = {}
    for s in samples:
        if s.name == "ray_shardserve_request_latency_ms_bucket":
            buckets[float(s.labels["le"])] = buckets.get(float(s.labels["le"]), 0.0) + s.value
    return count, sorted(buckets.items())


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "shardserve" and dashboard["panels"]
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
               for panel in dashboard["panels"])
    assert len(_queried_metrics()) >= 10


def test_every_dashboard_query_names_an_exported_metric(ray_cluster, small_index: Path) -> None:
    from deployments.run import deploy, undeploy

    index = small_index
    url = deploy(str(index), port=PORT, app_name="grafana", route_prefix="/grafana", max_in_flight=2,
                 shard_timeout_s=0.2, shard_class=slow_shards(search_s={"shard-000": 0.4}),
                 shard_num_cpus=0.1, router_num_cpus=0.1)
    body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 5},
                        option=orjson.OPT_SERIALIZE_NUMPY)

    async def traffic() -> set[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            responses = await asyncio.gather(*[client.post(f"{url}/v1/search", content=body)
                                               for _ in range(8)])
        return {r.status_code for r in responses}

    wanted = _queried_metrics()
    try:
        missing: set[str] = wanted
        sent = 0

        def all_exported() -> bool:  # traffic, then a look once Ray has had time to export it
            nonlocal missing, sent
            assert asyncio.run(traffic()) <= {200, 503}
            sent += 8
            time.sleep(3)  # Ray exports application metrics every few seconds
            missing = wanted - _exported_metrics()
            return not missing

        deadline = time.monotonic() + 90  # and 60 s past it for the histogram below
        try:
            wait_for(all_exported, "every metric the dashboard queries exported", timeout_s=90, interval_s=0)
        except AssertionError as exc:
            exc.add_note(f"metrics the dashboard queries that nobody exported: {sorted(missing)}")
            raise
        # The request histogram (deployments.metrics.ExportedHistogram) counts every search the
        # router answered, once: its totals reach Ray's export within seconds of the last request.

        def all_counted() -> list[tuple[float, float]]:
            count, buckets = _request_histogram(_exported_samples(), "grafana")
            return buckets if count == sent else []

        buckets = wait_for(all_counted, f"the request histogram counting all {sent} searches",
                           timeout_s=deadline + 60 - time.monotonic(), interval_s=2)
        cumulative = [n for _, n in buckets]
        assert cumulative == sorted(cumulative) and buckets[-1] == (float("inf"), sent), buckets
    finally:
        undeploy("grafana")
