"""What building from text costs: the embedding stage of `shardserve build --embedder` on Ray Data
against one process embedding the same texts, per core; and the recall of an IVF index of them.

`measure(texts)` embeds the same texts twice:
(a) in this process: one `Embedder` (one ONNX Runtime thread), the texts in the build's pieces
    (PIECE_ROWS each, as `--backend local` embeds them), timed by this process's CPU clock and the
    wall clock; the model's load is timed apart;
(b) with the build's Ray Data stage (index_build.embed_corpus.embedded_tables: an actor pool, one
    actor per CPU Ray has) on the Ray this process is connected to, its output taken in order as
    the build's driver takes it (not written). Wall: from the stage's start (actors started and
    their models loaded included) to its last piece. CPU: the actors' own process clocks
    (time.process_time in each actor, reported with its pieces) from the start of its __init__
    (model load included) to its last piece; the driver's CPU and Ray's own daemons are reported
    apart, not counted.
(c) for reference, without Ray: as many plain processes as (b) has actors (multiprocessing, spawned),
    each with one `Embedder` (one thread) embedding its share of the same pieces, all at once, each
    timed by its own CPU clock (model load included). What (c) loses against (a) per core is the
    machine's (cores sharing caches, memory, a host), not Ray's.
Per core: texts / CPU seconds; `ratio_per_core` = (b) / (a), the model loads counted on both sides
(one in (a), one per actor in (b)); `ratio_per_core_embedding_only` leaves every load out;
`ratio_per_core_vs_parallel_processes` = (b) / (c): Ray Data's own share of the difference.

`quality(texts)` builds an IVF index of them with `shardserve build --embedder` (Ray backend) and
grades recall@10 at several nprobe against the exact cosine neighbours under the same model, the
queries some of the texts (each one's own text left out of its answer and its truth).

    python -m loadtests.embed_throughput [--texts 4000] [--quality-texts 5000] [--save]
        → prints one JSON object (--save: records/embed-throughput.json)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def _corpus(texts: list[str], folder: Path):  # type: ignore[no-untyped-def]
    from shardserve.data.text import open_corpus

    path = folder / "texts.txt"
    path.write_text("\n".join(texts) + "\n")
    return open_corpus(str(path), None)


def measure(texts: list[str], model: str = DEFAULT_MODEL) -> dict:
    """(a) one process and (b) the Ray Data stage embedding `texts` (one text a line, no line breaks
    inside): texts/s, texts/s per core used, and (b)/(a) per core. Needs a running Ray (ray.init)."""
    import ray

    from index_build.embed_corpus import EmbedTotals, embedded_tables
    from shardserve.embed.model import Embedder

    if any("\n" in text for text in texts):
        raise ValueError("texts must be one line each (they are written one a line)")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = _corpus(texts, Path(tmp))
        # (a) one process, one thread
        cpu, wall = time.process_time(), time.perf_counter()
        embedder = Embedder(model, intra_op_threads=1)
        load_cpu, load_wall = time.process_time() - cpu, time.perf_counter() - wall
        cpu, wall = time.process_time(), time.perf_counter()
        one = [table.column("embedding") for table in embedded_tables(corpus, model, embedder, "local")]
        one_cpu, one_wall = time.process_time() - cpu, time.perf_counter() - wall
        # (b) the Ray Data stage
        totals = EmbedTotals()
        cpu, wall = time.process_time(), time.perf_counter()
        first_at = None
        many = []
        for table in embedded_tables(corpus, model, embedder, "ray"):
            first_at = first_at or time.perf_counter()
            totals.add(table, totals.rows)
            many.append(table.column("embedding"))
        ray_wall, driver_cpu = time.perf_counter() - wall, time.process_time() - cpu
        # (c) the same pieces over as many plain processes, at once
        processes = max(1, len(totals.cpu))  # as many as (b) had actors
        shares = [[texts[p.first_row:p.first_row + p.rows] for p in corpus.pieces[w::processes]]
                  for w in range(processes)]
        parallel = _parallel_processes(shares, model)
    same = np.array_equal(_matrix(one), _matrix(many))
    stats = totals.summary()
    n = len(texts)
    a = {"wall_s": round(one_wall, 3), "cpu_s": round(one_cpu, 3), "load_wall_s": round(load_wall, 3),
         "load_cpu_s": round(load_cpu, 3), "texts_per_s": round(n / one_wall, 2),
         "cores_used": round(one_cpu / one_wall, 3),
         "texts_per_s_per_core": round(n / (one_cpu + load_cpu), 2),
         "texts_per_s_per_core_embedding_only": round(n / one_cpu, 2)}
    b = {"wall_s": round(ray_wall, 3), "actors": stats["actors"], "actors_cpu_s": stats["cpu_s"],
         "actors_load_cpu_s": stats["load_cpu_s"], "actors_process_cpu_s": stats["process_cpu_s"],
         "driver_cpu_s": round(driver_cpu, 3),
         "first_piece_after_s": round((first_at or wall) - wall, 3),
         "ray_cpus": ray.cluster_resources().get("CPU"), "texts_per_s": round(n / ray_wall, 2),
         "cores_used": round(stats["cpu_s"] / ray_wall, 3),
         "texts_per_s_per_core": round(n / stats["cpu_s"], 2),
         "texts_per_s_per_core_embedding_only": round(n / (stats["cpu_s"] - stats["load_cpu_s"]), 2)}
    c = {"processes": len(shares), "wall_s": parallel["wall_s"], "cpu_s": parallel["cpu_s"],
         "texts_per_s": round(n / parallel["wall_s"], 2),
         "texts_per_s_per_core": round(n / parallel["cpu_s"], 2)}
    return {"texts": n, "model": model, "tokens": stats["tokens"], "truncated": stats["truncated"],
            "cores": len(os.sched_getaffinity(0)), "one_process": a, "ray_data": b, "parallel_processes": c,
            "same_vectors": bool(same),
            "ratio_per_core": round(b["texts_per_s_per_core"] / a["texts_per_s_per_core"], 3),
            "ratio_per_core_embedding_only": round(b["texts_per_s_per_core_embedding_only"]
                                                   / a["texts_per_s_per_core_embedding_only"], 3),
            "ratio_per_core_vs_parallel_processes": round(b["texts_per_s_per_core"]
                                                          / c["texts_per_s_per_core"], 3),
            "ratio_per_core_parallel_processes_vs_one": round(c["texts_per_s_per_core"]
                                                              / a["texts_per_s_per_core"], 3),
            "cpu": "process CPU clocks: this process for (a); each actor's own for (b), from the start of "
                   "its __init__ to its last piece"}


def _embed_share(texts: list[list[str]], model: str) -> tuple[float, float]:
    """One process's share for (c): its CPU seconds (model load included) and wall seconds."""
    from shardserve.embed.model import Embedder

    cpu, wall = time.process_time(), time.perf_counter()
    embedder = Embedder(model, intra_op_threads=1)
    for piece in texts:
        embedder.embed(piece)
    return time.process_time() - cpu, time.perf_counter() - wall


def _parallel_processes(shares: list[list[list[str]]], model: str) -> dict:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    wall = time.perf_counter()
    with ProcessPoolExecutor(len(shares), mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(_embed_share, shares, [model] * len(shares)))
    return {"wall_s": round(time.perf_counter() - wall, 3), "cpu_s": round(sum(cpu for cpu, _ in done), 3)}


def _matrix(columns: list) -> np.ndarray:
    """The float32 vectors of embedded tables' `embedding` columns, in order."""
    return np.concatenate([np.asarray(column.combine_chunks().flatten(), np.float32) for column in columns])


def quality(texts: list[str], model: str = DEFAULT_MODEL, factory: str = "IVF64,Flat",
            nprobes: tuple[int, ...] = (8, 16, 24, 32), queries: int = 200, shards: int = 2) -> dict:
    """Recall@10 of a `--index factory` build of `texts` at each nprobe, against the exact cosine
    neighbours of the same vectors (read back from the build's embedded files)."""
    import pyarrow.parquet as pq

    from index_build.job import build_index
    from serving.evaluate import sharded_search
    from shardserve.data.groundtruth import exact_search
    from shardserve.index.assigner import load_assigner
    from shardserve.query.searcher import load_all_shards

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "texts.txt").write_text("\n".join(texts) + "\n")
        out = Path(tmp) / "idx"
        started = time.perf_counter()
        manifest = build_index(str(Path(tmp) / "texts.txt"), shards, factory, str(out), backend="ray",
                               embedder=model)
        seconds = time.perf_counter() - started
        table = pq.read_table(manifest.dataset.name)
        base = np.asarray(table.column("embedding").combine_chunks().flatten(), np.float32).reshape(
            table.num_rows, -1)
        rows = np.random.default_rng(5).choice(len(base), queries, replace=False)
        _, truth = exact_search(base, base[rows], 10, "cosine", exclude=rows)
        _, searchers = load_all_shards(str(out))
        assigner = load_assigner(str(out))
        recall = {}
        for nprobe in nprobes:
            _, found = sharded_search(searchers, base[rows], 11, {"nprobe": nprobe}, "cosine", assigner)
            hits = 0
            for q in range(queries):
                answer = [int(i) for i in found[q] if i != rows[q]][:10]
                hits += len(set(truth[q].tolist()) & set(answer))
            recall[str(nprobe)] = round(hits / (10 * queries), 4)
    return {"texts": len(texts), "factory": factory, "shards": shards, "queries": queries, "k": 10,
            "recall_at_10_by_nprobe": recall, "build_s": round(seconds, 1),
            "embed": manifest.build.params["text"]["embed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=4000, help="fortunes to embed for the throughput")
    parser.add_argument("--quality-texts", type=int, default=5000, help="fortunes to index for the recall "
                                                                         "(0: skip)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--save", action="store_true", help="write records/embed-throughput.json")
    args = parser.parse_args()

    import ray

    from loadtests.record import header, save
    from shardserve.embed.text_data import real_texts

    started = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if started:  # a Ray of its own: one CPU a core of this machine
        ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, log_to_driver=False)
    elif not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    try:
        record = header("embed-throughput", tool=None, model=args.model)
        record["throughput"] = measure(real_texts(args.texts), args.model)
        print(json.dumps(record["throughput"]), flush=True)
        if args.quality_texts:
            record["quality"] = quality(real_texts(args.quality_texts), args.model)
            print(json.dumps(record["quality"]), flush=True)
    finally:
        if started:
            ray.shutdown()
    if args.save:
        print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
