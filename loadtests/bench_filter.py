"""Filtered search on the default `shardserve serve`: recall and queries/s at each selectivity.

python -m loadtests.bench_filter --index DIR [--duration 10]

Starts `shardserve serve DIR` (its own local Ray, the default edge) on a Fashion-MNIST index (its
`label` metadata), then per filter, from none to ~0.1 % of the rows: recall@10 over HTTP against
brute force over the matching rows (`shardserve eval --filter`, 10,000 test queries), and closed
loop at 32 clients for `--duration` seconds. Also, in this process, what choosing a filter's rows
costs each shard: the build's posting lists against a pass over the columns (same rows, checked).
Record: loadtests/records/bench-filter.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from loadtests.record import RECORDS, header, save
from loadtests.shedding import ctrl_c
from loadtests.vegeta_run import attack, make_targets, vegeta, write_targets
from serving.evaluate import evaluate
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest
from shardserve.index.metadata import MetadataTable
from shardserve.index.storage import Location
from shardserve.query.filters import check_filter, matching

PORT = 18490
# (label, filter): one class is 10 % of Fashion-MNIST, ids below 6,000 are a tenth of the rows
FILTERS: list[tuple[str, dict | None]] = [
    ("none", None),
    ("five classes (~50 %)", {"label": {"$in": [1, 3, 5, 7, 9]}}),
    ("one class (10 %)", {"label": 3}),
    ("one class, ids < 6,000 (~1 %)", {"label": 3, "$id": {"$lt": 6000}}),
    ("one class, ids < 600 (~0.1 %)", {"label": 3, "$id": {"$lt": 600}}),
]
GOAL = {"recall": 0.95, "qps_10pct_x_unfiltered": 0.5, "qps_1pct_x_unfiltered": 1.0}


def run(index: str, duration_s: float, work: Path, nprobe: int) -> list[dict]:
    exe = Path(sys.executable).parent / "shardserve"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    server = subprocess.Popen([str(exe), "serve", index, "--port", str(PORT)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    url, params = f"http://127.0.0.1:{PORT}", {"nprobe": nprobe}
    levels = []
    try:
        from deployments.run import wait_until_healthy

        wait_until_healthy(url, timeout_s=240)
        queries = load_dataset("fashion-mnist", num_queries=1000).queries
        for label, where in FILTERS:
            graded = evaluate(index, "fashion-mnist", k=10, params=params, url=url, where=where)
            extra = {"filter": where} if where else None
            lines = make_targets(queries, url, 10, params, extra=extra)
            targets = write_targets(work / "targets.jsonl", lines)
            attack(targets, "concurrency", 8, 2, work, "warm")
            level = attack(targets, "concurrency", 32, duration_s, work, label)
            levels.append({**level, "filter": where, "filter_label": label, "recall": graded["recall"],
                           "matching_rows": graded.get("matching_rows")})
            print(f"{label}: recall {graded['recall']}, {level['qps']} req/s", flush=True)
    finally:
        ctrl_c(server)
    return levels


def selection_cost(index: str, repeats: int = 50) -> list[dict]:
    """Per filter, the median ms (summed over shards) to find its rows with the posting lists and
    with a pass over the columns; the two must select the same rows."""
    location = Location.parse(index)
    manifest = read_manifest(location)
    tables = [MetadataTable.load(location, entry) for entry in manifest.metadata or []]
    if not tables or any(table.postings is None for table in tables):
        raise SystemExit(f"{index}: built without posting lists; rebuild it (shardserve build --force)")
    costs = []
    for label, where in FILTERS[1:]:
        canonical = check_filter(where, manifest.dataset.metadata_kinds)
        per_way = {}
        for way in ("postings", "scan"):
            total = 0.0
            for table in tables:
                postings = table.postings if way == "postings" else None
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    matching(canonical, table.table, table.ids, postings)
                    times.append(time.perf_counter() - start)
                total += float(np.median(times)) * 1000
            per_way[way] = round(total, 4)
        assert all(np.array_equal(matching(canonical, t.table, t.ids, t.postings),
                                  matching(canonical, t.table, t.ids)) for t in tables), label
        costs.append({"filter_label": label, "ms_postings": per_way["postings"], "ms_scan": per_way["scan"]})
        print(f"select {label}: postings {per_way['postings']} ms, scan {per_way['scan']} ms", flush=True)
    return costs


def verdict(levels: list[dict]) -> dict:
    base = levels[0]["qps"]
    by_label = {level["filter_label"]: level for level in levels}
    ten, one = by_label["one class (10 %)"], by_label["one class, ids < 6,000 (~1 %)"]
    checks = {"recall": all(level["recall"] >= GOAL["recall"] for level in levels),
              "all_200": all(level["success_ratio"] == 1.0 for level in levels),
              "qps_10pct": ten["qps"] >= GOAL["qps_10pct_x_unfiltered"] * base,
              "qps_1pct": one["qps"] >= GOAL["qps_1pct_x_unfiltered"] * base}
    return {"checks": checks, "met": all(checks.values()),
            "qps_x_unfiltered": {level["filter_label"]: round(level["qps"] / base, 3) for level in levels}}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", required=True)
    cli.add_argument("--duration", type=float, default=10.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--out", default=str(RECORDS))
    args = cli.parse_args()
    vegeta()  # built, or say what to run before anything starts
    selection = selection_cost(args.index)
    with tempfile.TemporaryDirectory() as work:
        levels = run(args.index, args.duration, Path(work), args.nprobe)
    manifest = read_manifest(Location.parse(args.index))
    index = {"version": manifest.index_version, "factory": manifest.index_factory,
             "shards": len(manifest.shards), "num_vectors": manifest.num_vectors}
    record = header("bench-filter", index=index,
                    goal=GOAL, levels=levels, verdict=verdict(levels), selection=selection,
                    not_covered=["single-vector queries", "IVF-Flat only (tests grade HNSW and IVF-PQ)",
                                 "vegeta shares the 2 cores with the server",
                                 "glove-50: make bench-glove (bench-glove.json, filtered)"])
    print(record["verdict"])
    print(save(record, Path(args.out), plot_levels=False))


if __name__ == "__main__":
    main()
