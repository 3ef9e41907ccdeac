"""Measure the knee of several layouts (shards x replicas per shard) side by side, one run, one
machine: the calibration and the check of the capacity model (`shardserve plan`).

python -m lab.layouts --index-1 DIR --index-2 DIR --index-4 DIR [--out loadtests/records]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from loadtests.record import RECORDS, header, save
from loadtests.report import find_knee
from loadtests.vegeta_run import attack, make_targets, write_targets
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location

PORT = 18700
LAYOUTS = ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2))  # (shards, replicas per shard)
LEVELS = (1, 4, 16, 48, 96)  # closed-loop concurrency


def measure(indexes: dict[int, str], duration_s: float, params: dict) -> list[dict]:
    from ray import serve

    from deployments.run import deploy, undeploy

    queries = load_dataset("fashion-mnist", num_queries=1000).queries
    results = []
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        for shards, replicas in LAYOUTS:
            app = f"layout-{shards}x{replicas}"
            url = deploy(indexes[shards], port=PORT, app_name=app, route_prefix=f"/{app}",
                         replicas_per_shard=replicas, shard_num_cpus=0.1, router_num_cpus=0.1)
            targets = write_targets(work / f"{app}.jsonl", make_targets(queries, url, 10, params))
            attack(targets, "concurrency", 8, 3, work, "warm-up")
            levels = [attack(targets, "concurrency", c, duration_s, work, f"{app}-c{c}") for c in LEVELS]
            undeploy(app)
            manifest = read_manifest(Location.parse(indexes[shards]))
            results.append({"shards": shards, "replicas_per_shard": replicas,
                            "vectors": manifest.num_vectors, "factory": manifest.index_factory,
                            "knee": find_knee(levels), "levels": levels})
            knee = results[-1]["knee"]
            print(f"{app}: knee c={knee['value']} {knee['qps']:.0f} req/s p99 {knee['p99_ms']:.1f} ms "
                  f"(peak {knee['peak_qps']:.0f})", flush=True)
    return results


def main() -> None:
    from shardserve.runtime.ray_session import apply_serving_node_env, ensure_ray, shutdown_ray

    apply_serving_node_env()
    cli = argparse.ArgumentParser(description=__doc__)
    for shards in (1, 2, 4):
        cli.add_argument(f"--index-{shards}", required=True)
    cli.add_argument("--duration", type=float, default=6.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--out", default=str(RECORDS))
    args = cli.parse_args()
    indexes = {1: args.index_1, 2: args.index_2, 4: args.index_4}
    started = ensure_ray(num_cpus=4, serving_node=True)
    try:
        layouts = measure(indexes, args.duration, {"nprobe": args.nprobe})
    finally:
        if started:
            shutdown_ray()
    record = {**header("layouts"),
              "load": {"mode": "concurrency", "levels": list(LEVELS), "duration_s": args.duration,
                       "params": {"nprobe": args.nprobe}, "query": "single vector, k=10"},
              "layouts": layouts}
    out = save(record, Path(args.out))
    print(out)


if __name__ == "__main__":
    main()
