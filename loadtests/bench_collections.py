"""`make bench-collections`: many collections on one `shardserve serve`, a committed record
(loadtests/records/bench-collections.json).

Per round, a `shardserve serve` started afresh as users start it (on a small index of its own):
1. one collection created and given its points; its searches at a fixed rate (vegeta, open loop):
   p99 with the server holding only it;
2. the other collections created and given their points: the server's processes counted before and
   after (creating a collection starts none), and the router replica's resident memory (what the
   collections it holds cost, per collection);
3. the first collection's searches again, the same way: p99 with every collection held.
The ratio of the two p99s is the target (at most 1.2); rounds alternate nothing (each round
measures "only it" first), so the record keeps every round.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from index_build.job import build_index
from loadtests.record import new_record, save
from loadtests.served import Server
from loadtests.vegeta_run import attack, make_targets, vegeta, write_targets
from shardserve.client import Client
from shardserve.runtime.ports import free_port

TARGETS = {"p99_all_vs_only": ("<=", 1.2)}


def _rss_mb(pid: int | None) -> float:
    return round(psutil.Process(pid).memory_info().rss / 2**20, 1) if pid else float("nan")


def _fill(client: Client, name: str, dim: int, points: int, seed: int) -> None:
    vectors = np.random.default_rng(seed).normal(size=(points, dim)).astype(np.float32)
    collection = client.create_collection(name, dim)
    for start in range(0, points, 1000):
        collection.upsert(list(range(start, min(start + 1000, points))), vectors[start:start + 1000])


def _p99(url: str, name: str, dim: int, rate: float, duration: float, work: Path, label: str) -> dict:
    queries = np.random.default_rng(99).normal(size=(500, dim)).astype(np.float32)
    targets = write_targets(work / f"{label}.jsonl", make_targets(
        queries, url, 10, route=f"/v1/collections/{name}/search", count=500))
    attack(targets, "rate", rate, 3.0, work, f"{label}-warm")
    return attack(targets, "rate", rate, duration, work, label)


def run_round(index: Path, args: argparse.Namespace, work: Path, number: int) -> dict:
    shutil.rmtree(index / "collections", ignore_errors=True)  # each round from none (serve keeps them)
    server = Server(index, free_port(), log=work / f"serve-{number}.log", flags=("--num-cpus", "2"))
    try:
        server.wait_said("Ctrl-C stops it.", 0)
        first = "c00000"
        with Client(server.url, timeout_s=60) as client:
            _fill(client, first, args.dim, args.points, 0)
            only = _p99(server.url, first, args.dim, args.rate, args.duration, work, f"only-{number}")
            router = server.replica(b"Router")
            processes, rss_before = sorted(server.pids()), _rss_mb(router)
            started = time.perf_counter()
            for n in range(1, args.collections):
                _fill(client, f"c{n:05d}", args.dim, args.points, n)
            filled_s = time.perf_counter() - started
            rss_after, processes_after = _rss_mb(router), sorted(server.pids())
            held = len(client.collections())
        every = _p99(server.url, first, args.dim, args.rate, args.duration, work, f"all-{number}")
    finally:
        server.stop()
    return {"round": number, "collections": held, "processes_before": len(processes),
            "processes_after": len(processes_after), "same_processes": processes == processes_after,
            "router_rss_mb_before": rss_before, "router_rss_mb_after": rss_after,
            "router_kb_per_collection": round((rss_after - rss_before) * 1024 / max(held - 1, 1), 1),
            "create_and_fill_s_per_collection": round(filled_s / max(args.collections - 1, 1), 4),
            "only": only, "all": every}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--collections", type=int, default=1000)
    cli.add_argument("--points", type=int, default=1000, help="points a collection")
    cli.add_argument("--dim", type=int, default=64)
    cli.add_argument("--rate", type=float, default=200.0, help="searches/s on the first collection")
    cli.add_argument("--duration", type=float, default=20.0)
    cli.add_argument("--rounds", type=int, default=2)
    cli.add_argument("--name", default="bench-collections")
    args = cli.parse_args()
    vegeta()
    with tempfile.TemporaryDirectory(prefix="bench-collections-") as tmp:
        work = Path(tmp)
        index = work / "idx"  # the index the server serves beside its collections: small, its own
        build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
        rounds = []
        for number in range(args.rounds):
            rounds.append(run_round(index, args, work, number))
            print({k: v for k, v in rounds[-1].items() if k not in ("only", "all")}, flush=True)
    only = statistics.median(r["only"]["p99_ms"] for r in rounds)
    every = statistics.median(r["all"]["p99_ms"] for r in rounds)
    ratio = round(every / only, 3)
    checks = {name: {"value": ratio, "target": f"{op} {bound}", "met": ratio <= bound}
              for name, (op, bound) in TARGETS.items()}
    levels = [level for r in rounds for level in (r["only"], r["all"])]
    record = new_record(args.name, levels, {"collections": args.collections, "points": args.points,
                                            "dim": args.dim, "metric": "l2", "stage": "exact"},
                        rounds=[{k: v for k, v in r.items() if k not in ("only", "all")} for r in rounds],
                        headline={"p99_ms_only": only, "p99_ms_all": every, "rate": args.rate},
                        ratios=checks)
    path = save(record)
    print(f"p99 with {args.collections} collections / with only it: {ratio} (target <= 1.2)")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
