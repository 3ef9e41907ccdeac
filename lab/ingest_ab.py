"""Interleaved A/B of code revisions on searches beside single upserts → loadtests/records/<name>.json.

python -m lab.ingest_ab --index DIR [--rounds 3] [--seconds 15] [--name write-path-ab] REV REV ...

What `make bench-writes` measures last (loadtests.bench_writes.search_under_ingest): the default
`shardserve serve` on a copy of the index, searches at 32 clients (vegeta, closed loop) quiet, then
beside an open loop of 200 single upserts/s, CPU per search by process class. Here without the
peer and the other write measures, so that only the write path's code differs: every revision runs
in every round (order alternating), each its own server on a fresh copy with 2,000 points upserted
first (a delta on every shard, as in the bench), and the record keeps every round and the medians.

Each revision runs from a temporary git worktree first on PYTHONPATH (lab.ab_revisions says why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRELOADED = 2000  # points upserted before measuring, in batches of 100


FLOOR = "/v1/nowhere"  # `--floor`: the same upsert bodies at the same rate, answered 404 by the router


def measure(index: str, seconds: float, route: str = "/v1/upsert") -> dict:
    """One run of the code importable here (the child's PYTHONPATH decides which revision)."""
    import httpx

    from loadtests.bench_writes import Points, Shardserve, _in_batches, search_under_ingest
    from shardserve.data.datasets import load_dataset
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    manifest = read_manifest(Location.parse(index))
    data = load_dataset(manifest.dataset.name, limit=manifest.num_vectors, **manifest.dataset.columns())
    with tempfile.TemporaryDirectory() as tmp:
        server = Shardserve(Path(index), Path(tmp) / "shardserve")
        try:
            with httpx.Client(timeout=30.0) as http:
                ids, vectors = Points(data.base, seed=1).take(PRELOADED)
                _in_batches(server.upsert, http, ids, vectors)
            elsewhere = {} if route == "/v1/upsert" else {"route": route}  # older revisions: no `route`
            return search_under_ingest(server, data.queries[:1000], Points(data.base, seed=2),
                                       Path(tmp) / "vegeta", seconds=seconds, **elsewhere)
        finally:
            server.stop()


def run_revision(revision: str, index: str, seconds: float, route: str = "/v1/upsert") -> dict:
    # imported here: the child imports this file with an older revision's `lab` on its path
    from lab.ab_revisions import in_worktree

    return in_worktree(Path(__file__), revision, ["--index", index, "--seconds", str(seconds),
                                                  "--route", route])


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True)
    return done.stdout.strip()


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("revisions", nargs="*")
    cli.add_argument("--index", required=True)
    cli.add_argument("--rounds", type=int, default=3)
    cli.add_argument("--seconds", type=float, default=15.0)
    cli.add_argument("--name", default="write-path-ab")
    cli.add_argument("--floor", action="store_true",
                     help="also run the first revision with its upserts sent to a route the router "
                          "answers 404: what the requests cost before any write path")
    cli.add_argument("--route", default="/v1/upsert", help=argparse.SUPPRESS)  # the child's
    cli.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    args = cli.parse_args()
    index = str(Path(args.index).resolve())
    if args.measure:
        print("RESULT " + json.dumps(measure(index, args.seconds, args.route)), flush=True)
        return
    if len(args.revisions) < 2 - args.floor:
        raise SystemExit("error: give at least two revisions to compare, or one and --floor")
    short = {spec: git("rev-parse", "--short", spec) for spec in args.revisions}
    runs: dict[str, list[dict]] = {short[r]: [] for r in args.revisions}
    floor = f"{short[args.revisions[0]]} writes 404" if args.floor else None
    if floor:
        runs[floor] = []
    for round_number in range(args.rounds):
        for revision in (list(runs) if round_number % 2 == 0 else list(runs)[::-1]):
            result = (run_revision(revision.split()[0], index, args.seconds, FLOOR) if revision == floor
                      else run_revision(revision, index, args.seconds))
            result["round"] = round_number
            runs[revision].append(result)
            print(f"round {round_number} {revision}: quiet {result['quiet']['qps']} q/s, ingesting "
                  f"{result['ingesting']['qps']} q/s ({result['qps_ratio']}x)", flush=True)
    from loadtests.record import header, save
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    manifest = read_manifest(Location.parse(index))
    summary = {}
    for revision, results in runs.items():
        summary[revision] = {
            "qps_ratio_median": round(statistics.median(r["qps_ratio"] for r in results), 3),
            "qps_ratios": [r["qps_ratio"] for r in results],
            **{f"{phase}_cpu_ms_per_search_median": {
                cls: round(statistics.median(r[phase]["cpu_ms_per_request"][cls] for r in results), 3)
                for cls in ("router", "shards", "ingress (HAProxy)", "total (servers)")}
               for phase in ("quiet", "ingesting")}}
    record = header(args.name, index={"uri": index, "version": manifest.index_version,
                                      "factory": manifest.index_factory, "shards": len(manifest.shards)},
                    measure="searches/s at 32 clients quiet, then beside 200 single upserts/s "
                            f"(loadtests.bench_writes.search_under_ingest, {args.seconds:g} s each), "
                            f"after {PRELOADED} upserts")
    subjects = {short[r]: git("log", "-1", "--format=%s", r)[:160] for r in args.revisions}
    if floor:
        subjects[floor] = f"the same upserts sent to {FLOOR}: HAProxy, the door and a 404, no write path"
    record.update(revisions=subjects,
                  rounds=args.rounds, runs=runs, summary=summary,
                  not_covered=["one index, 1 replica per shard", "this 2-core machine only"])
    print(json.dumps(summary, indent=1))
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
