"""Where a c=32 request waits when cores sit idle: per process class, time on a CPU against time
runnable but queued (the kernel's schedstat), in one Ray session, rounds alternating the router's
CPU priority.

Why: at c=32 the 4-shard app leaves ~15-20 % of the 2 cores idle while the uvicorn baseline keeps
both busy (bench.json). If the router or the shards were simply waiting for each other, they would
not also be queued for a CPU; this shows how long each class sat runnable but not running, next to
how idle the machine was over the same window. The router's nice value alternates between
`--router-nice` values (default 19, as served, and 15, Ray's own start value: a router above its
shards in priority), to see whether the wait is the router being preempted by the shards it wakes.
Lowering a nice value needs CAP_SYS_NICE; without it only the served value is measured.

    python -m lab.sched_wait --index indexes/fashion-mnist-ivf1024-4 [--rounds 3]
    → loadtests/records/sched-wait.json
Starts its own local Ray and stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from loadtests.record import header, index_info, save
from shardserve.runtime.procfs import CpuMeter, classified_pids, sched_times

SERVE_PORT, FRONT_PORT = 18000, 18001
CLIENTS = 32


def _sched(classes: dict[int, str]) -> dict[int, tuple[float, float, int, int]]:
    return {pid: sched_times(pid) for pid in classes}


def _renice_tree(pid: int, nice: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def per_class(classes: dict[int, str], before: dict, after: dict, wall_s: float) -> dict[str, dict]:
    """Run and run-queue wait as % of one core, and switches per second, per class (processes
    alive at both ends; the load generator starts and ends with its attack, so it is not here)."""
    sums: dict[str, list[float]] = {}
    for pid, name in classes.items():
        if pid not in before or pid not in after or after[pid] == (0.0, 0.0, 0, 0):
            continue
        total = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
        for i in range(4):
            total[i] += after[pid][i] - before[pid][i]
    return {name: {"run_percent_of_a_core": round(100 * run / wall_s, 1),
                   "runqueue_wait_percent_of_a_core": round(100 * wait / wall_s, 1),
                   "wait_per_run": round(wait / run, 2) if run else None,
                   "voluntary_switches_per_s": round(vol / wall_s),
                   "involuntary_switches_per_s": round(invol / wall_s)}
            for name, (run, wait, vol, invol) in sorted(sums.items())}


@contextlib.contextmanager
def warm_c32_app(index: str, app_name: str, work: Path) -> Iterator[tuple[dict, Path]]:
    """Its own local Ray with the app deployed (front door on FRONT_PORT), warmed up for 4 s:
    yields (the served index's summary, c=32 vegeta targets); stops Serve and Ray on exit."""
    from shardserve.runtime.ray_session import apply_serving_node_env, ensure_ray, shutdown_ray

    apply_serving_node_env()
    from ray import serve

    from deployments.run import deploy
    from loadtests.vegeta_run import attack, make_targets, write_targets
    from shardserve.data.datasets import load_dataset

    queries, params = load_dataset("fashion-mnist").queries, {"nprobe": 16}
    front = f"http://127.0.0.1:{FRONT_PORT}"
    if not ensure_ray(serving_node=True):
        raise SystemExit("error: needs its own Ray, and one is already running here")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
        deploy(index, port=SERVE_PORT, app_name=app_name, front_port=FRONT_PORT)
        warm = write_targets(work / "warm.jsonl", make_targets(queries, front, 10, params, 0, count=200))
        attack(warm, "concurrency", 8, 4.0, work, "warm-up")
        yield index_info(front), write_targets(work / "c32.jsonl",
                                               make_targets(queries, front, 10, params, 0, count=1000))
    finally:
        serve.shutdown()
        shutdown_ray()


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--rounds", type=int, default=3)
    cli.add_argument("--duration", type=float, default=8.0)
    cli.add_argument("--router-nice", default="19,15", help="nice values the router alternates between")
    cli.add_argument("--name", default="sched-wait")
    args = cli.parse_args()
    nices = [int(v) for v in args.router_nice.split(",")]

    from loadtests.vegeta_run import attack

    record = header(args.name, index=None)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, warm_c32_app(args.index, "sched", Path(tmp)) as served:
        work, (record["index"], targets) = Path(tmp), served
        classes = classified_pids()
        routers = [pid for pid, name in classes.items() if name == "router"]
        for round_ in range(args.rounds):
            for nice in (nices if round_ % 2 == 0 else nices[::-1]):
                try:
                    for pid in routers:
                        _renice_tree(pid, nice)
                except PermissionError:
                    print(f"router nice {nice}: not permitted here (CAP_SYS_NICE), skipped", flush=True)
                    continue
                before, started = _sched(classes), time.monotonic()
                level = attack(targets, "concurrency", CLIENTS, args.duration, work, f"c32-nice{nice}",
                               meter=CpuMeter())
                after, wall_s = _sched(classes), time.monotonic() - started
                run = {"round": round_, "router_nice": nice, "qps": level["qps"],
                       "p50_ms": level["p50_ms"], "status_codes": level["status_codes"],
                       "machine_idle_percent": level["machine_cpu"]["idle_percent"],
                       "classes": per_class(classes, before, after, wall_s)}
                runs.append(run)
                shards, router = run["classes"].get("shards", {}), run["classes"].get("router", {})
                print(f"round {round_} router nice {nice}: {run['qps']:.0f} req/s, machine idle "
                      f"{run['machine_idle_percent']} %, shards wait/run {shards.get('wait_per_run')}, "
                      f"router wait/run {router.get('wait_per_run')}", flush=True)
    record.update({"clients": CLIENTS, "duration_s": args.duration, "runs": runs, "summary": {
        str(nice): {key: statistics.median(values) for key, values in {
            "qps": [r["qps"] for r in runs if r["router_nice"] == nice],
            "machine_idle_percent": [r["machine_idle_percent"] for r in runs if r["router_nice"] == nice],
            "shards_wait_per_run": [r["classes"]["shards"]["wait_per_run"] for r in runs
                                    if r["router_nice"] == nice],
            "router_wait_per_run": [r["classes"]["router"]["wait_per_run"] for r in runs
                                    if r["router_nice"] == nice]}.items() if values}
        for nice in nices},
        "not_covered": ["the load generator (it starts and ends with each attack)",
                        "when, within a window, cores were idle and processes queued: only sums",
                        "other concurrencies, indexes and machines"]})
    print(f"record: {save(record)}")


if __name__ == "__main__":
    main()
