"""Steady load below capacity, for a long time, on the default `shardserve serve`: is anything refused?

python -m loadtests.soak --index DIR [--load 0.6] [--duration 600] [--capacity QPS]

Starts `shardserve serve DIR` as a user does and, from the moment it answers its health check, sends
an open loop (vegeta, a constant rate) of `--load` x the server's 32-client capacity: requests arrive at
a rate the server can carry, so every one should be answered 200. The capacity is measured on the same
server after the soak (a 32-client closed loop), unless given; `--capacity` fixes the rate up front.

The record keeps what finds a stall: status codes per second; p50/p99/max latency per minute; each
process class's RSS every 10 s; and every second that held a request slower than `--stall-ms` or a
non-200, with the CPU each process class used in that second and the processes that started or ended
around it (a warm-pool worker, a new replica, a restarted agent). Record: loadtests/records/soak-*.json.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from loadtests.record import RECORDS, header, save, work_dir
from loadtests.shedding import SERVER_NICE, ctrl_c
from loadtests.vegeta_run import VEGETA, attack, attack_flags, make_targets, write_targets
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from shardserve.runtime import procfs

PORT = 18490


def detailed_class(command: bytes) -> str | None:
    """procfs.process_class, with Ray's own processes told apart (raylet, GCS, an idle worker, the
    dashboard and its agents...): the candidates for a stall."""
    name = procfs.process_class(command)
    if name != "Ray system":
        return name
    first = command.split(b"\0", 1)[0].decode(errors="replace")
    if first.startswith("ray::"):
        return f"Ray: {first}"
    words = command.split(b"\0")
    script = next((w.decode(errors="replace").rsplit("/", 1)[-1] for w in words if w.endswith(b".py")), None)
    return f"Ray: {script or first.rsplit('/', 1)[-1]}"


class ProcessWatch:
    """Once a second: CPU seconds per process class of the machine (procfs.classified_pids) and the
    processes that came and went; every 10 s each class's RSS. Time is seconds since `t0`."""

    def __init__(self, t0: float, period_s: float = 1.0):
        self.t0, self.period_s = t0, period_s
        self.cpu: dict[int, dict[str, float]] = {}  # second -> class -> CPU seconds used in it
        self.rss: list[dict] = []
        self.events: list[dict] = []  # {"t", "started"|"ended", "class", "pid"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watch", daemon=True)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}
        next_rss = 0.0
        while not self._stop.wait(self.period_s):
            now = time.monotonic() - self.t0
            current = {pid: (name, procfs.cpu_seconds(pid))
                       for pid, name in procfs.classified_pids(detailed_class).items()}
            used: dict[str, float] = defaultdict(float)
            for pid, (name, seconds) in current.items():
                before = last.get(pid)
                if before is not None:
                    used[name] += seconds - before[1]
                elif last:  # started in this second: all it used so far
                    used[name] += seconds
                    self.events.append({"t": round(now, 1), "started": name, "pid": pid})
            for pid in set(last) - set(current):
                self.events.append({"t": round(now, 1), "ended": last[pid][0], "pid": pid})
            self.cpu[int(now)] = {name: round(s, 3) for name, s in used.items() if s > 0.005}
            if now >= next_rss:
                by_class: dict[str, float] = defaultdict(float)
                for pid, (name, _) in current.items():
                    by_class[name] += procfs.memory_mb(pid).get("rss_mb", 0.0)
                self.rss.append({"t": round(now, 1), **{k: round(v, 1) for k, v in sorted(by_class.items())}})
                next_rss = now + 10.0
            last = current


def open_loop(targets: Path, rate: float, duration_s: float, out: Path) -> Path:
    """vegeta at a constant `rate` for `duration_s`; its results as CSV (timestamp, code, latency)."""
    results = out / "soak.bin"
    with results.open("wb") as sink:
        subprocess.run([str(VEGETA), "attack", *attack_flags(targets, duration_s, rate=rate)],
                       stdout=sink, check=True)
    csv_path = out / "soak.csv"
    with csv_path.open("wb") as sink:
        subprocess.run([str(VEGETA), "encode", "--to", "csv", str(results)], stdout=sink, check=True)
    results.unlink()
    return csv_path


def timeline(csv_path: Path, t0_ns: int, stall_ms: float) -> dict:
    """Per second: status codes; per minute: p50/p99/max ms; the seconds with a stall or a non-200."""
    codes: dict[int, Counter[str]] = defaultdict(Counter)
    minutes: dict[int, list[float]] = defaultdict(list)
    slow: dict[int, list[float]] = defaultdict(list)
    with csv_path.open(newline="") as rows:
        for row in csv.reader(rows):
            second = (int(row[0]) - t0_ns) // 1_000_000_000
            code, ms = row[1], int(row[2]) / 1e6
            codes[second][code] += 1
            minutes[second // 60].append(ms)
            if code != "200" or ms > stall_ms:
                slow[second].append(ms)
    per_minute = [{"minute": m, "requests": len(v), "p50_ms": round(float(np.percentile(v, 50)), 2),
                   "p99_ms": round(float(np.percentile(v, 99)), 2), "max_ms": round(max(v), 1)}
                  for m, v in sorted(minutes.items())]
    return {"per_second": {str(s): dict(c) for s, c in sorted(codes.items())}, "per_minute": per_minute,
            "stall_seconds": {s: {"requests": len(v), "max_ms": round(max(v), 1), "codes": dict(codes[s])}
                              for s, v in sorted(slow.items())}}


def _wait_until_serving(server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until the server prints that it is serving (its start-up is over then, not at its first
    healthy answer): the soak's first second is a user's first second."""
    deadline = time.monotonic() + timeout_s
    while "shardserve: serving" not in log.read_text(errors="replace"):
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"shardserve serve did not start (see {log})")
        time.sleep(0.2)


def run(index: str, load: float, duration_s: float, capacity: float | None, stall_ms: float,
        work: Path, nprobe: int) -> dict:
    exe = Path(sys.executable).parent / "shardserve"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    url = f"http://127.0.0.1:{PORT}"
    queries = load_dataset(read_manifest(Location.parse(index)).dataset.name, num_queries=1000).queries
    targets = write_targets(work / "targets.jsonl", make_targets(queries, url, 10, {"nprobe": nprobe}))
    started = time.monotonic()
    server_log = (work / "serve.log").open("w")  # what the server printed, for the stalls' causes
    server = subprocess.Popen(["nice", "-n", str(SERVER_NICE), str(exe), "serve", index, "--port", str(PORT)],
                              env=env, stdout=server_log, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        _wait_until_serving(server, work / "serve.log", timeout_s=300)
        healthy_s = time.monotonic() - started
        if capacity is None:  # a short probe now: the soak's rate; re-measured at the end
            capacity = attack(targets, "concurrency", 32, 10, work, "capacity-before")["qps"]
        rate = round(load * capacity)  # vegeta takes whole requests per second
        t0 = time.monotonic()
        t0_ns = time.time_ns()
        with ProcessWatch(t0) as watch:
            csv_path = open_loop(targets, rate, duration_s, work)
        after = attack(targets, "concurrency", 32, 10, work, "capacity-after")
        stopped = ctrl_c(server)
    except BaseException:
        procfs.interrupt(server)
        raise
    found = timeline(csv_path, t0_ns, stall_ms)
    csv_path.unlink()
    for second, stall in found["stall_seconds"].items():  # what ran then, and what came and went
        around = (second - 1, second, second + 1)
        stall["cpu_s_by_class"] = {s: watch.cpu[s] for s in around if s in watch.cpu}
        stall["processes"] = [e for e in watch.events if second - 5 <= e["t"] <= second + 2]
    total = Counter[str]()
    for per in found["per_second"].values():
        total.update(per)
    requests = sum(total.values())
    return {"load_x_capacity": load, "capacity_qps": capacity, "capacity_after_qps": after["qps"],
            "rate": rate, "duration_s": duration_s, "healthy_after_s": round(healthy_s, 1),
            "requests": requests, "status_codes": dict(total),
            "success_ratio": round(total.get("200", 0) / max(requests, 1), 6),
            "stall_ms": stall_ms, **found, "rss_mb": watch.rss, "process_events": watch.events,
            "stop": stopped}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", required=True)
    cli.add_argument("--load", type=float, action="append",
                     help="x the 32-client capacity (repeat for several runs; default 0.6 and 0.8)")
    cli.add_argument("--duration", type=float, default=600.0, help="seconds per run")
    cli.add_argument("--capacity", type=float, help="req/s at 32 clients (default: measured first)")
    cli.add_argument("--stall-ms", type=float, default=50.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--name", default="soak")
    cli.add_argument("--out", default=str(RECORDS))
    cli.add_argument("--keep", help="keep the work files in this directory")
    args = cli.parse_args()
    runs = []
    for load in args.load or [0.6, 0.8]:
        with work_dir(args.keep, "soak-") as work:
            runs.append(run(args.index, load, args.duration, args.capacity, args.stall_ms, work, args.nprobe))
        print(f"load {load}: {runs[-1]['status_codes']} at {runs[-1]['rate']} req/s", flush=True)
    record = {**header(args.name), "index": {"path": args.index}, "runs": runs}
    print(save(record, Path(args.out), plot_levels=False))


if __name__ == "__main__":
    main()
