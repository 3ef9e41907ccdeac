"""Where searches/s go beside 200 upserts/s, by what the ingest sends → loadtests/records/<name>.json.

python -m lab.ingest_paired --index DIR [--rounds 5] [--seconds 10] [--name ingest-paired]

`make bench-writes`' measure (loadtests.bench_writes.search_under_ingest: searches at 32 clients,
a quiet window then one beside an open loop of upserts) for several kinds of ingest in turn, the
kinds rotated every round so that the machine's drift falls on each alike; each round on a fresh
server and copy of the index with 2,000 points upserted first (a delta on every shard, the same in
every round, and the automatic compaction out of reach):
- `json`: single upserts as JSON bodies (what `make bench-writes` sends);
- `npy`: single upserts as .npy bodies (what `Client.upsert` sends for points without metadata);
- `json 404`: the same JSON bodies at the same rate to a route the router answers 404: HAProxy,
  the door and a reply, no write path (the floor any write path stands on);
- `json x10`: the same points/s as JSON bodies of 10 points (a tenth of the requests).
The record keeps every pair and, per kind, the median ratio and the CPU per search by process class
(`load generator beside`: the ingest's own vegeta, per search).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import httpx

from loadtests.bench_writes import Points, Shardserve, _in_batches, search_under_ingest
from loadtests.record import header, save
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location

KINDS = {"json": {}, "npy": {"npy": True}, "json 404": {"route": "/v1/nowhere"}, "json x10": {"size": 10}}
CLASSES = ("router", "shards", "ingress (HAProxy)", "Ray system", "total (servers)", "load generator beside")


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", required=True)
    cli.add_argument("--rounds", type=int, default=5)
    cli.add_argument("--seconds", type=float, default=10.0)
    cli.add_argument("--name", default="ingest-paired")
    args = cli.parse_args()
    manifest = read_manifest(Location.parse(args.index))
    data = load_dataset(manifest.dataset.name, limit=manifest.num_vectors, **manifest.dataset.columns())
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    points = Points(data.base, seed=2, first=2_000_000_000)
    for round_number in range(args.rounds):
        order = list(KINDS)[round_number % len(KINDS):] + list(KINDS)[:round_number % len(KINDS)]
        with tempfile.TemporaryDirectory() as tmp:  # a server per round: the same delta in each
            server = Shardserve(Path(args.index), Path(tmp) / "shardserve")
            try:
                with httpx.Client(timeout=30.0) as http:
                    _in_batches(server.upsert, http, *Points(data.base, seed=1).take(2000))
                for kind in order:
                    result = search_under_ingest(server, data.queries[:1000], points, Path(tmp) / "vegeta",
                                                 seconds=args.seconds, pairs=1, **KINDS[kind])
                    result["round"] = round_number
                    runs[kind].append(result)
                    print(f"round {round_number} {kind}: {result['quiet']['qps']} -> "
                          f"{result['ingesting']['qps']} q/s ({result['qps_ratio']}x)", flush=True)
            finally:
                server.stop()
    summary = {kind: {
        "qps_ratio_median": round(statistics.median(r["qps_ratio"] for r in results), 3),
        "qps_ratios": [r["qps_ratio"] for r in results],
        **{f"{phase}_cpu_ms_per_search_median": {
            cls: round(statistics.median(r[phase]["cpu_ms_per_request"].get(cls, 0.0) for r in results), 3)
            for cls in CLASSES} for phase in ("quiet", "ingesting")}} for kind, results in runs.items()}
    record = header(args.name, index={"uri": args.index, "version": manifest.index_version,
                                      "factory": manifest.index_factory, "shards": len(manifest.shards)},
                    measure=f"searches/s at 32 clients, a quiet window then one beside 200 upserts/s "
                            f"({args.seconds:g} s each; loadtests.bench_writes.search_under_ingest), by kind "
                            "of ingest, the kinds rotated each round, a fresh server per round")
    record.update(kinds={k: KINDS[k] for k in KINDS}, rounds=args.rounds, runs=runs, summary=summary,
                  not_covered=["one index, 1 replica per shard", "this 2-core machine only"])
    print(json.dumps(summary, indent=1))
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
