"""Admission on the default `shardserve serve`, as a user runs it: are clients that wait for their
answers always served, is overload shed fast, and does what is admitted stay bounded?

python -m loadtests.shedding --index DIR [--duration 15] [--overload-duration 20]

Starts `shardserve serve DIR` (its own local Ray, the edge with its default admission), then through
the user's port: closed loop at 8, 32 and 128 clients (never an overload: each client waits for its
answer), then open loop at 2x the 32-client throughput (an overload: requests arrive faster than
they are answered). With --access-log, each level also records where its answered requests spent
their time, from the edge's access log (`edge_timings`: queued at the edge, in the router, in
total). Then Ctrl-C, timed, and what it left running. Goals (`GOAL`, checked in `verdict`):
100 % 200 at 8 and 32 clients, >= 99 % at 128; under overload only 200 and 503, the 503s' p99
under 10 ms, the 200s' p99 within max(3 x the 32-client p99, 50 ms), goodput >= 0.8x the
32-client throughput. The server starts niced (SERVER_NICE) so that vegeta, on the same 2 cores, is
not the one that waits, as a remote client would not. Record: loadtests/records/admission.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from loadtests.record import RECORDS, header, save
from loadtests.vegeta_run import attack, make_targets, vegeta, write_targets
from serving.edge import parse_access_line
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location

PORT = 18480
# The server (Ray, the edge; replicas go on to nice 19 once started) runs at this niceness, vegeta at
# 0: on 2 shared cores a starved vegeta reads its answers late, and that delay is the client's, not
# the server's (a remote client has none). Measured in one session (503 p99 / admitted 200 p99 under
# 2x overload): both at 0, 156 / 211 ms; server at 10, 5.1 / 146 and 11.7 / 139 ms; vegeta at 5
# instead, 105 / 629 ms.
SERVER_NICE = 10
GOAL: dict[str, Any] = {"closed_loop_success": {"8": 1.0, "32": 1.0, "128": 0.99}, "shed_p99_ms": 10.0,
        "admitted_p99_x_c32": 3.0, "admitted_p99_floor_ms": 50.0, "goodput_x_c32": 0.8}


def run(index: str, duration_s: float, overload_s: float, work: Path, params: dict,
        serve_flags: list[str] | None = None, server_nice: int = 0, access_log: bool = False,
        client_cpu: int | None = None, edge_nice: int | None = None) -> dict:
    exe = Path(sys.executable).parent / "shardserve"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    niced = ["nice", "-n", str(server_nice)] if server_nice else []
    log_path = work / "edge-access.log"
    logged = ["--access-log", str(log_path)] if access_log else []
    command = [*niced, str(exe), "serve", index, "--port", str(PORT), *logged, *(serve_flags or [])]
    server = subprocess.Popen(command, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    banner: list[str] = []
    try:
        from deployments.run import wait_until_healthy

        wait_until_healthy(f"http://127.0.0.1:{PORT}", timeout_s=240)
        if edge_nice is not None:
            renice_edge(server.pid, edge_nice)
        if client_cpu is not None:  # vegeta (our child from now on) on that core only; the server anywhere
            os.sched_setaffinity(0, {client_cpu})
        while server.stdout and not any("Ctrl-C" in line for line in banner):
            banner.append(server.stdout.readline().rstrip())
        url = f"http://127.0.0.1:{PORT}"
        queries = load_dataset(read_manifest(Location.parse(index)).dataset.name, num_queries=1000).queries
        targets = write_targets(work / "targets.jsonl", make_targets(queries, url, 10, params))
        attack(targets, "concurrency", 8, 3, work, "warm")

        def level(mode: str, value: int, seconds: float, label: str) -> dict:
            offset = log_path.stat().st_size if log_path.exists() else 0
            result = attack(targets, mode, value, seconds, work, label)
            return {**result, "edge_timings": edge_timings(log_path, offset) if access_log else {}}

        closed = {c: level("concurrency", c, duration_s, f"c{c}") for c in (8, 32, 128)}
        rate = round(2 * closed[32]["qps"])
        overload = level("rate", rate, overload_s, "2x")
    finally:
        stop = ctrl_c(server)
    return {"banner": [line for line in banner if "overload:" in line],
            "levels": [*closed.values(), overload], "ctrl_c": stop,
            "verdict": verdict(closed, overload)}


def renice_edge(session: int, nice: int) -> None:
    """The edge HAProxy of the server's session at `nice` (a lower one than the server's needs root
    or CAP_SYS_NICE): in production the edge runs at the server's niceness and the replicas at 19,
    so it answers before them; here the server is niced below vegeta, and the edge with it."""
    edges = [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"
             and _in_session(p.pid, session)]
    if not edges:
        raise SystemExit("no edge haproxy in the server's session")
    for pid in edges:
        os.setpriority(os.PRIO_PROCESS, pid, nice)


def _in_session(pid: int, session: int) -> bool:
    try:
        return os.getsid(pid) == session
    except (ProcessLookupError, PermissionError):
        return False


def edge_timings(access_log: Path, offset: int) -> dict:
    """Where the answered requests of one level spent their time, from the edge's access log lines
    past `offset`: p50/p99 ms waiting in the edge's queue, in the router, and in total. The total
    is what the client measured less the network and the client's own delay in reading."""
    with open(access_log, "rb") as log:
        log.seek(offset)
        lines = [parse_access_line(raw.decode(errors="replace")) for raw in log]
    answered = [line for line in lines if line is not None and line.status == 200]
    if not answered:
        return {}
    timings = {}
    for name in ("queue_ms", "router_ms", "total_ms"):
        values = np.array([getattr(line, name) for line in answered], dtype=np.float64)
        timings[name] = {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}
    return {"answered_200": len(answered), **timings}


def ctrl_c(server: subprocess.Popen) -> dict:
    """SIGINT the server's process group: seconds until it exited, what it printed meanwhile that
    warns, and which of the processes of its session are still running."""
    started = time.monotonic()
    os.killpg(server.pid, 2)
    try:
        code = server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, 9)
        code = server.wait()
    seconds = time.monotonic() - started
    rest = server.stdout.read() if server.stdout else ""
    left = _session(server.pid)
    while left and time.monotonic() - started < seconds + 10:  # exiting children get 10 s
        time.sleep(0.2)
        left = _session(server.pid)
    return {"seconds": round(seconds, 2), "exit_code": code, "processes_left_after_10_s": left,
            "all_gone_after_s": round(time.monotonic() - started, 2) if not left else None,
            "warnings": [line for line in rest.splitlines() if "fail" in line.lower() or "WARN" in line]}


def _session(sid: int) -> list[str]:
    return [process.info["name"] for process in psutil.process_iter(["pid", "name"])
            if _in_session(process.pid, sid)]


def verdict(closed: dict[int, dict], overload: dict) -> dict:
    """The goals, each with the figures it was checked on."""
    codes, by_status = overload["status_codes"], overload["p99_ms_by_status"]
    c32 = closed[32]
    admitted_bound = max(GOAL["admitted_p99_x_c32"] * c32["p99_ms"], GOAL["admitted_p99_floor_ms"])
    goodput = overload["qps"]  # 200s per second over the level's wall time
    checks = {
        **{f"c{c}_success": closed[c]["success_ratio"] >= GOAL["closed_loop_success"][str(c)]
           for c in closed},
        "only_200_or_503": set(codes) <= {"200", "503"},
        "shed_fast": (by_status.get("503") or 0.0) < GOAL["shed_p99_ms"],
        "shed_with_retry_after": overload["shed_without_retry_after"] == 0,
        "admitted_bounded": (by_status.get("200") or float("inf")) <= admitted_bound,
        "goodput": goodput >= GOAL["goodput_x_c32"] * c32["qps"],
    }
    return {"checks": checks, "met": all(checks.values()),
            "shed_p99_ms": by_status.get("503"), "admitted_p99_ms": by_status.get("200"),
            "admitted_p99_bound_ms": round(admitted_bound, 3), "goodput_qps": round(goodput, 1),
            "goodput_x_c32": round(goodput / c32["qps"], 3), "offered_qps": overload["value"]}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", required=True)
    cli.add_argument("--duration", type=float, default=15.0, help="seconds per closed-loop level")
    cli.add_argument("--overload-duration", type=float, default=20.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--name", default="admission")
    cli.add_argument("--out", default=str(RECORDS))
    cli.add_argument("--serve-flags", default="", help="extra `shardserve serve` flags, e.g. "
                     "'--edge-in-flight 32 --edge-queue 96' (the headline record takes none: the defaults)")
    cli.add_argument("--server-nice", type=int, default=SERVER_NICE,
                     help="niceness `shardserve serve` starts at (0: vegeta's)")
    cli.add_argument("--client-cpu", type=int, help="run vegeta on this core only (the server keeps "
                     "every core): it cannot take the server's other core, as a remote client cannot")
    cli.add_argument("--edge-nice", type=int, help="renice the edge HAProxy to this once the server "
                     "is up (e.g. 0, vegeta's: the edge above the replicas, as in production)")
    cli.add_argument("--access-log", action="store_true", help="the edge logs each request, and each "
                     "level records where its answers spent their time (the log costs the edge time)")
    args = cli.parse_args()
    vegeta()  # built, or say what to run before anything starts
    with tempfile.TemporaryDirectory() as work:
        result = run(args.index, args.duration, args.overload_duration, Path(work), {"nprobe": args.nprobe},
                     args.serve_flags.split(), args.server_nice, args.access_log, args.client_cpu,
                     args.edge_nice)
    print(result["verdict"], result["ctrl_c"], flush=True)
    manifest = read_manifest(Location.parse(args.index))
    record = header(args.name, serve_flags=args.serve_flags.split(), server_nice=args.server_nice,
                    edge_nice=args.edge_nice, access_log=args.access_log, client_cpu=args.client_cpu,
                    index={"version": manifest.index_version, "factory": manifest.index_factory,
                           "shards": len(manifest.shards), "num_vectors": manifest.num_vectors},
                    goal=GOAL, **result,
                    not_covered=["single-vector queries only", "one overload multiple (2x the c=32 "
                                 "throughput)", "vegeta shares the 2 cores (the server at nice 10)",
                                 "loopback only; a cluster's edge (configs/) is not measured here"])
    print(save(record, Path(args.out), plot_levels=False))


if __name__ == "__main__":
    main()
