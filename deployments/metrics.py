"""Application metrics: exported by every Ray node's metrics agent, shown in the Ray dashboard's
Metrics view (with Ray's Grafana/Prometheus integration) under the `shardserve_` names.

One histogram per stage: request latency (by endpoint, status), shard search (by shard), batch size;
gauges for in-flight requests; counters for coverage outcomes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

import prometheus_client
from ray.util import metrics

from shardserve.index.manifest import Manifest

LATENCY_MS_BOUNDARIES = [0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 25, 50, 100, 250, 500, 1000, 2500]
BATCH_BOUNDARIES: list[float] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
EXPORT_EVERY_S = 1.0  # histogram totals -> Ray gauges (Ray's agent exports every few seconds anyway)


class ExportedHistogram:
    """A histogram counted in this process (prometheus_client's, in a registry of its own) and
    exported through Ray as Prometheus's histogram series: `<name>_bucket{le}`, `<name>_count` and
    `<name>_sum`, each a Ray gauge holding the running total, set every EXPORT_EVERY_S.

    Why not `ray.util.metrics.Histogram`: Ray's metrics agent turns each exported histogram back
    into single observations (its OpenTelemetry bridge records every bucket's midpoint once per
    count, in Python), so the agent's CPU grows with the request rate, on top of the router's own
    call per observation. Totals cost the agent one point per series per export at any rate. `rate()` and
    `histogram_quantile()` read these series as they read a histogram's (a restarted replica's
    totals restart at 0: a counter reset to them), so the dashboards' queries are the same;
    Prometheus lists their type as gauge."""

    def __init__(self, name: str, description: str, boundaries: Sequence[float],
                 tag_keys: tuple[str, ...] = (), default_tags: dict[str, str] | None = None):
        default_tags = default_tags or {}
        self._registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self._local = prometheus_client.Histogram(name, description, tag_keys, registry=self._registry,
                                                  buckets=list(boundaries))
        self._exported = {suffix: metrics.Gauge(
            f"{name}{suffix}", f"{description} ({what})",
            tag_keys=(*default_tags, *tag_keys, *(("le",) if suffix == "_bucket" else ())),
        ).set_default_tags(default_tags) for suffix, what in (
            ("_bucket", "cumulative count at or below le"), ("_count", "count"), ("_sum", "sum"))}
        self._name = name

    def observe(self, value: float, *tag_values: str) -> None:
        (self._local.labels(*tag_values) if tag_values else self._local).observe(value)

    def export(self) -> None:
        """Set the Ray gauges to this process's totals so far."""
        for family in self._registry.collect():
            for sample in family.samples:
                gauge = self._exported.get(sample.name[len(self._name):])  # `_created`: not exported
                if gauge is not None:
                    gauge.set(sample.value, tags=sample.labels)


async def export_every(histograms: Sequence[ExportedHistogram]) -> None:
    """Runs for a replica's life: its histograms' totals to Ray every EXPORT_EVERY_S."""
    while True:
        await asyncio.sleep(EXPORT_EVERY_S)
        for histogram in histograms:
            histogram.export()


class RouterMetrics:
    """Created inside the router replica (metrics must be created in a Ray worker or driver). Every
    series carries the Serve `application` it serves, so two deployments on a cluster stay apart."""

    def __init__(self, application: str) -> None:
        app, by_app = {"application": application}, ("application",)
        self.request_ms = ExportedHistogram(
            "shardserve_request_latency_ms", "Router time per HTTP request", LATENCY_MS_BOUNDARIES,
            ("endpoint", "status"), app)
        self.shard_search_ms = ExportedHistogram(
            "shardserve_shard_search_ms", "FAISS search time per shard call", LATENCY_MS_BOUNDARIES,
            ("shard",), app)
        self.fanout_ms = ExportedHistogram(
            "shardserve_fanout_ms", "Router fan-out: first shard call to last answer",
            LATENCY_MS_BOUNDARIES, default_tags=app)
        self.batch_size = ExportedHistogram(
            "shardserve_batch_queries", "Query vectors per shard call (router batch)", BATCH_BOUNDARIES,
            default_tags=app)
        self.write_group = ExportedHistogram(
            "shardserve_write_group_requests", "Write requests per commit to the write log (requests that "
            "wait behind each other's fsync share one)", BATCH_BOUNDARIES, default_tags=app)
        self.embed_ms = ExportedHistogram(
            "shardserve_embed_ms", "Router time to turn a request's texts into vectors (cache, then the "
            "embedder for the misses)", LATENCY_MS_BOUNDARIES, default_tags=app)
        self.histograms = (self.request_ms, self.shard_search_ms, self.fanout_ms, self.batch_size,
                           self.write_group, self.embed_ms)
        self.embed_cache = metrics.Counter(
            "shardserve_embed_cache_lookups", "Texts looked up in the router's embedding cache, by result "
            "(hit / miss)", tag_keys=(*by_app, "result"))
        self.in_flight = metrics.Gauge(
            "shardserve_in_flight_requests", "Requests inside the router replica", tag_keys=by_app)
        self.deadline_misses = metrics.Counter(
            "shardserve_shard_deadline_misses", "Shard calls left out of an answer (late or failed)",
            tag_keys=(*by_app, "shard"))
        self.shed = metrics.Counter(
            "shardserve_shed_requests", "Requests refused with 503 by admission control",
            tag_keys=by_app)
        self.text_shed = metrics.Counter(
            "shardserve_text_shed_requests", "Text requests refused with 503 by the text admission or a "
            "late embedder", tag_keys=by_app)
        self.coverage = metrics.Counter(
            "shardserve_answers", "Answers by coverage (full / partial / none)",
            tag_keys=(*by_app, "coverage"))
        self.hedged = metrics.Counter(
            "shardserve_hedged_shard_calls", "Shard calls sent a second time after hedge_after_ms",
            tag_keys=by_app)
        self.index_generation = metrics.Gauge(
            "shardserve_index_generation", "Generation of the index version this router serves "
            "(rises by one per `shardserve swap`)", tag_keys=by_app)
        self.shard_links = metrics.Gauge(
            "shardserve_shard_links", "Shard replicas this router reaches over a shard link "
            "(fewer than the replicas: those shards are called through Serve)", tag_keys=by_app)
        for metric in (self.in_flight, self.deadline_misses, self.shed, self.coverage, self.hedged,
                       self.index_generation, self.shard_links, self.embed_cache, self.text_shed):
            metric.set_default_tags(app)
        self.shard_names: list[str] = []

    def follow(self, manifest: Manifest, generation: int) -> None:
        """The index version served now (set at start too, not only after a swap)."""
        self.shard_names = [s.name for s in manifest.shards]
        self.index_generation.set(generation)

    def embed_lookups(self, hits: int, misses: int) -> None:
        """A request's texts looked up in the embedding cache."""
        if hits:
            self.embed_cache.inc(hits, tags={"result": "hit"})
        if misses:
            self.embed_cache.inc(misses, tags={"result": "miss"})

    def observe_request(self, started: float, status: int, route: str = "search") -> None:
        self.request_ms.observe((time.perf_counter() - started) * 1000.0, route, str(status))

    async def export_histograms(self) -> None:
        """Runs for the replica's life: the histograms' totals to Ray every EXPORT_EVERY_S."""
        await export_every(self.histograms)

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
            self.shard_search_ms.observe(search_ms, name)
