"""Filtered search, per plan: the matching rows compared one by one (gathered, flat, BLAS) against
IVF widened to FILTER_WIDEN x nprobe / share lists with the selector in the scan, by selectivity
and batch rows; the unfiltered preassigned path beside them. In-process, one FAISS thread (as a
shard replica runs), every shard of the index in turn (CPU per query = the sum of the shards').

Where EXACT_SHARE comes from, and what the widened scan costs with each shard running the IVF
quantizer itself against taking its lists from the router's ranking (as served; router's
quantizer time included, once per batch).

    python -m lab.filter_plan --index indexes/fashion-mnist-ivf1024-4 → records/filter-plan.json
"""

from __future__ import annotations

import argparse
import time

import faiss
import numpy as np

import shardserve.query.searcher as searcher_module
from loadtests.record import header, save
from shardserve.data.datasets import load_dataset
from shardserve.index.assigner import EXACT_SHARE, load_assigner
from shardserve.index.indexes import prepare_vectors
from shardserve.query.filters import check_filter
from shardserve.query.searcher import load_all_shards
from shardserve.transport.shard_wire import ShardQuery

CLASSES = ([3], [0, 1, 2], [1, 3, 5, 7, 9], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8])
BATCHES = (1, 32)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", required=True)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--reps", type=int, default=100, help="batches timed per cell")
    args = cli.parse_args()
    faiss.omp_set_num_threads(1)
    manifest, searchers = load_all_shards(args.index)
    assigner = load_assigner(args.index)
    wanted = args.reps * max(BATCHES)
    data = load_dataset(manifest.dataset.name, num_queries=wanted)
    queries = prepare_vectors(data.queries, manifest.metric)

    def ms_per_query(make, rows: int) -> float:
        for searcher in searchers:  # warm: gathered vectors, selectors, caches
            searcher.answer(make(queries[:rows]))
        start = time.perf_counter()
        for first in range(0, args.reps * rows, rows):
            query = make(queries[first:first + rows])
            for searcher in searchers:
                searcher.answer(query)
        return round((time.perf_counter() - start) / (args.reps * rows) * 1000, 3)

    cells = []
    plain = {"nprobe": args.nprobe}
    for rows in BATCHES:
        if assigner is not None:
            cells.append({"filter_share": None, "plan": "unfiltered (router's lists)", "batch": rows,
                          "ms_per_query": ms_per_query(lambda m: assigner.query(m, 10, plain), rows)})
    saved = searcher_module.EXACT_SHARE
    try:
        for classes in CLASSES:
            where = check_filter({"label": {"$in": classes}}, manifest.dataset.metadata_kinds)
            share = round(sum(len(s.selected(where)) for s in searchers) / manifest.num_vectors, 3)
            plans = [("exact (gathered)", 1.0, None), ("ivf widened, each shard's quantizer", 0.0, None)]
            if assigner is not None and share >= EXACT_SHARE:
                plans.append(("ivf widened, the router's lists", 0.0, assigner))
            for plan, exact_share, router in plans:
                searcher_module.EXACT_SHARE = exact_share
                for rows in BATCHES:
                    params = {"nprobe": args.nprobe, "filter": where}

                    def make(m: np.ndarray, p: dict = params, a=router) -> ShardQuery:  # noqa: ANN001
                        return a.query(m, 10, p) if a is not None else ShardQuery(m, 10, p)
                    cell = {"filter_share": share, "plan": plan, "batch": rows,
                            "ms_per_query": ms_per_query(make, rows)}
                    print(cell, flush=True)
                    cells.append(cell)
    finally:
        searcher_module.EXACT_SHARE = saved
    record = header("filter-plan", tool=None, index={"version": manifest.index_version,
                                                     "factory": manifest.index_factory,
                                                     "shards": len(manifest.shards)},
                    nprobe=args.nprobe, exact_share_in_use=saved, cells=cells,
                    not_covered=["CPU of one process, shards in turn: no serving, no hop",
                                 "Fashion-MNIST labels only (filters that follow the clusters)"])
    print(save(record, plot_levels=False))


if __name__ == "__main__":
    main()
