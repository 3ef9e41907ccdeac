"""Where the list-by-list scan starts to pay, in the bytes a batch would read again: one shard's IVF
batches scanned query by query (FAISS's order, rows by lowest list) and list by list
(query.list_scan), in-process, one thread, warm page cache, against what the batch reads.

Per batch size and shard: CPU ms per query of each scan, and the batch's byte counts as
query.scan_choice computes them (the bytes its (query, list) pairs read, the bytes of its distinct
lists, the difference: read again query by query). The rule query.scan_choice applies is fitted on
these rows, on the 60K Fashion-MNIST index and on a 4M x 128 one.

    python -m lab.scan_choice --index indexes/fashion-mnist-ivf1024-4 --dataset fashion-mnist
    python -m lab.scan_choice --index DIR_4M --dataset embedding-like --nprobe 32 --name scan-choice-4m
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import faiss
import numpy as np

from lab.scan_cost import cpu_ms_per_query
from loadtests.record import header, save
from shardserve.data.datasets import load_dataset
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.indexes import prepare_vectors
from shardserve.index.manifest import Manifest
from shardserve.index.storage import Location
from shardserve.query.scan_choice import cache_bytes
from shardserve.query.searcher import ShardSearcher, load_all_shards
from shardserve.transport.shard_wire import ShardQuery


def queries_for(dataset: str, dim: int, count: int) -> np.ndarray:
    if dataset == "embedding-like":  # bench_scale's distribution, a seed its base does not use
        from loadtests.bench_scale import embedding_like
        return embedding_like(count, dim, seed=9_999)
    return load_dataset(dataset, num_queries=count).queries


def batched(index: str, queries: np.ndarray, k: int, nprobe: int, batches: list[int]
            ) -> tuple[Manifest, list[ShardSearcher], dict[int, list[ShardQuery]]]:
    """The index's shards (one FAISS thread, as in every replica) and the queries in batches of
    each size, assigned to lists as the router does."""
    faiss.omp_set_num_threads(1)
    manifest, shards = load_all_shards(index)
    assigner = CoarseAssigner.load(Location.parse(index), manifest)
    prepared = prepare_vectors(queries, manifest.metric)
    return manifest, shards, {batch: [assigner.query(prepared[row:row + batch], k, {"nprobe": nprobe})
                                      for row in range(0, len(prepared) - batch + 1, batch)]
                              for batch in batches}


def measure(index: str, queries: np.ndarray, k: int, nprobe: int, batches: list[int],
            rounds: int) -> list[dict]:
    _, shards, by_batch = batched(index, queries, k, nprobe, batches)
    rows = []
    for batch, assigned in by_batch.items():
        n = batch * len(assigned)
        for shard in shards:
            sizes = shard.scan_choice
            assert sizes is not None, f"{shard.name}: not IVF-Flat"
            counted = [sizes.count(query.assign) for query in assigned]
            sizes.forced = False  # query by query, rows by lowest list
            by_query = cpu_ms_per_query(assigned, n, shard.answer, rounds)
            sizes.forced = True  # list by list
            by_list = cpu_ms_per_query(assigned, n, shard.answer, rounds)
            rows.append({"batch": batch, "shard": shard.name, "by_query_ms": by_query, "by_list_ms": by_list,
                         "by_list_vs_by_query": round(by_list / by_query, 3),
                         "pairs": round(float(np.mean([c.pairs for c in counted])), 1),
                         "pair_mb": round(float(np.mean([c.pair_bytes for c in counted])) / 2**20, 2),
                         "distinct_mb": round(float(np.mean([c.distinct_bytes for c in counted])) / 2**20, 2),
                         "read_again_mb": round(float(np.mean([c.read_again for c in counted])) / 2**20, 2),
                         "mean_list_kb": round(sizes.mean_list_bytes / 1024, 1)})
            sizes.forced = None
            rows[-1]["chosen"] = "lists" if all(sizes.by_lists(q.assign) for q in assigned) else (
                "queries" if not any(sizes.by_lists(q.assign) for q in assigned) else "both")
            print(rows[-1], flush=True)
    return rows


def run(doc: str, name: str, batches: str, measure: Callable[..., list[dict]], key: str,
        not_covered: list[str]) -> None:
    """The command line of an in-process scan lab: `measure(index, queries, k, nprobe, batches,
    rounds)`'s rows saved under `key` in a record named `name`."""
    cli = argparse.ArgumentParser(description=doc)
    cli.add_argument("--index", required=True)
    cli.add_argument("--dataset", default="fashion-mnist", help="a dataset name, or embedding-like")
    cli.add_argument("--queries", type=int, default=1024)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--batches", default=batches)
    cli.add_argument("--rounds", type=int, default=2)
    cli.add_argument("--name", default=name)
    args = cli.parse_args()
    manifest, _ = load_all_shards(args.index)
    queries = queries_for(args.dataset, manifest.dim, args.queries)
    rows = measure(args.index, queries, args.k, args.nprobe, [int(b) for b in args.batches.split(",")],
                   args.rounds)
    record = header(args.name, tool=None,
                    index={"version": manifest.index_version, "factory": manifest.index_factory,
                           "vectors": manifest.num_vectors, "shards": len(manifest.shards),
                           "params": {"nprobe": args.nprobe}},
                    queries=len(queries), threads=1, cache_bytes=cache_bytes(),
                    unit="CPU ms per query (process time, best of rounds)", not_covered=not_covered,
                    **{key: rows})
    print(f"record: {save(record)}")


def main() -> None:
    run(__doc__ or "", "scan-choice", "4,8,16,32,64,128,256", measure, "scan_choice",
        ["serving: see bench-scale.json's served comparison"])


if __name__ == "__main__":
    main()
