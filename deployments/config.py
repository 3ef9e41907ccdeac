"""The application's settings (pydantic, same field names as the Serve config YAML's `args`)."""

from __future__ import annotations

import copy
import os
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.autoscaling import autoscaling_config
from shardserve.runtime.ray_session import SERVING_NODE_ENV
from shardserve.tracing import TraceConfig

# Batches in flight per router replica when shards autoscale: with 2, a shard's depth per router
# ranges over 0-2, so `shardserve tune` puts its knee depth at 1.
AUTOSCALED_BATCHES = 2
# With fixed replicas, a batch beyond one per shard replica starts only for this much queued work:
# past 32 rows the router's quantizer runs in a thread and shards scan off their event loop, so
# two such batches overlap for real; smaller ones run one after another.
OVERLAP_MIN_ROWS = 32
# The batch fill where a batch's queries share the scan: closed-loop clients stay in one full batch
# instead of alternating groups (query.batcher; docs/experiments.md).
AUTO_BATCH_FILL = 0.1


class AppArgs(BaseModel):
    """Arguments of `deployments.app:build_app`; unknown keys fail loudly."""

    model_config = ConfigDict(extra="forbid")

    index: str = Field(..., description="index directory or URI holding manifest.json")
    replicas_per_shard: int = Field(1, ge=1, description="fixed replicas of each shard deployment")
    shard_num_cpus: float = Field(0.25, gt=0, description="Ray CPUs reserved per shard replica")
    faiss_threads: int = Field(1, ge=1, description="OpenMP threads per shard replica (<= its cores)")
    shard_mmap: bool = Field(
        True, description="memory-map shard files (IVF lists stay in the page cache, shared by the "
                          "replicas on a node; remote indexes are downloaded once per node first); "
                          "false reads each replica its own copy")
    serving_nice: int = Field(
        19, ge=0, le=19, description="nice value router and shard replicas take once started (Ray "
                                     "starts workers at 15), so a replica that is starting "
                                     "(autoscaling, a restart) gets more CPU than each busy one on "
                                     "a saturated node; <= 15 leaves them as Ray started them")
    warm_workers: int = Field(
        4, ge=0, description="idle Ray workers each node with a shard replica keeps started, with the "
                             "serving code imported, so a new replica there (scale-up, restart) "
                             "skips its imports (runtime.warm_pool; 4 covers a burst that scales 4 shards "
                             "on one node at once; each is an idle Python process with them imported); "
                             "0: none")
    router_replicas: int = Field(1, ge=1)
    router_autoscaling: dict | None = Field(
        None, description="Serve autoscaling_config for the router (deployments.autoscaling."
                          "router_autoscaling_config): it scales on the cores its replicas use, "
                          "replacing router_replicas when set")
    router_num_cpus: float = Field(0.25, gt=0)
    max_batch_size: int = Field(
        256, ge=1, description="query vectors per router batch (a batch takes everything queued when a "
                               "slot frees, up to this)")
    max_concurrent_batches: int | None = Field(
        None, ge=1, description="batches in flight per router replica (`batching()`). Unset, with fixed "
                                "replicas: one per shard replica (replicas_per_shard), since a replica "
                                "scans one batch at a time, plus one more for large work only (>= "
                                "OVERLAP_MIN_ROWS queued vectors), "
                                "but none where batches share the shards' scan (query.scan_choice."
                                "shares_scan: a second batch would split the one that shares it); "
                                "with shard autoscaling AUTOSCALED_BATCHES, so a shard's queue can grow "
                                "past its knee depth")
    batch_fill: float | None = Field(
        None, ge=0, le=1, description="when a batch ends, the next waits up to this fraction of its time "
                                      "(at most 5 ms) for the clients it answered to send their next "
                                      "requests (query.batcher): closed-loop clients stay in one batch "
                                      "instead of alternating groups; 0: start with what is queued; "
                                      "unset: AUTO_BATCH_FILL where the index's IVF-Flat lists outgrow a "
                                      "core's cache (their scan is shared by a batch's queries), else 0")
    max_in_flight: int = Field(
        256, ge=1, description="admission control: requests inside a router replica beyond this get an "
                               "immediate 503 + Retry-After instead of joining a growing queue")
    front_port: int | None = Field(
        None, ge=0, le=65535,
        description="each router replica also answers HTTP itself on this port (transport.http_front: "
                    "SO_REUSEPORT, shared by the replicas on a node), off Serve's per-request HTTP "
                    "path; `shardserve serve` points its edge here. None = Serve's HTTP only")
    front_host: str = Field("127.0.0.1", description="address the front door binds (keep it private); "
                            "`node`: the node's own address as Ray knows it, where an edge on a node "
                            "with several addresses (or several nodes on one machine) reaches its router")
    router_max_ongoing_requests: int = Field(512, ge=1)
    router_max_queued_requests: int = Field(1024, ge=-1, description="beyond this Serve answers 503")
    shard_max_ongoing_requests: int = Field(16, ge=1)
    shard_autoscaling: dict | None = Field(
        None, description="Serve autoscaling_config for every shard deployment (from `shardserve tune`);"
                          " replaces replicas_per_shard when set")
    shard_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each shard replica needs, e.g. "
                                          "{shard_host: 0.01} to keep shards on nodes started with it")
    router_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources of the router and index-pointer "
                                          "replicas, e.g. {shardserve_head: 0.01} to keep them on the head")
    router_max_per_node: int | None = Field(
        None, ge=1, description="at most this many router replicas on one node (Serve's "
                                "max_replicas_per_node): 1 spreads them over the serving nodes, so "
                                "losing a node leaves the others' routers and edges answering")
    pointer_poll_s: float = Field(0.25, gt=0, description="how often routers ask which index to serve")
    gate_min_recall: float = Field(0.9, ge=0, le=1, description="`shardserve swap` refuses an index "
                                                                "whose recall@gate_k is below this")
    gate_queries: int = Field(500, ge=1, description="eval queries the swap gate searches")
    gate_k: int = Field(10, ge=1)
    gate_params: dict[str, int] = Field(
        default_factory=lambda: {"nprobe": 16, "efSearch": 64},
        description="search params of the gate queries (those the new index does not take are dropped)")
    max_k: int = Field(100, ge=1)
    max_vectors: int = Field(1024, ge=1, description="vectors per batch request")
    max_write_points: int = Field(1000, ge=1, description="ids per upsert or delete request")
    collections_dir: str | None = Field(
        None, description="where collections live (their catalogue and index directories; a local disk): "
                          "default the served index's directory/collections")
    max_collections: int = Field(10_000, ge=1, description="collections that may exist at once (a create "
                                                           "past it is a 409)")
    max_collections_held: int = Field(
        1024, ge=1, description="collections' shards one router replica holds loaded at most (a collection "
                                "built in N shards counts N; the least recently used let go)")
    min_apart_at: int = Field(
        100_000, ge=1_000, description="the server's floor under a collection's apart_at: no smaller "
                                       "collection gets shard deployments of its own")
    max_collections_apart: int = Field(
        8, ge=0, description="collections served apart by shard deployments of their own at most; the others "
                             "stay in the router replicas")
    max_collection_waiting: int = Field(
        256, ge=1, description="one collection's requests waiting for the collections' threads of a router "
                               "replica (the collections take them in turn); past it a fast 503")
    collection_threads: int = Field(
        2, ge=1, le=64, description="threads of a router replica answering the collections' reads, each "
                                    "collection on one at a time: a flood on one leaves the others a thread")
    collection_compact_at: int = Field(
        4096, ge=1, description="a collection's write operations waiting past its newest version before "
                                "`serve` folds them into a new one (compaction, then every replica moves)")
    chroma_shards: int = Field(2, ge=1, le=64, description="shards a collection created through Chroma's API "
                                                           "is built in once it grows (docs/chroma.md)")
    chroma_grow_at: int = Field(20_000, ge=1_000, le=10_000_000,
                                description="points past which a Chroma collection is built as its sharded "
                                            "index (exact below; a native collection's grow_at)")
    chroma_max_batch: int = Field(1000, ge=1, le=100_000,
                                  description="records one Chroma add, update or upsert takes at most (and "
                                              "at most max_write_points: one write, one log transaction)")
    chroma_allow_reset: bool = Field(False, description="Chroma's POST /api/v2/reset deletes every Chroma "
                                                        "collection, tenant and database: refused unless set")
    max_page: int = Field(1000, ge=1, le=100_000, description="points one get by ids or one scroll page "
                                                              "answers at most")
    max_work: int = Field(
        65536, ge=1, description="query vectors x probes (nprobe or efSearch) one request may ask for; "
                                 "more gets a 422 naming the limit (FAISS cannot be stopped mid-scan)")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="larger bodies get 413, counted "
                                                                      "while reading (chunked too)")
    body_timeout_s: float = Field(10.0, gt=0, description="a body not fully received by then gets 408 "
                                                          "(slow uploads hold no admission slot)")
    shard_timeout_s: float = Field(2.0, gt=0, description="deadline of one shard call")
    retry_after_s: int = Field(1, ge=1, description="Retry-After on 503")
    shard_transport: Literal["link", "serve"] = Field(
        "link", description="router -> shard hop: `link` = a TCP link per shard replica "
                            "(shardserve.transport.shard_link; a Serve call when no link is up), `serve` = "
                            "Serve handle calls only")
    hedge_after_ms: float = Field(
        0.0, ge=0, description="0 = off. A shard call not answered after this many ms is sent again "
                               "(Serve routes it by queue length, so with >= 2 replicas usually to "
                               "another one); the first answer wins, the other call is cancelled")

    embedder: str | None = Field(
        None, description="where the embedder replicas of an index built from text find its model: a "
                          "known model's name or a model folder on every node (default: the manifest's "
                          "model name, which must then be a known one); its files must be the ones the "
                          "index was built with (checked by hash)")
    embedder_replicas: int = Field(1, ge=1, description="fixed embedder replicas (an index built from "
                                                        "text), when embedder_autoscaling is null")
    embedder_autoscaling: dict | None = Field(
        default_factory=lambda: default_embedder_autoscaling(),
        description="Serve autoscaling_config of the embedder deployment, on its own queue and knee "
                    "(deployments.autoscaling.autoscaling_config; `shardserve tune` writes one from a "
                    "text sweep); null: embedder_replicas")
    embedder_num_cpus: float = Field(
        0.5, gt=0, description="Ray CPUs reserved per embedder replica (each runs one model thread)")
    embedder_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each embedder replica needs, e.g. "
                                          "{embed_host: 0.01} to keep them on nodes of their own")
    embedder_max_batch: int = Field(64, ge=1, description="texts per model batch in an embedder replica")
    embedder_providers: list[str] = Field(
        default_factory=lambda: ["CPUExecutionProvider"],
        description="ONNX Runtime execution providers of the embedder replicas, by preference (a GPU's "
                    "needs onnxruntime-gpu on its nodes: untested here)")
    embedder_idle_priority: bool = Field(
        True, description="run the model at Linux's idle scheduling class (SCHED_IDLE): on a node it "
                          "shares with shards and routers, it takes only the CPU they leave, so vector "
                          "searches keep their latency under a text flood, and texts wait instead; on "
                          "nodes of its own it changes nothing. false: the replicas' nice value")
    embedding_cache_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="each router replica's cache of embeddings by (model, exact "
                                            "text); 0: none")
    max_texts_in_flight: int = Field(
        256, ge=1, description="text admission: texts a router replica may have waiting for the "
                               "embedder (a few seconds of one replica's work); a request whose cache "
                               "misses would pass it gets an immediate 503 (vector searches are not "
                               "counted, nor are cache hits, nor a request that finds none waiting). "
                               "The edge's text lane (serving.edge) bounds text requests first")
    max_texts: int = Field(64, ge=1, description="texts per request (search, embed, upsert)")
    max_text_chars: int = Field(2000, ge=1, description="characters per text (the model reads at most "
                                                        "its token limit of it: the rest is truncated, "
                                                        "and the answer says which texts were)")
    embed_timeout_s: float = Field(10.0, gt=0, description="a request's wait for the embedder, then 503")
    trace_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL every replica exports its spans to (shardserve.tracing); "
                          "null: each node's SHARDSERVE_TRACE_ENDPOINT, and no tracing where unset")
    trace_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="share of requests without a sampled `traceparent` that are "
                                          "traced (one whose caller's traceparent says sampled always "
                                          "is); null: SHARDSERVE_TRACE_RATIO, else 0")

    @field_validator("trace_endpoint")
    @classmethod
    def _trace_url(cls, endpoint: str | None) -> str | None:
        if endpoint is not None:
            TraceConfig(endpoint=endpoint)  # an http(s) URL, or a BadArgument (a ValueError) saying so
        return endpoint

    def trace_config(self, service: str) -> TraceConfig:
        """Where this app's replicas of `service` (router, shard, embedder) send spans, and how many."""
        return TraceConfig.resolve(self.trace_endpoint, self.trace_ratio, service)

    def fill_for(self, shared_scan: bool) -> float:
        """`batch_fill`, or its default for an index whose batches do or do not share each shard's
        scan (query.scan_choice.shares_scan; see its description)."""
        if self.batch_fill is not None:
            return self.batch_fill
        return AUTO_BATCH_FILL if shared_scan else 0.0

    def batching(self, shared_scan: bool = False) -> tuple[int, int, int]:
        """(batches in flight at most, how many start whatever their size, queued vectors that let
        one more start): `max_concurrent_batches` or its default (see its description)."""
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches, self.max_concurrent_batches, 1
        if self.shard_autoscaling:
            return AUTOSCALED_BATCHES, AUTOSCALED_BATCHES, 1
        if shared_scan:
            return self.replicas_per_shard, self.replicas_per_shard, 1
        return self.replicas_per_shard + 1, self.replicas_per_shard, OVERLAP_MIN_ROWS


# An embedder replica batches what is queued; past about this many calls waiting per replica a
# batch no longer gets cheaper per text and latency is queueing (`shardserve tune` measures it).
EMBEDDER_KNEE_DEPTH = 8.0
EMBEDDER_MAX_REPLICAS = 2


def default_embedder_autoscaling() -> dict:
    """The embedder's own knee policy (deployments.autoscaling.knee_policy) on its own queue."""
    return autoscaling_config(EMBEDDER_KNEE_DEPTH, 1, EMBEDDER_MAX_REPLICAS, knee_policy=True)


EMBEDDER = "Embedder"  # an index version's embedder deployment (an index built from text)
INDEX_INGRESS = "IndexVersion"  # the index version app's ingress: readiness, gate, link directory


def index_app_name(main_app: str, version: str | None = None) -> str:
    """`<app>-index` for the version a config starts with, `<app>-index-<version>` for swapped-in ones."""
    return f"{main_app}-index" if version is None else f"{main_app}-index-{version[:12]}"


def serve_config_yaml(index: str, host: str = "127.0.0.1", port: int = 8000,
                      replicas_per_shard: int = 1, app_name: str = "shardserve", **overrides) -> str:
    """A Serve config file that `serve run` and `serve deploy` accept unchanged."""
    if "://" not in index:
        index = os.path.abspath(index)  # `serve deploy` builds the app elsewhere: no relative paths
    args = AppArgs(index=index, replicas_per_shard=replicas_per_shard, **overrides).model_dump()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": host, "port": port},
        "applications": [
            # The index version's shards: no HTTP route, found by name by the router.
            {"name": index_app_name(app_name), "route_prefix": None,
             "import_path": "deployments.app:build_index_app", "args": copy.deepcopy(args)},
            {"name": app_name, "route_prefix": "/", "import_path": "deployments.app:build_app",
             "args": args},
        ],
    }
    header = (
        "# Generated by `shardserve serve-config`. Run: serve run THIS.yaml  (or: serve deploy THIS.yaml)\n"
        "# Start Ray with Serve's fast ingress (HAProxy, throughput-optimised) and the serving code\n"
        "# preloaded into its workers (a new replica then skips those imports):\n"
        + "".join(f"#   export {k}={v}\n" for k, v in SERVING_NODE_ENV.items())
        + "# (set them before `ray start` / `serve run`, which starts Ray itself)\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False)
