"""`make bench` (f), `make bench-tracing` alone: what tracing costs, side by side in one run.

`shardserve serve` as users start it, three ways: no trace endpoint (the default: no tracer at all),
an endpoint and ratio 0 (every request's `traceparent` looked at, none traced: what tracing "on but
sampling off" costs), and 1 % of requests traced to a real Jaeger. Each is started afresh, in an
order that alternates over --rounds rounds, warmed up, left to reach its steady state, then driven
by 32 closed-loop vegeta clients. CPU per request counts every process of the server (not Jaeger's).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from loadtests.bench import Bench, bench_cli, checked, index_fields, served
from loadtests.jaeger import Jaeger
from loadtests.record import new_record, save
from loadtests.vegeta_run import vegeta
from shardserve.data.datasets import load_dataset

SIDES = ("tracing-off", "tracing-ratio0", "tracing-1pct")
# sampling off within noise of no tracing; 1 % traced costs at most 3 % more CPU per request
TARGETS = {"cpu_per_request_ratio0_vs_off": ("<=", 1.02), "qps_ratio0_vs_off": (">=", 0.98),
           "cpu_per_request_1pct_vs_off": ("<=", 1.03)}


def _cpu(level: dict) -> float:
    return level.get("cpu_ms_per_request", {}).get("total (servers)", float("nan"))


def summary(levels: list[dict]) -> dict:
    """Per side over its rounds: mean queries/s, CPU per request over all its requests, median p99."""
    out: dict[str, dict] = {}
    for side in SIDES:
        runs = [level for level in levels if level["label"].startswith(side + "-")]
        out[side] = {"rounds": len(runs), "qps_c32": round(statistics.mean(lv["qps"] for lv in runs), 1),
                     "cpu_ms_per_request_c32": round(sum(_cpu(lv) * lv["requests"] for lv in runs)
                                                     / sum(lv["requests"] for lv in runs), 4),
                     "p99_ms_c32": round(statistics.median(lv["p99_ms"] for lv in runs), 3)}
    return out


def ratios(sides: dict) -> dict:
    off, zero, one = sides["tracing-off"], sides["tracing-ratio0"], sides["tracing-1pct"]
    cpu = "cpu_ms_per_request_c32"
    return {"cpu_per_request_ratio0_vs_off": round(zero[cpu] / off[cpu], 4),
            "qps_ratio0_vs_off": round(zero["qps_c32"] / off["qps_c32"], 4),
            "cpu_per_request_1pct_vs_off": round(one[cpu] / off[cpu], 4),
            "qps_1pct_vs_off": round(one["qps_c32"] / off["qps_c32"], 4)}


def main() -> None:
    args = bench_cli(__doc__, "bench-tracing", 3).parse_args()
    vegeta()
    from deployments.config import AppArgs
    from shardserve.index.manifest import Published

    index = os.path.abspath(args.index)
    published = Published.open(index)
    params = {"nprobe": args.nprobe} if args.nprobe else {}
    jaeger = Jaeger().wait_ready()
    flags = {"tracing-off": (),
             "tracing-ratio0": ("--trace-endpoint", jaeger.otlp, "--trace-ratio", "0"),
             "tracing-1pct": ("--trace-endpoint", jaeger.otlp, "--trace-ratio", "0.01")}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench = Bench(load_dataset(args.dataset).queries, args.k, params, args.duration, Path(tmp))
            for n in range(args.rounds):
                order = SIDES[n % len(SIDES):] + SIDES[:n % len(SIDES)]  # each side first once in 3
                for side in order:
                    with served(index, bench.work / "serve.log", flags[side]) as url:
                        bench.warm_up(url)
                        bench.steady(f"{side}-{n}", AppArgs(index=args.index).warm_workers)
                        bench.run(url, f"{side}-{n}", 32)
    finally:
        jaeger.stop()
    sides, manifest = summary(bench.levels), published.manifest
    measured = ratios(sides)
    checks = checked(measured, TARGETS)
    record = new_record(args.name, bench.levels, index_fields(manifest, params),
                        headline=sides, ratios=checks, also=measured, idle_percent_of_a_core=bench.idle,
                        not_covered=["a trace store on another machine",
                                     "text requests (the embedder's spans)", "writes (not traced yet)"])
    path = save(record)
    for name, check in checks.items():
        print(f"{name:<34} {check['value']:>7}   {check['target']:<7}  {check['met']}")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
