"""Compaction under load: the default `shardserve serve` answers an open loop of searches (vegeta) and
a steady stream of single upserts while `shardserve compact` folds the write log into a new version
and `shardserve swap` moves the running server onto it, recall gate included.

It checks what a user relies on: every search and every upsert answered 200 throughout, every
acknowledged upsert found by its own vector afterwards, and the served version the compacted one
(its `log_position` in GET /v1/index). Once the upserts stop, a second compaction and swap leave
the served version holding every write (an empty delta); the router's and the shard replicas'
resident memory is sampled after `warm_s` of searches alone (before the first write), at the
writes' peak and after that last swap, once the router has let go of the replaced version
(`settle_s`), still under searches.

    python -m loadtests.compact_under_load --index indexes/fashion-mnist-ivf1024-4
      -> loadtests/records/compact-under-load.json

tests/test_writes_served.py runs a small one. The index is copied first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

from loadtests.served import Server
from loadtests.vegeta_run import attack, make_targets, write_targets
from shardserve.data.dataset import Dataset
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import Manifest, read_manifest
from shardserve.index.storage import Location
from shardserve.runtime.ports import free_port
from shardserve.runtime.procfs import classified_pids, memory_mb

RECORDS = Path(__file__).parent / "records"
EXE = Path(sys.executable).parent / "shardserve"
NEW_IDS = 2_000_000_000


class Upserts:
    """Single upserts at a steady rate, one client: each answer's status, and the acknowledged points."""

    def __init__(self, url: str, base: np.ndarray, per_s: float):
        self.url, self.base, self.per_s = url, base, per_s
        self.statuses: dict[int, int] = {}
        self.acked: dict[int, np.ndarray] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.rng = np.random.default_rng(5)

    def _run(self) -> None:
        sent, start = 0, time.perf_counter()
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                id_ = NEW_IDS + sent
                vector = (self.base[self.rng.integers(len(self.base))]
                          + self.rng.normal(0, 8, self.base.shape[1])).astype(np.float32)
                body = orjson.dumps({"ids": [id_], "vectors": vector[None]},
                                    option=orjson.OPT_SERIALIZE_NUMPY)
                try:
                    status = http.post(f"{self.url}/v1/upsert", content=body,
                                       headers={"content-type": "application/json"}).status_code
                except httpx.HTTPError as exc:
                    status = -1
                    print(f"upsert {id_}: {exc!r}", file=sys.stderr)
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if status == 200:
                    self.acked[id_] = vector
                sent += 1
                ahead = sent / self.per_s - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)


def _ray_address(log: Path, timeout_s: float = 60) -> str:
    """The serve command's own Ray address, as it prints it for `shardserve swap --address`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"its own, at (\S+) \(for", log.read_text() if log.exists() else "")
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise RuntimeError(f"no Ray address in {log}")


def _cli(*args: str, log: Path) -> dict:
    started = time.perf_counter()
    with log.open("a") as sink:
        done = subprocess.run([str(EXE), *args], stdout=subprocess.PIPE, stderr=sink, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"shardserve {' '.join(args)} failed ({done.returncode}): see {log}")
    return {"command": f"shardserve {args[0]}", "seconds": round(time.perf_counter() - started, 1),
            "said": done.stdout.strip()}


def memory_by_class() -> dict[str, dict[str, float]]:
    """Resident memory (anon: the process's own, not the shared mapped index) of the router and of
    each shard replica now: the largest process of each class and their sum."""
    found: dict[str, list[float]] = {}
    for pid, name in classified_pids().items():
        if name in ("router", "shards"):
            anon = memory_mb(pid).get("rss_anon_mb")
            if anon is not None:
                found.setdefault(name, []).append(anon)
    return {name: {"processes": len(mb), "largest_anon_mb": max(mb), "sum_anon_mb": round(sum(mb), 1)}
            for name, mb in sorted(found.items())}


def start_on_copy(index: Path, work: Path, num_cpus: int, flags: tuple[str, ...] = ()
                  ) -> tuple[Manifest, Dataset, Path, Server]:
    """The index's manifest, its data (1,000 queries), a copy of it in `work`, and the default
    `shardserve serve` starting on the copy with `num_cpus` logical CPUs: a swap runs the new
    version beside the old until the switch, and Ray must count room for both (its default counts
    the machine's cores, which one version of 4 shards fills on two)."""
    manifest = read_manifest(Location.parse(str(index)))
    data = load_dataset(manifest.dataset.name, limit=manifest.num_vectors, num_queries=1000,
                        **manifest.dataset.columns())
    work.mkdir(parents=True, exist_ok=True)
    copy = work / "index"
    shutil.copytree(index, copy)
    return manifest, data, copy, Server(copy, free_port(), work / "serve.log",
                                        ("--num-cpus", str(num_cpus), *flags))


def run(index: Path, work: Path, searches_per_s: float = 150, upserts_per_s: float = 50,
        seconds: float = 200, compact_after_s: float = 30, upserts_stop_s: float = 100,
        warm_s: float = 10, settle_s: float = 75, num_cpus: int = 4) -> dict:
    manifest, data, copy, server = start_on_copy(index, work, num_cpus)
    steps: list[dict] = []
    memory: dict[str, dict] = {}
    try:
        server.wait_healthy()
        address = _ray_address(work / "serve.log")
        targets = write_targets(work / "targets.jsonl", make_targets(data.queries, server.url, k=10,
                                                                     params={"nprobe": 16}))
        searches: dict = {}
        load = threading.Thread(target=lambda: searches.update(attack(
            targets, "rate", searches_per_s, seconds, work, "searches")))
        upserts = Upserts(server.url, data.base, upserts_per_s)
        started = time.monotonic()
        load.start()
        time.sleep(warm_s)  # searches alone first: the processes' memory as serving has it
        memory["before_writes"] = memory_by_class()
        upserts.thread.start()
        time.sleep(compact_after_s)  # writes pile up in the log first
        steps.append(_cli("compact", str(copy), log=work / "cli.log"))
        steps.append(_cli("swap", str(copy), "--address", address, log=work / "cli.log"))
        time.sleep(max(0.0, upserts_stop_s - (time.monotonic() - started)))
        memory["writes_peak"] = memory_by_class()  # the delta since the first compaction, at its largest
        upserts.stop.set()
        upserts.thread.join(timeout=60)
        steps.append(_cli("compact", str(copy), log=work / "cli.log"))  # every write, under searches
        steps.append(_cli("swap", str(copy), "--address", address, log=work / "cli.log"))
        time.sleep(settle_s)  # the router drains the replaced version for 60 s, then hands its memory back
        memory["after_last_swap"] = memory_by_class()
        load.join()
        with httpx.Client(timeout=120) as http:
            served = http.get(f"{server.url}/v1/index").json()
            acked = list(upserts.acked.items())
            lost = []
            for start in range(0, len(acked), 256):
                chunk = acked[start:start + 256]
                vectors = np.stack([v for _, v in chunk])
                body = orjson.dumps({"vectors": vectors, "k": 10, "require_full": True},
                                    option=orjson.OPT_SERIALIZE_NUMPY)
                answer = http.post(f"{server.url}/v1/search", content=body,
                                   headers={"content-type": "application/json"}).json()
                lost += [id_ for (id_, _), hits in zip(chunk, answer["results"], strict=True)
                         if id_ not in hits["ids"]]
    finally:
        server.stop()
    compacted = read_manifest(Location.parse(str(copy)))
    return {
        "name": "compact-under-load", "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "index": manifest.index_version, "compacted_version": compacted.index_version,
        "searches_per_s": searches_per_s, "upserts_per_s": upserts_per_s, "seconds": seconds,
        "serve_flags": f"--num-cpus {num_cpus}", "steps": steps, "searches": {k: searches.get(k) for k in (
            "requests", "success_ratio", "status_codes", "p50_ms", "p99_ms", "max_ms")},
        "upserts": {"statuses": {str(k): v for k, v in upserts.statuses.items()}, "acked": len(acked),
                    "lost": lost},
        "served_after": {"index_version": served["index_version"], "log_position": served["log_position"],
                         "num_vectors": served.get("num_vectors")},
        "compacted_log_position": compacted.log_position, "memory": memory,
        "memory_after_vs_before": {name: round(memory["after_last_swap"][name]["largest_anon_mb"]
                                               / memory["before_writes"][name]["largest_anon_mb"], 3)
                                   for name in memory["before_writes"] if name in memory["after_last_swap"]},
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--index", required=True)
    cli.add_argument("--seconds", type=float, default=200)
    cli.add_argument("--out", default=str(RECORDS / "compact-under-load.json"))
    args = cli.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"compact-under-load-{os.getpid()}"
    record = run(Path(args.index), work, seconds=args.seconds)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
