"""Application metrics via ray.util.metrics: exported by every Ray node's metrics agent, shown in the
Ray dashboard's Metrics view (with Ray's Grafana/Prometheus integration) under the `shardserve_` names.

One histogram per stage: request latency (by endpoint, status), shard search (by shard), batch size;
gauges for in-flight requests; counters for coverage outcomes.
"""

from __future__ import annotations

import time
from collections import Counter

from ray.util import metrics

from shardserve.index.manifest import Manifest

LATENCY_MS_BOUNDARIES = [0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 25, 50, 100, 250, 500, 1000, 2500]
BATCH_BOUNDARIES: list[float] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


class RouterMetrics:
    """Created inside the router replica (metrics must be created in a Ray worker or driver)."""

    def __init__(self) -> None:
        self.request_ms = metrics.Histogram(
            "shardserve_request_latency_ms", "Router time per HTTP request",
            boundaries=LATENCY_MS_BOUNDARIES, tag_keys=("endpoint", "status"))
        self.shard_search_ms = metrics.Histogram(
            "shardserve_shard_search_ms", "FAISS search time per shard call",
            boundaries=LATENCY_MS_BOUNDARIES, tag_keys=("shard",))
        self.fanout_ms = metrics.Histogram(
            "shardserve_fanout_ms", "Router fan-out: first shard call to last answer",
            boundaries=LATENCY_MS_BOUNDARIES)
        self.batch_size = metrics.Histogram(
            "shardserve_batch_queries", "Query vectors per shard call (router batch)",
            boundaries=BATCH_BOUNDARIES)
        self.in_flight = metrics.Gauge(
            "shardserve_in_flight_requests", "Requests inside the router replica")
        self.deadline_misses = metrics.Counter(
            "shardserve_shard_deadline_misses", "Shard calls left out of an answer (late or failed)",
            tag_keys=("shard",))
        self.shed = metrics.Counter(
            "shardserve_shed_requests", "Requests refused with 503 by admission control")
        self.coverage = metrics.Counter(
            "shardserve_answers", "Answers by coverage (full / partial / none)", tag_keys=("coverage",))
        self.hedged = metrics.Counter(
            "shardserve_hedged_shard_calls", "Shard calls sent a second time after hedge_after_ms")
        self.index_generation = metrics.Gauge(
            "shardserve_index_generation", "Generation of the index version this router serves "
            "(rises by one per `shardserve swap`)")
        self.shard_links = metrics.Gauge(
            "shardserve_shard_links", "Shard replicas this router reaches over a shard link "
            "(fewer than the replicas: those shards are called through Serve)")
        self.shard_names: list[str] = []

    def follow(self, manifest: Manifest, generation: int) -> None:
        """The index version served now (set at start too, not only after a swap)."""
        self.shard_names = [s.name for s in manifest.shards]
        self.index_generation.set(generation)

    def observe_request(self, started: float, status: int) -> None:
        self.request_ms.observe((time.perf_counter() - started) * 1000.0,
                                tags={"endpoint": "search", "status": str(status)})

    def observe_batch(self, items: list, results: list, in_flight: int) -> None:
        """Per batch, not per request: its size, the fan-out time, the in-flight gauge (sampled) and
        the answers by coverage (one counter call per outcome, not one per request)."""
        self.batch_size.observe(float(sum(len(query.matrix) for _, query in items)))
        self.in_flight.set(in_flight)
        self.fanout_ms.observe(results[0].fanout_ms)
        outcomes = Counter("full" if r.answered == r.shards else "partial" if r.answered else "none"
                           for r in results)
        for coverage, count in outcomes.items():
            self.coverage.inc(count, tags={"coverage": coverage})

    def shard_done(self, shard: int, search_ms: float | None) -> None:
        """One shard call finished: its search time, or None when it missed the deadline / failed."""
        name = self.shard_names[shard] if shard < len(self.shard_names) else str(shard)
        if search_ms is None:
            self.deadline_misses.inc(tags={"shard": name})
        else:
            self.shard_search_ms.observe(search_ms, tags={"shard": name})
