"""`make bench-grow`: a collection crosses its growth threshold under load, a committed record
(loadtests/records/grow-under-load.json).

One `shardserve serve` started as users start it (on a small index of its own). A collection is
created (`--index`, `--shards`, `--grow-at`) and given `--prefill` points below its threshold; its
exact answers are checked at rest (recall@10 1.0 against brute force). Then, for `--duration`
seconds, vegeta searches it at `--search-rate` (open loop, in 10 s segments, each a level of the
record with the collection's stage at its start and end) while a writer upserts one new point at
a time at `--write-rate`, recording each 200. The server's folder builds the collection as its
index once it holds `--grow-at` points and the router replicas move to it. At the end: every
status, every acknowledged write found with its vector, and recall@10 of the built collection
against brute force over every point.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from index_build.job import build_index
from loadtests.record import new_record, save
from loadtests.served import Server
from loadtests.vegeta_run import attack, make_targets, vegeta, write_targets
from shardserve.client import Client
from shardserve.runtime.ports import free_port

NAME = "growing"
SEGMENT_S = 10.0
TARGETS = {"every_search_200": ("==", 1.0), "acknowledged_writes_found": ("==", 1.0),
           "recall_at_10_exact_stage": ("==", 1.0), "recall_at_10_built": (">=", 0.99)}


def _recall(collection: Client, ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray) -> float:
    hits = 0
    for query in queries:
        truth = ids[np.argsort(((vectors - query) ** 2).sum(1), kind="stable")[:10]]
        hits += len(set(collection.search(query, k=10).ids) & set(truth.tolist()))
    return hits / (10 * len(queries))


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--dataset", default="fashion-mnist", help="real vectors: prefill, writes and queries")
    cli.add_argument("--index", default="IVF64,Flat")
    cli.add_argument("--shards", type=int, default=2)
    cli.add_argument("--grow-at", type=int, default=10_000)
    cli.add_argument("--prefill", type=int, default=9_000)
    cli.add_argument("--search-rate", type=float, default=150.0)
    cli.add_argument("--write-rate", type=float, default=50.0)
    cli.add_argument("--duration", type=float, default=120.0)
    cli.add_argument("--name", default="grow-under-load")
    args = cli.parse_args()
    vegeta()
    from shardserve.data.datasets import load_dataset

    data = load_dataset(args.dataset)
    dim = data.dim
    with tempfile.TemporaryDirectory(prefix="grow-") as tmp:
        work = Path(tmp)
        index = work / "idx"  # the index the server serves beside the collection: small, its own
        build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
        server = Server(index, free_port(), log=work / "serve.log", flags=("--num-cpus", "2"))
        points: dict[int, np.ndarray] = {}
        failed_writes: list[str] = []
        stages: list[tuple[float, str]] = []
        stop = threading.Event()
        try:
            server.wait_said("Ctrl-C stops it.", 0)
            with Client(server.url, timeout_s=60) as client:
                collection = client.create_collection(NAME, dim, index=args.index, shards=args.shards,
                                                      grow_at=args.grow_at)
                prefill = np.ascontiguousarray(data.base[:args.prefill], np.float32)
                for start in range(0, args.prefill, 1000):
                    collection.upsert(list(range(start, min(start + 1000, args.prefill))),
                                      prefill[start:start + 1000])
                points.update(enumerate(prefill))
                queries = np.ascontiguousarray(data.queries[:200], np.float32)
                writes = np.ascontiguousarray(data.base[args.prefill:], np.float32)
                exact_recall = _recall(collection, np.arange(args.prefill), prefill, queries[:50])
                stage_before = collection.index()["stage"]

                def write() -> None:
                    with Client(server.url, timeout_s=10) as writer:
                        target, n, next_at = writer.collection(NAME), args.prefill, time.monotonic()
                        while not stop.is_set():
                            next_at += 1.0 / args.write_rate
                            time.sleep(max(0.0, next_at - time.monotonic()))
                            vector = writes[n - args.prefill:n - args.prefill + 1]
                            try:
                                target.upsert([n], vector)
                            except Exception as exc:  # noqa: BLE001 (counted: the record says what failed)
                                failed_writes.append(str(exc)[:200])
                                continue
                            points[n] = vector[0]
                            n += 1

                def watch() -> None:
                    with Client(server.url, timeout_s=10) as watcher:
                        target, last = watcher.collection(NAME), None
                        while not stop.wait(0.5):
                            try:
                                stage = target.index()["stage"]
                            except Exception:  # noqa: BLE001 (a 503 under load: asked again)
                                continue
                            if stage != last:
                                stages.append((time.time(), stage))
                                last = stage

                threads = [threading.Thread(target=write), threading.Thread(target=watch)]
                for thread in threads:
                    thread.start()
                targets = write_targets(work / "search.jsonl", make_targets(
                    queries, server.url, 10, route=f"/v1/collections/{NAME}/search", count=200))
                levels, started = [], time.time()
                for segment in range(int(args.duration // SEGMENT_S)):
                    at_start = stages[-1][1] if stages else stage_before
                    level = attack(targets, "rate", args.search_rate, SEGMENT_S, work, f"segment-{segment}")
                    level.update(stage_at_start=at_start, stage_at_end=stages[-1][1] if stages else at_start,
                                 points_acknowledged=len(points))
                    levels.append(level)
                    shown = ("label", "requests", "status_codes", "p99_ms", "stage_at_start", "stage_at_end",
                             "points_acknowledged")
                    print({k: level[k] for k in shown}, flush=True)
                stop.set()
                for thread in threads:
                    thread.join(timeout=60)
                described = collection.index()
                ids = np.array(sorted(points))
                found: dict[int, np.ndarray] = {}
                for start in range(0, len(ids), 1000):
                    for point in collection.get(ids[start:start + 1000].tolist(), include=[], vectors=True):
                        if point.vector is not None:
                            found[point.id] = point.vector
                kept = sum(1 for i in ids.tolist()
                           if i in found and bool(np.array_equal(found[i], points[i])))
                matrix = np.stack([points[i] for i in ids.tolist()])
                built_recall = _recall(collection, ids, matrix, queries)
        finally:
            stop.set()
            server.stop()
        folds = [line for line in (work / "serve.log").read_text().splitlines() if "collection" in line
                 and ("grown" in line or "compacted" in line or "fold failed" in line)]
    searches = sum(level["requests"] for level in levels)
    ok = sum(level["status_codes"].get("200", 0) for level in levels)
    swapped_at = next((t - started for t, stage in stages if stage == "built"), None)
    values = {"every_search_200": ok / max(searches, 1), "acknowledged_writes_found": kept / len(ids),
              "recall_at_10_exact_stage": exact_recall, "recall_at_10_built": built_recall}
    checks = {name: {"value": round(values[name], 4), "target": f"{op} {bound}",
                     "met": values[name] == bound if op == "==" else values[name] >= bound}
              for name, (op, bound) in TARGETS.items()}
    record = new_record(args.name, levels, {"collection": NAME, "dataset": args.dataset, "dim": dim,
                                            "index": args.index,
                                            "shards": args.shards, "grow_at": args.grow_at,
                                            "prefill": args.prefill, "metric": "l2"},
                        load={"search_rate": args.search_rate, "write_rate": args.write_rate,
                              "duration_s": args.duration, "segment_s": SEGMENT_S},
                        headline={"searches": searches, "searches_200": ok, "writes_acknowledged":
                                  len(ids) - args.prefill, "writes_failed": len(failed_writes),
                                  "failed_examples": failed_writes[:3], "built_s_into_load": None
                                  if swapped_at is None else round(swapped_at, 1),
                                  "stage_at_end": described["stage"], "built_as": described.get("built_as"),
                                  "search_params": described.get("search_params"),
                                  "count_at_end": described["count"], "server_said": folds},
                        ratios=checks)
    path = save(record)
    print({name: check["met"] for name, check in checks.items()}, f"built {swapped_at} s into the load")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
