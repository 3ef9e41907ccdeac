"""`make bench-scale`'s served comparison: the default `shardserve serve` against the uvicorn + FAISS
monolith at 4M x 128 (IVF1024,Flat, 4 shards, nprobe 32), side by side in one run, as `make
bench`'s headline is at 60K.

1. the dataset (bench_scale's embedding-like parquet) and the index, built once under `--work`;
2. exact ground truth for the eval queries (a flat scan of the whole base);
3. `--rounds` rounds, the two sides in alternating order, each started afresh: closed loops at 1,
   32 and 128 clients, CPU per request by process class, then recall@10 over HTTP;
4. on each side's last round, an open-loop burst at `--burst-x` times the monolith's capacity (its
   best closed-loop queries/s in the first round, so both sides get the same rate) for `--burst-s`
   seconds, per second: requests, answers, p99.

    python -m loadtests.scale_served [--work DIR] → loadtests/records/bench-scale-served.json
Everything it starts it stops; without --work the data goes to a temp dir, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from loadtests.autoscale import attack_phase, per_second_of
from loadtests.bench import Bench, baseline_server, served
from loadtests.bench_scale import embedding_like, write_parquet
from loadtests.record import header, save, work_dir
from loadtests.vegeta_run import decode, make_targets, write_targets
from shardserve.client import Client
from shardserve.data.datasets import load_dataset
from shardserve.query.scan_choice import cache_bytes

SIDES = ("monolith", "shardserve")
QUERY_SEED = 9_999  # not a seed of the base's files


def build(work: Path, rows: int, dim: int, shards: int, factory: str) -> Path:
    data, index = work / "emb", work / f"index-{factory.replace(',', '-').lower()}-{shards}"
    if not any(data.glob("*.parquet")):
        print(f"writing {rows} x {dim} under {data}", flush=True)
        write_parquet(data, rows, dim, files=32)
    if not (index / "manifest.json").exists():
        exe = Path(sys.executable).parent / "shardserve"
        subprocess.run([str(exe), "build", "--dataset", str(data), "--shards", str(shards),
                        "--index", factory, "--out", str(index), "--vector-column", "emb",
                        "--id-column", "doc_id", "--force"],
                       check=True)
    return index


def ground_truth(data: Path, queries: np.ndarray, k: int) -> np.ndarray:
    """The exact k nearest (the source's ids) of every query over the whole base."""
    dataset = load_dataset(str(data), vector_column="emb", id_column="doc_id")
    flat = faiss.IndexFlatL2(dataset.base.shape[1])
    flat.add(dataset.base)
    _, rows = flat.search(queries, k)
    return dataset.index_ids()[rows]


def recall(url: str, queries: np.ndarray, truth: np.ndarray, k: int, params: dict) -> float:
    client = Client(url)
    found = 0
    for row in range(0, len(queries), 50):
        for hits, expected in zip(client.search_batch(queries[row:row + 50], k, params), truth[row:row + 50],
                                  strict=True):
            found += len(set(hits.ids) & set(expected.tolist()))
    return round(found / truth.size, 4)


def burst(bench: Bench, url: str, label: str, rate: int, seconds: float) -> dict:
    """An open loop at `rate` for `seconds` (vegeta at the harness's nice, as the autoscale run's):
    per second and over the burst, what was sent, answered and how long the answers took."""
    targets = write_targets(bench.work / f"{label}.jsonl", make_targets(
        bench.queries, url, bench.k, bench.params, 0, count=1000))
    out = bench.work / f"{label}.bin"
    started = time.time()
    attack_phase(targets, rate, seconds, out)
    hits = decode(out)
    out.unlink()
    codes = Counter(str(hit["code"]) for hit in hits)
    answered = np.array([hit["latency"] / 1e6 for hit in hits if hit["code"] == 200])
    refused = np.array([hit["latency"] / 1e6 for hit in hits if hit["code"] == 503])
    row = {"label": label, "rate": rate, "seconds": seconds, "requests": len(hits),
           "status_codes": dict(codes),
           "p99_ms_200": round(float(np.percentile(answered, 99)), 2) if len(answered) else None,
           "p50_ms_200": round(float(np.percentile(answered, 50)), 2) if len(answered) else None,
           "p99_ms_503": round(float(np.percentile(refused, 99)), 2) if len(refused) else None,
           "per_second": per_second_of(hits, started)}
    print(f"  burst {label}: {rate}/s for {seconds:g} s, codes {dict(codes)}, answered p50 "
          f"{row['p50_ms_200']} p99 {row['p99_ms_200']} ms", flush=True)
    return row


def summary(levels: list[dict], clients: list[int]) -> dict:
    def side(name: str, c: int) -> list[dict]:
        return [lv for lv in levels if lv["label"].startswith(name + "-") and lv["value"] == c]

    def cpu(level: dict) -> float:
        return level.get("cpu_ms_per_request", {}).get("total (servers)", float("nan"))

    out: dict[str, Any] = {}
    for name in SIDES:
        out[name] = {f"c{c}": {"qps": round(statistics.mean(lv["qps"] for lv in side(name, c)), 1),
                               "p50_ms": round(statistics.median(lv["p50_ms"] for lv in side(name, c)), 2),
                               "p99_ms": round(statistics.median(lv["p99_ms"] for lv in side(name, c)), 2),
                               "cpu_ms_per_request": round(statistics.mean(cpu(lv) for lv in side(name, c)),
                                                           3),
                               "success": min(lv["success_ratio"] for lv in side(name, c))}
                     for c in clients}
    ours, theirs = out["shardserve"], out["monolith"]
    out["ratios"] = {}
    for c in clients:
        out["ratios"][f"qps_c{c}_vs_monolith"] = round(ours[f"c{c}"]["qps"] / theirs[f"c{c}"]["qps"], 3)
        out["ratios"][f"cpu_per_request_c{c}_vs_monolith"] = round(
            ours[f"c{c}"]["cpu_ms_per_request"] / theirs[f"c{c}"]["cpu_ms_per_request"], 3)
    out["ratios"]["c1_p50_minus_monolith_ms"] = round(ours["c1"]["p50_ms"] - theirs["c1"]["p50_ms"], 2)
    return out


def run(args: argparse.Namespace, work: Path) -> None:
    index = build(work, args.rows, args.dim, args.shards, args.factory)
    queries = embedding_like(args.queries, args.dim, seed=QUERY_SEED)
    params = {"nprobe": args.nprobe}
    print("exact ground truth", flush=True)
    truth = ground_truth(work / "emb", queries[:args.recall_queries], args.k)
    bench = Bench(queries, args.k, params, args.duration, work / "runs")
    clients = [int(c) for c in args.clients.split(",")]
    recalls: dict[str, list[float]] = {name: [] for name in SIDES}
    bursts: list[dict] = []
    capacity: list[float] = []  # the monolith's closed-loop queries/s, first round

    def measure(name: str, round_number: int, url: str, processes: dict[str, int] | None) -> None:
        bench.warm_up(url, seconds=5.0)
        for c in clients:
            level = bench.run(url, f"{name}-{round_number}", c, extra_processes=processes)
            if name == "monolith" and round_number == 0:
                capacity.append(level["qps"])
        recalls[name].append(recall(url, queries[:args.recall_queries], truth, args.k, params))
        print(f"  {name} recall@{args.k}: {recalls[name][-1]}", flush=True)
        if round_number == args.rounds - 1 and args.burst_s > 0 and capacity:  # each side's last round
            rate = round(args.burst_x * max(capacity))  # the same for both sides
            bursts.append(burst(bench, url, f"{name}-burst", rate, args.burst_s))

    def monolith(round_number: int) -> None:
        with baseline_server(str(index)) as (url, processes):
            measure("monolith", round_number, url, processes)

    def shardserve_serve(round_number: int) -> None:
        with served(str(index), bench.work / "serve.log") as url:
            measure("shardserve", round_number, url, None)

    for round_number in range(args.rounds):
        order = (monolith, shardserve_serve) if round_number % 2 == 0 else (shardserve_serve, monolith)
        for side in order:
            side(round_number)
    manifest = json.loads((index / "manifest.json").read_text())
    record = header(args.name,
                    dataset={"rows": args.rows, "dim": args.dim, "kind": "bench_scale.embedding_like"},
                    index={"factory": manifest["index_factory"], "shards": args.shards,
                           "vectors": manifest["num_vectors"], "version": manifest["index_version"],
                           "params": params},
                    sides={"monolith": "loadtests.baseline_server: uvicorn + FastAPI, one worker per core, "
                                       "the shards merged into one in-memory index",
                           "shardserve": "`shardserve serve INDEX` with its defaults (edge, admission)"},
                    core_cache_bytes=cache_bytes(), rounds=args.rounds, duration_s=args.duration,
                    summary=summary(bench.levels, clients),
                    recall={name: {"recall_at_k": min(values), "rounds": values,
                                   "queries": args.recall_queries} for name, values in recalls.items()},
                    bursts=bursts, levels=bench.levels)
    print(json.dumps(record["summary"], indent=1), flush=True)
    print(f"record: {save(record, plot_levels=False)}")


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--rows", type=int, default=4_000_000)
    cli.add_argument("--dim", type=int, default=128)
    cli.add_argument("--shards", type=int, default=4)
    cli.add_argument("--factory", default="IVF1024,Flat")
    cli.add_argument("--nprobe", type=int, default=32)
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--queries", type=int, default=2000)
    cli.add_argument("--recall-queries", type=int, default=500)
    cli.add_argument("--clients", default="1,32,128")
    cli.add_argument("--duration", type=float, default=10.0, help="seconds per closed-loop level")
    cli.add_argument("--rounds", type=int, default=2, help="rounds of each side, alternating")
    cli.add_argument("--burst-x", type=float, default=2.0, help="the burst's rate, x the monolith's capacity")
    cli.add_argument("--burst-s", type=float, default=10.0)
    cli.add_argument("--work", default=None, help="keep the data and index here (default: a temp dir)")
    cli.add_argument("--name", default="bench-scale-served")
    args = cli.parse_args()
    with work_dir(args.work, "bench-scale-served-") as work:
        run(args, work)


if __name__ == "__main__":
    main()
