"""Run by Chroma's own Python (the peer venv's, where `chromadb` is), by loadtests.chroma_suite:
adds batches to a Chroma collection through `chromadb.HttpClient` until killed or failing, and
appends each batch's first and last index to ACKED once the client has seen it succeed.
Standalone on purpose: it imports only chromadb and numpy.

    python loadtests/chroma_writer.py PORT ACKED          # write until killed
    python loadtests/chroma_writer.py check PORT ACKED    # every acknowledged record there, whole,
                                                          # the batch in flight whole or absent
"""

import sys

import chromadb
import numpy as np

BATCH, DIM = 50, 16


def vectors(start: int, stop: int) -> np.ndarray:
    """Record i's embedding, the same in the writer and the checker."""
    rows = [np.random.default_rng(i).normal(size=DIM) for i in range(start, stop)]
    return np.stack(rows).astype(np.float32)


def main(port: int, acked: str) -> None:
    client = chromadb.HttpClient(host="127.0.0.1", port=port)
    collection = client.get_or_create_collection("killed", embedding_function=None)
    start = 0
    with open(acked, "a") as out:
        while True:
            stop = start + BATCH
            collection.add(ids=[f"r{i}" for i in range(start, stop)], embeddings=vectors(start, stop),
                           documents=[f"record {i}" for i in range(start, stop)],
                           metadatas=[{"i": i} for i in range(start, stop)])
            out.write(f"{start} {stop}\n")
            out.flush()
            start = stop


def check(port: int, acked: str) -> None:
    """Every acknowledged record, with its embedding, document and metadata, or exit 1 naming one missing."""
    client = chromadb.HttpClient(host="127.0.0.1", port=port)
    collection = client.get_collection("killed")
    with open(acked) as lines:
        spans = [tuple(map(int, line.split())) for line in lines if line.strip()]
    for start, stop in spans:
        ids = [f"r{i}" for i in range(start, stop)]
        got = collection.get(ids=ids, include=["embeddings", "documents", "metadatas"])
        if sorted(got["ids"]) != sorted(ids):
            sys.exit(f"lost: {sorted(set(ids) - set(got['ids']))[:5]}")
        order = {sid: n for n, sid in enumerate(got["ids"])}
        for i in range(start, stop):
            n = order[f"r{i}"]
            whole = np.allclose(got["embeddings"][n], vectors(i, i + 1)[0])
            if not whole or got["documents"][n] != f"record {i}" or got["metadatas"][n] != {"i": i}:
                sys.exit(f"record r{i} differs")
    # the batch the kill cut off (sent, its answer never seen): one write, so all of it or none
    last = max((stop for _, stop in spans), default=0)
    cut = collection.get(ids=[f"r{i}" for i in range(last, last + BATCH)], include=[])["ids"]
    if len(cut) not in (0, BATCH):
        sys.exit(f"the batch in flight at the kill was half written: {len(cut)} of {BATCH} records")
    count = collection.count()
    if count != last + len(cut):
        sys.exit(f"count {count}: {last} acknowledged, {len(cut)} of the batch in flight")
    print(f"{sum(b - a for a, b in spans)} acknowledged records found whole; the batch in flight at the kill "
          f"{'there whole' if cut else 'absent'}; count {count}")


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check(int(sys.argv[2]), sys.argv[3])
    else:
        main(int(sys.argv[1]), sys.argv[2])
