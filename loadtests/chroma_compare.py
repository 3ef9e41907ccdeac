"""Run by Chroma's own Python (the peer venv's, where `chromadb` is), by loadtests.bench_chroma:
the same `chromadb.HttpClient` code against one server (Chroma's or shardserve's), printing one
JSON line of what it measured. Standalone on purpose: it imports only chromadb and numpy.

    python loadtests/chroma_compare.py PORT DATA_DIR [--clients 8] [--seconds 20]

DATA_DIR holds base.npy (float32, n x d), labels.npy (int, n), queries.npy, query_labels.npy.
1. load: the base added in batches of the server's max_batch_size, each record's label its metadata;
2. identity: 1,000 queries, each filtered to its own label (`where={"label": l}`), n_results 10;
3. query rate: `clients` threads querying (filtered as above) for `seconds`;
4. add rate: `clients` threads adding batches of 10 new records for `seconds`.
"""

import argparse
import json
import threading
import time

import chromadb
import numpy as np


def _rate(clients: int, seconds: float, work) -> dict:
    counts = [0] * clients
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop = time.monotonic() + seconds

    def run(who: int) -> None:
        i = who
        while time.monotonic() < stop:
            started = time.perf_counter()
            work(who, i)
            latencies[who].append((time.perf_counter() - started) * 1000)
            counts[who] += 1
            i += clients

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    every = sorted(x for own in latencies for x in own)
    return {"requests": sum(counts), "per_s": round(sum(counts) / elapsed, 1),
            "p50_ms": round(every[len(every) // 2], 2), "p99_ms": round(every[int(len(every) * 0.99)], 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("data")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--queries", type=int, default=1000)
    args = parser.parse_args()
    base = np.load(f"{args.data}/base.npy")
    labels = np.load(f"{args.data}/labels.npy")
    queries = np.load(f"{args.data}/queries.npy")[:args.queries]
    query_labels = np.load(f"{args.data}/query_labels.npy")[:args.queries]
    client = chromadb.HttpClient(host="127.0.0.1", port=args.port)
    hnsw = {"space": "l2", "ef_search": 1000, "ef_construction": 400, "max_neighbors": 32}
    collection = client.create_collection("fashion", embedding_function=None, configuration={"hnsw": hnsw})
    batch = client.get_max_batch_size()
    started = time.perf_counter()
    for start in range(0, len(base), batch):
        stop = min(start + batch, len(base))
        collection.add(ids=[str(i) for i in range(start, stop)], embeddings=base[start:stop],
                       metadatas=[{"label": int(label)} for label in labels[start:stop]])
    load_s = time.perf_counter() - started
    found = []
    started = time.perf_counter()
    for vector, label in zip(queries, query_labels, strict=True):
        answer = collection.query(query_embeddings=vector[None], n_results=10, where={"label": int(label)},
                                  include=["distances"])
        found.append([int(i) for i in answer["ids"][0]])
    identity_s = time.perf_counter() - started
    clients = [chromadb.HttpClient(host="127.0.0.1", port=args.port) for _ in range(args.clients)]
    collections = [c.get_collection("fashion") for c in clients]

    def query(who: int, i: int) -> None:
        n = i % len(queries)
        collections[who].query(query_embeddings=queries[n][None], n_results=10,
                               where={"label": int(query_labels[n])}, include=["distances"])

    queried = _rate(args.clients, args.seconds, query)
    rng = np.random.default_rng(7)
    extra = rng.normal(size=(10, base.shape[1])).astype(np.float32)

    def add(who: int, i: int) -> None:
        first = 10_000_000 + i * 10
        collections[who].add(ids=[str(first + j) for j in range(10)], embeddings=extra,
                             metadatas=[{"label": 0}] * 10)

    added = _rate(args.clients, args.seconds, add)
    print(json.dumps({"load_s": round(load_s, 1), "records": len(base), "batch": batch,
                      "identity_s": round(identity_s, 1), "ids": found, "query": queried, "add": added,
                      "add_records_per_s": round(added["per_s"] * 10, 1)}))


if __name__ == "__main__":
    main()
