"""Autoscaling demonstration: an open-loop vegeta ramp (low → 3x the knee → low) while recording, every
second, the RUNNING replicas of each deployment (Serve's status API), QPS, p50/p99 and status codes.

python -m loadtests.autoscale --knee-rate 700 [--url http://127.0.0.1:8000] [--app shardserve]
Needs a running shardserve whose shard deployments autoscale (e.g. a `shardserve tune` config), on
the Ray cluster this process can join (RAY_ADDRESS or the local one). Loopback targets only.

python -m loadtests.autoscale --index DIR --knee-rate 300 [--knee-depth 2 --upscale-delay 0.5 ...]
starts its own local Ray instead, deploys DIR with those autoscaling settings (knee policy, shard
links), runs the ramp and stops everything it started. The record keeps the settings.

--pin-initial CORE: spare cores on one machine. Once deployed, every serving replica (router and
shards) is pinned to CORE, all its threads; replicas the autoscaler starts later come from the
warm pool unpinned and use every core. The first replicas then have one core, and a new replica
adds the cores they did not have, as a node added to a cluster would.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from deployments.autoscaling import ROUTER_BUSY_TARGET
from loadtests.during import ReplicaWatcher
from loadtests.record import RECORDS, header, index_info
from loadtests.report import parse_timestamp
from loadtests.vegeta_run import assert_loopback, attack_flags, decode, make_targets, vegeta, write_targets
from shardserve.data.datasets import load_dataset
from shardserve.runtime.procfs import lower_priority

HARNESS_NICE = 19  # the load generator and this watcher: no more CPU priority than a serving replica


def attack_phase(targets: Path, rate: int, seconds: float, out: Path) -> None:
    """One open-loop phase. vegeta runs at HARNESS_NICE: on a real cluster the clients are not on
    the serving node, and here they would otherwise take CPU first from a replica that is starting
    (Ray starts workers at nice 15, vegeta would run at 0)."""
    with out.open("wb") as sink:
        subprocess.run([vegeta(), "attack", *attack_flags(targets, seconds, rate=rate, max_workers=512)],
                       stdout=sink, check=True, preexec_fn=lambda: lower_priority(HARNESS_NICE))


def per_second(results: list[Path], start: float) -> list[dict]:
    """Bin every request by the second it was sent: QPS, latency percentiles, status codes."""
    return per_second_of([hit for path in results for hit in decode(path)], start)


def per_second_of(hits: list[dict], start: float) -> list[dict]:
    """per_second over decoded requests."""
    bins: dict[int, dict] = {}
    for hit in hits:
        second = int(parse_timestamp(hit["timestamp"]) - start)
        entry = bins.setdefault(second, {"latencies": [], "codes": {}, "by_code": {}})
        entry["latencies"].append(hit["latency"] / 1e6)
        entry["codes"][str(hit["code"])] = entry["codes"].get(str(hit["code"]), 0) + 1
        entry["by_code"].setdefault(str(hit["code"]), []).append(hit["latency"] / 1e6)
    rows = []
    for second in sorted(bins):
        lat = np.asarray(bins[second]["latencies"])
        rows.append({"t": second, "sent": int(lat.size), "ok": bins[second]["codes"].get("200", 0),
                     "p50_ms": round(float(np.percentile(lat, 50)), 3),
                     "p99_ms": round(float(np.percentile(lat, 99)), 3),
                     "p99_ms_by_status": {code: round(float(np.percentile(values, 99)), 3)
                                          for code, values in bins[second]["by_code"].items()},
                     "status_codes": bins[second]["codes"]})
    return rows


def phase_summary(result: Path) -> dict:
    """One phase's requests by status: count, p50/p99 ms each; `other` counts anything but a 200
    or a 503 (vegeta's timeouts and connection errors among them)."""
    latencies: dict[str, list[float]] = {}
    for hit in decode(result):
        latencies.setdefault(str(hit["code"]), []).append(hit["latency"] / 1e6)
    return {"by_status": {code: {"count": len(values), "p50_ms": round(float(np.percentile(values, 50)), 3),
                                 "p99_ms": round(float(np.percentile(values, 99)), 3)}
                          for code, values in sorted(latencies.items())},
            "other": sum(len(values) for code, values in latencies.items() if code not in ("200", "503"))}


def reaction_times(samples: list[dict], start: float, burst_at_s: float) -> dict[str, float | None]:
    """Per deployment: seconds from the burst's start to its first sample with more replicas than
    it had just before the burst (None: it never scaled up). An upper bound on the reaction to
    the queue passing the knee, which happens at or after the burst's start; the sampling period
    is the resolution."""
    before = [s for s in samples if "replicas" in s and s["t"] - start < burst_at_s]
    after = [s for s in samples if "replicas" in s and s["t"] - start >= burst_at_s]
    base = before[-1]["replicas"] if before else {}
    names = sorted({n for s in after for n in s["replicas"]})
    return {name: next((round(s["t"] - start - burst_at_s, 1) for s in after
                        if s["replicas"].get(name, 0) > base.get(name, 1)), None) for name in names}


def knee_reactions(samples: list[dict], crossings: dict[str, list[dict]], since: float,
                   started: dict[str, list[dict]] | None = None) -> dict[str, dict]:
    """Per shard deployment, the reaction the issue asks for: from its queue first passing the knee
    after `since` (the knee policy's crossings, deployments.autoscaling.knee_events) to the first
    replica-watcher sample with more RUNNING replicas than it had then. None: no scale-up after
    the crossing (or no crossing). Counted from the FIRST crossing, so a crossing the queue fell
    back from before a replica came still counts against the reaction; the resolution is the
    watcher's sampling period. With `started` (replica_startups), also whether the first replica
    ready after the crossing ran in a warm worker — a process already there before the crossing
    (shardserve.runtime.warm_pool) — and how long its constructor took."""
    rows = [s for s in samples if "replicas" in s]
    result = {}
    for name in sorted({n for s in rows for n in s["replicas"]}):
        events = [e for e in crossings.get(name, []) if e["t"] >= since]
        entry: dict = {"crossings": len(events), "passed_knee_s": None, "reaction_s": None}
        if events:
            first = events[0]
            entry.update(passed_knee_s=round(first["t"] - since, 2), depth_at_knee=first["depth"])
            scaled = next((s for s in rows if s["t"] >= first["t"]
                           and s["replicas"].get(name, 0) > first["replicas"]), None)
            if scaled is not None:
                entry.update(reaction_s=round(scaled["t"] - first["t"], 2),
                             replicas_then=scaled["replicas"][name])
            new = sorted((r for r in (started or {}).get(name, []) if r["ready_at"] >= first["t"]),
                         key=lambda r: r["ready_at"])
            if new:
                entry.update(warm_worker=new[0]["ready_at"] - new[0]["process_age_s"] < first["t"],
                             constructor_s=new[0].get("constructor_s"))
        result[name] = entry
    return result


def plot(record: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rep, ax_lat) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    start = record["start"]
    samples = [s for s in record["replicas"] if "replicas" in s]
    names = sorted({n for s in samples for n in s["replicas"]})
    for name in names:
        ax_rep.step([s["t"] - start for s in samples], [s["replicas"].get(name, 0) for s in samples],
                    where="post", label=name)
    ax_rep.set_ylabel("RUNNING replicas")
    ax_rep.legend(fontsize=8)
    secs = record["seconds"]
    ax_lat.plot([r["t"] for r in secs], [r["p50_ms"] for r in secs], label="p50")
    ax_lat.plot([r["t"] for r in secs], [r["p99_ms"] for r in secs], label="p99")
    ax_qps = ax_lat.twinx()
    ax_qps.plot([r["t"] for r in secs], [r["ok"] for r in secs], color="tab:green", alpha=0.5, label="200/s")
    ax_qps.plot([r["t"] for r in secs], [r["sent"] for r in secs], color="grey", alpha=0.5, label="sent/s")
    ax_qps.set_ylabel("requests/s")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms")
    ax_lat.set_xlabel("seconds")
    ax_lat.legend(loc="upper left")
    ax_qps.legend(loc="upper right")
    fig.suptitle(record["name"])
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--url", default="http://127.0.0.1:8000")
    cli.add_argument("--app", default="shardserve")
    cli.add_argument("--knee-rate", type=float, required=True, help="knee throughput (requests/s)")
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--phases", default="0.3:15,3:20,0.3:30", help="multiple-of-knee:seconds,...")
    cli.add_argument("--name", default="autoscale")
    own = cli.add_argument_group("--index DIR: a local Ray of its own, DIR deployed with these settings")
    own.add_argument("--index")
    own.add_argument("--knee-depth", type=float, default=1.0,
                     help="shard calls in flight per replica: over links each call is a batch and a "
                          "replica searches one batch at a time (one FAISS thread), so past 1 batches wait")
    own.add_argument("--max-replicas", type=int, default=3)
    own.add_argument("--router-max-replicas", type=int, default=2,
                     help="the router autoscales on the cores it uses, up to this (1: fixed)")
    own.add_argument("--router-busy", type=float, default=ROUTER_BUSY_TARGET,
                     help="cores a router replica may use before the policy adds one")
    own.add_argument("--upscale-delay", type=float, default=0.0,
                     help="the depth is already averaged over --look-back: a crossing scales at once")
    own.add_argument("--downscale-delay", type=float, default=8.0)
    own.add_argument("--metrics-interval", type=float, default=0.5)
    own.add_argument("--look-back", type=float, default=1.0)
    own.add_argument("--num-cpus", type=float, default=4.0,
                     help="logical CPUs of the Ray it starts: enough that every shard's extra replicas "
                          "fit (at shard_num_cpus 0.25), whatever the cores")
    own.add_argument("--serving-nice", type=int, default=None, help="AppArgs.serving_nice (default: its own)")
    own.add_argument("--pin-initial", type=int, metavar="CORE", help="pin the replicas deployed first to "
                     "this core; the ones autoscaling adds use every core (spare cores)")
    own.add_argument("--no-edge", action="store_true", help="drive Serve's HTTP directly, no admission edge")
    own.add_argument("--edge-delay-ms", type=int, default=None,
                     help="the edge's delay target while shedding (default: its own; 0: the counts alone)")
    own.add_argument("--warm-workers", type=int, default=None, help="AppArgs.warm_workers (default: its own)")
    args = cli.parse_args()
    vegeta()  # built, or say what to run before anything starts
    assert_loopback(args.url)
    if args.index:
        run_own(args)
        return
    import ray

    ray.init(address="auto", log_to_driver=False)
    ramp(args, settings=None)


def run_own(args: argparse.Namespace) -> None:
    """Own local Ray: deploy `args.index` with autoscaling shards, ramp, stop what we started."""
    from urllib.parse import urlparse

    from deployments.autoscaling import autoscaling_config, router_autoscaling_config
    from deployments.config import AppArgs
    from deployments.run import deploy
    from serving.edge import Admission, EdgeProcess
    from shardserve.runtime.ports import free_port
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    settings = autoscaling_config(args.knee_depth, 1, args.max_replicas, args.upscale_delay,
                                  args.downscale_delay, args.metrics_interval, args.look_back,
                                  knee_policy=True)
    routers = (router_autoscaling_config(1, args.router_max_replicas, args.router_busy, args.upscale_delay,
                                         args.downscale_delay, args.metrics_interval, args.look_back)
               if args.router_max_replicas > 1 else None)
    started = ensure_ray(num_cpus=args.num_cpus, serving_node=True)
    if not started:  # e.g. the previous run's Ray, still shutting down: its settings are not ours
        raise SystemExit("error: --index needs its own Ray, and one is already running here "
                         "(RAY_ADDRESS or a local cluster); stop it or run without --index")
    edge = None
    try:
        chosen: dict[str, Any] = {name: value for name, value in (("serving_nice", args.serving_nice),
                                                  ("warm_workers", args.warm_workers),
                                                  ("router_autoscaling", routers)) if value is not None}
        # As `shardserve serve` runs it: Serve and the router's door on private ports, the edge with
        # its default admission on the user's port (--no-edge: Serve's HTTP on the user's port).
        port = urlparse(args.url).port or 8000
        if args.no_edge:
            deploy(args.index, port=port, app_name=args.app, shard_autoscaling=settings, **chosen)
        else:
            front = free_port()
            deploy(args.index, port=free_port(), app_name=args.app, shard_autoscaling=settings,
                   front_port=front, **chosen)
            admitted = Admission() if args.edge_delay_ms is None else Admission(delay_ms=args.edge_delay_ms)
            edge = EdgeProcess(f"127.0.0.1:{front}", f"127.0.0.1:{port}", admitted).start()
        pool = wait_for_pool(AppArgs(index=args.index, **chosen).warm_workers)
        admission = None if edge is None else dataclasses.asdict(edge.admission)
        pinned = None if args.pin_initial is None else pin_replicas(args.pin_initial)
        ramp(args, settings, extra={"warm_pool": pool, "edge_admission": admission,
                                    "router_autoscaling": routers, "pinned_initial": pinned})
    finally:
        if edge is not None:
            edge.stop()
        if started:
            shutdown_ray()


def pin_replicas(core: int) -> dict:
    """Pin every running Serve replica process, each of its threads, to `core` (see the module
    docstring); what was pinned, by process title."""
    from shardserve.runtime.procfs import cmdline, pids_matching

    pinned: dict[str, int] = {}
    for pid in pids_matching(b"ray::ServeReplica"):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), {core})
            except (ProcessLookupError, PermissionError):
                continue
        title = cmdline(pid).split(b"\0")[0].decode(errors="replace")
        pinned[title] = pid
    print(f"pinned to core {core}: {sorted(pinned)}", flush=True)
    return {"core": core, "replicas": pinned}


def pooled_on_this_node() -> list[int]:
    """Idle (or starting) Ray workers of the local raylet: the warm pool (shardserve.runtime.warm_pool)."""
    from shardserve.runtime.procfs import pids_matching
    from shardserve.runtime.warm_pool import pooled_pids

    return [pid for raylet in pids_matching(b"src/ray/raylet/raylet") for pid in pooled_pids(raylet)]


def wait_until_pooled(target: int, timeout_s: float) -> list[int]:
    """Wait (at most `timeout_s`) until the local warm pool holds `target` workers that finished
    starting (titled idle, not still importing), then 2 s for the last one's tail; their pids."""
    from shardserve.runtime.procfs import cmdline
    from shardserve.runtime.warm_pool import IDLE_TITLE

    def idle() -> list[int]:
        return [pid for pid in pooled_on_this_node() if cmdline(pid).startswith(IDLE_TITLE)]

    deadline = time.monotonic() + timeout_s
    while len(idle()) < target and time.monotonic() < deadline:
        time.sleep(1.0)
    time.sleep(2.0)
    return idle()


def wait_for_pool(target: int, timeout_s: float = 120.0, measure_s: float = 10.0) -> dict:
    """After a deploy, the pool fills one worker at a time from spare CPU, as it would long before
    any burst in production: the ramp starts once it is full (or after `timeout_s`). Then what the
    idle pool costs, per worker, over `measure_s`: its own memory and CPU (from /proc)."""
    from shardserve.runtime.procfs import cpu_seconds, memory_mb

    pids = wait_until_pooled(target, timeout_s)
    before = {pid: cpu_seconds(pid) for pid in pids}
    time.sleep(measure_s)
    cpu = [(cpu_seconds(pid) - before[pid]) / measure_s for pid in pids if cpu_seconds(pid)]
    anon = [memory_mb(pid)["rss_anon_mb"] for pid in pids if cpu_seconds(pid)]
    cost = {"target": target, "idle_workers": len(pids),
            "mean_rss_anon_mb": round(float(np.mean(anon)), 1) if anon else None,
            "mean_cpu_share_of_a_core": round(float(np.mean(cpu)), 4) if cpu else None,
            "measured_s": measure_s}
    print(f"warm pool: {cost}", flush=True)
    return cost


def crossings(app: str) -> dict[str, list[dict]]:
    """The knee policy's recorded crossings for every shard deployment of `app`'s index, and for
    its router (none unless the router autoscales)."""
    from deployments.autoscaling import knee_events
    from deployments.config import index_app_name
    from deployments.run import shard_replicas

    index_app = index_app_name(app)
    return {**{name: knee_events(index_app, name) for name in shard_replicas(app)},
            "Router": knee_events(app, "Router")}


def startups(app: str, since: float) -> dict[str, list[dict]]:
    """The start-up cost of every shard replica ready since `since` (deployments.shard.
    replica_startups; `ready_at` is wall-clock seconds, like the replica samples)."""
    from deployments.config import index_app_name
    from deployments.shard import replica_startups

    return {name: [row for row in rows if row.get("ready_at", 0) >= since]
            for name, rows in replica_startups(index_app_name(app)).items()}


def ramp(args: argparse.Namespace, settings: dict | None, extra: dict | None = None) -> None:
    queries = load_dataset(args.dataset).queries
    lower_priority(HARNESS_NICE)  # the replica watcher polls Serve's status from this process
    phases = [(float(m), float(s)) for m, s in (p.split(":") for p in args.phases.split(","))]
    with tempfile.TemporaryDirectory() as tmp, ReplicaWatcher(args.app, 0.5, router=True) as watcher:
        targets = write_targets(Path(tmp) / "t.jsonl", make_targets(
            queries, args.url, 10, {"nprobe": args.nprobe} if args.nprobe else None, 0, 2000))
        start = time.time()
        results, pooled = [], []
        for number, (multiple, seconds) in enumerate(phases):
            out = Path(tmp) / f"phase-{number}.bin"
            rate = multiple * args.knee_rate
            pooled.append(len(pooled_on_this_node()))
            print(f"phase {number}: {multiple:g} x knee = {rate:.0f}/s for {seconds:g} s "
                  f"(warm pool: {pooled[-1]})", flush=True)
            attack_phase(targets, max(1, round(rate)), seconds, out)
            results.append(out)
        time.sleep(5)  # the replicas after the load, too
        seconds_rows = per_second(results, start)
        summaries = [phase_summary(result) for result in results]
    samples = watcher.samples
    record = header(args.name, index=index_info(args.url), knee_rate=args.knee_rate,
                    nprobe=args.nprobe, shard_autoscaling=settings,
                    phases=[{"multiple_of_knee": m, "seconds": s, "warm_workers_at_start": n}
                            for (m, s), n in zip(phases, pooled, strict=True)], start=start,
                    replicas=samples, seconds=seconds_rows, harness_nice=HARNESS_NICE, **(extra or {}))
    if args.index:  # the Ray this run started, and the app settings it changed
        record["own_ray"] = {"num_cpus": args.num_cpus, "serving_nice": args.serving_nice,
                             "warm_workers": args.warm_workers}
    burst = next((number for number, (m, _) in enumerate(phases) if m > 1.0), None)
    if burst is not None:
        record["burst_at_s"] = sum(s for _, s in phases[:burst])
        record["burst_requests"] = summaries[burst]
        print(f"burst: {record['burst_requests']}")
        record["reaction_s"] = reaction_times(samples, start, record["burst_at_s"])
        print(f"scale-up (s after the burst began): {record['reaction_s']}")
    record["knee_events"] = crossings(args.app)
    record["replica_startups"] = startups(args.app, start)
    record["knee_reactions"] = knee_reactions(samples, record["knee_events"], start,
                                              record["replica_startups"])
    print(f"scale-up reaction (s from each shard's queue passing the knee): {record['knee_reactions']}")
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{args.name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    plot(record, path.with_suffix(".png"))
    peak: dict = {}
    for sample in samples:
        for name, count in sample.get("replicas", {}).items():
            peak[name] = max(peak.get(name, 0), count)
    print(f"peak replicas: {peak}")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
