"""What a shard replica's start costs, memory-mapped vs read: process age and CPU when ready, index
load time and resident memory (own vs mapped file pages) of every replica, from the replicas' own
/proc counters (deployments.shard.keep_startup).

python -m lab.shard_start --index DIR [--replicas-per-shard 2]
Starts its own local Ray, deploys DIR once per mode (`shard_mmap` true, then false) with that many
replicas per shard, waits for them, records, and stops everything it started → shard-start.json.
No load: start-up only.
"""

from __future__ import annotations

import argparse
import json
import time

from loadtests.record import RECORDS, header

PORT = 8031


def measure(index: str, mmap: bool, replicas: int) -> list[dict]:
    from deployments.config import index_app_name
    from deployments.run import deploy, undeploy
    from deployments.shard import replica_startups

    app = f"start-{'mmap' if mmap else 'read'}"
    since = time.time()
    deploy(index, port=PORT, app_name=app, route_prefix=f"/{app}", replicas_per_shard=replicas,
           shard_mmap=mmap, shard_num_cpus=0.1, router_num_cpus=0.1)
    try:
        rows = []
        for deployment, started in sorted(replica_startups(index_app_name(app)).items()):
            rows += [{"deployment": deployment, **row} for row in started if row["ready_at"] >= since]
        return rows
    finally:
        undeploy(app)


def summary(rows: list[dict]) -> dict:
    """Means over the replicas, and the totals a node holds (own memory adds up, mapped pages are
    counted once per file however many replicas map it)."""
    def mean(key: str) -> float:
        return round(sum(r[key] for r in rows) / len(rows), 3)

    return {"replicas": len(rows), "mmapped": all(r["mmapped"] for r in rows),
            **{f"mean_{k}": mean(k) for k in ("process_age_s", "cpu_s", "index_load_s", "rss_anon_mb",
                                               "rss_file_mb")},
            "sum_rss_anon_mb": round(sum(r["rss_anon_mb"] for r in rows), 1)}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--replicas-per-shard", type=int, default=2)
    cli.add_argument("--name", default="shard-start")
    args = cli.parse_args()

    from ray import serve

    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    if not ensure_ray(num_cpus=4, serving_node=True):
        raise SystemExit("error: needs its own Ray, and one is already running here")
    try:
        modes = {}
        for mmap in (True, False):
            rows = measure(args.index, mmap, args.replicas_per_shard)
            modes["mmap" if mmap else "read"] = {"summary": summary(rows), "replicas": rows}
            print(f"{'mmap' if mmap else 'read'}: {modes['mmap' if mmap else 'read']['summary']}", flush=True)
    finally:
        serve.shutdown()
        shutdown_ray()
    manifest = read_manifest(Location.parse(args.index))
    record = header(args.name, tool=None, index={"uri": args.index, "factory": manifest.index_factory,
                                                 "num_vectors": manifest.num_vectors,
                                                 "shards": len(manifest.shards),
                                                 "shard_bytes": [s.bytes for s in manifest.shards]},
                    replicas_per_shard=args.replicas_per_shard, modes=modes)
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{args.name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
