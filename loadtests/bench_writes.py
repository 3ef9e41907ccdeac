"""`make bench-writes`: online writes on the default `shardserve serve`, side by side in one run with a
real peer's server (Chroma's `chroma run`, its own venv: .venv-peer) holding the same 60K x 784
Fashion-MNIST base. Both are driven by the same Python harness over HTTP on loopback:

- batches of 100 upserts, one client: vectors/s (shardserve also with .npy bodies, which the
  peer's API has no form of);
- single upserts from 8 clients: upserts/s and the acknowledgement p50/p99;
- read-your-writes: 500 single upserts, each searched by its own vector on another connection
  right after its 200; 1,000 deletes (batches of 100), each deleted id searched after its 200;
- deletes in batches of 100: ids/s;
- shardserve only: searches/s at 32 clients (vegeta, closed loop) without, then with, an ingest of
  200 single upserts/s beside them, on a fresh server (no automatic compaction within reach); then
  deletes by filter beside the same ingest, each of two points tagged for it.

    python -m loadtests.bench_writes --index indexes/fashion-mnist-ivf1024-4
      -> loadtests/records/bench-writes.json

The index is copied first: the writes go to the copy's log, never to the index given.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import faiss
import httpx
import numpy as np
import orjson

from loadtests.served import Server
from loadtests.vegeta_run import attack, make_targets, write_targets
from shardserve.client import Client
from shardserve.data.dataset import Dataset
from shardserve.data.datasets import load_dataset
from shardserve.errors import ApiError
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from shardserve.runtime.ports import free_port
from shardserve.runtime.procfs import CpuMeter

RECORDS = Path(__file__).parent / "records"
PEER = Path(__file__).resolve().parent.parent / ".venv-peer" / "bin" / "chroma"
NEW_IDS = 1_000_000_000  # written ids start here, far from the base's row numbers
CHROMA = "/api/v2/tenants/default_tenant/databases/default_database/collections"


class Shardserve:
    """The default `shardserve serve` on a copy of the index."""

    name = "shardserve"

    def __init__(self, index: Path, work: Path):
        copy = work / "index"
        work.mkdir(parents=True, exist_ok=True)
        shutil.copytree(index, copy)
        self.server = Server(copy, free_port(), work / "serve.log")
        self.server.wait_healthy()
        self.url = self.server.url

    def upsert(self, http: httpx.Client, ids: list[int], vectors: np.ndarray) -> None:
        body = orjson.dumps({"ids": ids, "vectors": vectors}, option=orjson.OPT_SERIALIZE_NUMPY)
        _ok(http.post(f"{self.url}/v1/upsert", content=body, headers=_JSON))

    def delete(self, http: httpx.Client, ids: list[int]) -> None:
        _ok(http.post(f"{self.url}/v1/delete", content=orjson.dumps({"ids": ids}), headers=_JSON))

    def upsert_npy(self, http: httpx.Client, ids: list[int], vectors: np.ndarray) -> None:
        """The bulk form: the ids then the vectors as .npy arrays in one body (what Client.upsert
        sends without metadata)."""
        body = _npy(np.asarray(ids, np.int64)) + _npy(np.asarray(vectors, np.float32))
        _ok(http.post(f"{self.url}/v1/upsert", content=body, headers={"content-type": "application/x-npy"}))

    def query(self, http: httpx.Client, vector: np.ndarray, k: int) -> list[int]:
        body = orjson.dumps({"vector": vector, "k": k}, option=orjson.OPT_SERIALIZE_NUMPY)
        return orjson.loads(_ok(http.post(f"{self.url}/v1/search", content=body, headers=_JSON)))["ids"]

    def stop(self) -> None:
        self.server.stop()


class Chroma:
    """Chroma's own server (`chroma run`, persistent, on loopback), the base loaded first."""

    name = "chroma"

    def __init__(self, base: np.ndarray, work: Path):
        if not PEER.exists():
            raise SystemExit(f"{PEER} missing: `make peer` installs Chroma in its own venv")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        work.mkdir(parents=True, exist_ok=True)
        self._log = (work / "chroma.log").open("w")
        command = [str(PEER), "run", "--path", str(work / "chroma"), "--host", "127.0.0.1",
                   "--port", str(port)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "ANONYMIZED_TELEMETRY": "False"})
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/api/v2/heartbeat", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"chroma did not start: see {self._log.name}")
            time.sleep(0.3)
        with httpx.Client(timeout=600) as http:
            created = _ok(http.post(f"{self.url}{CHROMA}", json={
                "name": "fashion_mnist", "metadata": {"hnsw:space": "l2"}}))
            self.collection = f"{self.url}{CHROMA}/{orjson.loads(created)['id']}"
            started = time.perf_counter()
            for start in range(0, len(base), 1000):
                self.upsert(http, list(range(start, min(start + 1000, len(base)))), base[start:start + 1000])
            self.load_s = round(time.perf_counter() - started, 1)

    def upsert(self, http: httpx.Client, ids: list[int], vectors: np.ndarray) -> None:
        body = orjson.dumps({"ids": [str(i) for i in ids], "embeddings": vectors},
                            option=orjson.OPT_SERIALIZE_NUMPY)
        _ok(http.post(f"{self.collection}/upsert", content=body, headers=_JSON))

    def delete(self, http: httpx.Client, ids: list[int]) -> None:
        _ok(http.post(f"{self.collection}/delete", content=orjson.dumps({"ids": [str(i) for i in ids]}),
                      headers=_JSON))

    def query(self, http: httpx.Client, vector: np.ndarray, k: int) -> list[int]:
        body = orjson.dumps({"query_embeddings": vector[None], "n_results": k, "include": []},
                            option=orjson.OPT_SERIALIZE_NUMPY)
        found = orjson.loads(_ok(http.post(f"{self.collection}/query", content=body, headers=_JSON)))
        return [int(i) for i in found["ids"][0]]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


_JSON = {"content-type": "application/json"}


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _ok(response: httpx.Response) -> bytes:
    if response.status_code not in (200, 201):
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.content


class Points:
    """New points: base rows plus noise, each id used once."""

    def __init__(self, base: np.ndarray, seed: int, first: int = NEW_IDS):
        self.base, self.rng, self.next = base, np.random.default_rng(seed), first
        self.lock = threading.Lock()

    def take(self, n: int) -> tuple[list[int], np.ndarray]:
        with self.lock:
            ids = list(range(self.next, self.next + n))
            self.next += n
            rows = self.rng.integers(0, len(self.base), n)
            return ids, (self.base[rows] + self.rng.normal(0, 8, (n, self.base.shape[1]))).astype(np.float32)


def _percentiles(ms: list[float]) -> dict[str, float]:
    return {f"p{q}_ms": round(float(np.percentile(ms, q)), 2) for q in (50, 99)}


def batch_upserts(send: Callable, points: Points, batches: int = 40, size: int = 100) -> dict:
    ms: list[float] = []
    with httpx.Client(timeout=120) as http:
        started = time.perf_counter()
        for _ in range(batches):
            ids, vectors = points.take(size)
            t = time.perf_counter()
            send(http, ids, vectors)
            ms.append((time.perf_counter() - t) * 1000)
        elapsed = time.perf_counter() - started
    return {"vectors_per_s": round(batches * size / elapsed, 1), **_percentiles(ms)}


def single_upserts(target, points: Points, clients: int = 8, seconds: float = 20.0) -> dict:
    ms: list[list[float]] = [[] for _ in range(clients)]
    stop = time.perf_counter() + seconds

    def client(who: int) -> None:
        with httpx.Client(timeout=120) as http:
            while time.perf_counter() < stop:
                ids, vectors = points.take(1)
                t = time.perf_counter()
                target.upsert(http, ids, vectors)
                ms[who].append((time.perf_counter() - t) * 1000)
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(who,)) for who in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [m for each in ms for m in each]
    return {"clients": clients, "upserts": len(done),
            "upserts_per_s": round(len(done) / (time.perf_counter() - started), 1), **_percentiles(done)}


def read_your_writes(target, points: Points, upserts: int = 500, deletes: int = 1000) -> dict:
    found = absent = 0
    written: list[tuple[int, np.ndarray]] = []
    with httpx.Client(timeout=120) as writer, httpx.Client(timeout=120) as reader:
        for _ in range(upserts):
            ids, vectors = points.take(1)
            target.upsert(writer, ids, vectors)
            found += ids[0] in target.query(reader, vectors[0], 10)
            written.append((ids[0], vectors[0]))
        extra_ids, extra = points.take(deletes - len(written))
        _in_batches(target.upsert, writer, extra_ids, extra)
        written += list(zip(extra_ids, extra, strict=True))
        started = time.perf_counter()
        for start in range(0, deletes, 100):
            chunk = written[start:start + 100]
            target.delete(writer, [i for i, _ in chunk])
        deletes_s = time.perf_counter() - started
        for id_, vector in written[:deletes]:
            absent += id_ not in target.query(reader, vector, 10)
    return {"upserts_found_at_once": found, "upserts": upserts, "deleted_absent": absent, "deletes": deletes,
            "deletes_per_s": round(deletes / deletes_s, 1)}


def _in_batches(send: Callable, http: httpx.Client, ids: list[int], vectors: np.ndarray) -> None:
    for start in range(0, len(ids), 100):
        send(http, ids[start:start + 100], vectors[start:start + 100])


def _upsert_targets(path: Path, url: str, points: Points, count: int, route: str = "/v1/upsert",
                    npy: bool = False, size: int = 1) -> Path:
    """vegeta targets: `count` upserts of `size` new points each (each id written once), to
    `route`; `npy`: as the client sends points without metadata (the ids, then the vectors, as .npy)."""
    lines = []
    for _ in range(count):
        ids, vectors = points.take(size)
        body, kind = ((_npy(np.asarray(ids, np.int64)) + _npy(vectors), "application/x-npy") if npy else
                      (orjson.dumps({"ids": ids, "vectors": vectors}, option=orjson.OPT_SERIALIZE_NUMPY),
                       "application/json"))
        encoded = base64.b64encode(body).decode()
        lines.append(orjson.dumps({"method": "POST", "url": f"{url}{route}",
                                   "header": {"Content-Type": [kind]}, "body": encoded}))
    return write_targets(path, lines)


INGEST_PAIRS = 5  # quiet/ingesting windows per measure: the ratio is their median


def search_under_ingest(server: Shardserve, queries: np.ndarray, points: Points, work: Path,
                        seconds: float = 10.0, ingest_per_s: float = 200.0,
                        route: str = "/v1/upsert", pairs: int = INGEST_PAIRS, npy: bool = False,
                        size: int = 1) -> dict:
    """Searches/s at 32 clients, quiet, then beside an open loop of `ingest_per_s` single upserts
    (vegeta at that exact rate, new ids, started LEAD_S before the searches and ending after
    them: the searches are measured beside a steady ingest); CPU per search by process class.
    `pairs` such pairs of windows, one after the other: the ratio is the median of each pair's, and
    `quiet`, `ingesting` and `ingest` are the levels of the median pair. Why pairs: on this shared
    2-core machine a level's searches/s drifts by up to ±20 % from one minute to the next
    (loadtests/records/ingest-paired.json), so one quiet window then one ingesting window measured
    the drift as much as the ingest. `route`: where the upserts go (lab.ingest_ab sends them to a
    route the router answers 404: what the same requests cost before any write path); `npy`: the
    upserts as .npy bodies; `size`: points per request (the same upserts/s in fewer requests)."""
    targets = write_targets(work / "targets.jsonl", make_targets(queries, server.url, k=10,
                                                                 params={"nprobe": 16}))
    measured = [_ingest_pair(targets, _upsert_targets(work / "upserts.jsonl", server.url, points,
                                                      int((seconds + 2 * LEAD_S) * ingest_per_s / size),
                                                      route, npy, size),
                             work, seconds, ingest_per_s / size) for _ in range(pairs)]
    median = sorted(measured, key=lambda m: m["qps_ratio"])[(pairs - 1) // 2]
    return {**median, "pairs": [m["qps_ratio"] for m in measured], "seconds_per_window": seconds,
            "bodies": "npy" if npy else "json", "points_per_request": size}


LEAD_S = 3.0  # the ingest starts this long before the searches it is measured beside, ends after them


def _ingest_pair(targets: Path, upserts: Path, work: Path, seconds: float, requests_per_s: float) -> dict:
    """One quiet window of searches, then one beside the upserts at `requests_per_s`."""
    keep = ("requests", "success_ratio", "qps", "p50_ms", "p99_ms", "cpu_ms_per_request")
    quiet = attack(targets, "concurrency", 32, seconds, work, "search-quiet", meter=CpuMeter())
    ingest: dict = {}
    thread = threading.Thread(target=lambda: ingest.update(
        attack(upserts, "rate", requests_per_s, seconds + 2 * LEAD_S, work, "ingest")))
    thread.start()
    time.sleep(LEAD_S)
    busy = attack(targets, "concurrency", 32, seconds, work, "search-ingest", meter=CpuMeter())
    thread.join()
    return {"quiet": {k: quiet.get(k) for k in keep}, "ingesting": {k: busy.get(k) for k in keep},
            "ingest": {k: ingest.get(k) for k in keep[:5]}, "qps_ratio": round(busy["qps"] / quiet["qps"], 3)}


def filter_deletes_under_ingest(server: Shardserve, base: np.ndarray, column: str, points: Points, work: Path,
                                deletes: int = 60, ingest_per_s: float = 200.0) -> dict:
    """Deletes by filter beside an open loop of `ingest_per_s` single upserts (vegeta): each of two
    points upserted with a `column` value of their own, then deleted by that filter. Each must get
    its 200 (the writes landing meanwhile are carried forward, shardserve.writes.roll) and delete
    exactly its two points."""
    seconds = deletes * 0.4 + 10  # the deletes' loop, and room to spare
    upserts = _upsert_targets(work / "filter-upserts.jsonl", server.url, points, int(seconds * ingest_per_s))
    ingest: dict = {}
    thread = threading.Thread(target=lambda: ingest.update(
        attack(upserts, "rate", ingest_per_s, seconds, work, "filter-ingest")))
    thread.start()
    time.sleep(3.0)
    outcomes: dict[str, int] = {}
    ms: list[float] = []
    rng = np.random.default_rng(5)
    with Client(server.url) as client:
        for n in range(deletes):
            tag, first = (1 << 50) + n, 4 * NEW_IDS + 2 * n
            client.upsert([first, first + 1], base[rng.integers(0, len(base), 2)],
                          metadata=[{column: tag}, {column: tag}])
            started = time.perf_counter()
            try:
                outcome = f"200, deleted {client.delete(filter={column: tag})['deleted']}"
            except ApiError as error:
                outcome = f"{error.status}: {str(error)[:80]}"
            ms.append((time.perf_counter() - started) * 1000)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            time.sleep(0.3)
    thread.join()
    return {"deletes": deletes, "outcomes": outcomes, **_percentiles(ms),
            "ingest": {k: ingest.get(k) for k in ("requests", "success_ratio", "qps", "p50_ms", "p99_ms")}}


def churn_recall(server: Shardserve, data: Dataset, index_factory: str, nprobe: int = 16,
                 share: float = 0.1, queries: int = 1000, seed: int = 3) -> dict:
    """recall@10 after churn: `share` of the base rows deleted and as many new rows upserted (real
    rows: Fashion-MNIST's test images not used as queries), against exact ground truth recomputed
    over the live rows; beside a fresh `index_factory` index trained and filled on those live rows
    (in process, same nprobe), and the served index before the churn."""
    k, rng = 10, np.random.default_rng(seed)
    asked, spare = data.queries[:queries], data.queries[queries:]
    count = min(int(share * len(data.base)), len(spare))
    gone = np.sort(rng.choice(len(data.base), count, replace=False))
    new_ids = np.arange(NEW_IDS // 2, NEW_IDS // 2 + count, dtype=np.int64)
    params = {"nprobe": nprobe}
    with Client(server.url, timeout_s=120) as client:
        before = _served(client, asked, k, params)
        for start in range(0, count, 100):
            client.delete(gone[start:start + 100])
            client.upsert(new_ids[start:start + 100], spare[start:start + 100])
        after = _served(client, asked, k, params)
    keep = np.ones(len(data.base), bool)
    keep[gone] = False
    live = np.vstack([data.base[keep], spare[:count]])
    live_ids = np.concatenate([np.flatnonzero(keep), new_ids])
    truth_before = _exact(data.base, np.arange(len(data.base)), asked, k)
    truth = _exact(live, live_ids, asked, k)
    fresh = faiss.IndexIDMap(faiss.index_factory(data.dim, index_factory))
    fresh.train(live)
    fresh.add_with_ids(live, live_ids)
    faiss.extract_index_ivf(fresh).nprobe = nprobe
    fresh_ids = fresh.search(asked, k)[1]
    recall = {"served_before_churn": _recall(before, truth_before),
              "served_after_churn": _recall(after, truth),
              "fresh_index_on_live_rows": _recall(fresh_ids, truth)}
    return {"deleted": count, "added": count, "nprobe": nprobe, "queries": queries, "recall_at_10": recall,
            "after_minus_fresh": round(recall["served_after_churn"] - recall["fresh_index_on_live_rows"], 4),
            "deleted_ids_answered": int(np.isin(after, gone).sum())}


def _served(client: Client, queries: np.ndarray, k: int, params: dict) -> np.ndarray:
    batches = (client.search_batch(queries[start:start + 100], k, params)
               for start in range(0, len(queries), 100))
    return np.vstack([np.stack([hits.ids for hits in batch]) for batch in batches])


def _exact(base: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    flat = faiss.IndexFlatL2(base.shape[1])
    flat.add(base)
    return ids[flat.search(queries, k)[1]]


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = [len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]
    return round(float(np.mean(hits)), 4)


def run(index: Path, work: Path) -> dict:
    manifest = read_manifest(Location.parse(str(index)))
    data = load_dataset(manifest.dataset.name, limit=manifest.num_vectors, **manifest.dataset.columns())
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    shardserve = Shardserve(index, work / "shardserve")
    chroma = None
    try:
        churn = churn_recall(shardserve, data, manifest.index_factory)
        chroma = Chroma(data.base, work / "chroma")
        for name, target in (("shardserve", shardserve), ("chroma", chroma)):
            points = Points(data.base, seed=1)
            results[name] = {"batch_100": batch_upserts(target.upsert, points),
                             "single_8_clients": single_upserts(target, points),
                             **read_your_writes(target, points)}
        chroma.stop()  # idle, but not on the machine beside the next measure
        results["shardserve"]["batch_100_npy"] = batch_upserts(
            shardserve.upsert_npy, Points(data.base, seed=3, first=2 * NEW_IDS))
        results["shardserve"]["churn"] = churn
        # On a fresh server and copy: the writes above (~40,000) bring the automatic compaction
        # (--compact-at 50,000) within reach, and a compaction beside the measure is what
        # `make bench-compact` measures, not this. 2,000 upserts first: a delta on every shard.
        shardserve.stop()
        shardserve = Shardserve(index, work / "shardserve-ingest")
        with httpx.Client(timeout=120) as http:
            _in_batches(shardserve.upsert, http, *Points(data.base, seed=4, first=3 * NEW_IDS).take(2000))
        results["shardserve"]["search_32_clients"] = search_under_ingest(
            shardserve, data.queries[:1000], Points(data.base, seed=2), work / "vegeta")
        tag_column = next((c for c, kind in manifest.dataset.metadata_kinds.items() if kind == "int64"), None)
        if tag_column is not None:
            tagged = Points(data.base, seed=6, first=5 * NEW_IDS)
            results["shardserve"]["filter_deletes_under_ingest"] = filter_deletes_under_ingest(
                shardserve, data.base, tag_column, tagged, work / "vegeta")
    finally:
        shardserve.stop()
        if chroma is not None and chroma.process.poll() is None:
            chroma.stop()
    s, c = results["shardserve"], results["chroma"]
    return {
        "name": "bench-writes", "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "index": manifest.index_version, "peer": "chroma (chroma run, .venv-peer)",
        "peer_load_s": chroma.load_s if chroma else None, "results": results,
        "ratios": {
            "batch_100_vectors_per_s": round(s["batch_100"]["vectors_per_s"]
                                             / c["batch_100"]["vectors_per_s"], 2),
            "single_upserts_per_s": round(s["single_8_clients"]["upserts_per_s"]
                                          / c["single_8_clients"]["upserts_per_s"], 2),
            "single_ack_p99": round(s["single_8_clients"]["p99_ms"] / c["single_8_clients"]["p99_ms"], 3),
            "deletes_per_s": round(s["deletes_per_s"] / c["deletes_per_s"], 2),
            "search_qps_while_ingesting": s["search_32_clients"]["qps_ratio"],
            "churn_recall_after_minus_fresh": s["churn"]["after_minus_fresh"],
        },
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--index", required=True)
    cli.add_argument("--work", default=None, help="work directory (default: a new one in TMPDIR)")
    cli.add_argument("--out", default=str(RECORDS / "bench-writes.json"))
    args = cli.parse_args()
    work = Path(args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-writes-{os.getpid()}")
    record = run(Path(args.index), work)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"ratios": record["ratios"], **record["results"]}, indent=1))


if __name__ == "__main__":
    main()
