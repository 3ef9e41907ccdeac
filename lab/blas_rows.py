"""The router's coarse quantizer per query, FAISS's BLAS path against its per-query kernels, by
batch rows: where shardserve.index.indexes.BLAS_MIN_ROWS comes from. In-process, one thread, no serving.

FAISS picks the path by rows x dim against a process-wide threshold (its default: BLAS from 164
rows at d=784); a router batch at c=32 is 16-25 rows. Both paths must pick the same lists
(answers identical to the unsharded index), so the record also counts rows whose lists differ.

    python -m lab.blas_rows --index indexes/fashion-mnist-ivf1024-4 → records/blas-rows.json
"""

from __future__ import annotations

import argparse

import faiss
import numpy as np

from lab.scan_cost import cpu_ms_per_query
from loadtests.record import header, save
from shardserve.data.datasets import load_dataset
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.indexes import BLAS_MIN_ROWS, flat_search_with_blas_from
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)
BLAS_ALWAYS, BLAS_NEVER = 1, 1 << 30  # rows from which BLAS is used


def lists_differ(assigner: CoarseAssigner, queries: np.ndarray, nprobe: int, rows: int) -> int:
    """Rows of `queries`, searched in batches of `rows`, whose assigned lists (in order) differ
    between the two paths."""
    dim, differ = queries.shape[1], 0
    for start in range(0, len(queries), rows):
        batch = np.ascontiguousarray(queries[start:start + rows])
        flat_search_with_blas_from(BLAS_NEVER, dim)
        _, plain = assigner.quantizer.search(batch, nprobe)
        flat_search_with_blas_from(BLAS_ALWAYS, dim)
        _, blas = assigner.quantizer.search(batch, nprobe)
        differ += int((plain != blas).any(axis=1).sum())
    return differ


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--queries", type=int, default=2000)
    args = cli.parse_args()
    faiss.omp_set_num_threads(1)  # as in the router
    location = Location.parse(args.index)
    manifest = read_manifest(location)
    assigner = CoarseAssigner.load(location, manifest)
    if assigner is None:
        raise SystemExit(f"{args.index}: not a plain IVF index (no coarse quantizer to time)")
    queries = np.ascontiguousarray(load_dataset(args.dataset).queries[:args.queries], np.float32)
    dim, params = queries.shape[1], {"nprobe": args.nprobe}
    rows_out = []
    for rows in ROWS:
        batches = [queries[s:s + rows] for s in range(0, len(queries) - rows + 1, rows)][:max(8, 256 // rows)]
        cost = {}
        for label, from_rows in (("kernels", BLAS_NEVER), ("blas", BLAS_ALWAYS)):
            flat_search_with_blas_from(from_rows, dim)
            cost[label] = cpu_ms_per_query(batches, rows * len(batches),
                                           lambda b: assigner.query(np.ascontiguousarray(b), 10, params), 5)
        rows_out.append({"rows": rows, "kernels_ms_per_query": cost["kernels"],
                         "blas_ms_per_query": cost["blas"],
                         "blas_vs_kernels": round(cost["blas"] / cost["kernels"], 3)})
        print(f"{rows:3d} rows: kernels {cost['kernels'] * 1000:6.1f} us, BLAS {cost['blas'] * 1000:6.1f} us "
              f"per query", flush=True)
    differ = {rows: lists_differ(assigner, queries, args.nprobe, rows) for rows in (BLAS_MIN_ROWS, 14, 32)}
    record = header("blas-rows", tool=None, index={
        "version": manifest.index_version, "factory": manifest.index_factory,
        "nlist": int(assigner.ivf.nlist), "dim": dim, "params": params})
    record.update({"blas_min_rows": BLAS_MIN_ROWS, "faiss": faiss.__version__, "rows": rows_out,
                   "queries_checked": len(queries), "rows_with_other_lists": differ,
                   "not_covered": ["other machines' BLAS libraries and cores (the crossover moves)",
                                   "other dimensions and nlist", "inner-product / cosine indexes"]})
    print(f"rows whose lists differ between the paths: {differ}\nrecord: {save(record)}")


if __name__ == "__main__":
    main()
