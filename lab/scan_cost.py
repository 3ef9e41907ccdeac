"""How much of a sharded query's CPU is FAISS itself: in-process, one thread, no serving at all.

Per query, at a few batch sizes: the router's coarse quantizer (once per batch, on BLAS from
BLAS_MIN_ROWS rows as the router runs it), then the shards' `search_preassigned` scans, with the
shards dealt as the index was built (whole IVF lists per shard, index.partition) and, for comparison,
the same vectors dealt by row (i mod S, every shard a piece of every list; built here in memory from
the same trained index); the lists-dealt scans query by query (FAISS's own order, rows by lowest
list: query.searcher.LIST_ORDER_ROWS) instead of list by list (query.list_scan, where
query.scan_choice picks it), and with the rows in arrival order too; and the unsharded (merged)
index, both its scan of the same assigned lists and its full search as the uvicorn baseline runs
it. Whatever a served request costs beyond quantizer + scans is serving overhead (HTTP, parsing,
the hop, Ray's processes); `make bench` measures that total.

    python -m lab.scan_cost --index indexes/fashion-mnist-ivf1024-4 → records/scan-cost.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import faiss
import numpy as np

from index_build.job import rows_per_shard
from loadtests.baseline_server import merged_searcher
from loadtests.record import header, save
from shardserve.data.datasets import load_dataset
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.indexes import BLAS_MIN_ROWS, add_to_copy, flat_search_with_blas_from, prepare_vectors
from shardserve.index.manifest import read_shard_checked
from shardserve.index.partition import BY_LISTS, Partition
from shardserve.index.storage import Location
from shardserve.query.searcher import LIST_ORDER_ROWS, ShardSearcher, load_all_shards


def cpu_ms_per_query(items: list, queries: int, search: Callable[[object], object], rounds: int = 3) -> float:
    """Process CPU per query for `search` over every item, best of `rounds` (the machine is shared)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for item in items:
            search(item)
        best = min(best, (time.process_time() - start) * 1000.0 / queries)
    return round(best, 4)


def measure(index: str, dataset: str, queries: np.ndarray, k: int, params: dict,
            batches: list[int]) -> list[dict]:
    faiss.omp_set_num_threads(1)  # as in the router's quantizer thread and every shard replica
    manifest, shards = load_all_shards(index)
    if manifest.build.params.get("partition", {}).get("kind") != BY_LISTS:
        raise SystemExit(f"{index}: not dealt by IVF list (built before index.partition, or not plain IVF)")
    location = Location.parse(index)
    assigner = CoarseAssigner.load(location, manifest)
    empty = read_shard_checked(location, manifest.trained)
    data = load_dataset(dataset, limit=manifest.num_vectors)
    if data.fingerprint() != manifest.dataset.fingerprint:
        raise SystemExit(f"{dataset} is not the data {index} was built from")
    base = prepare_vectors(data.base, manifest.metric)
    by_rows = [ShardSearcher(add_to_copy(empty, base[rows], data.index_ids()[rows]), manifest.metric, f"r{s}",
                             manifest.index_version)
               for s, rows in enumerate(rows_per_shard(Partition(len(shards)), empty, base))]
    monolith, _ = merged_searcher(index)
    prepared = prepare_vectors(queries, manifest.metric)
    rows = []
    for batch in batches:
        matrices = [prepared[row:row + batch] for row in range(0, len(prepared), batch)]
        assigned = [assigner.query(matrix, k, params) for matrix in matrices]
        n = len(prepared)
        faiss_default = faiss.cvar.distance_compute_blas_threshold
        flat_search_with_blas_from(BLAS_MIN_ROWS, prepared.shape[1])  # as the router sets it
        quantizer = cpu_ms_per_query(matrices, n, lambda m: assigner.query(m, k, params))
        faiss.cvar.distance_compute_blas_threshold = faiss_default  # the baseline keeps FAISS's
        scans = cpu_ms_per_query(assigned, n, lambda q: [shard.answer(q) for shard in shards])
        rows_scans = cpu_ms_per_query(assigned, n, lambda q: [shard.answer(q) for shard in by_rows])
        for shard in shards:  # the same scans query by query (FAISS's order), rows by lowest list
            if shard.scan_choice is not None:
                shard.scan_choice.forced = False
        query_major = cpu_ms_per_query(assigned, n, lambda q: [shard.answer(q) for shard in shards])
        for shard in shards:  # ... and rows in arrival order
            shard.list_order_rows = batch + 1
        arrival = cpu_ms_per_query(assigned, n, lambda q: [shard.answer(q) for shard in shards])
        for shard in shards:
            shard.list_order_rows = LIST_ORDER_ROWS
            if shard.scan_choice is not None:
                shard.scan_choice.forced = None
        unsharded_scan = cpu_ms_per_query(assigned, n, monolith.answer)
        full = cpu_ms_per_query(matrices, n, lambda m: monolith.search(m, k, params, prepared=True))
        rows.append({"batch": batch, "quantizer_ms": quantizer, "shard_scans_ms": scans,
                     "shard_scans_by_rows_ms": rows_scans, "shard_scans_query_major_ms": query_major,
                     "shard_scans_arrival_order_ms": arrival, "unsharded_scan_ms": unsharded_scan,
                     "sharded_total_ms": round(quantizer + scans, 4), "monolith_ms": full,
                     "sharded_vs_monolith": round((quantizer + scans) / full, 3),
                     "scans_vs_unsharded_scan": round(scans / unsharded_scan, 3),
                     "by_rows_vs_unsharded_scan": round(rows_scans / unsharded_scan, 3)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--queries", type=int, default=2000)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--batches", default="1,8,32,256")
    cli.add_argument("--name", default="scan-cost")
    args = cli.parse_args()
    queries = load_dataset(args.dataset, num_queries=args.queries).queries
    params = {"nprobe": args.nprobe}
    rows = measure(args.index, args.dataset, queries, args.k, params,
                   [int(b) for b in args.batches.split(",")])
    manifest, _ = load_all_shards(args.index)
    record = header(args.name, tool=None,
                    index={"version": manifest.index_version, "factory": manifest.index_factory,
                           "shards": len(manifest.shards), "replicas": 0, "params": params},
                    queries=len(queries), threads=1, unit="CPU ms per query (process time, best of 3)",
                    scan_cost=rows,
                    not_covered=["serving (HTTP, parsing, the hop): see bench.json",
                                 "indexes other than this one: the shard tax depends on list length"])
    print(f"record: {save(record)}")


if __name__ == "__main__":
    main()
