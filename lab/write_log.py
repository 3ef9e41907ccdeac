"""The write log's acknowledgement latency on both engines, side by side in one run: how long
`append` takes to return (SQLite: its commit fsynced, WAL, synchronous=FULL; Redis: Debian's
redis-server on loopback, appendfsync always, its append-only file on the same disk), for single
upserts and for batches of 100, in-process, one thread, no serving. A 200 for a write cannot come
sooner than this; Chroma's server acknowledged single upserts at a p50 of 76-81 ms and a p99 of
182-205 ms over HTTP (bench-writes.json).

The log file lives in `--dir` (default: a temporary directory): put it on the disk the index
directory uses, since the fsync is the cost.

    python -m lab.write_log → records/writes-log-latency.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from loadtests.local_cluster import RedisStore
from loadtests.record import header, save
from shardserve.runtime.ports import free_port
from shardserve.writes.log import WriteLog
from shardserve.writes.ops import Op, Upsert
from shardserve.writes.redis_log import RedisLogAddress, RedisWriteLog


def _filesystem(path: Path) -> str:
    try:
        return subprocess.run(["df", "--output=fstype", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[-1]
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(log: WriteLog | RedisWriteLog, batch: int, dim: int, seconds: float, first_id: int) -> dict:
    """Append requests of `batch` upserts back to back for `seconds`: latency per append."""
    rng = np.random.default_rng(batch)
    vectors = rng.random((batch, dim), dtype=np.float32)
    latencies: list[float] = []
    next_id = first_id
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        ops: list[Op] = [Upsert(next_id + i, vectors[i], {"label": int(i % 10)}) for i in range(batch)]
        next_id += batch
        began = time.perf_counter()
        log.append(ops)
        latencies.append((time.perf_counter() - began) * 1000.0)
    elapsed = time.perf_counter() - start
    ms = np.array(latencies)
    return {"batch": batch, "requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "max_ms": round(float(ms.max()), 3),
            "mean_ms": round(float(ms.mean()), 3),
            "requests_per_s": round(len(ms) / elapsed, 1),
            "vectors_per_s": round(len(ms) * batch / elapsed, 1), "next_id": next_id}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=784)  # Fashion-MNIST's, as the peer numbers
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--name", default="writes-log-latency")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]  # the machine is shared: what else ran
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="write-log-") as work, \
            RedisStore(port=free_port()) as store:
        logs = {"sqlite": WriteLog(Path(work) / "log.sqlite"),
                "redis": RedisWriteLog(RedisLogAddress.for_index(f"redis://{store.address}/0", "lab"),
                                       password=store.password)}
        engines: dict[str, list[dict]] = {name: [] for name in logs}
        for batch in (1, 100):
            for name, log in logs.items():  # interleaved: both see the same machine
                level = measure(log, batch, args.dim, args.seconds, 0)
                level.pop("next_id")
                engines[name].append(level)
                print(name, level)
        log_bytes = sum(os.path.getsize(p) for p in Path(work).iterdir())
        for log in logs.values():
            log.close()
        filesystem = _filesystem(Path(work))
    levels = engines["sqlite"]
    record = header(args.name, tool=None, threads=1, dim=args.dim, seconds_per_level=args.seconds,
                    load_average_before=round(load_before, 2),
                    engine="sqlite3 (stdlib), journal_mode=WAL, synchronous=FULL",
                    redis={"engine": "Debian redis-server on loopback, appendonly yes, appendfsync always, "
                                     "a Lua script per request (INCR + XADD)", "levels": engines["redis"],
                           "p50_vs_sqlite": [round(r["p50_ms"] / s["p50_ms"], 2)
                                             for r, s in zip(engines["redis"], levels, strict=True)]},
                    filesystem=filesystem, log_bytes_at_end=log_bytes,
                    unit="milliseconds per WriteLog.append (one request, one fsynced commit)",
                    levels=levels,
                    caveat="a virtual disk: its flush may be acknowledged by the host's cache before "
                           "stable media (a physical SSD's fsync takes ~0.1-2 ms, a disk's ~5-10 ms)",
                    not_covered=["HTTP, parsing and the shards' apply: the served path (make bench-writes)",
                                 "several writers at once (SQLite serialises them; the router is the one)"])
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
