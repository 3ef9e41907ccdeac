"""`make bench-scale`: millions of vectors, streamed from parquet, built on a Ray with a capped object
store, served over HTTP and graded against exact ground truth.

1. synthetic embedding-like float32 vectors (`--rows` x `--dim`, low intrinsic dimension, see
   `embedding_like`) in `--files` parquet files, with an int64
   `doc_id` (sparse, not row numbers) and a string `caption`;
2. `shardserve build --index auto` (streaming, index_build/streaming.py) as a driver of a local Ray
   whose object store is capped (`--object-store-gb`), peak RSS of the driver and of every Ray
   process sampled from /proc every 0.5 s;
3. a single-process FAISS build of the same factory on the same data (in memory, all cores) for
   vectors/s/core side by side;
4. the index deployed, recall@10 over HTTP against exact ground truth (the user's ids graded through
   the dataset's id -> row map), and `include` checked against the parquet source for 50 queries.

    python -m loadtests.bench_scale [--rows 4000000] → loadtests/records/bench-scale.json
Everything it starts (the Ray, the build, the deployment) it stops; the temp dir it writes to, it removes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from loadtests.local_cluster import LocalCluster
from loadtests.record import header, save, work_dir
from shardserve.runtime import procfs

CAPTION = "caption {}"


def source_id(rows: np.ndarray) -> np.ndarray:
    """The id the source gives row r: sparse and large, never a row number."""
    return rows.astype(np.int64) * 7919 + 10**12


def embedding_like(rows: int, dim: int, seed: int, intrinsic: int = 12, clusters: int = 256) -> np.ndarray:
    """Vectors with the structure real embeddings have: a low intrinsic dimension (a clustered
    `intrinsic`-dim Gaussian mixture, linearly embedded in `dim`) plus a little isotropic noise.
    Why not shardserve.data.datasets.synthetic_vectors at this size: its points are isotropic noise around 64
    centres, so inside a cluster every point is almost equally far from every other one and the
    exact top-10 is decided by noise no compressed code can see."""
    basis = np.random.default_rng(1).normal(0, 1, (intrinsic, dim)).astype(np.float32)
    centres = np.random.default_rng(2).normal(0, 3, (clusters, intrinsic)).astype(np.float32)
    rng = np.random.default_rng(seed)
    low = centres[rng.integers(0, clusters, rows)] + rng.normal(0, 1, (rows, intrinsic)).astype(np.float32)
    return np.ascontiguousarray(low @ basis + rng.normal(0, 0.1, (rows, dim)).astype(np.float32))


def write_parquet(directory: Path, rows: int, dim: int, files: int, seed: int = 11) -> float:
    """Write the dataset file by file (one file's rows in memory at a time); seconds taken."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    for number, part in enumerate(np.array_split(np.arange(rows), files)):
        vectors = embedding_like(len(part), dim, seed + number)
        flat = pa.array(vectors.reshape(-1), type=pa.float32())
        table = pa.table({"emb": pa.FixedSizeListArray.from_arrays(flat, dim),
                          "doc_id": pa.array(source_id(part)),
                          "caption": pa.array([CAPTION.format(r) for r in part.tolist()])})
        pq.write_table(table, directory / f"part-{number:03d}.parquet", row_group_size=65536)
    return time.perf_counter() - started


class PeakRss:
    """Peak RSS (MB) of a process and, separately, of every process under some roots, every 0.5 s."""

    def __init__(self, driver: int, cluster_roots: list[int], period_s: float = 0.5):
        self.driver, self.roots, self.period_s = driver, cluster_roots, period_s
        self.driver_mb, self.worker_mb, self.samples = 0.0, 0.0, 0
        self.worker_name = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples += 1
            self.driver_mb = max(self.driver_mb, procfs.memory_mb(self.driver).get("rss_mb", 0.0))
            for root in self.roots:
                for pid in [root, *procfs.descendants(root)]:
                    rss = procfs.memory_mb(pid).get("rss_mb", 0.0)
                    if rss > self.worker_mb:
                        self.worker_mb = rss
                        self.worker_name = procfs.cmdline(pid).split(b"\0", 1)[0].decode(errors="replace")


def single_process_build(data_dir: Path, factory: str) -> dict:
    """The same factory trained (on the same capped sample) and filled in this process, all cores:
    vectors/s/core. The data is read into memory first, untimed."""
    import faiss

    from index_build.publish import BuildParams, training_rows
    from index_build.streaming import TRAIN_MAX_BYTES
    from shardserve.data.datasets import load_dataset
    from shardserve.index.indexes import add_to_copy, train_empty_index

    data = load_dataset(str(data_dir), vector_column="emb", id_column="doc_id")
    cores = len(os.sched_getaffinity(0))
    faiss.omp_set_num_threads(cores)
    started = time.perf_counter()
    params = BuildParams(factory, 1, "l2")
    rows = training_rows(factory, data.dim, "l2", len(data.base), 0, params.seed, TRAIN_MAX_BYTES)
    sample = data.base if rows is None else data.base[rows]  # the streaming build's sample, same cap
    empty = train_empty_index(factory, "l2", sample, params.seed)
    trained = time.perf_counter()
    add_to_copy(empty, data.base, data.index_ids())
    done = time.perf_counter()
    return {"train_s": round(trained - started, 2), "add_s": round(done - trained, 2),
            "seconds": round(done - started, 2), "vectors": len(data.base), "cores": cores,
            "vectors_per_s_per_core": round(len(data.base) / (done - started) / cores, 1)}


def check_include(url: str, data_dir: Path, queries: int = 50) -> dict:
    """Every hit's `caption` is the one the parquet source has for its id."""
    import httpx

    from shardserve.data.datasets import load_dataset

    data = load_dataset(str(data_dir), vector_column="emb", id_column="doc_id", num_queries=queries)
    hits = wrong = 0
    for vector in data.queries:
        answer = httpx.post(f"{url}/v1/search", json={"vector": vector.tolist(), "k": 10,
                                                      "include": ["caption"]}, timeout=30).json()
        for doc_id, meta in zip(answer["ids"], answer["metadata"], strict=True):
            hits += 1
            row = (doc_id - 10**12) // 7919
            wrong += meta.get("caption") != CAPTION.format(row)
    return {"queries": queries, "hits": hits, "wrong_captions": wrong}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--rows", type=int, default=4_000_000)
    cli.add_argument("--dim", type=int, default=128)
    cli.add_argument("--files", type=int, default=32)
    cli.add_argument("--shards", type=int, default=4)
    cli.add_argument("--object-store-gb", type=float, default=1.0)
    cli.add_argument("--nprobe", type=int, default=64)
    cli.add_argument("--work", default=None,
                     help="keep the data and index here (default: a temp dir, removed at the end)")
    cli.add_argument("--name", default="bench-scale")
    cli.add_argument("--build-only", action="store_true",
                     help="record the build (time, peak RSS) and stop: no serving, no eval")
    args = cli.parse_args()
    with work_dir(args.work, "bench-scale-") as work:
        run(args, work)


def run(args: argparse.Namespace, work: Path) -> None:
    data_dir, index_dir = work / "emb", work / "index"
    exe = Path(sys.executable).parent / "shardserve"
    record = header(args.name, tool=None, dataset={"rows": args.rows, "dim": args.dim, "files": args.files,
                                                    "kind": "synthetic, embedding-like: 256 clusters in 12 "
                                                            "intrinsic dims, embedded, + noise 0.1"})
    if not any(data_dir.glob("*.parquet")):
        print(f"writing {args.rows} x {args.dim} in {args.files} parquet files under {data_dir}", flush=True)
        record["dataset"]["write_s"] = round(write_parquet(data_dir, args.rows, args.dim, args.files), 1)
    record["dataset"]["bytes"] = sum(p.stat().st_size for p in data_dir.glob("*.parquet"))

    cluster = LocalCluster(workers=[], head_cpus=len(os.sched_getaffinity(0)))
    cluster.object_store_bytes = int(args.object_store_gb * 2**30)
    with cluster:
        env = {**os.environ, **cluster.driver_env(), "RAY_ADDRESS": cluster.address}
        started = time.perf_counter()
        build = subprocess.Popen([str(exe), "build", "--dataset", data_dir.as_uri(),
                                  "--shards", str(args.shards),
                                  "--index", "auto", "--out", str(index_dir), "--force",
                                  "--vector-column", "emb", "--id-column", "doc_id",
                                  "--metadata-columns", "caption"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        with PeakRss(build.pid, cluster.processes()) as peak:
            output, _ = build.communicate(timeout=3600)
        seconds = time.perf_counter() - started
        print(output[-2000:], flush=True)
        if build.returncode != 0:
            raise SystemExit(f"build failed: {output.strip().splitlines()[-1]}")
        manifest = json.loads((index_dir / "manifest.json").read_text())
        cores = len(os.sched_getaffinity(0))
        record["build"] = {
            "factory": manifest["index_factory"], "auto": manifest["build"]["params"].get("auto"),
            "shards": args.shards, "vectors": manifest["num_vectors"], "seconds": round(seconds, 1),
            "stages_s": manifest["build"]["params"]["stages_s"],
            "streaming": manifest["build"]["params"].get("streaming"),
            "object_store_gb": args.object_store_gb, "cores": cores,
            "vectors_per_s_per_core": round(manifest["num_vectors"] / seconds / cores, 1),
            "peak_rss_mb": {"driver": round(peak.driver_mb, 1), "any_ray_process": round(peak.worker_mb, 1),
                            "that_process": peak.worker_name, "samples": peak.samples},
            "goal_mb": {"driver": 1024, "any_ray_process": 1536}}
        print(f"build: {record['build']}", flush=True)
        if args.build_only:
            print(save(record, plot_levels=False))
            return

        from shardserve.runtime.ray_session import apply_serving_node_env

        apply_serving_node_env()
        os.environ.update({**cluster.driver_env(), "RAY_ADDRESS": cluster.address})
        import ray

        from deployments.run import deploy, undeploy

        ray.init(address=cluster.address, log_to_driver=False)
        try:
            url = deploy(str(index_dir), port=18700, shard_num_cpus=0.25, router_num_cpus=0.25)
            # The dataset by URI: the path every remote store (s3://, gs://) takes, at this size.
            evaluate = subprocess.Popen(
                [str(exe), "eval", str(index_dir), "--dataset", data_dir.as_uri(),
                 "--nprobe", str(args.nprobe), "--url", url, "--json"],
                env=os.environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            with PeakRss(evaluate.pid, []) as eval_peak:  # the streamed ground truth's memory
                out, err = evaluate.communicate(timeout=3600)
            if evaluate.returncode != 0:
                raise SystemExit(f"eval failed: {err.strip()[-500:]}")
            evaluated = subprocess.CompletedProcess(evaluate.args, 0, out, err)
            base_mb = manifest["num_vectors"] * args.dim * 4 / 2**20
            record["eval_peak_rss_mb"] = {"eval_process": round(eval_peak.driver_mb, 1),
                                          "samples": eval_peak.samples, "base_set_mb": round(base_mb, 1)}
            record["served"] = {"params": {"nprobe": args.nprobe}, **json.loads(evaluated.stdout),
                                "include": check_include(url, data_dir), "goal_recall": 0.90}
            print(f"served: {record['served']}", flush=True)
            undeploy()
        finally:
            ray.shutdown()
    print("single-process FAISS build of the same factory", flush=True)
    record["single_process"] = single_process_build(data_dir, record["build"]["factory"])
    record["build"]["vs_single_process_per_core"] = round(
        record["build"]["vectors_per_s_per_core"] / record["single_process"]["vectors_per_s_per_core"], 3)
    record["not_covered"] = ["an s3:// or gs:// bucket: the dataset is read by file:// URI, through the "
                             "same pyarrow filesystem calls, from local disk",
                             "GloVe-50 (its own record: bench-glove.json)",
                             "QPS under load at this size (one client, eval)"]
    print(f"record: {save(record)}")


if __name__ == "__main__":
    main()
