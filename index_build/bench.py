"""`make bench-build`: the Ray Data build against a single-process FAISS loop, in one run.

Both builds run the same stages on the same data (train once, add per shard, write, checksum); only
the add/write stage differs. Cluster start-up (Ray + warm Ray Data workers) is timed on its own and
excluded from the Ray figure, as the issue asks; the record keeps it.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from pathlib import Path

from index_build.job import BuildParams, build_from_dataset
from shardserve.data.datasets import load_dataset
from shardserve.index.storage import Location
from shardserve.runtime.procfs import cpu_model

RECORDS = Path(__file__).resolve().parent.parent / "loadtests" / "records"


def _warm_ray() -> float:
    """Start Ray and run one tiny Ray Data job so worker processes exist: that is start-up cost."""
    import numpy as np
    import ray

    start = time.perf_counter()
    ray.init(num_cpus=None, include_dashboard=False, log_to_driver=False)
    ray.data.from_items([{"x": i} for i in range(4)], override_num_blocks=4).map_batches(
        lambda b: {"x": np.asarray(b["x"]) + 1}, batch_size=1, num_cpus=1).take_all()
    return time.perf_counter() - start


def run(dataset_spec: str, shards: int, factory: str, repeats: int) -> dict:
    dataset = load_dataset(dataset_spec)
    params = BuildParams(factory, shards, dataset.metric)
    startup = _warm_ray()
    times: dict[str, list[float]] = {"ray": [], "local": []}
    versions = set()
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for backend in ("ray", "local"):  # interleaved so machine noise hits both alike
                location = Location.parse(f"{tmp}/{backend}-{repeat}")
                location.ensure_writable()
                start = time.perf_counter()
                manifest = build_from_dataset(dataset, params, location, backend=backend)
                times[backend].append(time.perf_counter() - start)
                versions.add(manifest.index_version)
    import ray

    ray.shutdown()
    best = {backend: min(values) for backend, values in times.items()}
    return {
        "name": f"build-{dataset.name}-{factory}-{shards}shards",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": _cores(), "cpu_model": cpu_model(), "python": platform.python_version()},
        "dataset": {"name": dataset.name, "num_vectors": len(dataset.base), "dim": dataset.dim},
        "index": {"factory": factory, "shards": shards},
        "cluster_startup_s": round(startup, 3),
        "build_s": {backend: [round(v, 3) for v in values] for backend, values in times.items()},
        "best_s": {backend: round(v, 3) for backend, v in best.items()},
        "ratio_ray_over_local": round(best["ray"] / best["local"], 3),
        "identical_shards": len(versions) == 1,
    }


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--shards", type=int, default=4)
    cli.add_argument("--index", default="IVF1024,Flat")
    cli.add_argument("--repeats", type=int, default=3)
    args = cli.parse_args()
    logging.basicConfig(level=logging.WARNING)
    record = run(args.dataset, args.shards, args.index, args.repeats)
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{record['name'].replace(',', '_')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"cluster start-up {record['cluster_startup_s']:.1f} s (excluded)")
    print(f"build: ray {record['best_s']['ray']:.2f} s, single-process {record['best_s']['local']:.2f} s "
          f"(best of {args.repeats}) → ratio {record['ratio_ray_over_local']:.2f}x; "
          f"identical shards: {record['identical_shards']}")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
