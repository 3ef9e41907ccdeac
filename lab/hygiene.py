"""`make bench-hygiene`: what each process-hygiene knob of the serving stack costs or saves, A/B.

python -m lab.hygiene --index DIR [--rounds 2] [--duration 8]

Every variant runs the 4-shard app on its own fresh local Ray (as `make bench` does), driven at
the router's front door (closed loop, 32 clients), and some also through Serve's HTTP ingress
or with 256-vector batches. Before the load, 10 s with no load at all: what the stack burns idle.
CPU is read from /proc per process, Ray's own processes named one by one. Rounds alternate the
variant order (round 2 runs them backwards), so drift on this shared machine hits every variant.

The knobs (issue: process hygiene):
- the dashboard agent's metrics: Ray's metrics collection on (default) or off;
- GC freezing after warm-up: the committed record also has a variant with a second
  gc.collect() + gc.freeze() after 2,000 requests, on top of the one Serve does at replica start-up
  (app arg `gc_freeze_after`, commit 90c530c); it bought nothing and was removed;
- idle polling: routers ask IndexControl which index to serve every `pointer_poll_s` (0.25 s)
  vs every 1 s (a swap then takes up to 1 s longer to reach every router);
- HAProxy threads: Serve's HAProxy ingress at Ray's default of 4 threads vs 2 (the cores) vs 1;
- OpenMP wait policy: with one FAISS thread per shard replica (our default) OpenMP never forks a
  team, so the policy only matters with `faiss_threads` 2: default (spin, then sleep) vs PASSIVE;
- Serve's controller loop: every 0.1 s (Ray's default) vs 0.25 s vs 0.5 s (the controller is the
  largest idle process of the stack; autoscaling and health decisions then come up to 0.15 or 0.4 s
  later). Recorded with `--variants default,serve-control-loop-0.25s,serve-control-loop-0.5s --name
  control-loop-ab` before 0.25 s became the default (SERVING_NODE_ENV): `default` there is 0.1 s; since
  then it is 0.25 s, and `serve-control-loop-0.1s` is Ray's default.
Record: loadtests/records/hygiene.json, loadtests/records/control-loop-ab.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.record import header, save
from loadtests.vegeta_run import attack, make_targets, write_targets
from shardserve.runtime.procfs import CpuMeter, process_class

SERVE_PORT = 18600
FRONT_PORT = 18602
IDLE_S = 10.0


@dataclass(frozen=True)
class Variant:
    env: dict[str, str] = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)
    levels: tuple[str, ...] = ("front",)


VARIANTS = {
    "default": Variant(levels=("front", "serve-http", "batch256")),
    "metrics-off": Variant(env={"RAY_enable_metrics_collection": "false"}),
    "pointer-poll-1s": Variant(overrides={"pointer_poll_s": 1.0}),
    "haproxy-2-threads": Variant(env={"RAY_SERVE_HAPROXY_NBTHREAD": "2"}, levels=("serve-http",)),
    "haproxy-1-thread": Variant(env={"RAY_SERVE_HAPROXY_NBTHREAD": "1"}, levels=("serve-http",)),
    "faiss-2-threads": Variant(overrides={"faiss_threads": 2}, levels=("front", "batch256")),
    "faiss-2-threads-omp-passive": Variant(env={"OMP_WAIT_POLICY": "PASSIVE"},
                                           overrides={"faiss_threads": 2}, levels=("front", "batch256")),
    "serve-control-loop-0.5s": Variant(env={"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}),
    "serve-control-loop-0.25s": Variant(env={"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25"}),
    "serve-control-loop-0.1s": Variant(env={"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}),
    # Ray's log monitor lists the session's log files on every 0.1 s pass while there are fewer than
    # this threshold of them; at 0 it lists them every LOG_NAME_UPDATE_INTERVAL_S (0.5 s) instead.
    "log-monitor-list-0.5s": Variant(env={"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}),
}
RAY_PROCESSES = [(b"gcs_server", "GCS"), (b"raylet", "raylet"),
                 (b"ray::DashboardAgent", "dashboard agent"), (b"dashboard/dashboard.py", "dashboard head"),
                 (b"ray::RuntimeEnvAgent", "runtime env agent"),
                 (b"autoscaler/_private/monitor.py", "autoscaler monitor"), (b"log_monitor", "log monitor"),
                 (b"ray::ServeController", "Serve controller"), (b"ray::HAProxyManager", "HAProxy manager"),
                 (b"ray::ProxyActor", "HAProxy manager"), (b"ray::IDLE", "idle Ray workers")]


def classify(command: bytes) -> str | None:
    """process_class, with Ray's own processes named one by one."""
    found = process_class(command)
    if found != "Ray system":
        return found
    return next((name for marker, name in RAY_PROCESSES if marker in command), "Ray, other")


def run_variant(name: str, variant: Variant, index: str, queries, duration_s: float, work: Path) -> dict:
    from ray import serve

    from deployments.run import deploy
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    saved = {key: os.environ.get(key) for key in variant.env}
    os.environ.update(variant.env)
    started = ensure_ray(serving_node=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
        serve_http = deploy(index, port=SERVE_PORT, app_name="hygiene", front_port=FRONT_PORT,
                            **variant.overrides)
        front = f"http://127.0.0.1:{FRONT_PORT}"
        params = {"nprobe": 16}
        warm = write_targets(work / "warm.jsonl", make_targets(queries, front, 10, params, 0, count=200))
        attack(warm, "concurrency", 8, 4.0, work, "warm-up")
        meter = CpuMeter(classify=classify)
        meter.start()
        time.sleep(IDLE_S)
        idle = {cls: round(100 * cpu / IDLE_S, 2) for cls, cpu in sorted(meter.stop().items())}
        result = {"idle_percent_of_a_core": idle, "levels": {}}
        for level in variant.levels:
            url = serve_http if level == "serve-http" else front
            batch, concurrency = (256, 2) if level == "batch256" else (0, 32)
            targets = write_targets(work / f"{name}-{level}.jsonl", make_targets(
                queries, url, 10, params, batch, count=20 if batch else 1000))
            measured = attack(targets, "concurrency", concurrency, duration_s, work, f"{name}-{level}",
                              queries_per_request=batch or 1, meter=CpuMeter(classify=classify))
            result["levels"][level] = {key: measured[key] for key in (
                "qps", "queries_per_s", "p50_ms", "p99_ms", "status_codes", "cpu_ms_per_request")}
            print(f"  {name:<28} {level:<10} {measured['qps']:8.1f} req/s  p99 {measured['p99_ms']:7.2f} ms"
                  f"  CPU ms/req {measured['cpu_ms_per_request'].get('total (servers)')}", flush=True)
        print(f"  {name:<28} idle % of a core: {idle}", flush=True)
        return result
    finally:
        serve.shutdown()
        if started:
            shutdown_ray()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per variant and level: mean req/s and server CPU ms per request over the rounds, and the
    ratio to the default variant's (the A/B)."""
    summary: dict[str, dict] = {}
    for name, rounds in runs.items():
        summary[name] = {"idle_percent_of_a_core": round(statistics.mean(
            sum(r["idle_percent_of_a_core"].get(cls, 0.0) for cls in r["idle_percent_of_a_core"]
                if cls != "load generator") for r in rounds), 2), "levels": {}}
        for level in rounds[0]["levels"]:
            qps = [r["levels"][level]["qps"] for r in rounds]
            cpu = [r["levels"][level]["cpu_ms_per_request"].get("total (servers)", float("nan"))
                   for r in rounds]
            summary[name]["levels"][level] = {"qps": round(statistics.mean(qps), 1), "qps_runs": qps,
                                              "cpu_ms_per_request": round(statistics.mean(cpu), 3),
                                              "cpu_runs": cpu}
    default = summary["default"]["levels"]
    for name, entry in summary.items():
        for level, values in entry["levels"].items():
            if name != "default" and level in default:
                values["qps_vs_default"] = round(values["qps"] / default[level]["qps"], 3)
                values["cpu_vs_default"] = round(
                    values["cpu_ms_per_request"] / default[level]["cpu_ms_per_request"], 3)
    return summary


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True, help="the 4-shard index directory")
    cli.add_argument("--rounds", type=int, default=2)
    cli.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    cli.add_argument("--variants", default=",".join(VARIANTS))
    cli.add_argument("--name", default="hygiene", help="record name (a subset of variants: its own record)")
    args = cli.parse_args()
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()  # before ray.serve is imported anywhere in this process

    from shardserve.data.datasets import load_dataset
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    index = os.path.abspath(args.index)
    manifest = read_manifest(Location.parse(index))
    queries = load_dataset(manifest.dataset.name, num_queries=1000).queries
    names = [name for name in args.variants.split(",") if name]
    if "default" not in names:
        names.insert(0, "default")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.rounds):
            order = names if number % 2 == 0 else names[::-1]
            print(f"round {number + 1}: {', '.join(order)}", flush=True)
            for name in order:
                runs[name].append(run_variant(name, VARIANTS[name], index, queries, args.duration, Path(tmp)))
    record = header(args.name, index={"version": manifest.index_version, "factory": manifest.index_factory,
                                      "shards": len(manifest.shards), "params": {"nprobe": 16}},
                    variants={name: {"env": VARIANTS[name].env, "app_args": VARIANTS[name].overrides}
                              for name in names},
                    summary=summarise(runs), runs=runs, rounds=args.rounds, duration_s=args.duration,
                    not_covered=["multi-node clusters (one node here)", "open-loop overload",
                                 "knobs' effect on tail latency beyond p99 of one 8 s level"])
    print(f"record: {save(record)}")


if __name__ == "__main__":
    main()
