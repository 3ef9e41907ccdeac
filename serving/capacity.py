"""Capacity model (`shardserve plan`): the knee throughput of a layout from the CPU one request costs.

Past the knee the machine is CPU-bound (throughput stops growing near concurrency = cores), so

    knee_qps(S shards, R replicas, C cores) = usable_cores x 1000 / cpu_ms(S)
    cpu_ms(S) = fixed_ms + per_shard_ms x S
    usable_cores = min(C, S x R x faiss_threads + router_replicas)

`fixed_ms` is what a request costs whatever the shard count (HTTP ingress, parsing, the router's
batching, merge, rendering); `per_shard_ms` is what each shard adds (one shard call per batch,
the shard's Python, its FAISS scan: for IVF, the coarse quantizer over nlist centroids plus nprobe
lists). Both are fitted by least squares on measured layouts with one replica per shard; layouts
with more replicas are predicted, not fitted, and their error is the model's test.

Scaling to N vectors (on paper): the FAISS part of per_shard_ms scales with the work per query of
an IVF shard, d x (nlist + nprobe x N_shard / nlist); the Serve/Python part does not.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shardserve.errors import BadArgument, ShardserveError


@dataclass(frozen=True)
class Layout:
    shards: int
    replicas_per_shard: int
    cores: float
    knee_qps: float | None = None  # measured, when known
    p99_ms: float | None = None


@dataclass(frozen=True)
class CapacityModel:
    fixed_ms: float
    per_shard_ms: float
    faiss_threads: int = 1
    router_replicas: int = 1

    def usable_cores(self, layout: Layout) -> float:
        return min(layout.cores, layout.shards * layout.replicas_per_shard * self.faiss_threads
                   + self.router_replicas)

    def cpu_ms(self, shards: int) -> float:
        return self.fixed_ms + self.per_shard_ms * shards

    def knee_qps(self, layout: Layout) -> float:
        return self.usable_cores(layout) * 1000.0 / self.cpu_ms(layout.shards)


def _measured(layout: Layout) -> float:
    if layout.knee_qps is None:
        raise BadArgument(f"layout {layout.shards}x{layout.replicas_per_shard} has no measured knee")
    return layout.knee_qps


def fit(layouts: list[Layout]) -> CapacityModel:
    """Least-squares fit of cpu_ms = fixed + per_shard x S on measured layouts (>= 2 shard counts)."""
    shard_counts = {layout.shards for layout in layouts}
    if len(shard_counts) < 2:
        raise BadArgument("fitting needs measured layouts with at least two different shard counts")
    probe = CapacityModel(0.0, 0.0)
    design = np.array([[1.0, layout.shards] for layout in layouts])
    cpu = np.array([probe.usable_cores(layout) * 1000.0 / _measured(layout) for layout in layouts])
    (fixed, per_shard), *_ = np.linalg.lstsq(design, cpu, rcond=None)
    return CapacityModel(float(fixed), float(per_shard))


def check(model: CapacityModel, layouts: list[Layout], fitted: set[tuple[int, int]]) -> list[dict]:
    """Predicted vs measured knee of every measured layout, with the relative error of each."""
    rows = []
    for layout in layouts:
        predicted, measured = model.knee_qps(layout), _measured(layout)
        rows.append({"layout": f"{layout.shards}x{layout.replicas_per_shard}",
                     "measured_qps": round(measured, 1), "predicted_qps": round(predicted, 1),
                     "error": round(predicted / measured - 1.0, 3),
                     "role": "fit" if (layout.shards, layout.replicas_per_shard) in fitted else "test"})
    return rows


def plan(cpu_ms: Callable[[int], float], target_qps: float, cores_per_node: float,
         index_bytes: float = 0.0, memory_per_node_gb: float = 64.0,
         shard_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), headroom: float = 0.8) -> list[dict]:
    """Layouts that reach `target_qps` at `headroom` of their knee (so p99 stays near the knee's),
    fewest nodes first among those whose replicas fit in memory: fewer shards cost less CPU per
    request (each shard adds a call and a quantizer scan), more shards make replicas small enough."""
    options = []
    for shards in shard_counts:
        per_core = headroom * 1000.0 / cpu_ms(shards)
        cores = target_qps / per_core
        replicas = max(1, int(np.ceil(cores / shards)))  # one core per single-threaded shard replica
        replica_gb = index_bytes / shards / 1e9
        per_node = min(cores_per_node, np.floor(0.7 * memory_per_node_gb / replica_gb)
                       if replica_gb else cores_per_node)
        nodes = int(np.ceil(shards * replicas / per_node)) if per_node >= 1 else None
        options.append({"shards": shards, "replicas_per_shard": replicas, "cores": round(cores, 1),
                        "nodes": nodes, "gb_per_replica": round(replica_gb, 2),
                        "cpu_ms_per_request": round(cpu_ms(shards), 3)})
    return sorted(options, key=lambda o: (o["nodes"] is None, o["nodes"] or 0, o["cores"]))


def ivf_work(vectors_per_shard: float, nlist: int, nprobe: int, dim: int) -> float:
    """Relative work of one IVF shard search: quantizer + scanned lists (distance computations x d)."""
    return dim * (nlist + nprobe * vectors_per_shard / nlist)


def scaled_cpu_ms(model: CapacityModel, faiss_ms_per_shard: float | None, measured_vectors: int,
                  vectors: int, nlist: int, nprobe: int) -> Callable[[int], float]:
    """cpu_ms(S) at `vectors` instead of `measured_vectors`. Only the FAISS part of the per-shard cost
    scales, by the IVF work ratio with nlist ~ sqrt(vectors per shard) (FAISS wiki guideline);
    `faiss_ms_per_shard=None` (not measured) scales the whole per-shard cost: an upper bound."""
    faiss_ms = model.per_shard_ms if faiss_ms_per_shard is None else min(faiss_ms_per_shard,
                                                                         model.per_shard_ms)

    def cpu_ms(shards: int) -> float:
        measured = measured_vectors / shards
        target = vectors / shards
        ratio = (ivf_work(target, max(1, int(nlist * np.sqrt(target / measured))), nprobe, 1)
                 / ivf_work(measured, nlist, nprobe, 1))
        return model.fixed_ms + shards * (model.per_shard_ms - faiss_ms + faiss_ms * ratio)

    return cpu_ms


def faiss_ms_per_query(index_dir: str, params: dict, batch: int = 32) -> float:
    """Measured here, in-process: FAISS milliseconds per query per shard at a router-sized batch, on
    eval queries of the dataset the index was built from (its manifest names it)."""
    import time

    from shardserve.data.datasets import load_dataset
    from shardserve.query.searcher import load_all_shards

    manifest, searchers = load_all_shards(index_dir)
    matrix = load_dataset(manifest.dataset.name, num_queries=batch, **manifest.dataset.columns()).queries
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for searcher in searchers:
            searcher.search(matrix, 10, params)
        best = min(best, (time.perf_counter() - start) * 1000.0 / (len(searchers) * len(matrix)))
    return best


def embed_ms_per_text(model: str, texts: int = 200) -> float:
    """Measured here, in-process: the model's CPU milliseconds per text, one text at a time on one
    thread (as an embedder replica runs it), over real texts (shardserve.embed.text_data), after a
    warm-up. CPU time, not wall time, so a busy machine does not inflate it."""
    import time

    from shardserve.embed.model import Embedder
    from shardserve.embed.text_data import real_texts

    embedder = Embedder(model, max_batch=1)
    sample = real_texts(texts + 20)
    embedder.embed(sample[:20])
    started = time.thread_time()
    for text in sample[20:]:
        embedder.embed([text])
    return (time.thread_time() - started) * 1000.0 / texts


def embedding_stage(embed_ms: float, target_qps: float, text_share: float, cores_per_node: float,
                    headroom: float = 0.8) -> dict:
    """The embedder replicas `target_qps` needs when `text_share` of the requests are texts the
    cache misses, each costing `embed_ms` of one core (a replica runs one model thread), at
    `headroom` of their capacity; and the nodes of their own they fill (configs/cluster.yaml's
    embedding node type)."""
    cores = target_qps * text_share * embed_ms / 1000.0 / headroom
    replicas = max(1, int(np.ceil(cores)))
    return {"embed_ms_per_text": round(embed_ms, 3), "text_share": text_share, "cores": round(cores, 1),
            "replicas": replicas, "nodes": int(np.ceil(replicas / cores_per_node))}


@dataclass
class CapacityPlan:
    """`shardserve plan`'s answer: the model fitted on a layouts record, its check against every
    measured layout, and (for a target QPS) the cheapest layouts that reach it."""

    model: CapacityModel
    record: dict
    fitted: int
    checks: list[tuple[dict, Layout]]
    options: list[dict] = field(default_factory=list)
    vectors: int | None = None
    faiss_ms: float | None = None


def plan_from_record(record_path: str, target_qps: float | None = None, cores_per_node: float = 8,
                     memory_per_node_gb: float = 32, vectors: int | None = None,
                     index_dir: str | None = None, bytes_per_vector: float = 3200,
                     top: int = 5) -> CapacityPlan:
    try:
        with open(record_path) as handle:
            record = json.load(handle)
        measured = [(Layout(lay["shards"], lay["replicas_per_shard"], record["machine"]["cores"],
                            lay["knee"]["qps"], lay["knee"]["p99_ms"]), lay) for lay in record["layouts"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShardserveError(f"{record_path}: not a layouts record ({type(exc).__name__}: {exc})") from None
    fitted = [layout for layout, _ in measured if layout.replicas_per_shard == 1]
    model = fit(fitted)
    rows = check(model, [m for m, _ in measured], {(f.shards, f.replicas_per_shard) for f in fitted})
    result = CapacityPlan(model, record, len(fitted), list(zip(rows, [m for m, _ in measured], strict=True)))
    if not target_qps:
        return result
    base = max((lay for _, lay in measured), key=lambda lay: lay["shards"])
    params = record["load"]["params"]
    result.faiss_ms = faiss_ms_per_query(index_dir, params) if index_dir else None
    nlist = int(base["factory"].split(",")[0].removeprefix("IVF") or 1)
    result.vectors = vectors or base["vectors"]
    cpu_ms = scaled_cpu_ms(model, result.faiss_ms, base["vectors"], result.vectors, nlist,
                           params.get("nprobe", 1))
    index_bytes = (base["index_bytes"] * result.vectors / base["vectors"] if "index_bytes" in base
                   else result.vectors * bytes_per_vector)
    result.options = plan(cpu_ms, target_qps, cores_per_node, index_bytes, memory_per_node_gb)[:top]
    return result
