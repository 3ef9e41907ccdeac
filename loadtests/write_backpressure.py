"""Write backpressure: upserts faster than anything folds them in, on the default `shardserve serve`,
while an open loop of searches runs beside them.

Until compaction folds them into a new version, upserts live in the shard replicas' deltas
(memory). The router refuses an upsert that would take the log's backlog past one delta's bound
(`max_write_backlog` in GET /v1/index) with a 503 and Retry-After. This fills the backlog from
several clients sending batches of 100 as fast as they are answered, keeps sending for a while once
refused, then runs `shardserve compact` and `shardserve swap` and checks that upserts are taken
again. It records:

- the upserts acknowledged (exactly the bound, never more) and the 503s: how many, how fast;
- the searches' p99 quiet, while the backlog fills, while writes are refused;
- the router's and the largest shard replica's resident memory: before, full, after the swap;
- every acknowledged upsert found afterwards (a sample, by its own vector).

    python -m loadtests.write_backpressure --index indexes/fashion-mnist-ivf1024-4
      -> loadtests/records/write-backpressure.json

The index is copied first. The server runs with `--compact-at 0`: this measures the bound itself,
what protects memory when writes outrun compaction (by default `shardserve serve` compacts on its
own once 50,000 operations wait, and would fold part of this flood in between).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

from loadtests.compact_under_load import _cli, _ray_address, memory_by_class, start_on_copy
from loadtests.vegeta_run import attack, make_targets, write_targets

RECORDS = Path(__file__).parent / "records"
NEW_IDS = 3_000_000_000
_JSON = {"content-type": "application/json"}


class Writers:
    """`clients` threads, each sending batches of 100 new points as fast as they are answered until
    `stop`; every answer's status and time, and the acknowledged ids with a vector of each batch."""

    def __init__(self, url: str, base: np.ndarray, clients: int, batch: int = 100):
        self.url, self.base, self.batch = url, base, batch
        self.answers: list[tuple[float, int, float]] = []  # (when, status, ms)
        self.acked: list[tuple[int, np.ndarray]] = []  # one (id, vector) per acknowledged batch
        self.acked_points = 0
        self.retry_after: set[str] = set()
        self.stop = threading.Event()
        self._next, self._lock = NEW_IDS, threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(seed,), daemon=True)
                        for seed in range(clients)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                with self._lock:
                    first, self._next = self._next, self._next + self.batch
                ids = list(range(first, first + self.batch))
                vectors = (self.base[rng.integers(0, len(self.base), self.batch)]
                           + rng.normal(0, 8, (self.batch, self.base.shape[1]))).astype(np.float32)
                body = orjson.dumps({"ids": ids, "vectors": vectors}, option=orjson.OPT_SERIALIZE_NUMPY)
                sent = time.perf_counter()
                answer = http.post(f"{self.url}/v1/upsert", content=body, headers=_JSON)
                ms = (time.perf_counter() - sent) * 1000
                with self._lock:
                    self.answers.append((time.monotonic(), answer.status_code, ms))
                    if answer.status_code == 200:
                        self.acked.append((ids[0], vectors[0]))
                        self.acked_points += self.batch
                    elif answer.status_code == 503:
                        self.retry_after.add(answer.headers.get("retry-after", ""))
                if answer.status_code == 503:
                    time.sleep(0.05)  # a client honouring backpressure a little; still faster than folding


class Searches:
    """An open loop of searches in consecutive `step_s` vegeta levels until `stop`, each level tagged
    with the phase current when it started."""

    def __init__(self, targets: Path, per_s: float, work: Path, step_s: float = 5.0):
        self.targets, self.per_s, self.work, self.step_s = targets, per_s, work, step_s
        self.phase, self.levels = "filling", list[tuple[str, dict]]()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            phase = self.phase
            level = attack(self.targets, "rate", self.per_s, self.step_s, self.work,
                           f"searches-{len(self.levels)}", timeout_s=30)
            self.levels.append((phase, level))

    def by_phase(self) -> dict[str, dict]:
        """Per phase: requests and status codes summed, the worst level's p99 and max."""
        phases: dict[str, dict] = {}
        for phase, level in self.levels:
            into = phases.setdefault(phase, {"requests": 0, "status_codes": {}, "worst_p99_ms": 0.0,
                                             "max_ms": 0.0, "levels": 0})
            into["requests"] += level["requests"]
            into["levels"] += 1
            for code, count in (level.get("status_codes") or {}).items():
                into["status_codes"][code] = into["status_codes"].get(code, 0) + count
            into["worst_p99_ms"] = max(into["worst_p99_ms"], level["p99_ms"])
            into["max_ms"] = max(into["max_ms"], level["max_ms"])
        return phases


def _percentiles(ms: list[float]) -> dict:
    if not ms:
        return {"count": 0}
    return {"count": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(max(ms), 2)}


def _found(url: str, acked: list[tuple[int, np.ndarray]]) -> tuple[int, int]:
    """(sampled, lost): up to ~500 acknowledged batches, each searched by one of its vectors."""
    sample, lost = acked[:: max(1, len(acked) // 500)], 0
    with httpx.Client(timeout=60) as http:
        for start in range(0, len(sample), 100):
            chunk = sample[start:start + 100]
            body = orjson.dumps({"vectors": np.stack([v for _, v in chunk]), "k": 10, "require_full": True},
                                option=orjson.OPT_SERIALIZE_NUMPY)
            found = http.post(f"{url}/v1/search", content=body, headers=_JSON).json()["results"]
            lost += sum(id_ not in hits["ids"] for (id_, _), hits in zip(chunk, found, strict=True))
    return len(sample), lost


def run(index: Path, work: Path, searches_per_s: float = 100, clients: int = 4, refused_s: float = 20,
        quiet_s: float = 20, num_cpus: int = 4) -> dict:
    manifest, data, copy, server = start_on_copy(index, work, num_cpus, ("--compact-at", "0"))
    memory: dict[str, dict] = {}
    steps: list[dict] = []
    searches = None
    try:
        server.wait_healthy()
        address = _ray_address(work / "serve.log")
        bound = httpx.get(f"{server.url}/v1/index", timeout=30).json()["max_write_backlog"]
        targets = write_targets(work / "targets.jsonl", make_targets(data.queries, server.url, k=10,
                                                                     params={"nprobe": 16}))
        searches = Searches(targets, searches_per_s, work)
        searches.phase = "quiet"
        searches.thread.start()
        time.sleep(quiet_s)
        memory["before"] = memory_by_class()
        writers = Writers(server.url, data.base, clients)
        searches.phase = "filling"
        started = time.monotonic()
        writers.start()
        while not any(status == 503 for _, status, _ in list(writers.answers)):
            if time.monotonic() - started > 900:
                raise RuntimeError("the write backlog never filled")
            time.sleep(0.2)
        full_at = time.monotonic()
        searches.phase = "refusing"
        time.sleep(refused_s)
        memory["full"] = memory_by_class()
        writers.join()
        refused_until = time.monotonic()
        searches.phase = "compact_and_swap"
        steps.append(_cli("compact", str(copy), log=work / "cli.log"))
        steps.append(_cli("swap", str(copy), "--address", address, log=work / "cli.log"))
        searches.phase = "after"
        with httpx.Client(timeout=60) as http:
            ids = list(range(NEW_IDS - 200, NEW_IDS - 100))  # below the writers' ids: new points
            body = orjson.dumps({"ids": ids, "vectors": data.base[:100] + 1.0},
                                option=orjson.OPT_SERIALIZE_NUMPY)
            after = http.post(f"{server.url}/v1/upsert", headers=_JSON, content=body).status_code
        sampled, lost = _found(server.url, writers.acked)
        time.sleep(5)
        memory["after_swap"] = memory_by_class()
    finally:
        if searches is not None:
            searches.stop.set()
            searches.thread.join(timeout=120)
        server.stop()
    answers = writers.answers
    return {
        "name": "write-backpressure", "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "index": manifest.index_version, "serve_flags": f"--num-cpus {num_cpus} --compact-at 0",
        "bound_upserts": bound,
        "writers": {"clients": clients, "batch": 100, "seconds_to_fill": round(full_at - started, 1),
                    "seconds_refused": round(refused_until - full_at, 1)},
        "upserts_acknowledged": writers.acked_points,
        "acknowledged_upserts_per_s_while_filling": round(writers.acked_points / (full_at - started), 1),
        "accepted": _percentiles([ms for _, status, ms in answers if status == 200]),
        "refused_503": {**_percentiles([ms for _, status, ms in answers if status == 503]),
                        "retry_after": sorted(writers.retry_after)},
        "other_statuses": sorted({status for _, status, _ in answers if status not in (200, 503)}),
        "searches_per_s": searches_per_s, "searches": searches.by_phase() if searches else {},
        "steps": steps, "upsert_after_swap_status": after,
        "acknowledged_sampled": sampled, "acknowledged_sampled_lost": lost, "memory": memory,
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--index", required=True)
    cli.add_argument("--out", default=str(RECORDS / "write-backpressure.json"))
    args = cli.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"write-backpressure-{os.getpid()}"
    record = run(Path(args.index), work)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
