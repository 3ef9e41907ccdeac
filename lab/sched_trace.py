"""When, within a batch cycle, a core sits idle at c=32: a per-CPU timeline from the kernel's
scheduler events (`perf sched record`), reduced to what each core was doing and what was waiting.

Why: the sums (`sched_wait.py`, `/proc/stat`) show that at c=32 the 4-shard app leaves ~15-20 % of
the cores idle while its processes also sit queued for a CPU, but not whether those happen at the
same instant. Two very different causes fit the sums: (a) work stranded on the other core's run
queue while this one idles (wake-up placement, load balancing: a scheduler matter), or (b) idle
with nothing runnable anywhere (everyone waiting on a hand-off: a pipeline matter). This replays
the switch, wake-up and migration events and splits each core's idle time into those two.

    python -m lab.sched_trace --index indexes/fashion-mnist-ivf1024-4 [--windows 3]
    → a record named by --name (the committed one, loadtests/records/sched-trace-try.json, is one
      exploratory window)
Needs `perf` with the sched tracepoints (root here). Starts its own local Ray and stops it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from lab.sched_wait import CLIENTS, warm_c32_app
from loadtests.record import header, save, work_dir

_EVENT = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<tid>-?\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<time>[\d.]+):\s+"
                    r"sched:(?P<name>\w+):\s+(?P<rest>.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass
class Event:
    time: float
    cpu: int
    name: str  # sched_switch, sched_waking, sched_wakeup, sched_wakeup_new, sched_migrate_task
    fields: dict[str, str]


def parse_perf_script(lines: Iterable[str]) -> list[Event]:
    """`perf script` lines of sched tracepoints → events (other lines skipped)."""
    events = []
    for line in lines:
        match = _EVENT.match(line)
        if match is None:
            continue
        rest = match["rest"]
        if match["name"] == "sched_switch":  # "prev_comm=a prev_pid=1 ... ==> next_comm=b next_pid=2 ..."
            rest = rest.replace("==>", " ")
        fields = dict(_FIELD.findall(rest))
        events.append(Event(float(match["time"]), int(match["cpu"]), match["name"], fields))
    return events


@dataclass
class Timeline:
    """Seconds each core spent idle, split by what was runnable at that instant."""

    cpus: int
    wall_s: float = 0.0
    idle_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    idle_with_work_elsewhere_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    busy_with_queue_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    # class of the task at the head of another core's queue while this core idled
    stranded_by_class_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # on every core at once: idle with nothing runnable anywhere (all waiting on a hand-off)
    all_idle_s: float = 0.0

    def summary(self) -> dict:
        core_s = self.wall_s * self.cpus or 1.0
        idle = sum(self.idle_s.values())
        stranded = sum(self.idle_with_work_elsewhere_s.values())

        def share(seconds: float, of: float = core_s) -> float:
            return round(100 * seconds / of, 1)

        return {
            "window_s": round(self.wall_s, 3),
            "idle_percent_of_cores": share(idle),
            "idle_with_work_queued_elsewhere_percent_of_cores": share(stranded),
            "idle_with_nothing_runnable_percent_of_cores": share(idle - stranded),
            "every_core_idle_percent_of_wall": share(self.all_idle_s, self.wall_s or 1.0),
            "busy_with_others_queued_percent_of_cores": share(sum(self.busy_with_queue_s.values())),
            "stranded_work_by_class_percent_of_cores": {
                name: share(seconds)
                for name, seconds in sorted(self.stranded_by_class_s.items(), key=lambda kv: -kv[1])},
        }


def replay(events: list[Event], cpus: int, class_of: dict[int, str]) -> Timeline:
    """Rebuild who ran where and who waited on which core's queue, event by event.

    A task is queued on a core from its wake-up (the target core, or where a migration moves it) or
    a preemption (`prev_state=R`) until a switch puts it on a core. Until a core's first switch is
    seen, what it runs is unknown and that span is not counted (hence the window starts at the
    last core's first switch)."""
    running: dict[int, int | None] = dict.fromkeys(range(cpus))  # cpu -> tid (0 = idle)
    queued_on: dict[int, int] = {}  # tid -> cpu whose queue holds it
    timeline = Timeline(cpus)
    start: float | None = None
    last: float | None = None
    seen: set[int] = set()
    for event in events:
        if start is not None and last is not None and event.time > last:
            _account(timeline, running, queued_on, event.time - last, class_of)
        last = event.time
        f = event.fields
        if event.name == "sched_switch":
            prev, nxt = int(f["prev_pid"]), int(f["next_pid"])
            running[event.cpu] = nxt
            queued_on.pop(nxt, None)
            if prev != 0 and f.get("prev_state", "").startswith("R"):
                queued_on[prev] = event.cpu
            else:
                queued_on.pop(prev, None)
            seen.add(event.cpu)
            if start is None and len(seen) == cpus:
                start = event.time
        elif event.name in ("sched_waking", "sched_wakeup", "sched_wakeup_new"):
            tid = int(f["pid"])
            if tid not in running.values():
                queued_on[tid] = int(f.get("target_cpu", event.cpu))
        elif event.name == "sched_migrate_task":
            tid = int(f["pid"])
            if tid in queued_on:
                queued_on[tid] = int(f["dest_cpu"])
    if start is not None and last is not None:
        timeline.wall_s = last - start
    return timeline


def _account(timeline: Timeline, running: dict[int, int | None], queued_on: dict[int, int], span: float,
             class_of: dict[int, str]) -> None:
    per_cpu: dict[int, list[int]] = defaultdict(list)
    for tid, cpu in queued_on.items():
        per_cpu[cpu].append(tid)
    idle = [cpu for cpu, tid in running.items() if tid == 0]
    for cpu, tid in running.items():
        if tid is None:
            continue
        if tid == 0:
            timeline.idle_s[cpu] += span
            elsewhere = [t for c, tids in per_cpu.items() if c != cpu for t in tids]
            if elsewhere:
                timeline.idle_with_work_elsewhere_s[cpu] += span
                timeline.stranded_by_class_s[class_of.get(elsewhere[0], "other")] += span
        elif per_cpu.get(cpu):
            timeline.busy_with_queue_s[cpu] += span
    if len(idle) == len(running) and not queued_on:
        timeline.all_idle_s += span


def thread_classes(classes: dict[int, str]) -> dict[int, str]:
    """Every thread id of the classified processes → its process's class (events name threads)."""
    out = {}
    for pid, name in classes.items():
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                out[int(tid)] = name
        except OSError:
            continue
    return out


def record_window(seconds: float, out: Path) -> list[Event]:
    subprocess.run(["perf", "sched", "record", "-a", "-o", str(out), "--", "sleep", str(seconds)],
                   check=True, capture_output=True)
    script = subprocess.run(["perf", "script", "-i", str(out), "-F", "comm,tid,cpu,time,event,trace"],
                            check=True, capture_output=True, text=True).stdout
    return parse_perf_script(script.splitlines())


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--windows", type=int, default=3, help="perf windows, one per attack")
    cli.add_argument("--window", type=float, default=2.0, help="seconds of scheduler events per window")
    cli.add_argument("--name", default="sched-trace")
    cli.add_argument("--work", help="keep the perf data here (default: a temporary directory)")
    args = cli.parse_args()

    from loadtests.vegeta_run import attack
    from shardserve.runtime.procfs import CpuMeter, classified_pids, machine_cpu_seconds

    record = header(args.name, index=None)
    windows: list[dict] = []
    cpus = os.cpu_count() or 1
    with work_dir(args.work, "sched-trace") as work, warm_c32_app(args.index, "trace", work) as served:
        record["index"], targets = served
        for window in range(args.windows):
            level: dict = {}
            load = threading.Thread(target=lambda level=level, label=f"c32-{window}": level.update(
                attack(targets, "concurrency", CLIENTS, args.window + 4.0, work, label, meter=CpuMeter())))
            load.start()
            time.sleep(2.0)  # past the attack's start-up
            classes = thread_classes(classified_pids())  # vegeta included, as "load generator"
            before = machine_cpu_seconds()
            events = record_window(args.window, work / f"perf-{window}.data")
            after = machine_cpu_seconds()
            load.join()
            summary = replay(events, cpus, classes).summary()
            idle_s, busy_s = after["idle"] - before["idle"], after["busy"] - before["busy"]
            summary.update({"proc_stat_idle_percent": round(100 * idle_s / (idle_s + busy_s), 1),
                            "qps": level.get("qps"), "events": len(events),
                            "attack_machine_idle_percent": level.get("machine_cpu", {}).get("idle_percent")})
            windows.append(summary)
            print(f"window {window}: {summary}", flush=True)
    record.update({"clients": CLIENTS, "window_s": args.window, "windows": windows, "not_covered": [
        "perf's own cost while recording (it runs on these cores too)",
        "other concurrencies, indexes and machines; one Ray session"]})
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
