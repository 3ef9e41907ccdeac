"""What one single upsert costs each process that must touch it, in-process, one thread, CPU time:
the router's parse and its fsynced append, then, in every shard replica, the log read that catches
it up and its `apply` (the home shard adds the point to its delta: a coarse assignment against the
trained quantizer; the others only check their tombstones). These are the parts of the write path
no transport or scheduling adds to: what `make bench-writes`' searches beside 200 single upserts/s
give up at least, on top of what the same requests cost with no write path (the `json 404` floor
of loadtests/records/ingest-paired.json).

    python -m lab.write_costs --index indexes/fashion-mnist-ivf1024-4 → records/write-costs.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
import orjson

from loadtests.record import header, save
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked
from shardserve.index.storage import Location
from shardserve.query.searcher import ShardSearcher
from shardserve.writes.follow import ShardWrites
from shardserve.writes.log import WriteLog
from shardserve.writes.ops import Op
from shardserve.writes.parse import parse_upsert


def _cpu_ms(calls: list[Callable[[], object]]) -> float:
    """CPU milliseconds per call, each call once, in order."""
    started = time.process_time()
    for call in calls:
        call()
    return (time.process_time() - started) * 1000.0 / len(calls)


def _shard_costs(location: Location, manifest: Manifest, shard: int, path: Path, writes: int) -> dict:
    """One shard replica catching up one request at a time, as under a steady ingest."""
    searcher = ShardSearcher.load(location, manifest, shard)
    follower = ShardWrites(searcher, shard, len(manifest.shards), path, 0,
                           lambda: read_shard_checked(location, manifest.trained))
    log = follower._open()
    assert log is not None
    delta = follower._start_delta().delta
    reads: list = []
    # under a steady ingest each catch-up finds the one request committed since the last: the log
    # holds them all here, so each read is limited to it (READ_REQUESTS bounds a longer catch-up)
    read_ms = _cpu_ms([lambda p=p: reads.append(log.read(p, 1)) for p in range(writes)])
    newest_ms = _cpu_ms([log.last_position for _ in range(writes)])
    requests = [found[0] for found in reads]
    home = [(p, ops) for p, ops in requests if delta.route.home_of(ops[0].id) == shard]
    away = [(p, ops) for p, ops in requests if delta.route.home_of(ops[0].id) != shard]
    # each kind timed on its own requests, in log order
    home_ms = _cpu_ms([lambda p=p, ops=ops: delta.apply(p, ops, bounded=False) for p, ops in home])
    delta.position = 0
    away_ms = _cpu_ms([lambda p=p, ops=ops: delta.apply(p, ops, bounded=False) for p, ops in away])
    return {"shard": shard, "home_writes": len(home), "read_ms": round(read_ms, 4),
            "newest_position_ms": round(newest_ms, 4), "apply_home_ms": round(home_ms, 4),
            "apply_elsewhere_ms": round(away_ms, 4)}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", required=True)
    cli.add_argument("--writes", type=int, default=2000)
    cli.add_argument("--name", default="write-costs")
    args = cli.parse_args()
    faiss.omp_set_num_threads(1)  # as in every shard replica
    location = Location.parse(args.index)
    manifest = read_manifest(location)
    rng = np.random.default_rng(0)
    vectors = (rng.random((args.writes, manifest.dim), dtype=np.float32) * 255).round()
    bodies = [orjson.dumps({"ids": [2_000_000_000 + i], "vectors": vectors[i:i + 1]},
                           option=orjson.OPT_SERIALIZE_NUMPY) for i in range(args.writes)]
    kinds = manifest.dataset.metadata_kinds
    parsed: list[list[Op]] = []
    parse_ms = _cpu_ms([lambda b=b: parsed.append(parse_upsert(b, manifest.dim, manifest.metric, kinds, 1000))
                        for b in bodies])
    with tempfile.TemporaryDirectory(dir=Path(args.index).parent) as tmp:  # the index's disk: its fsync
        path = Path(tmp) / "log.sqlite"
        log = WriteLog(path)
        wall = time.perf_counter()
        append_ms = _cpu_ms([lambda ops=ops: log.append(ops) for ops in parsed])
        append_wall_ms = (time.perf_counter() - wall) * 1000.0 / len(parsed)
        shards = [_shard_costs(location, manifest, shard, path, len(parsed))
                  for shard in range(len(manifest.shards))]
        log.close()
    n = len(shards)
    per_write = {
        "router: parse (JSON, one point)": round(parse_ms, 4),
        "router: append, commit fsynced (CPU)": round(append_ms, 4),
        "shard replicas: log reads": round(sum(s["read_ms"] for s in shards), 4),
        "shard replicas: apply (one home, the others tombstones)": round(
            statistics.mean(s["apply_home_ms"] for s in shards)
            + (n - 1) * statistics.mean(s["apply_elsewhere_ms"] for s in shards), 4)}
    per_write["in all"] = round(sum(per_write.values()), 4)
    record = header(args.name, tool=None, index={"uri": args.index, "version": manifest.index_version,
                                                 "factory": manifest.index_factory, "shards": n,
                                                 "dim": manifest.dim},
                    measure="CPU ms per single upsert, in-process, one thread, warm (time.process_time)",
                    writes=args.writes, append_wall_ms=round(append_wall_ms, 4), shards=shards,
                    per_write=per_write,
                    not_covered=["HTTP (HAProxy, the router's door), the hand-off to the writes thread, "
                                 "scheduling: ingest-paired.json's json-404 floor and its CPU per search"])
    for part, ms in per_write.items():
        print(f"{ms:8.3f} ms  {part}")
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
