"""How much of a sharded query's CPU is FAISS itself: in-process, one thread, no serving at all.

Per query, at a few batch sizes: the router's coarse quantizer (once per batch), the shards'
`search_preassigned` scans (every shard, its own shorter lists; also with the batch's rows in
arrival order instead of by lowest list, core.searcher.LIST_ORDER_ROWS), and the unsharded (merged)
index's full search, as the uvicorn baseline runs it. Whatever a served request costs beyond the first two
is serving overhead (HTTP, parsing, the hop, Ray's processes); `make bench` measures that total.

    python -m loadtests.scan_cost --index indexes/fashion-mnist-ivf1024-4 → records/scan-cost.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import faiss
import numpy as np

from core.datasets import load_dataset
from core.indexes import prepare_vectors
from core.searcher import LIST_ORDER_ROWS, CoarseAssigner, load_all_shards
from core.storage import Location
from loadtests.baseline_server import merged_searcher
from loadtests.record import header, save


def cpu_ms_per_query(items: list, queries: int, search: Callable[[object], object], rounds: int = 3) -> float:
    """Process CPU per query for `search` over every item, best of `rounds` (the machine is shared)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for item in items:
            search(item)
        best = min(best, (time.process_time() - start) * 1000.0 / queries)
    return round(best, 4)


def measure(index: str, queries: np.ndarray, k: int, params: dict, batches: list[int]) -> list[dict]:
    faiss.omp_set_num_threads(1)  # as in the router's quantizer thread and every shard replica
    manifest, shards = load_all_shards(index)
    assigner = CoarseAssigner.load(Location.parse(index), manifest)
    if assigner is None:
        raise SystemExit(f"{manifest.index_factory}: not a plain IVF index (no shared quantizer)")
    monolith, _ = merged_searcher(index)
    prepared = prepare_vectors(queries, manifest.metric)
    rows = []
    for batch in batches:
        matrices = [prepared[row:row + batch] for row in range(0, len(prepared), batch)]
        assigned = [assigner.query(matrix, k, params) for matrix in matrices]
        n = len(prepared)
        quantizer = cpu_ms_per_query(matrices, n, lambda m: assigner.query(m, k, params))
        scans = cpu_ms_per_query(assigned, n, lambda q: [shard.answer(q) for shard in shards])
        for shard in shards:  # the same scans with every batch's rows in arrival order
            shard.list_order_rows = batch + 1
        arrival = cpu_ms_per_query(assigned, n, lambda q: [shard.answer(q) for shard in shards])
        for shard in shards:
            shard.list_order_rows = LIST_ORDER_ROWS
        full = cpu_ms_per_query(matrices, n, lambda m: monolith.search(m, k, params, prepared=True))
        rows.append({"batch": batch, "quantizer_ms": quantizer, "shard_scans_ms": scans,
                     "shard_scans_arrival_order_ms": arrival,
                     "sharded_total_ms": round(quantizer + scans, 4), "monolith_ms": full,
                     "sharded_vs_monolith": round((quantizer + scans) / full, 3)})
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
    rows = measure(args.index, queries, args.k, params, [int(b) for b in args.batches.split(",")])
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
